"""How a step's groups are cut into training micro-batches: the configured layout, or packed to a budget.

The prompts of a step are split into `gradient_accumulation_steps` chunks (each chunk is one normalization
unit of the loss). Inside a chunk, a micro-batch holds prompts each with some of their completions (a group
cut across micro-batches carries its prompt into each: the gradients stay those of the whole group). Without
a budget the layout is the configured one (whole chunks, or `group_split` completions per sub-batch). With
`--max-memory-gb` a Packer fills each micro-batch up to a byte budget from the step's real prompt and
completion lengths, so a step's peak is the plan's whatever the completions' lengths: short completions take
fewer micro-batches, long ones more. `grpo_fast.trainer.estimate` runs the same code on the longest lengths
to plan.
"""

from dataclasses import dataclass
from typing import Callable

# a micro-batch: [(prompt index, [completion rows])]; rows of one prompt are consecutive
Part = list


@dataclass
class Packer:
    """cost(groups, P, C): bytes of a micro-batch of `groups` [(prompt length, [completion lengths])] whose
    prompts are P and completions C tokens wide (grpo_fast.trainer.estimate.Estimator.micro_batch_bytes);
    budget: the bytes a micro-batch may take."""

    cost: Callable
    budget: float

    def fits(self, groups, P, C) -> bool:
        return self.cost(groups, P, C) <= self.budget


def partition(prompt_lens, completion_lens, G, chunks, P, C, group_split=0, packer=None) -> list[list[Part]]:
    """The micro-batches of each chunk. prompt_lens: real tokens per prompt; completion_lens: per completion
    (row s answers prompt s // G); chunks: how many normalization chunks; P, C: the batch's widths."""
    n = len(prompt_lens)
    if n % chunks:
        raise ValueError(f"{n} prompts do not split into {chunks} chunks")
    per = n // chunks
    out = []
    for c in range(chunks):
        prompts = range(c * per, (c + 1) * per)
        if packer is not None:
            out.append(_pack(prompts, prompt_lens, completion_lens, G, P, C, packer))
        elif 0 < group_split < G:
            rows = lambda i, k: list(range(i * G + k * group_split, i * G + (k + 1) * group_split))  # noqa
            out.append([[(i, rows(i, k))] for i in prompts for k in range(G // group_split)])
        else:
            out.append([[(i, list(range(i * G, (i + 1) * G))) for i in prompts]])
    return out


def _pack(prompts, prompt_lens, completion_lens, G, P, C, packer) -> list[Part]:
    """Greedy in order, one completion at a time: a micro-batch takes completions (with their prompts) while
    it fits, so it is cut where the budget is full, inside a group or between groups (a group cut in two
    runs its prompt in both). A completion that does not fit alone still runs alone: it cannot be cut."""
    shape = lambda part: [(prompt_lens[i], [completion_lens[r] for r in rows]) for i, rows in part]  # noqa
    parts, current = [], []
    for i in prompts:
        for r in range(i * G, (i + 1) * G):
            grown = [*current[:-1], (i, current[-1][1] + [r])] if current and current[-1][0] == i else [
                *current, (i, [r])
            ]  # fmt: skip
            if current and not packer.fits(shape(grown), P, C):
                parts.append(current)
                grown = [(i, [r])]
            current = grown
    if current:
        parts.append(current)
    return parts


def split_to(parts_by_chunk: list[list[Part]], count: int) -> list[list[Part]]:
    """Cut the largest micro-batches (most completions) in two until there are `count`: distributed ranks
    must run the same number of forwards (FSDP gathers the weights in each). Cutting only lowers memory."""
    total = sum(len(p) for p in parts_by_chunk)
    while total < count:
        c, k = max(
            ((c, k) for c, parts in enumerate(parts_by_chunk) for k in range(len(parts))),
            key=lambda ck: sum(len(rows) for _, rows in parts_by_chunk[ck[0]][ck[1]]),
        )
        part = parts_by_chunk[c][k]
        if len(part) > 1:
            halves = [part[: len(part) // 2], part[len(part) // 2 :]]
        else:
            (i, rows), h = part[0], len(part[0][1]) // 2
            if h == 0:
                raise ValueError(f"cannot cut {total} micro-batches into {count}: too few completions")
            halves = [[(i, rows[:h])], [(i, rows[h:])]]
        parts_by_chunk[c][k : k + 1] = halves
        total += 1
    return parts_by_chunk


def tokens_run(parts_by_chunk: list[list[Part]], prompt_lens, completion_lens) -> int:
    """Tokens the micro-batches run forward: each micro-batch runs its prompts once (prefix sharing)."""
    return sum(
        prompt_lens[i] + sum(completion_lens[r] for r in rows)
        for parts in parts_by_chunk
        for part in parts
        for i, rows in part
    )
