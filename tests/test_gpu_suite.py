"""bench/gpu_suite.sh stays runnable: its dry run (tiny shapes, CPU, Triton interpreter) in a new process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gpu_suite_dry_run(tmp_path):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")  # the venv's python3
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_suite.sh"), str(tmp_path), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert result["dry_run"] is True
    for section in ("correctness", "speed", "e2e_prefix", "e2e_vs_trl"):
        assert "error" not in result[section], result[section]
    corr = result["correctness"]
    assert corr["logprobs logp max abs diff"] < 1e-4 and abs(corr["loss triton"] - corr["loss twin"]) < 1e-4
    assert (tmp_path / "report.md").read_text().startswith("# GPU suite (dry run, CPU)")
    e2e = {r["provider"]: r for r in result["e2e_vs_trl"]}
    assert e2e["grpo_fast"]["tokens_per_s"] > 0 and "speedup_vs_trl" in e2e["grpo_fast"]
