"""bench/gpu_suite.sh stays runnable: its dry run (tiny shapes, CPU, Triton interpreter) in a new process, in
a bare environment (torch, triton and the oldest supported transformers only, as on the GPU machine: `make
test` builds it and names it in GRPO_FAST_BARE_PYTHON), every section, and in ours, the sections whose rows
change with TRL, Liger and matplotlib (every section where there is no bare environment). Missing packages
must be skipped rows, never a traceback."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ["compile", "correctness", "speed", "backward", "precision", "atomics", "tiles", "prefix",
            "generation", "memory", "e2e"]  # fmt: skip
# the sections that read TRL (e2e, precision), Liger (speed) or matplotlib (e2e), and compile, which decides
# whether the Triton rows run: the rest run the same code in both environments (~3 minutes each on 2 cores)
WITH_PACKAGES = ["compile", "speed", "precision", "e2e"]


def _bare():
    bare = os.environ.get("GRPO_FAST_BARE_PYTHON")
    return bare if bare and Path(bare).is_file() else None


def _pythons():
    no_bare = pytest.mark.skipif(not _bare(), reason="no bare environment (make test builds .venv-bare)")
    return [pytest.param(sys.executable, id="ours"), pytest.param(_bare(), id="bare", marks=no_bare)]


def _dry_run(python, out, sections=None):
    env = dict(os.environ, PATH=f"{Path(python).parent}:{os.environ['PATH']}")  # that environment's python3
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_suite.sh"), str(out), "--dry-run"]
        + (["--sections", ",".join(sections)] if sections else []),
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.slow
@pytest.mark.parametrize("python", _pythons())
def test_gpu_suite_dry_run(tmp_path, python):
    subset = python == sys.executable and _bare()
    proc = _dry_run(python, tmp_path, WITH_PACKAGES if subset else None)
    sections = WITH_PACKAGES if subset else SECTIONS
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    assert "Traceback" not in proc.stdout + proc.stderr, log
    result = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert result["dry_run"] is True and result["errored"] == []
    assert result["machine"]["git_commit"]  # recorded, though the suite runs from a copy without .git
    assert (list(result["sections"]) == sections) if subset else (set(sections) <= set(result["sections"]))
    for name in sections:
        sec = result["sections"][name]
        assert "error" not in sec and "skipped" not in sec, (name, sec)
        assert sec["rows"], name
    if "correctness" in sections:  # every kernel variant checked against fp64, and each passed
        checks = result["sections"]["correctness"]["rows"]
        assert {(r["impl"], r["dtype"]) for r in checks} == {
            (i, d) for i in ("triton", "torch") for d in ("bfloat16", "float32")
        }
        quantities = {"logp", "entropy", "loss", "d hidden", "d weight", "d bias"}
        assert {r["quantity"] for r in checks} == quantities
        assert all(r["ok"] == "yes" for r in checks), [r for r in checks if r["ok"] != "yes"]
        assert result["sections"]["atomics"]["auto_should_pick"] in ("triton", "torch")
        backward = {r["provider"]: r for r in result["sections"]["backward"]["rows"]}
        for p in ("naive torch", "grpo_fast triton chunked", "grpo_fast triton atomic", "grpo_fast twin"):
            assert backward[p]["ms"] > 0 and backward[p]["d_hidden_rel_err"] < 1e-4, backward[p]
    speed = {(r["mode"], r["provider"]): r for r in result["sections"]["speed"]["rows"]}
    assert speed[("loss fwd+bwd", "grpo_fast triton")]["ms"] > 0
    e2e = {r["provider"]: r for r in result["sections"]["e2e"]["rows"]}
    assert e2e["grpo_fast"]["tokens_per_s"] > 0
    precision = result["sections"]["precision"]["rows"]
    mp = {r["provider"]: r for r in precision if r["what"] == "e2e"}
    assert mp["grpo_fast_mp"]["tokens_per_s"] > 0 and mp["grpo_fast"]["tokens_per_s"] > 0
    recipes = {r["config"] for r in precision if r["what"] == "memory" and "estimate_mib" in r}
    assert recipes == {"full_bf16_master"}
    report = (tmp_path / "report.md").read_text()
    assert report.startswith("# GPU suite (dry run, CPU)") and "## speed" in report
    missing = []
    for pkg in ("trl", "liger_kernel", "matplotlib"):
        code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({pkg!r}) is None)"
        if subprocess.run([python, "-c", code]).returncode:
            missing.append(pkg)
    if "trl" in missing:
        assert "trl is not importable" in e2e["trl"]["skipped"]
    else:
        assert "speedup_vs_trl" in e2e["grpo_fast"]
    if "liger_kernel" in missing:
        assert "skipped" in speed[("loss fwd+bwd", "liger")]["note"]
    if "matplotlib" in missing:
        assert "matplotlib is not installed" in proc.stdout
    assert (tmp_path / "bench_e2e_quick.png").exists() == ("matplotlib" not in missing)
