import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpo_fast.trainer import checkpoint as ck


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(3, 3)

    def save_pretrained(self, path, safe_serialization=True):
        from safetensors.torch import save_file

        save_file(self.state_dict(), str(Path(path) / "model.safetensors"))


def _save(out, step, model, fail=False):
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    class Tok:
        def save_pretrained(self, path):
            if fail:
                raise OSError("disk full")

    return ck.save_checkpoint(
        out,
        step,
        model,
        Tok(),
        opt.state_dict(),
        sched,
        {"epoch": 0, "pos": step},
        torch.Generator(),
        {},
        keep=2,
    )


def test_failed_save_keeps_last_good_checkpoint(tmp_path):
    m = _Tiny()
    _save(tmp_path, 1, m)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 2, m, fail=True)
    assert ck.latest_checkpoint(tmp_path).name == "checkpoint-1"
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-1"]  # the temporary directory is gone


def test_torn_directories_are_ignored_and_old_ones_rotated(tmp_path):
    m = _Tiny()
    for s in (1, 2, 3):
        _save(tmp_path, s, m)
    (tmp_path / ".checkpoint-4-abc").mkdir()  # a save killed before its rename
    (tmp_path / "checkpoint-9").mkdir()  # no trainer_state.json: not a checkpoint
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-3"]
    state = json.loads((tmp_path / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["sampler"]["pos"] == 3


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_then_exits(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "grpo_fast.trainer.train",
            "--output-dir",
            str(out),
            "--max-steps",
            "10000",
            "--eval-max-samples",
            "0",
            "--save-steps",
            "0",
            "--time-budget-s",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, stdout[-2000:]
    saved = ck.latest_checkpoint(out)
    assert saved is not None and "interrupted: checkpoint saved" in stdout
    assert json.loads((saved / "trainer_state.json").read_text())["step"] >= 2
