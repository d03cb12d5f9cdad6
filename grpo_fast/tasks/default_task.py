"""The embedded default task: "A shop has 6 boxes of 8 items and sells 6 . How many items are left ?" -> 42.

Problems are (a, b, c) with a, b in 2..9 and 1 <= c <= min(9, a*b - 1); the answer is a*b - c. A fixed
split holds 64 problems out: neither the base model's pretraining corpus nor GRPO ever sees them. Each
held-out problem's two facts (a * b and P - c) are taught by training problems, so a model can get it right
by composing what it saw, never by recalling it. The training problems are both the pretraining corpus's
subject and GRPO's prompts, as a real base model has seen text of the kind its RL prompts are made of.

The base model (built by `scripts/build_base_model.py`, shipped in `grpo_fast/tasks/assets/shop-base`) learned
from a deliberately noisy teacher: the right chain of thought 25% of the time, a systematic slip (answering
one too many) 55%, and other mistakes 20%. It therefore knows the format and the procedure but its greedy
answer is usually the slip; sampling finds the right answer about a quarter of the time, which is what GRPO
can amplify.
"""

import random
import re
from pathlib import Path

ASSET_DIR = Path(__file__).resolve().parent / "assets" / "shop-base"
# a small code task for `--reward code`: functions with assert tests, programs with stdin/stdout cases
CODE_TASK = Path(__file__).resolve().parent / "assets" / "code_task.jsonl"
TEMPLATES = [
    "A shop has {a} boxes of {b} items and sells {c} . How many items are left ?",
    "A store gets {a} crates with {b} apples each and sells {c} apples . How many apples are left ?",
]
SPLIT_SEED = 1234


def answer(a: int, b: int, c: int) -> int:
    return a * b - c


def all_problems() -> list[tuple[int, int, int]]:
    return [(a, b, c) for a in range(2, 10) for b in range(2, 10) for c in range(1, min(9, a * b - 1) + 1)]


def _facts(p):
    a, b, c = p
    return (("mul", a, b), ("sub", a * b, c))


def split_problems(n_eval: int = 64) -> dict[str, list[tuple[int, int, int]]]:
    """Deterministic disjoint split {"train", "eval"}: a problem is held out only while both of its facts
    are still taught by some training problem."""
    probs = all_problems()
    random.Random(SPLIT_SEED).shuffle(probs)
    count = {}
    for p in probs:
        for f in _facts(p):
            count[f] = count.get(f, 0) + 1
    out = {"eval": [], "train": []}
    for p in probs:
        if len(out["eval"]) < n_eval and all(count[f] > 1 for f in _facts(p)):
            for f in _facts(p):
                count[f] -= 1
            out["eval"].append(p)
        else:
            out["train"].append(p)
    return out


def prompt_text(p, template: int = 0) -> str:
    a, b, c = p
    return TEMPLATES[template].format(a=a, b=b, c=c)


def completion_text(a: int, b: int, c: int, product: int, result: int, final: int, close: bool = True) -> str:
    end = " </think>" if close else ""
    return f"<think> {a} * {b} = {product} , {product} - {c} = {result}{end} {final}"


def noisy_completion(p, rng: random.Random) -> str:
    """The noisy teacher of the base model's corpus (see the module docstring)."""
    a, b, c = p
    prod, res = a * b, a * b - c
    u = rng.random()
    if u < 0.25:
        return completion_text(a, b, c, prod, res, res)
    if u < 0.80:  # the systematic slip
        return completion_text(a, b, c, prod, res + 1, res + 1)
    if u < 0.90:  # a wrong product, carried through
        wrong = prod + rng.choice([-2, -1, 1, 2])
        return completion_text(a, b, c, wrong, wrong - c, wrong - c)
    return completion_text(a, b, c, prod, res, res + rng.choice([-2, 2]), close=rng.random() < 0.5)


def dataset_rows(split: str) -> list[dict]:
    """Rows for the trainer (split "train" or "eval"): a `prompt` and the `answer` column the reward reads."""
    rows = []
    for p in split_problems()[split]:
        for t in range(len(TEMPLATES)):
            rows.append({"prompt": prompt_text(p, t), "answer": str(answer(*p))})
    return rows


_ANSWER = re.compile(r"</think>\s*(-?\d+)\s*$")


def shop_answer_reward(prompts, completions, answer, **_):
    """1.0 when the text after </think> is exactly the expected number, else 0.0. A multi-turn completion
    (messages, `make demo-tools`) is read from its assistant turns (the tool's answer is not the model's)."""
    out = []
    for comp, ans in zip(completions, answer):
        if isinstance(comp, list):
            comp = " ".join(m.get("content") or "" for m in comp if m.get("role") == "assistant")
        m = _ANSWER.search(comp.strip())
        out.append(1.0 if m and m.group(1) == str(ans) else 0.0)
    return out


def vocabulary() -> list[str]:
    words = set()
    for t in TEMPLATES:
        words.update(w for w in t.split() if not w.startswith("{"))
    words.update(["*", "=", ",", "-"])
    return sorted(words) + [str(i) for i in range(100)]
