"""How a step's groups become micro-batches (grpo_fast.trainer.batching), checked on hand-made lengths."""

import pytest

from grpo_fast.trainer.batching import Packer, partition, split_to


def tokens(groups, P, C):  # a micro-batch's cost: its real tokens, the prompt once per group
    return sum(p + sum(lens) for p, lens in groups)


def test_configured_layouts():
    lens = [5] * 8
    assert partition([3, 3], lens, 4, 1, 3, 5) == [[[(0, [0, 1, 2, 3]), (1, [4, 5, 6, 7])]]]
    assert partition([3, 3], lens, 4, 2, 3, 5) == [[[(0, [0, 1, 2, 3])]], [[(1, [4, 5, 6, 7])]]]
    assert partition([3, 3], lens, 4, 1, 3, 5, group_split=2) == [
        [[(0, [0, 1])], [(0, [2, 3])], [(1, [4, 5])], [(1, [6, 7])]]
    ]


def test_packing_follows_the_real_lengths():
    """Short completions: groups share a micro-batch; long ones: a group is cut into sub-batches of
    consecutive completions, each as large as the budget allows; a completion over budget still runs alone."""
    short = partition([10, 10, 10], [5] * 12, 4, 1, 10, 64, packer=Packer(tokens, 65))
    assert short == [[[(0, [0, 1, 2, 3]), (1, [4, 5, 6, 7])], [(2, [8, 9, 10, 11])]]]
    long = partition([10], [30, 30, 20, 64], 4, 1, 10, 64, packer=Packer(tokens, 65))
    assert long == [[[(0, [0])], [(0, [1, 2])], [(0, [3])]]]
    # a micro-batch is cut where the budget is full, inside a group too (its prompt then runs in both)
    cut = partition([10, 10], [5] * 8, 4, 1, 10, 64, packer=Packer(tokens, 50))
    assert cut == [[[(0, [0, 1, 2, 3]), (1, [4, 5])], [(1, [6, 7])]]]
    # chunks are never mixed: they are the loss's normalization units
    chunked = partition([10, 10], [5] * 8, 4, 2, 10, 64, packer=Packer(tokens, 1000))
    assert chunked == [[[(0, [0, 1, 2, 3])]], [[(1, [4, 5, 6, 7])]]]
    for parts in (short, long, cut, chunked):  # every completion exactly once
        rows = sorted(r for chunk in parts for part in chunk for _, rs in part for r in rs)
        assert rows == list(range(len(rows)))


def test_split_to_agrees_on_a_count():
    parts = [[[(0, [0, 1, 2, 3]), (1, [4, 5, 6, 7])]]]
    assert split_to(parts, 3) == [[[(0, [0, 1])], [(0, [2, 3])], [(1, [4, 5, 6, 7])]]]
    with pytest.raises(ValueError, match="too few completions"):
        split_to([[[(0, [0])]]], 2)
