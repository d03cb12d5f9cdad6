"""Prompt datasets: the embedded task, local files or Hub datasets (through `datasets`), and their order.

A dataset needs a `prompt` column (text, or chat messages as a list of {"role", "content"}); every other
column reaches the reward functions as a keyword argument. Prompts are rendered with the tokenizer's chat
template when it has one.
"""

import inspect
import json
import random
from pathlib import Path

from ..tasks import task_rows

_FILE_TYPES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def load_rows(spec: str, split: str, what: str = "--dataset") -> list[dict]:
    """Rows of a local JSONL/JSON/CSV/Parquet file or a Hub dataset, checked for a usable `prompt` column.
    JSONL is read directly (no `datasets` needed); the other formats and the Hub through `datasets`."""
    path = Path(spec)
    if path.suffix in _FILE_TYPES:
        if not path.is_file():
            raise ValueError(f"{what} {spec!r}: no such file")
        if path.stat().st_size == 0:
            raise ValueError(f"{what} {spec!r}: the dataset is empty")
        rows = (
            _read_jsonl(path, what, spec)
            if path.suffix == ".jsonl"
            else _read_with_datasets(path, what, spec)
        )
    elif path.exists():
        raise ValueError(f"{what} {spec!r}: expected a .jsonl, .json, .csv or .parquet file")
    else:
        import datasets

        try:
            rows = [dict(r) for r in datasets.load_dataset(spec, split=split)]
        except Exception as exc:  # noqa: BLE001 - offline, missing, private: say which and why
            raise ValueError(
                f"{what} {spec!r}: could not load it as a Hub dataset ({type(exc).__name__}: {exc})"
            )
    if not rows:
        raise ValueError(f"{what} {spec!r}: the dataset is empty")
    lacking = next((i for i, r in enumerate(rows) if "prompt" not in r), None)
    if lacking is not None:
        raise ValueError(f"{what} {spec!r}: no 'prompt' column (row {lacking} has {sorted(rows[lacking])})")
    return rows


def _read_jsonl(path: Path, what: str, spec: str) -> list[dict]:
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what} {spec!r}: line {i} is not valid JSON ({exc.msg})") from exc
        if not isinstance(row, dict):
            raise ValueError(f"{what} {spec!r}: line {i} is not a JSON object")
        rows.append(row)
    return rows


def _read_with_datasets(path: Path, what: str, spec: str) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_dataset(_FILE_TYPES[path.suffix], data_files=str(path), split="train")
    except Exception as exc:  # noqa: BLE001 - malformed or empty files: name the file and the cause
        if "corresponds to no data" in str(exc):
            raise ValueError(f"{what} {spec!r}: the dataset is empty") from exc
        raise ValueError(f"{what} {spec!r}: could not read it ({type(exc).__name__}: {exc})") from exc
    return [dict(r) for r in ds]


def train_and_eval_rows(cfg) -> tuple[list[dict], list[dict]]:
    if not cfg.dataset:
        return task_rows(cfg.task)
    train = load_rows(cfg.dataset, cfg.dataset_split)
    evals = load_rows(cfg.eval_dataset, cfg.eval_split, "--eval-dataset") if cfg.eval_dataset else []
    return train, evals


# keyword arguments every reward function gets from the trainer itself, not from a dataset column
_TRAINER_ARGUMENTS = ("prompts", "completions", "completion_ids", "environments")  # environments: multi-turn


def reward_columns_needed(func) -> list[str]:
    """The dataset columns a reward function cannot do without: its parameters without a default, past
    `prompts` and `completions` (what `**kwargs` takes is optional)."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: nothing to read, nothing required
        return []
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [
        p.name
        for p in params
        if p.kind in named and p.default is inspect.Parameter.empty and p.name not in _TRAINER_ARGUMENTS
    ]


def check_rows(rows: list[dict], what: str, reward_funcs=(), names=()) -> None:
    """Every row can be trained on, checked before any model loads: `prompt` is text or chat messages, every
    row has the columns the first row has (they all reach the reward functions), and the columns each reward
    function needs are there. `names`: the reward functions' names, for the errors."""
    for i, row in enumerate(rows):
        problem = _prompt_problem(row["prompt"])
        if problem:
            raise ValueError(f"{what}: row {i}: 'prompt' must be text or a list of chat messages; {problem}")
    columns = set(rows[0])
    for i, row in enumerate(rows):
        missing = sorted(columns - set(row))
        if missing:
            raise ValueError(
                f"{what}: row {i} lacks the column(s) {missing} that row 0 has (every column reaches the "
                "reward functions, so every row needs it)"
            )
    for func, name in zip(reward_funcs, names):
        lacking = [c for c in reward_columns_needed(func) if c not in columns]
        if lacking:
            raise ValueError(
                f"{what}: reward function {name!r} needs the column(s) {lacking}; the dataset has "
                f"{sorted(columns)}"
            )


def _prompt_problem(prompt) -> str | None:
    if isinstance(prompt, str):
        return None
    if not isinstance(prompt, list):
        return f"got {type(prompt).__name__} {str(prompt)[:60]!r}"
    if not prompt:
        return "got an empty list of messages"
    for j, m in enumerate(prompt):
        # content: text, or a list of content parts (as chat templates take them)
        content = m.get("content") if isinstance(m, dict) else None
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(content, (str, list))):
            return f'message {j} is not {{"role": str, "content": str}} (got {str(m)[:60]!r})'
    return None


def render_prompt(prompt, tokenizer, template_kwargs: dict | None = None) -> str:
    """Text the model sees: the chat template (with the generation prompt and `template_kwargs`, TRL's
    chat_template_kwargs) when there is one."""
    kw = template_kwargs or {}
    if isinstance(prompt, list):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "a conversational prompt (list of messages) needs a tokenizer with a chat template"
            )
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False, **kw)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": str(prompt)}], add_generation_prompt=True, tokenize=False, **kw
        )
    return str(prompt)


class PromptSampler:
    """Prompts in a reshuffled order each epoch (`shuffle`, else in the rows' order every epoch); its state
    (epoch, position) goes into checkpoints."""

    def __init__(self, rows: list[dict], batch: int, seed: int, shuffle: bool = True):
        self.rows, self.batch, self.seed, self.shuffle = rows, batch, seed, shuffle
        self.epoch, self.pos = 0, 0
        self._order = self._shuffle()

    def _shuffle(self):
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def next(self) -> list[dict]:
        out = []
        while len(out) < self.batch:
            if self.pos == len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._shuffle()
            out.append(self.rows[self._order[self.pos]])
            self.pos += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def rewound(self, state: dict, n: int) -> dict:
        """The state `n` prompts before `state` (back across epochs: each epoch's order is its seed's), so
        that the next draw from it starts with those n prompts again."""
        epoch, pos = state["epoch"], state["pos"] - n
        while pos < 0:
            if epoch == 0:
                raise ValueError(f"rewinding {n} prompts goes before the first one (from {state})")
            epoch, pos = epoch - 1, pos + len(self.rows)
        return {"epoch": epoch, "pos": pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._shuffle()
