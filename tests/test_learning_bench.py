"""bench/learning/vs_trl.py's bookkeeping, without training: the runs kept before --task and
--time-budget-s existed are still taken by --reuse at the settings they ran with, the flags it gives
`grpo-fast train` are ones the trainer's parser accepts (with their values), a kept payload of a one-kind task
renders, and the settings that have flags of their own cannot be given through --set."""

import json
from pathlib import Path

import pytest

from bench.learning import vs_trl
from grpo_fast.trainer.config import build_parser

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results" / "zen4"


def test_runs_kept_before_the_task_and_budget_settings_are_reused_at_what_they_ran():
    kept = sorted((RESULTS / "learning_runs").glob("*.json"))
    assert len(kept) == 12  # seeds 1-6 of trl and ours
    now = vs_trl.shared_settings("smollm2", 30, 0.0, {})
    for f in kept:
        settings = json.loads(f.read_text())["settings"]
        assert "task" not in settings and {**vs_trl.LATER_SETTINGS, **settings} == now, f
    # another task or a budget is another run
    assert vs_trl.shared_settings("smollm2-two-step", 30, 0.0, {}) != now
    assert vs_trl.shared_settings("smollm2", 30, 600.0, {}) != now


def test_the_flags_given_to_grpo_fast_train_parse_to_the_settings():
    s = vs_trl.shared_settings("smollm2-two-step", 12, 90.0, {"learning_rate": "3e-5"})
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in s.items()]
    ns = build_parser().parse_args(flags)
    assert ns.task == "smollm2-two-step" and ns.time_budget_s == 90.0 and ns.max_steps == 12
    assert ns.learning_rate == 3e-5 and ns.max_completion_length == 128 and ns.loss_type == "dapo"
    with pytest.raises(SystemExit, match="--time-budget-s"):
        vs_trl.shared_settings("smollm2", 30, 0.0, {"time_budget_s": "60"})


def test_a_kept_one_kind_payload_renders_its_kind_and_no_nan():
    payload = json.loads((RESULTS / "learning-smollm2-two-step" / "learning_vs_trl.json").read_text())
    md = vs_trl.render(payload)
    assert "two-step (last)" in md and "add (last)" not in md and "nan" not in md.lower()
    assert "--task smollm2-two-step" in md
    old = json.loads((RESULTS / "learning_vs_trl.json").read_text())  # settings from before --task
    old["settings"].pop("task", None)
    assert "add (last)" in vs_trl.render(old)
