"""Reward functions (TRL's convention) and how several combine into one reward per completion.

A reward function is `f(prompts, completions, **columns) -> list[float | None]`: one value per completion,
`None` meaning "no opinion on this sample". Dataset columns other than `prompt` arrive as keyword arguments
(one value per completion), plus `completion_ids` (token ids). With several functions the reward is the
weighted sum over the functions that had an opinion; a completion nobody scored gets advantage 0.

The package: the built-in rewards and their loading (here), and the code reward's two halves, isolation
(`sandbox`: bubblewrap, uids, seccomp, cgroups) and the verdict (`judge`, with `judge_runtime` running inside
the sandboxes). Imports: grpo_fast.tasks (the embedded task's reward) and nothing else of grpo_fast.
"""

import importlib.util
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .judge import judge_many
from .sandbox import SandboxLimits, SandboxUnavailable, check_available


class RewardError(ValueError):
    """A reward function failed: raised, returned the wrong number of values, or a non-finite value."""

    def __init__(self, func_name: str, message: str, sample: int | None = None):
        where = f" on sample {sample}" if sample is not None else ""
        super().__init__(f"reward function {func_name!r}{where}: {message}")
        self.func_name, self.sample = func_name, sample


# --------------------------------------------------------------------------------------------------------
# Answer extraction
# --------------------------------------------------------------------------------------------------------
_THINK_END = "</think>"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def final_answer_text(completion: str) -> str:
    """The part of a completion that carries the answer: after </think> when there is one."""
    return completion.rsplit(_THINK_END, 1)[1] if _THINK_END in completion else completion


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(completion: str) -> str | None:
    """\\boxed{} content if present, else the last number after </think> (or in the whole text)."""
    text = final_answer_text(completion)
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed.strip()
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def _to_text(completion) -> str:
    # conversational completions: [{"role": "assistant", "content": ...}, {"role": "tool", ...}, ...]: the
    # model's own text only (a tool's answer is not the model's)
    if isinstance(completion, list):
        return "".join(
            m.get("content") or ""
            for m in completion
            if isinstance(m, dict) and m.get("role", "assistant") == "assistant"
        )
    return str(completion)


# --------------------------------------------------------------------------------------------------------
# Built-in rewards
# --------------------------------------------------------------------------------------------------------
def accuracy_reward(prompts, completions, answer, **_):
    """1.0 when the final answer equals the `answer` column, checked by math-verify (0.0 otherwise).

    Equivalence is mathematical: "0.5", "1/2" and "\\frac{1}{2}" all match; \\boxed{} is understood."""
    from math_verify import parse, verify

    out = []
    for comp, gold in zip(completions, answer):
        pred_text = extract_answer(_to_text(comp))
        if pred_text is None:
            out.append(0.0)
            continue
        gold_parsed = parse(f"${gold}$") or parse(str(gold))
        pred_parsed = parse(f"${pred_text}$") or parse(pred_text)
        out.append(1.0 if gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed) else 0.0)
    return out


# integer_answer: an integer literal (1,234 read as one number; 82.0 an integer), not part of a longer token
_INTEGER = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?![\w]|\.\d|,\d{3})")
# what, just before a stated number, makes it an operand instead: a binary operator after a number
# ("19 + 61", "4 x 6", "(3) * 2"; not markdown's "**82**" nor a sign)
_OPERATOR_BEFORE = re.compile(r"[\d)\]}]\s*(?:[-+*/×÷^·xX]|\\times|\\cdot|\\div)$")
# ... or a list of numbers ("78, 79 or 80")
_LIST_BEFORE = re.compile(r"\d\s*(?:,|;|&|\bor|\band)$")
_PLAIN_INTEGER = re.compile(r"-?\s*(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.0+)?")


def stated_integer(completion: str) -> int | None:
    """The integer a completion states as its answer, or None when it states none or states something else.

    The answer is the last \\boxed{} when there is one, and counts only when it holds a plain integer (an
    expression, a list or words inside it: None). Without a box it is the last integer literal in the text,
    unless that number is an operand or a list item: preceded by an operator ("19 + 61", "4 x 6") or by
    another number and a separator ("78, 79 or 80"), so that restating the question, leaving an expression or
    listing candidates states no answer. A leading minus sign after a non-number is the number's sign."""
    text = final_answer_text(completion)
    boxed = extract_boxed(text)
    if boxed is not None:
        inner = boxed.strip().strip("$").strip().rstrip(".").strip()
        if not _PLAIN_INTEGER.fullmatch(inner):
            return None
        return int(re.sub(r"[,\s]|\.0+$", "", inner))  # exact for any size (no float on the way)
    found = list(_INTEGER.finditer(text))
    if not found:
        return None
    last = found[-1]
    if last.group(2) and set(last.group(2)[1:]) != {"0"}:
        return None  # 47.5: not an integer
    value = int(last.group(1).replace(",", ""))
    before = text[: last.start()].rstrip()
    if _OPERATOR_BEFORE.search(before) or _LIST_BEFORE.search(before):
        return None
    if before.endswith("-"):  # not after a number (that was a subtraction): the number's sign
        value = -value
    return value


def integer_answer_reward(prompts, completions, answer, **_):
    """1.0 when the integer the completion states (`stated_integer`: the last integer, a \\boxed{} only when
    it holds a plain integer) equals the integer `answer` column, else 0.0: an expression, a list of
    candidates or the question restated states no answer and scores 0 (math-verify's `accuracy` would
    evaluate a boxed "19 + 61" and pay it).
    For tasks whose answers are integers (the `smollm2` task's reward)."""
    out = []
    for i, (comp, gold) in enumerate(zip(completions, answer)):
        try:
            want = int(str(gold).strip())
        except ValueError:
            raise ValueError(f"integer_answer: the answer column must hold integers, got {gold!r} (row {i})")
        out.append(1.0 if stated_integer(_to_text(comp)) == want else 0.0)
    return out


_FORMAT = re.compile(r"^\s*<think>.*?</think>\s*\S.*$", re.DOTALL)


def format_reward(prompts, completions, **_):
    """1.0 for `<think>...</think>` followed by an answer, else 0.0."""
    return [1.0 if _FORMAT.match(_to_text(c)) else 0.0 for c in completions]


def partial_credit_reward(prompts, completions, answer, **_):
    """Graded credit: 1.0 for the right number; 0.5 * (1 - relative error) for a wrong number (0 when it is
    off by 100% or more); 0.1 for a well-formed completion with no number; 0.0 otherwise."""
    out = []
    for comp, gold in zip(completions, answer):
        text = _to_text(comp)
        pred = extract_answer(text)
        try:
            p, g = float(pred), float(gold)
        except (TypeError, ValueError):
            out.append(0.1 if _FORMAT.match(text) else 0.0)
            continue
        if p == g:
            out.append(1.0)
        else:
            out.append(0.5 * max(0.0, 1.0 - abs(p - g) / max(1.0, abs(g))))
    return out


def soft_overlong_punishment(max_completion_length: int, soft_punish_cache: int):
    """DAPO's soft overlong penalty: 0 up to L_max - L_cache tokens, then linearly down to -1 at L_max."""
    if not 0 <= soft_punish_cache <= max_completion_length:
        raise ValueError(
            f"soft_punish_cache must be in [0, {max_completion_length}], got {soft_punish_cache}"
        )

    def overlong_reward(prompts, completions, completion_ids, **_):
        start = max_completion_length - soft_punish_cache
        out = []
        for ids in completion_ids:
            n = len(ids)
            if n <= start:
                out.append(0.0)
            elif n <= max_completion_length:
                out.append((start - n) / max(1, soft_punish_cache))
            else:
                out.append(-1.0)
        return out

    return overlong_reward


_CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
    """The last fenced Python block, else everything after </think>."""
    text = final_answer_text(completion)
    blocks = _CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else text


def _test_list(t) -> list:
    """A sample's `tests` as a list: assert snippets, or stdin/stdout cases ({"input", "output"}); also one
    snippet as a string, or {"inputs": [...], "outputs": [...]} (competitive-programming data sets)."""
    if isinstance(t, str):
        return [t]
    if isinstance(t, dict) and "inputs" in t and "outputs" in t:
        return [{"input": i, "output": o} for i, o in zip(t["inputs"], t["outputs"])]
    return list(t or [])


def code_reward(
    prompts, completions, tests, limits: SandboxLimits = SandboxLimits(), allow_unsandboxed=False,
    metrics: dict | None = None, entry_point=None, **_,
):  # fmt: skip
    """Fraction of the sample's `tests` passed by the completion's code (its last fenced Python block),
    judged in two OS sandboxes (grpo_fast/rewards/judge.py; completions in parallel); tests that cannot fail
    pay nothing. An `entry_point` column (HumanEval's: the function's name, or a list of names) limits the
    names of the completion's the tests may use to those. `metrics`, when given, receives this call's count of
    completions whose judging stopped early, per cause (timeout, crashed, malformed): they scored what they
    had passed, never a reward error."""
    names = entry_point if entry_point is not None else [None] * len(completions)
    jobs = [(extract_code(_to_text(c)), _test_list(t), e) for c, t, e in zip(completions, tests, names)]
    verdicts = judge_many(jobs, limits, allow_unsandboxed=allow_unsandboxed)
    if metrics is not None:
        metrics.clear()
        for cause in ("timeout", "crashed", "malformed"):
            metrics[f"sandbox_{cause}"] = sum(v.failure == cause for v in verdicts)
        metrics["sandbox_failures"] = sum(v.failure is not None for v in verdicts)
    return [v.score for v in verdicts]


def shop_answer_reward(prompts, completions, answer, **kw):
    """The embedded default task's reward (exact final number after </think>)."""
    from ..tasks.default_task import shop_answer_reward as f

    return f(prompts, [_to_text(c) for c in completions], answer, **kw)


BUILTINS = {
    "accuracy": accuracy_reward,
    "integer_answer": integer_answer_reward,
    "format": format_reward,
    "partial": partial_credit_reward,
    "code": code_reward,
    "shop_answer": shop_answer_reward,
}


def load_reward(spec: str, max_completion_length: int = 256, allow_unsandboxed_code: bool = False):
    """A built-in by name ("accuracy", "integer_answer", "format", "partial", "code", "shop_answer",
    "overlong[:CACHE]") or a user function as "path/to/file.py:function". "code" checks here that its OS
    sandbox can run."""
    if spec == "code":
        try:
            kind = check_available(allow_unsandboxed_code)
        except SandboxUnavailable as exc:
            raise ValueError(f"--reward code: {exc}") from exc
        if kind != "bwrap":
            print("grpo-fast: code rewards run WITHOUT the OS sandbox (--allow-unsandboxed-code)", flush=True)

        def code(prompts, completions, tests, **kw):
            return code_reward(prompts, completions, tests, allow_unsandboxed=allow_unsandboxed_code,
                               metrics=code.last_metrics, **kw)  # fmt: skip

        code.last_metrics = {}  # the last call's sandbox failures (metrics.jsonl: rewards/code/...)
        return code
    if spec in BUILTINS:
        return BUILTINS[spec]
    if spec.startswith("overlong"):
        cache = int(spec.split(":", 1)[1]) if ":" in spec else max(1, max_completion_length // 4)
        return soft_overlong_punishment(max_completion_length, cache)
    if ":" not in spec:
        raise ValueError(
            f"--reward {spec!r}: expected a built-in ({', '.join(BUILTINS)}, overlong[:N]) "
            "or path/to/file.py:function"
        )
    return load_from_file(spec, "--reward", "function")


def load_from_file(spec: str, flag: str, what: str = "function"):
    """The callable `name` of "path/to/file.py:name" (a reward, a tool, an environment class)."""
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ValueError(f"{flag} {spec!r}: expected path/to/file.py:{what}")
    if not Path(path).is_file():
        raise ValueError(f"{flag} {spec!r}: no such file {path!r}")
    mod_spec = importlib.util.spec_from_file_location(f"user_{flag.strip('-')}_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    obj = getattr(module, name, None)
    if not callable(obj):
        raise ValueError(f"{flag} {spec!r}: {path} has no {what} {name!r}")
    return obj


def reward_name(func) -> str:
    return getattr(func, "__name__", type(func).__name__)


# --------------------------------------------------------------------------------------------------------
# Combining
# --------------------------------------------------------------------------------------------------------
@dataclass
class Scores:
    rewards: torch.Tensor  # (N,) weighted sum over the functions with an opinion; NaN when none had one
    per_func: torch.Tensor  # (N, F) raw values, NaN for None
    failed: torch.Tensor  # (N,) bool: a function failed on this sample (only with on_error="skip")


def _call_checked(func, prompts, completions, columns, n):
    name = reward_name(func)
    try:
        values = func(prompts=prompts, completions=completions, **columns)
    except Exception as exc:  # noqa: BLE001 - we re-raise with the function and sample named
        # find the first sample it fails on, so the error can point at it
        for i in range(n):
            one = {k: v[i : i + 1] for k, v in columns.items()}
            try:
                func(prompts=prompts[i : i + 1], completions=completions[i : i + 1], **one)
            except Exception:  # noqa: BLE001
                raise RewardError(name, f"raised {type(exc).__name__}: {exc}", sample=i) from exc
        raise RewardError(name, f"raised {type(exc).__name__}: {exc}") from exc
    if values is None or len(values) != n:
        got = "None" if values is None else f"{len(values)} values"
        raise RewardError(name, f"returned {got}, expected {n} (one per completion)")
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(float("nan"))
            continue
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise RewardError(name, f"returned {v!r}, expected a float or None", sample=i) from None
        if not math.isfinite(f):
            raise RewardError(name, f"returned {f}, expected a finite float or None", sample=i)
        out.append(f)
    return out


def score(funcs, weights, prompts, completions, columns, on_error: str = "raise") -> Scores:
    """Run every reward function on the batch and combine them (TRL: weighted nansum; all-None -> NaN)."""
    n = len(completions)
    per_func = torch.full((n, len(funcs)), float("nan"))
    failed = torch.zeros(n, dtype=torch.bool)
    for j, func in enumerate(funcs):
        try:
            per_func[:, j] = torch.tensor(_call_checked(func, prompts, completions, columns, n))
        except RewardError as err:
            if on_error != "skip":
                raise
            if err.sample is not None:  # score the others one by one; drop the ones that fail
                for i in range(n):
                    one = {k: v[i : i + 1] for k, v in columns.items()}
                    try:
                        per_func[i, j] = _call_checked(
                            func, prompts[i : i + 1], completions[i : i + 1], one, 1
                        )[0]
                    except RewardError:
                        failed[i] = True
            else:
                failed[:] = True
    return Scores(rewards=weighted_sum(per_func, weights), per_func=per_func, failed=failed)


def weighted_sum(per_func: torch.Tensor, weights) -> torch.Tensor:
    """TRL's combination of the functions' scores (rows, functions; NaN: no opinion): the weighted nansum per
    row, NaN where no function scored the row."""
    w = torch.as_tensor(weights, dtype=per_func.dtype, device=per_func.device)
    return (per_func * w).nansum(1).masked_fill(per_func.isnan().all(1), float("nan"))
