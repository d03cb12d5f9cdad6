"""The CPU heap's free memory: kept for the next step while the machine has memory to spare, handed back to
the OS when it runs short (grpo_fast.trainer.memory.release_free_memory)."""

import pytest
import torch

from grpo_fast.trainer import memory


def _heap_with_free_holes(mib: int):
    """`mib` MiB of 64 KiB tensors (under glibc's mmap threshold: from the heap), touched, then every other
    one freed: free chunks inside the heap that glibc keeps and only malloc_trim hands back."""
    blocks = [torch.ones(16384) for _ in range(mib * 16)]
    return blocks[::2]


@pytest.mark.skipif(memory._glibc_on("cpu") is None, reason="glibc >= 2.33 on a CPU")
def test_free_heap_is_kept_unless_the_machine_runs_short(monkeypatch):
    keep = _heap_with_free_holes(256)  # ~128 MiB free in holes
    before = memory.current_mib("cpu")
    monkeypatch.setattr(memory, "available_mib", lambda: 1e9)  # plenty: kept for the next step
    assert not memory.release_free_memory("cpu", 64, under_pressure_only=True)
    assert memory.current_mib("cpu") > before - 32
    monkeypatch.setattr(memory, "available_mib", lambda: 100.0)  # the free heap is over a quarter of it
    assert memory.release_free_memory("cpu", 64, under_pressure_only=True)
    assert memory.current_mib("cpu") < before - 64, (before, memory.current_mib("cpu"))
    del keep


def test_available_memory_is_read_from_the_machine():
    """MemAvailable (or a cgroup's limit, smaller): a positive figure no larger than the machine's RAM."""
    total = memory._meminfo_kib("MemTotal") / 1024
    assert 0 < memory.available_mib() <= total
