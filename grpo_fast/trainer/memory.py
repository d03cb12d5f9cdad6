"""A process's peak memory per phase: CUDA's allocator peak, or the CPU's resident-set high-water mark; and on
a CPU, keeping the C heap from holding what tensors freed.

    reset_peak(device); ...; peak_mib(device)

On CUDA the peak is `torch.cuda.max_memory_allocated` (what tensors held; the CUDA context and the caching
allocator's reserve come on top). On the CPU it is the resident set's high-water mark (VmHWM), reset through
/proc/self/clear_refs; where that is not allowed the peak is the process's since it started.
"""

import ctypes
import functools
import os
import resource
from pathlib import Path

import torch


def _proc_kib(file: str, field: str) -> int | None:
    """A field of /proc/self/status or /proc/meminfo, in KiB (None where unreadable)."""
    try:
        for line in Path(file).read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _status_kib(field: str) -> int | None:
    return _proc_kib("/proc/self/status", field)


def current_mib(device) -> float:
    """Memory in use now: allocated tensors (CUDA) or the resident set (CPU)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    kib = _status_kib("VmRSS")
    return (kib if kib is not None else 0) / 1024


def reset_peak(device) -> None:
    """Start a new peak from what is in use now."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_mib(device) -> float:
    """The peak since the last `reset_peak` (MiB)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    kib = _status_kib("VmHWM")
    return (kib if kib is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024


TRIM_ABOVE_MIB = 256  # free heap worth handing back (the demo keeps ~80 MiB free: trimming it cost 15% there)


_MALLINFO2 = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
              "keepcost")  # fmt: skip


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2]


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):
        return None  # not glibc (>= 2.33)


def _glibc_on(device):
    """glibc, where the trainer may tune it: a CPU device, glibc >= 2.33, GRPO_FAST_TRIM not 0; else None."""
    if torch.device(device).type != "cpu" or os.environ.get("GRPO_FAST_TRIM", "1") == "0":
        return None
    return _libc()


def release_free_memory(device, above_mib: float = TRIM_ABOVE_MIB, under_pressure_only: bool = False) -> bool:
    """On a CPU, hand the heap's free pages back to the OS (glibc's malloc_trim) once it holds more than
    `above_mib` free; `under_pressure_only`: and only when the machine is short of memory, the free heap
    being over PRESSURE_SHARE of what it still has available (available_mib). Returns whether it trimmed.
    GRPO_FAST_TRIM=0 turns it off (to measure what it costs).

    Why not every step: between steps the free heap is mostly the next step's working set (the rollout's
    packed weights and KV, the freed activations), and handed back, every page of it is faulted in again:
    on SmolLM2 (the smollm2 preset, Xeon AMX) that cost 15% of the step (6.32 s vs 5.38 s median over 30
    steps) while the step's peak resident set differed by 3.5% (4.97 vs 5.14 GB at step 30). What does grow
    without trimming is fragmentation (the steps' tensors have other sizes each time: free heap 2.0 -> 2.9
    GB over 60 steps there; 1.7 -> 6.4 GB resident in 15 steps in an earlier layout), handed back once it
    weighs on the machine."""
    libc = _glibc_on(device)
    if libc is None:
        return False
    free_mib = libc.mallinfo2().fordblks / 2**20
    if free_mib < above_mib or (under_pressure_only and free_mib < PRESSURE_SHARE * available_mib()):
        return False
    libc.malloc_trim(0)
    return True


PRESSURE_SHARE = 0.25  # the free heap's share of the machine's available memory that has it handed back


def available_mib() -> float:
    """Memory the machine can still give: MemAvailable, or less where a cgroup (v2 or v1) limits the process
    (its limit minus its usage, reclaimable page cache counted as available)."""
    avail = _meminfo_kib("MemAvailable") / 1024
    for limit_f, usage_f, stat_f, cache_key in (
        ("memory.max", "memory.current", "memory.stat", "inactive_file"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
         "total_inactive_file"),
    ):  # fmt: skip
        try:
            root = Path("/sys/fs/cgroup")
            limit = (root / limit_f).read_text().strip()
            if limit == "max" or int(limit) >= 2**60:  # no limit
                continue
            stat = dict(line.split() for line in (root / stat_f).read_text().splitlines())
            usage = int((root / usage_f).read_text()) - int(stat.get(cache_key, 0))
            avail = min(avail, (int(limit) - usage) / 2**20)
        except (OSError, ValueError):
            continue
    return avail


def _meminfo_kib(field: str) -> float:
    kib = _proc_kib("/proc/meminfo", field)
    return float("inf") if kib is None else float(kib)  # unknown: never short of memory


MMAP_ABOVE_MIB = 0.125  # glibc's initial mmap threshold, held there under a budget (map_large_allocations)
_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD = -3, -1  # glibc's mallopt parameters
HOLD_MMAP_ABOVE_MIB = 1024  # without a budget, the heap serves every tensor under 1 GiB (hold_freed_memory)
_policy = {"mapped": False}  # map_large_allocations was asked for in this process: it stands


def map_large_allocations(device) -> bool:
    """On a CPU, have glibc serve every allocation of MMAP_ABOVE_MIB or more with its own mapping, handed
    back to the OS when freed (mallopt M_MMAP_THRESHOLD). glibc starts there but raises the threshold as
    large blocks are freed, up to 32 MiB, and activations and masks of a few MiB then come from the heap:
    training micro-batches of other shapes than the last one's find it full of freed blocks of the wrong
    sizes. On SmolLM2 under a 4 GiB plan, the resident set after a step's micro-batches sat 100-550 MiB over
    its tensors and its peak varied +-8% with the batch; held at 128 KiB, within 50 MiB and 4%. Held only in
    training (the rollout back at 32 MiB), peaks still drifted up to +5% after step 3, so the trainer holds
    it for the whole run under --max-memory-gb. It costs page faults: ~25% of the training phase's time on
    SmolLM2, and in long rollouts up to ~1.9x generation time (4 layers, C=8192). The heap's top is trimmed at
    glibc's default 128 KiB (whatever hold_freed_memory set before in this process). Returns whether it was
    set. GRPO_FAST_TRIM=0 leaves the allocator alone."""
    libc = _glibc_on(device)
    if libc is None:
        return False
    _policy["mapped"] = True
    return bool(
        libc.mallopt(_M_MMAP_THRESHOLD, int(MMAP_ABOVE_MIB * 2**20))
        and libc.mallopt(_M_TRIM_THRESHOLD, 2**17)
    )


def hold_freed_memory(device) -> bool:
    """On a CPU without a memory budget, keep what the heap frees for the next step: glibc's automatic trim
    off (M_TRIM_THRESHOLD -1) and every allocation under HOLD_MMAP_ABOVE_MIB served from the heap
    (M_MMAP_THRESHOLD; setting the trim threshold ends glibc's own sliding mmap threshold, whose 32 MiB
    ceiling mapped and unmapped the LM head's gradient and the loss's logit chunks every step).

    glibc hands back the heap's top whenever more than twice its mmap threshold (up to 64 MiB) of it is
    free, and a training phase frees its activations from the top down: on SmolLM2's real workload one phase
    grew and shrank the heap by 2.7 GB through brk, and every page was faulted in again, 780k faults, 6-14 s
    of kernel time in phases of 18-25 s on a 2-core VM (~18 us a fault). Held, the heap stays at its peak
    between steps (the next step's working set), handed back by release_free_memory when the machine runs
    short. A process that asked for map_large_allocations keeps it (bench.models.memory measures the budget's
    policy on trainers without one). Returns whether it was set; GRPO_FAST_TRIM=0 leaves the allocator
    alone."""
    libc = _glibc_on(device)
    if libc is None or _policy["mapped"]:
        return False
    return bool(
        libc.mallopt(_M_MMAP_THRESHOLD, HOLD_MMAP_ABOVE_MIB * 2**20) and libc.mallopt(_M_TRIM_THRESHOLD, -1)
    )
