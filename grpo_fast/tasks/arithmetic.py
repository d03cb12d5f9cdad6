"""The real-model task (`make demo-smollm2`, `--task smollm2`): chat questions for SmolLM2-135M-Instruct with
integer answers, scored by the `integer_answer` reward (the integer the completion states; an expression, a
list or the question restated scores 0), in two kinds:

- `add`: "What is 37 + 45? Answer with the number." (a, b in 10..99);
- `two-step`: word problems from templates, two operations on three numbers ("Mia has 23 stickers. She buys
  4 packs of 6 stickers. How many stickers does she have now? Answer with the number." -> 47), where the base
  model is weak.

`--task smollm2` trains and evaluates on both kinds; `--task smollm2-two-step` on the word
problems alone, with the same held-out word problems (`dataset_rows(split, kinds)` filters one split).

Held out: a fixed set of problems (half of each kind) none of which is a training problem in another guise:
the split deduplicates on what makes two problems the same (`same_problem`: an addition's operands in either
order; a word problem's template and numbers, whatever its name and item). It is a pure function of
SPLIT_SEED. The base model often explains at length and is cut by `--max-completion-length` before it states
a number, or slips in the arithmetic: GRPO rewards the completions that state the right number in time, and
held-out greedy accuracy, scored by an evaluator of its own (`arithmetic_eval`), measures whether that carries
to unseen problems.
"""

import random

SPLIT_SEED = 46
KINDS = ("add", "two-step")
# --task name -> the kinds of problem it trains and is held out on
TASK_KINDS = {"smollm2": KINDS, "smollm2-two-step": ("two-step",)}
N_EVAL_PER_KIND = 64
N_TRAIN_PER_KIND = 2000
SUFFIX = " Answer with the number."
NAMES = [("Mia", "She", "she"), ("Tom", "He", "he"), ("Ana", "She", "she"), ("Sam", "He", "he")]
ITEMS = ["stickers", "apples", "marbles", "cards", "pencils", "coins"]
# (text, answer): {name} {Pro} {pro} {item} and the numbers a, b, c
TWO_STEP = [
    ("{name} has {a} {item}. {Pro} buys {b} packs of {c} {item}. How many {item} does {pro} have now?",
     lambda a, b, c: a + b * c),
    ("{name} had {a} {item}. {Pro} gave away {b} and then found {c} more. How many {item} does {pro} have "
     "now?", lambda a, b, c: a - b + c),
    ("A box holds {c} {item}. {name} fills {b} boxes and has {a} {item} left over. How many {item} does "
     "{pro} have in all?", lambda a, b, c: b * c + a),
]  # fmt: skip


def _add(rng: random.Random) -> tuple:
    return ("add", 0, rng.randint(10, 99), rng.randint(10, 99), 0, 0, 0)


def _two_step(rng: random.Random) -> tuple:
    t, who, item = rng.randrange(len(TWO_STEP)), rng.randrange(len(NAMES)), rng.randrange(len(ITEMS))
    a, b, c = rng.randint(10, 60), rng.randint(2, 9), rng.randint(2, 9)
    if t == 1:
        b = rng.randint(2, a - 2)  # gives away fewer than it has
    return ("two-step", t, a, b, c, who, item)


def question(p: tuple) -> tuple[str, int]:
    """(the user's message, the answer) of a problem tuple (kind, template, a, b, c, name, item)."""
    kind, t, a, b, c, who, item = p
    if kind == "add":
        return f"What is {a} + {b}?{SUFFIX}", a + b
    text, answer = TWO_STEP[t]
    name, pro_cap, pro = NAMES[who]
    words = text.format(name=name, Pro=pro_cap, pro=pro, item=ITEMS[item], a=a, b=b, c=c)
    return words + SUFFIX, answer(a, b, c)


def same_problem(p: tuple) -> tuple:
    """What two problems share when they are the same problem in another guise: an addition's operands as a
    set (37 + 45 is 45 + 37), a word problem's template and numbers (the name and the item are decoration)."""
    kind, t, a, b, c, _, _ = p
    return (kind, min(a, b), max(a, b)) if kind == "add" else (kind, t, a, b, c)


def split_problems() -> dict[str, list[tuple]]:
    """{"train", "eval"}: lists of problem tuples, half of each list of each kind (deterministic), no two of
    them (within or across the lists) the same problem by `same_problem`."""
    rng = random.Random(SPLIT_SEED)
    out = {"eval": [], "train": []}
    seen = set()
    for split, n in (("eval", N_EVAL_PER_KIND), ("train", N_TRAIN_PER_KIND)):
        for make in (_add, _two_step):
            got = 0
            while got < n:
                p = make(rng)
                if same_problem(p) not in seen:
                    seen.add(same_problem(p))
                    out[split].append(p)
                    got += 1
    return out


def dataset_rows(split: str, kinds: tuple = KINDS) -> list[dict]:
    """Rows for the trainer (split "train" or "eval"): a chat `prompt`, the `answer` the reward reads
    and the problem's `kind` (add or two-step), train rows shuffled; only the problems of `kinds` (the same
    split whatever the kinds: a word problem is held out in both tasks or in neither)."""
    if not kinds or not set(kinds) <= set(KINDS):
        raise ValueError(f"kinds: one or more of {KINDS}, got {kinds!r}")
    rows = []
    for p in split_problems()[split]:
        if p[0] not in kinds:
            continue
        q, ans = question(p)
        rows.append({"prompt": [{"role": "user", "content": q}], "answer": str(ans), "kind": p[0]})
    if split == "train":
        random.Random(SPLIT_SEED + 1).shuffle(rows)
    return rows
