"""A process's peak memory per phase: CUDA's allocator peak, or the CPU's resident-set high-water mark.

    reset_peak(device); ...; peak_mib(device)

On CUDA the peak is `torch.cuda.max_memory_allocated` (what tensors held; the CUDA context and the caching
allocator's reserve come on top). On the CPU it is the resident set's high-water mark (VmHWM), reset through
/proc/self/clear_refs; where that is not allowed the peak is the process's since it started.
"""

import resource
from pathlib import Path

import torch


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


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
