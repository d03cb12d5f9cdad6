"""The real-model task (`--task smollm2`, `make demo-smollm2`): its questions' answers checked by arithmetic
written here from the question's own words; the held-out split sharing no problem with training in any guise
(operands swapped, another name or item), read off the texts by this file's own regexes; the task's reward
(`integer_answer`) paying a stated right integer in any wording and nothing for the question's own expression,
a list of candidates or the question restated (which math-verify's `accuracy` pays); the independent held-out
evaluator agreeing with transformers' own loading and generation; and `grpo-fast train --task smollm2`
training SmolLM2 on it end to end."""

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


def _same_problem(question: str) -> tuple:
    """What makes two questions one problem, read off the text: an addition's operands as a set, a word
    problem's template (which reader matches) and its numbers in order."""
    for i, (pattern, _) in enumerate(READERS):
        m = re.search(pattern, question)
        if m:
            nums = tuple(map(int, m.groups()))
            return ("add", frozenset(nums), len(set(nums))) if i == 0 else (i, nums)
    raise AssertionError(f"no reader for {question!r}")


def test_held_out_questions_are_never_trained_on_in_any_guise_and_the_split_is_fixed():
    train_q = [r["prompt"][0]["content"] for r in arithmetic.dataset_rows("train")]
    held = [r["prompt"][0]["content"] for r in arithmetic.dataset_rows("eval")]
    assert len(set(held)) == len(held) == 2 * arithmetic.N_EVAL_PER_KIND
    assert not set(train_q) & set(held)
    train_keys = {_same_problem(q) for q in train_q}
    twins = [q for q in held if _same_problem(q) in train_keys]
    assert not twins, f"{len(twins)} held-out problems are training problems in another guise: {twins[:3]}"
    assert len({_same_problem(q) for q in held}) == len(held)  # nor twice in the held-out set
    assert held == [r["prompt"][0]["content"] for r in arithmetic.dataset_rows("eval")]


def _gaming_answers(question: str) -> list[str]:
    """Completions that state no computed answer: the question's own expression (boxed, bare, in LaTeX), the
    question restated, candidates listed around the right answer."""
    m = re.search(r"What is (\d+) \+ (\d+)\?", question)
    if m:
        expr = f"{m[1]} + {m[2]}"
    else:  # the word problem's numbers as the expression its template asks for
        found = [(i, re.search(p, question)) for i, (p, _) in enumerate(READERS) if i]
        [(i, nums)] = [(i, tuple(map(int, m.groups()))) for i, m in found if m]
        a, b, c = nums if i != 3 else (nums[2], nums[1], nums[0])
        expr = [f"{a} + {b} \\times {c}", f"{a} - {b} + {c}", f"{b} \\times {c} + {a}"][i - 1]
    right = _expected(question)
    return [
        f"The answer is \\boxed{{{expr}}}.", f"\\boxed{{{expr}}}", f"The answer is {expr}.", f"${expr}$",
        question, question.removesuffix(" Answer with the number."),
        f"It is {right - 1}, {right} or {right + 1}.", f"\\boxed{{{right - 1}, {right}}}",
        f"{right - 2}, {right - 1}, {right}", f"Either {right + 1} or {right}",
    ]  # fmt: skip


def test_the_tasks_reward_pays_no_expression_list_or_restated_question_that_math_verify_pays():
    from grpo_fast.rewards import load_reward
    from grpo_fast.trainer.config import SMOLLM2_TASK_PRESET

    [task_reward] = [load_reward(r) for r in SMOLLM2_TASK_PRESET["reward"]]
    rows = arithmetic.dataset_rows("eval")
    boxed_paid = 0
    for r in rows:
        q = r["prompt"][0]["content"]
        gaming = _gaming_answers(q)
        assert task_reward(None, gaming, [r["answer"]] * len(gaming)) == [0.0] * len(gaming), q
        boxed_paid += accuracy_reward(None, gaming[:1], [r["answer"]])[0]
    assert boxed_paid == len(rows)  # the hole it closes: math-verify evaluates the boxed expression and pays


def test_the_tasks_reward_pays_the_right_integer_in_any_wording():
    from grpo_fast.rewards import integer_answer_reward

    for r in arithmetic.dataset_rows("eval")[::16]:
        n = int(r["answer"])
        right = [f"{n}", f"The answer is {n}.", f"\\boxed{{{n}}}", f"The answer is $\\boxed{{{n}}}$.",
                 f"19 + 61 = 80, so wait, it is {n}", f"She has {n} stickers now.", f"**{n}**",
                 f"Answer: {n}!", f"{n}.0", f"That makes {n} apples in all.\nFinal answer: {n}",
                 f"23 + 24 = {n}"]  # fmt: skip
        wrong = [f"{n + 1}", f"The answer is {n - 1}.", f"\\boxed{{{n + 10}}}", f"{n}.5", "Let me think",
                 f"{n}0", f"{n} + 1", f"\\boxed{{{n}}} or \\boxed{{{n + 1}}}"]  # fmt: skip
        got = integer_answer_reward(None, right + wrong, [r["answer"]] * (len(right) + len(wrong)))
        assert got == [1.0] * len(right) + [0.0] * len(wrong), (n, got)
    chat = [[{"role": "assistant", "content": "It is 82."}]]
    assert integer_answer_reward(None, chat, ["82"]) == [1.0]
    with pytest.raises(ValueError, match="answer column must hold integers"):
        integer_answer_reward(None, ["1"], ["1/2"])


def test_task_smollm2_is_the_preset_the_model_and_the_rows():
    from grpo_fast.trainer.config import SMOLLM2_TASK_PRESET, parse_config
    from grpo_fast.trainer.data import train_and_eval_rows
    from grpo_fast.trainer.modeling import model_path

    cfg = parse_config(["--task", "smollm2", "--learning-rate", "3e-6"])
    assert cfg.reward == ["integer_answer"] and cfg.learning_rate == 3e-6
    assert cfg.max_completion_length == SMOLLM2_TASK_PRESET["max_completion_length"]
    assert (Path(model_path(cfg)) / "config.json").is_file()
    train, held = train_and_eval_rows(cfg)
    assert train == arithmetic.dataset_rows("train") and held == arithmetic.dataset_rows("eval")


def test_task_smollm2_two_step_is_the_word_problems_alone_with_the_same_held_out_set():
    """--task smollm2-two-step: only word problems, every one a word problem of the
    mixed task's own split (a held-out problem stays held out), none of its held-out problems trained on in
    any guise (the test's own reading of the texts), and its preset's longer completions."""
    from grpo_fast.tasks.arithmetic_eval import HeldOut
    from grpo_fast.trainer.config import TASK_PRESETS, parse_config
    from grpo_fast.trainer.data import train_and_eval_rows

    cfg = parse_config(["--task", "smollm2-two-step"])
    train, held = train_and_eval_rows(cfg)
    assert cfg.reward == ["integer_answer"]
    assert cfg.max_completion_length == TASK_PRESETS["smollm2-two-step"]["max_completion_length"] > 32
    word = lambda rows: [r for r in rows if not r["prompt"][0]["content"].startswith("What is")]  # noqa: E731
    assert word(train) == train and word(held) == held and len(held) == 64
    mixed_train, mixed_held = (arithmetic.dataset_rows(s) for s in ("train", "eval"))
    assert sorted(map(str, train)) == sorted(map(str, word(mixed_train)))
    assert held == word(mixed_held)
    trained = {_same_problem(r["prompt"][0]["content"]) for r in train}
    assert not trained & {_same_problem(r["prompt"][0]["content"]) for r in held}
    with pytest.raises(ValueError, match="kinds"):
        arithmetic.dataset_rows("train", ("sub",))
    with pytest.raises(ValueError, match="task: one of"):
        HeldOut(8, task="shop")


def test_the_evaluator_asks_which_problems_for_a_run_trained_through_dataset(tmp_path):
    """A run trained on these problems through --dataset records --task's default (shop): the CLI stops and
    names --task instead of scoring the wrong held-out set."""
    from grpo_fast.tasks import arithmetic_eval

    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "config.json").write_text(
        json.dumps({"task": "shop", "max_completion_length": 8, "model": ""})
    )
    with pytest.raises(SystemExit, match="--task"):
        arithmetic_eval.main([str(tmp_path)])


@pytest.mark.slow
def test_train_task_smollm2_end_to_end(tmp_path):
    """Two steps of `grpo-fast train --task smollm2` (small): SmolLM2 from the offline build, chat prompts,
    the held-out evaluation before and after, a checkpoint that loads in transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_fast.tasks import arithmetic_eval
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
    model = AutoModelForCausalLM.from_pretrained(out / "checkpoint-2")

    # the independent evaluator on the run: its answers for the trained weights are what transformers'
    # own loading of the checkpoint generates (greedy), and it states the base model's and the gain
    arithmetic_eval.main([str(out), "--n-eval", "4"])
    got = json.loads((out / "heldout_eval.json").read_text())
    assert got["checkpoint"].endswith("checkpoint-2") and got["n_eval"] == 4 and got["max_new_tokens"] == 6
    assert got["gain"] == got["trained"]["accuracy"] - got["base"]["accuracy"]
    tok = AutoTokenizer.from_pretrained(out / "checkpoint-2")
    held = arithmetic.dataset_rows("eval")
    rows = [r for k in ("add", "two-step") for r in [x for x in held if x["kind"] == k][:2]]  # 2 a kind
    texts = []
    for r in rows:
        ids = tok.apply_chat_template(
            r["prompt"], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        new = model.generate(**ids, max_new_tokens=6, do_sample=False)[0, ids["input_ids"].shape[1] :]
        texts.append(tok.decode(new, skip_special_tokens=True))
    assert got["trained"]["examples"] == texts


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
