import math

import pytest
import torch

from grpo_fast.rewards import (
    RewardError,
    accuracy_reward,
    code_reward,
    extract_answer,
    format_reward,
    load_reward,
    partial_credit_reward,
    score,
    soft_overlong_punishment,
)


def test_extract_answer():
    assert extract_answer("<think> 6*8=48 </think> 42") == "42"
    assert extract_answer("so the answer is \\boxed{\\frac{1}{2}} ok") == "\\frac{1}{2}"
    assert extract_answer("<think> \\boxed{3} </think> \\boxed{x^{2}}") == "x^{2}"
    assert extract_answer("no number here") is None


def test_accuracy_reward_uses_math_equivalence():
    comps = [
        "<think>...</think> \\boxed{0.5}",
        "the answer is 1/2",
        "<think>..</think> 42",
        "\\boxed{\\frac{1}{2}}",
        "<think> 1/2 </think> 3",
    ]
    got = accuracy_reward(None, comps, answer=["\\frac{1}{2}", "0.5", "42", "1/2", "1/2"])
    assert got == [1.0, 1.0, 1.0, 1.0, 0.0]


def test_format_and_partial_credit():
    assert format_reward(
        None, ["<think> a </think> 4", "4", "<think> a </think>", " <think>\nx\n</think>\n 5"]
    ) == [1.0, 0.0, 0.0, 1.0]
    got = partial_credit_reward(
        None,
        ["<think>x</think> 42", "<think>x</think> 40", "<think>x</think> none", "junk"],
        answer=["42", "42", "42", "42"],
    )
    assert got[0] == 1.0 and got[1] == pytest.approx(0.5 * (1 - 2 / 42)) and got[2] == 0.1 and got[3] == 0.0


def test_soft_overlong_punishment_matches_dapo():
    f = soft_overlong_punishment(max_completion_length=20, soft_punish_cache=5)
    got = f(None, [""] * 5, completion_ids=[[0] * n for n in (10, 15, 16, 20, 21)])
    assert got == [0.0, 0.0, pytest.approx(-0.2), pytest.approx(-1.0), -1.0]


def test_combination_weights_and_none():
    def a(prompts, completions, **kw):
        return [1.0, None, 0.5, None]

    def b(prompts, completions, **kw):
        return [0.0, 1.0, None, None]

    s = score([a, b], [2.0, 0.5], ["p"] * 4, ["c"] * 4, {})
    assert s.rewards[:3].tolist() == [2.0, 0.5, 1.0] and math.isnan(s.rewards[3])
    assert torch.isnan(s.per_func[1, 0]) and s.per_func[1, 1] == 1.0


def test_reward_errors_name_function_and_sample():
    def boom(prompts, completions, **kw):
        if len(completions) > 1:
            raise KeyError("answer")
        return [0.0 if completions[0] != "bad" else 1 / 0]

    with pytest.raises(RewardError, match=r"'boom' on sample 2: raised KeyError"):
        score([boom], [1.0], ["p"] * 4, ["a", "b", "bad", "c"], {})
    skipped = score([boom], [1.0], ["p"] * 4, ["a", "b", "bad", "c"], {}, on_error="skip")
    assert skipped.failed.tolist() == [False, False, True, False]


def test_load_reward_specs(tmp_path):
    assert load_reward("format") is format_reward
    assert load_reward("overlong:4", max_completion_length=16)(None, [""], completion_ids=[[0] * 14]) == [
        -0.5
    ]
    with pytest.raises(ValueError, match="no such file"):
        load_reward(str(tmp_path / "x.py") + ":f")
    (tmp_path / "r.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="has no function 'f'"):
        load_reward(str(tmp_path / "r.py") + ":f")


def test_code_reward_fraction_and_assert_guard():
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    half = "```python\ndef add(a, b):\n    return 3\n```"
    tests = ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]
    assert code_reward(None, [good, half], tests=[tests, tests]) == [1.0, 0.5]
    # the reward-hacking guard: tests that cannot fail pay nothing
    assert code_reward(None, [good], tests=[["add(1, 2)", "print(add(2, 2))"]]) == [0.0]
