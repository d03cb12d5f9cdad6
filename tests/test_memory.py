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


_REFAULTS = """
import resource, sys, torch
from grpo_fast.trainer import memory
held = memory.hold_freed_memory("cpu") if sys.argv[1] == "hold" else False
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def phase():  # a training phase's pattern: activations made bottom-up, freed top-down, and one large tensor
    acts = [torch.ones(2 * 2**20) for _ in range(24)]  # 24 x 8 MiB
    big = torch.ones(50 * 2**20)  # 200 MiB, over glibc's 32 MiB sliding mmap threshold
    del big
    while acts:
        acts.pop()
for _ in range(4):  # glibc settles where to put them (held: the heap grows to ~1.9x the phase, then stays)
    phase()
before = faults()
phase()
print(held, faults() - before)
"""


@pytest.mark.skipif(memory._glibc_on("cpu") is None, reason="glibc >= 2.33 on a CPU")
def test_held_heap_serves_the_next_phase_without_faulting_it_in_again():
    """Without a budget the trainer holds what the heap frees (hold_freed_memory): once the heap has grown to
    the phase's pattern, a phase of the same shapes reuses its pages. glibc's defaults, run beside as the
    reference, map the large tensor anew each time (over their 32 MiB ceiling), so every phase faults its
    200 MiB (51,200 pages) in again. Each in a process of its own: the allocator's settings are the
    process's."""
    import subprocess
    import sys

    def last_phase_faults(mode):
        out = subprocess.run(
            [sys.executable, "-c", _REFAULTS, mode], capture_output=True, text=True, check=True
        )
        held, faults = out.stdout.split()
        return held == "True", int(faults)

    big = 200 * 2**20 // 4096
    held, faults = last_phase_faults("default")
    assert not held and faults > 0.8 * big, faults
    held, faults = last_phase_faults("hold")
    assert held and faults < 0.05 * big, faults
