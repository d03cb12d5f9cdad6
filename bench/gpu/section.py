"""A GPU suite section's context (`Section`: its rows written as they are measured, timing, memory, the
compile caches; `measure_row`), the shapes the sections use, and the plain references they check against
(full logits, log_softmax, TRL's clipped loss: no code shared with grpo_fast.kernels)."""

import json
import os
import statistics
import time
from pathlib import Path

import torch

from bench.gpu.results import publish

BIG = dict(N=16384, H=4096, V=151936)  # the shape: 16 sequences of 1024 tokens, Qwen's vocabulary
CHECK = dict(N=4096, H=4096, V=151936)  # correctness against fp64: its logits are 5 GB in fp64
TINY = dict(N=2 * 37, H=32, V=1001)


class Section:
    def __init__(self, name: str, out: Path, deadline: float, dry: bool, triton_ok: bool):
        self.name, self.out, self.deadline, self.dry, self.triton_ok = name, out, deadline, dry, triton_ok
        self.device = torch.device("cpu" if dry else "cuda")
        self.result = {"rows": [], "columns": [], "notes": []}

    def left(self) -> float:
        return self.deadline - time.time()

    def add(self, row: dict) -> None:
        self.result["rows"].append(row)
        self.save()
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()}
        print("  " + json.dumps(shown), flush=True)

    def note(self, text: str) -> None:
        self.result["notes"].append(text)
        self.save()

    def save(self) -> None:
        publish(self.out, name=self.name, section=self.result)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(self, fn, budget_s: float = 2.5) -> dict:
        """One warm-up call (compilation, allocator), then as many timed calls as fit in `budget_s` (at least
        one, at most 20): median and min in ms, and the peak memory the calls allocated above what was
        allocated before them (CUDA; NaN on the CPU). A call slower than the budget is timed once; 2.5 s
        gives a call of 0.5 s five samples, and the suite's ~60 rows fit a loan."""
        budget_s = max(0.0, min(budget_s, self.left() - 5))
        fn()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        times = []
        start = time.perf_counter()
        while len(times) < 20:
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append((time.perf_counter() - t0) * 1e3)
            if time.perf_counter() - start + times[0] / 1e3 > budget_s:
                break
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else float("nan")
        return {"ms": statistics.median(times), "min_ms": min(times), "calls": len(times), "peak_mib": peak}

    def peak_mib(self, fn) -> float:
        """Memory one call allocates above what is allocated before it (CUDA); NaN on the CPU."""
        if self.device.type != "cuda":
            fn()
            return float("nan")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    def free(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def load_compile_cache(self) -> None:
        """torch.compiler's artifacts of earlier sections and loans, before anything compiles."""
        cache = Path(os.environ.get("GRPO_FAST_SUITE_CACHE", "/nonexistent"))
        for f in sorted((cache / "artifacts").glob("*.bin")):
            try:
                torch.compiler.load_cache_artifacts(f.read_bytes())
            except Exception as exc:  # noqa: BLE001 - another torch's artifacts: compile cold
                self.note(f"compile cache {f.name} not loaded: {type(exc).__name__}: {str(exc)[:120]}")

    def save_compile_cache(self) -> None:
        """This process's torch.compiler artifacts so far, for the suite's compile_cache.tar.gz."""
        cache = os.environ.get("GRPO_FAST_SUITE_CACHE")
        got = torch.compiler.save_cache_artifacts() if cache else None
        if got and got[0]:
            Path(cache, "artifacts").mkdir(parents=True, exist_ok=True)
            Path(cache, "artifacts", f"{self.name}.bin").write_bytes(got[0])


def _problem(N, H, V, dtype, device, seed=0):
    """Hidden states (B, T, H) with T <= 1024, an LM head with logits of O(2) (a peaked, not one-hot softmax),
    a bias, uniform targets, a mask with ~10% padding, advantages."""
    g = torch.Generator(device=device).manual_seed(seed)
    T = min(N, 1024)
    B = N // T
    hidden = torch.randn(B, T, H, device=device, generator=g).to(dtype)
    weight = (torch.randn(V, H, device=device, generator=g) * (2 / H**0.5)).to(dtype)
    bias = (torch.randn(V, device=device, generator=g) * 0.5).to(dtype)
    targets = torch.randint(0, V, (B, T), device=device, generator=g)
    mask = (torch.rand(B, T, device=device, generator=g) > 0.1).long()
    adv = torch.randn(B, device=device, generator=g)
    return hidden, weight, bias, targets, mask, adv


# ---------------------------------------------------------------------------------------------------------
# Plain references (no grpo_fast code)
# ---------------------------------------------------------------------------------------------------------
def ref_logprobs(h, w, b, targets, temperature, mm_dtype, entropy=False):
    """log_softmax((h @ w.T + b) / T)[targets] with the matmul in `mm_dtype` and the softmax in fp32 (fp64
    when mm_dtype is fp64): what plain PyTorch computes, or the ground truth."""
    soft = torch.float64 if mm_dtype == torch.float64 else torch.float32
    z = h.to(mm_dtype) @ w.to(mm_dtype).T
    if b is not None:
        z = z + b.to(mm_dtype)
    lsm = torch.log_softmax(z.to(soft) / temperature, dim=-1)
    logp = lsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return (logp,)
    return logp, -(lsm.exp() * lsm).sum(-1)


def ref_grpo_loss(logp, old, ref, adv, mask, beta, eps_low, eps_high):
    """TRL 1.16's token-level clipped loss with the k3 KL, dapo normalization (sum over active tokens)."""
    ratio = torch.exp(logp - old)
    a = adv[:, None]
    per_token = -torch.min(ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)
    d = ref - logp
    per_token = per_token + beta * (torch.exp(d) - d - 1)
    m = mask.to(per_token.dtype)
    return (per_token * m).sum() / m.sum()


def _run(fn, leaves, upstream):
    """Outputs of fn(*leaves) and the gradients of the leaves under fixed upstream gradients."""
    leaves = [None if x is None else x.detach().clone().requires_grad_(True) for x in leaves]
    outs = fn(*leaves)
    torch.autograd.backward(list(outs), [u.to(o.dtype) for o, u in zip(outs, upstream)])
    return [o.detach() for o in outs], [None if x is None else x.grad for x in leaves]


def measure_row(sec, label, fn, flops, extra, need_s=15.0):
    """`fn` timed (sec.timed) as one row, if `need_s` is left of the section: the first call of a naive
    loss at the speed sections' shapes allocates ~28 GiB and may compile; a training step of the prefix
    section takes well under a second."""
    if isinstance(fn, str):
        sec.add(dict(extra, provider=label, note=fn))
        return None
    if sec.left() < need_s:
        sec.add(dict(extra, provider=label, note="skipped: section out of time"))
        return None
    try:
        t = sec.timed(fn)
        row = dict(extra, provider=label, **t, tflops=flops / (t["ms"] * 1e-3) / 1e12)
    except Exception as exc:  # noqa: BLE001 - an OOM of the naive path is a result, not a crash
        row = dict(extra, provider=label, note=f"error: {type(exc).__name__}: {str(exc)[:200]}")
    sec.free()
    sec.add(row)
    if "compiled" in label or label == "liger":  # Liger's loss is torch.compile'd too
        sec.save_compile_cache()
    return row
