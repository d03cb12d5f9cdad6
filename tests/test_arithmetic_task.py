"""The real-model task (`--task smollm2`, `make demo-smollm2`): its questions' answers checked by arithmetic
written here from the question's own words, the held-out split disjoint from training, math-verify's reward
paying the right number only, and `grpo-fast train --task smollm2` training SmolLM2 on it end to end."""

import json
import re
from pathlib import Path

import pytest

from grpo_fast.rewards import accuracy_reward
from grpo_fast.tasks import arithmetic

# each template's arithmetic, read off the question's words (independent of the task module's lambdas)
READERS = [
    (r"What is (\d+) \+ (\d+)\?", lambda a, b: a + b),
    (r"has (\d+) \w+\. \w+ buys (\d+) packs of (\d+) \w+\.", lambda a, b, c: a + b * c),
    (r"had (\d+) \w+\. \w+ gave away (\d+) and then found (\d+) more\.", lambda a, b, c: a - b + c),
    (
        r"A box holds (\d+) \w+\. \w+ fills (\d+) boxes and has (\d+) \w+ left over\.",
        lambda c, b, a: b * c + a,
    ),
]


def _expected(question: str) -> int:
    for pattern, f in READERS:
        m = re.search(pattern, question)
        if m:
            return f(*map(int, m.groups()))
    raise AssertionError(f"no reader for {question!r}")


@pytest.mark.parametrize("split", ["train", "eval"])
def test_every_answer_is_the_arithmetic_of_its_question(split):
    rows = arithmetic.dataset_rows(split)
    for r in rows:
        [msg] = r["prompt"]
        assert msg["role"] == "user" and msg["content"].endswith("Answer with the number.")
        assert int(r["answer"]) == _expected(msg["content"]) >= 0, r
    kinds = [r["kind"] for r in rows]
    assert kinds.count("add") == kinds.count("two-step") == len(rows) // 2
    if split == "eval":  # every template is held out, not just the easiest
        assert {next(i for i, (p, _) in enumerate(READERS) if re.search(p, r["prompt"][0]["content"]))
                for r in rows} == set(range(len(READERS)))  # fmt: skip


def test_held_out_questions_are_never_trained_on_and_the_split_is_fixed():
    train = {r["prompt"][0]["content"] for r in arithmetic.dataset_rows("train")}
    held = [r["prompt"][0]["content"] for r in arithmetic.dataset_rows("eval")]
    assert len(set(held)) == len(held) == 2 * arithmetic.N_EVAL_PER_KIND
    assert not train & set(held)
    assert held == [r["prompt"][0]["content"] for r in arithmetic.dataset_rows("eval")]


def test_the_reward_pays_the_stated_right_number_only():
    q = {"What is 37 + 45? Answer with the number.": "82"}
    [(_, gold)] = q.items()
    completions = ["37 + 45 = 82", "The answer is 82.", "82", "37 + 45 = 81", "37 + 45", "Let me think"]
    assert accuracy_reward(None, completions, [gold] * len(completions)) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    chat = [[{"role": "assistant", "content": "It is 82."}]]
    assert accuracy_reward(None, chat, [gold]) == [1.0]


def test_task_smollm2_is_the_preset_the_model_and_the_rows():
    from grpo_fast.trainer.config import SMOLLM2_TASK_PRESET, parse_config
    from grpo_fast.trainer.data import train_and_eval_rows
    from grpo_fast.trainer.modeling import model_path

    cfg = parse_config(["--task", "smollm2", "--learning-rate", "3e-6"])
    assert cfg.reward == ["accuracy"] and cfg.learning_rate == 3e-6
    assert cfg.max_completion_length == SMOLLM2_TASK_PRESET["max_completion_length"]
    assert (Path(model_path(cfg)) / "config.json").is_file()
    train, held = train_and_eval_rows(cfg)
    assert train == arithmetic.dataset_rows("train") and held == arithmetic.dataset_rows("eval")


@pytest.mark.slow
def test_train_task_smollm2_end_to_end(tmp_path):
    """Two steps of `grpo-fast train --task smollm2` (small): SmolLM2 from the offline build, chat prompts,
    the held-out evaluation before and after, a checkpoint that loads in transformers."""
    from transformers import AutoModelForCausalLM

    from grpo_fast.trainer.config import parse_config
    from grpo_fast.trainer.train import train

    out = tmp_path / "run"
    cfg = parse_config(["--task", "smollm2", "--max-steps", "2", "--num-generations", "2",
                        "--prompts-per-step", "2", "--max-completion-length", "6", "--eval-max-samples", "4",
                        "--eval-steps", "2", "--save-steps", "2", "--no-bf16",
                        "--output-dir", str(out)])  # fmt: skip
    train(cfg)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "eval_accuracy" in r] == [0, 2]
    assert [r["step"] for r in recs if "loss" in r] == [1, 2]
    assert all(r["completion_len_max"] <= 6 for r in recs if "loss" in r)
    AutoModelForCausalLM.from_pretrained(out / "checkpoint-2")


def test_every_task_choice_has_its_rows_and_its_model():
    """--task's choices are the task table's names: each gives train and eval rows (prompt, answer) and, with
    no --model, the base model grpo-fast train loads."""
    from grpo_fast.tasks import EMBEDDED, task_rows
    from grpo_fast.trainer.config import GRPOConfig, parse_config
    from grpo_fast.trainer.modeling import model_path

    assert set(GRPOConfig.__dataclass_fields__["task"].metadata["choices"]) == set(EMBEDDED)
    for name in ("shop", "shop-tools"):  # smollm2 is built on first use (test_train_task_smollm2_end_to_end)
        train, evals = task_rows(name)
        assert train and evals and {"prompt", "answer"} <= set(train[0]) & set(evals[0])
        assert (Path(model_path(parse_config(["--task", name]))) / "config.json").is_file()
    assert parse_config(["--task", "shop-tools"]).task == "shop-tools"
    assert model_path(parse_config(["--task", "shop-tools"])) != model_path(parse_config(["--task", "shop"]))
