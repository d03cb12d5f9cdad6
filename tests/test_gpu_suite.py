"""bench/gpu/suite.sh stays runnable and fits a GPU loan: its dry run (tiny shapes, CPU, Triton interpreter)
in a new process, in a bare environment (torch, triton and the oldest supported transformers only, as on the
GPU machine: `make test` builds it and names it in GRPO_FAST_BARE_PYTHON) as the two documented calls (tier
1, then tier 2), and in ours the sections whose rows change with TRL, Liger and matplotlib (both tiers where
there is no bare environment). Missing packages must be skipped rows, never a traceback. A time-out in the
middle of a section keeps every row written before it; the plan fits the default budget."""

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from pythons import bare_python, both_pythons

from bench.gpu import models as gpu_models
from bench.gpu import suite as gpu_suite
from bench.models import memory as bench_memory

ROOT = Path(__file__).resolve().parent.parent
TIER1 = ["correctness", "speed", "backward", "precision", "generation", "e2e"]
TIER2 = ["atomics", "tiles", "prefix", "memory"]
# the sections that read TRL (e2e, precision), Liger (speed) or matplotlib (e2e): the rest run the same code
# in both environments
WITH_PACKAGES = ["speed", "precision", "e2e"]
MAX_FILES = 8  # what the device returns of $OUT


def _command(python, out, *args):
    env = dict(os.environ, PATH=f"{Path(python).parent}:{os.environ['PATH']}")  # that environment's python3
    env.pop("PYTHONPATH", None)
    return ["bash", str(ROOT / "bench" / "gpu" / "suite.sh"), str(out), "--dry-run", *args], env


def _dry_run(python, out, *args):
    """The call, its temporary files in a folder of their own: the suite leaves nothing there."""
    cmd, env = _command(python, out, *args)
    tmp = Path(f"{out}.tmp")
    tmp.mkdir(parents=True)
    proc = subprocess.run(cmd, env=dict(env, TMPDIR=str(tmp)), capture_output=True, text=True, timeout=900)
    assert not list(tmp.glob("gpu_suite_cache_*")), "the suite left its compile cache folder behind"
    return proc


def test_plan_fits_the_loan():
    """Tier 1 is the value order and fits the default budget, which fits one 10-minute command; a section
    never takes the minimum that a later one needs."""
    assert gpu_suite.plan(1, None) == TIER1 and gpu_suite.plan(2, None) == TIER2
    assert sum(gpu_suite.SECTIONS[n][2] for n in TIER2) <= 420 - gpu_suite.RESERVE_S  # a loan's second call
    assert sorted(gpu_models.GPU_MEMORY_ORDER) == sorted(bench_memory.CONFIGS)  # each once
    assert sum(gpu_suite.SECTIONS[n][2] for n in TIER1) <= gpu_suite.BUDGET_S - gpu_suite.RESERVE_S
    assert gpu_suite.BUDGET_S + gpu_suite.SHELL_MARGIN_S + 30 <= 600  # + copying the tree, installing wheels
    assert gpu_suite.budget_of([]) == gpu_suite.BUDGET_S
    assert gpu_suite.budget_of(["x", "--budget", "200"]) == 200
    assert gpu_suite.plan(1, ["e2e", "speed"]) == ["e2e", "speed"]
    assert gpu_suite.allowance("speed", 100, ["backward", "e2e"]) == 100 - 30 - 60
    assert gpu_suite.allowance("speed", 1000, ["e2e"]) == gpu_suite.SECTIONS["speed"][2]


def test_compile_cache_round_trip(tmp_path):
    """Triton's cache and torch.compiler's artifacts come back as one file and are restored from it."""
    cache, out, again = tmp_path / "cache", tmp_path / "out", tmp_path / "again"
    out.mkdir()
    assert "cold" in gpu_suite.restore_cache(None, cache) and gpu_suite.pack_cache(cache, out) == 0
    (cache / "triton" / "abc").mkdir(parents=True)
    (cache / "triton" / "abc" / "k.cubin").write_bytes(b"\x01" * 1000)
    (cache / "artifacts" / "backward.bin").write_bytes(b"\x02" * 10)
    assert gpu_suite.pack_cache(cache, out) > 0 and os.listdir(out) == [gpu_suite.CACHE_FILE]
    assert "restored 2 files" in gpu_suite.restore_cache(out / gpu_suite.CACHE_FILE, again)
    assert (again / "triton" / "abc" / "k.cubin").read_bytes() == b"\x01" * 1000
    assert (again / "artifacts" / "backward.bin").read_bytes() == b"\x02" * 10
    with tarfile.open(out / gpu_suite.CACHE_FILE) as tar:  # artifacts first: Triton's files are cut first
        assert tar.getnames()[0] == "artifacts/backward.bin"


def _check_run(proc, out, order):
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    assert "Traceback" not in proc.stdout + proc.stderr, log
    result = json.loads((out / "gpu_suite.json").read_text())
    assert result["dry_run"] is True and result["errored"] == []
    assert result["machine"]["git_commit"]  # recorded, though the suite runs from a copy without .git
    assert result["order"] == order and list(result["sections"]) == order
    for name in order:
        sec = result["sections"][name]
        assert "error" not in sec and "skipped" not in sec, (name, sec)
        assert sec["rows"] and sec["status"] == "done", name
        assert 0 < sec["seconds"] <= sec["planned_s"] + 5, (name, sec)
    assert "| section | tier | planned s | spent s | rows | status |" in proc.stdout  # the timeline
    assert (out / "gpu_suite.log").read_text().strip()
    assert len(os.listdir(out)) <= 4 <= MAX_FILES, os.listdir(out)  # json, report, log, compile cache
    report = (out / "report.md").read_text()
    assert report.startswith("# GPU suite (dry run, CPU)") and f"## {order[0]}" in report
    return result["sections"]


def _missing(python):
    missing = []
    for pkg in ("trl", "liger_kernel", "matplotlib"):
        code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({pkg!r}) is None)"
        if subprocess.run([python, "-c", code]).returncode:
            missing.append(pkg)
    return missing


@pytest.mark.slow
@pytest.mark.parametrize("python", both_pythons())
def test_gpu_suite_dry_run(tmp_path, python):
    """Bare: the two documented calls, every tier-1 and tier-2 section. Ours (beside a bare one): the
    sections with package-dependent rows. Each section within its plan, in the plan's order."""
    subset = python == sys.executable and bare_python()
    if subset:
        sections = _check_run(
            _dry_run(python, tmp_path, "--sections", ",".join(WITH_PACKAGES)), tmp_path, WITH_PACKAGES
        )
        proc = None
    else:
        proc = _dry_run(python, tmp_path / "first")
        sections = _check_run(proc, tmp_path / "first", TIER1)
        sections.update(_check_run(_dry_run(python, tmp_path / "second", "--tier", "2"), tmp_path / "second",
                                   TIER2))  # fmt: skip
        sections.update(_check_run(_dry_run(python, tmp_path / "decode", "--sections", "decode"),
                                   tmp_path / "decode", ["decode"]))  # fmt: skip
    if "correctness" in sections:  # every kernel variant checked against fp64, and each passed
        checks = sections["correctness"]["rows"]
        assert sections["correctness"]["triton_ok"] is True
        assert {(r["impl"], r["dtype"]) for r in checks} == {
            (i, d) for i in ("triton", "torch") for d in ("bfloat16", "float32")
        }
        quantities = {"logp", "entropy", "loss", "d hidden", "d weight", "d bias"}
        assert {r["quantity"] for r in checks} == quantities
        assert all(r["ok"] == "yes" for r in checks), [r for r in checks if r["ok"] != "yes"]
        backward = {r["provider"]: r for r in sections["backward"]["rows"]}
        for p in ("naive torch", "grpo_fast triton chunked", "grpo_fast triton atomic", "grpo_fast twin"):
            assert backward[p]["ms"] > 0 and backward[p]["d_hidden_rel_err"] < 1e-4, backward[p]
        assert list(backward)[-1] == "naive torch, compiled"
        rows = sections["generation"]["rows"]
        generation = [(r["provider"], r["prompts"]) for r in rows]
        graphs = "native, CUDA graphs"
        assert generation[:3] == [(graphs, 8), ("HF generate", 8), (graphs, 32)]
        assert all(r["tokens_per_s"] > 0 for r in rows)
        for r in rows[:3:2]:  # on a CPU the graphs rows run the buckets eagerly, and say so
            assert r["cuda_graphs"] == 0 and r["capture_s"] == 0 and "no CUDA device" in r["note"], r
    if "atomics" in sections:
        assert sections["atomics"]["auto_should_pick"] in ("triton", "torch")
        recipes = {r["config"] for r in sections["memory"]["rows"] if "estimate_mib" in r}
        assert recipes == {"full_beta_gc_unshared", "full_bf16_master"}
        decode = [(r["provider"], r.get("layers")) for r in sections["decode"]["rows"]]
        assert decode[1] == ("native, eager", 2) and decode[-1] == ("reference engine", 2)
    speed = {(r["mode"], r["provider"]): r for r in sections["speed"]["rows"]}
    assert speed[("loss fwd+bwd", "grpo_fast triton")]["ms"] > 0
    e2e = {r["provider"]: r for r in sections["e2e"]["rows"]}
    assert e2e["grpo_fast"]["tokens_per_s"] > 0
    mp = {r["provider"]: r for r in sections["precision"]["rows"]}
    assert list(mp) == ["trl_bf16", "grpo_fast_mp"] and mp["grpo_fast_mp"]["tokens_per_s"] > 0
    missing = _missing(python)
    if "trl" in missing:
        assert "trl is not importable" in e2e["trl"]["skipped"]
    else:
        assert "speedup_vs_trl" in e2e["grpo_fast"] and "vs_trl_bf16" in mp["grpo_fast_mp"]
    if "liger_kernel" in missing:
        assert "skipped" in speed[("loss fwd+bwd", "liger")]["note"]
    if "matplotlib" in missing and proc is not None:
        assert "matplotlib is not installed" in proc.stdout


def _child(pid: int, comm: str) -> int | None:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)
            if fields[0].split("(", 1)[1] == comm and int(fields[1].split()[1]) == pid:
                return int(stat.parent.name)
        except (OSError, IndexError, ValueError):
            continue
    return None


@pytest.mark.slow
def test_gpu_suite_forced_timeout(tmp_path):
    """The shell's time-out (SIGTERM to `timeout`, as when --budget's limit passes) in the middle of a
    section: the finished section's rows and the ones of the section in flight are in gpu_suite.json and
    report.md, the section says it was killed, the suite exits 124."""
    python = bare_python() or sys.executable
    cmd, env = _command(python, tmp_path, "--sections", "prefix,atomics")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    path, rows, t0 = tmp_path / "gpu_suite.json", [], time.time()
    try:
        while time.time() - t0 < 300 and proc.poll() is None:
            time.sleep(0.2)
            try:
                rows = json.loads(path.read_text())["sections"].get("atomics", {}).get("rows", [])
            except (OSError, ValueError, KeyError):
                continue
            if len(rows) >= 2:
                break
        assert proc.poll() is None and len(rows) >= 2, "atomics ended before the kill"
        timeout = _child(proc.pid, "timeout")
        assert timeout is not None
        os.kill(timeout, signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 124, output[-3000:]
    result = json.loads(path.read_text())
    prefix, atomics = result["sections"]["prefix"], result["sections"]["atomics"]
    assert prefix["status"] == "done" and len(prefix["rows"]) == 3 and "error" not in prefix
    assert len(atomics["rows"]) >= len(rows) and "killed" in atomics["error"], atomics
    assert atomics["rows"][: len(rows)] == rows
    report = (tmp_path / "report.md").read_text()
    assert "| atomics | 2 |" in report and rows[1]["provider"] in report
    assert len(os.listdir(tmp_path)) <= MAX_FILES
    print("\n".join(["", "after the forced time-out:", *gpu_suite.timeline(result)]))
