"""The GPU suite's sections, each run in its own process by bench/gpu_suite.py:

    python -m bench.gpu_sections NAME OUTDIR DEADLINE_EPOCH_S [--dry-run] [--no-triton]

A section merges its result ({"rows": [...], "columns": [...], "notes": [...]}) into OUTDIR/gpu_suite.json and
rewrites OUTDIR/report.md after every row (bench.gpu_suite.publish), so that a section stopped or killed at
any moment still reports what it measured. torch.compiler's artifacts of earlier sections and loans are
loaded first and this section's saved at its end (GRPO_FAST_SUITE_CACHE). --dry-run: tiny shapes on the CPU
(Triton through its interpreter). --no-triton: the JIT pass failed, so Triton rows are skipped.

The references here are written out plainly (full logits, log_softmax, TRL's clipped loss) and share no code
with grpo_fast.kernels.
"""

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# ---------------------------------------------------------------------------------------------------------
# Plumbing: one section's context, timing and memory
# ---------------------------------------------------------------------------------------------------------
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
        from bench.gpu_suite import publish

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


# ---------------------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------------------
CHECK_COLUMNS = [
    ["variant", "variant"],
    ["dtype", "dtype"],
    ["impl", "impl"],
    ["quantity", "quantity"],
    ["max_abs_err", "max abs err vs fp64"],
    ["rel_err", "max err / max |ref|"],
    ["plain_torch_err", "plain torch err"],
    ["bound", "bound"],
    ["ok", "pass"],
]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # the tests' oracle tolerances, relative to max |ref|


VARIANTS = [  # (name, kind, bias, temperature, entropy): the public functions with their options
    ("logprobs", "logprobs", False, 1.0, False),
    ("logprobs bias T=0.7 entropy", "logprobs", True, 0.7, True),
    ("loss old+ref beta=0.04 bias T=0.7", "loss", True, 0.7, False),
]


def check_against_fp64(sec: Section, shape: dict, dtypes, impls, jit=False) -> bool:
    """Rows of the flash-attention rule: err(ours) <= 2 * err(plain torch in that dtype) + tol * max|ref|;
    `jit`: the rows say "JIT pass" in their variant."""
    from grpo_fast.kernels import fused_linear_grpo_loss, fused_linear_logprobs

    all_ok = True
    for dtype in dtypes:
        hidden, weight, bias, targets, mask, adv = _problem(**shape, dtype=dtype, device=sec.device)
        g = torch.Generator(device=sec.device).manual_seed(1)
        up = [
            torch.randn(targets.shape, device=sec.device, generator=g, dtype=torch.float64) for _ in range(2)
        ]
        for name, kind, with_bias, temp, ent in VARIANTS:
            name = f"JIT pass: {name}" if jit else name
            b = bias if with_bias else None
            if kind == "logprobs":

                def plain(h, w, bb, mm):
                    return ref_logprobs(h, w, bb, targets, temp, mm, entropy=ent)

                def ours(h, w, bb, impl):
                    out = fused_linear_logprobs(
                        h, w, targets, bias=bb, temperature=temp, return_entropy=ent, impl=impl
                    )
                    return out if ent else (out,)

                ups = up[: 2 if ent else 1]
                names = ["logp", "entropy"][: len(ups)]
            else:
                with torch.no_grad():
                    true = ref_logprobs(hidden, weight, bias, targets, temp, torch.float64)[0].float()
                # log-ratios on both sides of the clip range [log 0.8, log 1.28] and inside it, each at
                # least 0.12 from its edges: a bf16 log-prob's rounding (~0.03) must not move a token across
                # an edge, where the gradient jumps (the first GPU run compared such jumps, not the kernels)
                log_ratio = torch.tensor([-0.6, -0.1, 0.1, 0.6], device=sec.device)
                pick = torch.randint(0, 4, true.shape, device=sec.device, generator=g)
                old = true - log_ratio[pick]
                ref = true + 0.2 * torch.randn(true.shape, device=sec.device, generator=g)
                loss_kw = dict(beta=0.04, eps_low=0.2, eps_high=0.28)

                def plain(h, w, bb, mm):
                    lp = ref_logprobs(h, w, bb, targets, temp, mm)[0]
                    return (
                        ref_grpo_loss(
                            lp, old.to(lp.dtype), ref.to(lp.dtype), adv.to(lp.dtype), mask, **loss_kw
                        ),
                    )

                def ours(h, w, bb, impl):
                    loss, _ = fused_linear_grpo_loss(
                        h, w, targets, mask, adv, bias=bb, temperature=temp, old_logps=old, ref_logps=ref,
                        beta=0.04, epsilon_low=0.2, epsilon_high=0.28, loss_type="dapo", impl=impl,
                    )  # fmt: skip
                    return (loss,)

                ups = [torch.ones((), device=sec.device, dtype=torch.float64)]
                names = ["loss"]
            leaves64 = [hidden.double(), weight.double(), None if b is None else b.double()]
            truth, truth_g = _run(lambda h, w, bb: plain(h, w, bb, torch.float64), leaves64, ups)
            low, low_g = _run(lambda h, w, bb: plain(h, w, bb, dtype), [hidden, weight, b], ups)
            for impl in impls:
                if impl == "triton" and not sec.triton_ok:
                    sec.add(dict(variant=name, dtype=str(dtype)[6:], impl=impl, ok="skipped (compile check)"))
                    continue
                try:
                    got, got_g = _run(lambda h, w, bb: ours(h, w, bb, impl), [hidden, weight, b], ups)
                except Exception as exc:  # noqa: BLE001 - a failing variant is a row, the others still run
                    all_ok = False
                    sec.add(dict(variant=name, dtype=str(dtype)[6:], impl=impl, ok=f"ERROR {exc!r}"[:300]))
                    continue
                quantities = list(zip(names, got, truth, low))
                quantities += [
                    (q, x, r, lo)
                    for q, x, r, lo in zip(("d hidden", "d weight", "d bias"), got_g, truth_g, low_g)
                    if r is not None
                ]
                for q, x, r, lo in quantities:
                    err = (x.double() - r).abs().max().item()
                    err_low = (lo.double() - r).abs().max().item()
                    scale = max(r.abs().max().item(), 1e-30)
                    bound = 2 * err_low + TOL[dtype] * scale
                    ok = bool(err <= bound) and bool(torch.isfinite(x).all())
                    all_ok &= ok
                    sec.add(
                        dict(variant=name, dtype=str(dtype)[6:], impl=impl, quantity=q, max_abs_err=err,
                             rel_err=err / scale, plain_torch_err=err_low, bound=bound,
                             ok="yes" if ok else "NO")
                    )  # fmt: skip
            del truth, truth_g, low, low_g
            sec.free()
    return all_ok


def section_correctness(sec: Section) -> None:
    """Triton and the PyTorch twin on this device against fp64, bf16 and fp32 inputs, real vocabulary. First
    one JIT pass: every Triton kernel and variant at a small shape with the big one's divisibility by 16 and
    vocabulary (what Triton specializes on: the big check reuses what this compiles); on failure later
    sections skip Triton rows."""
    sec.result["columns"] = CHECK_COLUMNS
    shape = TINY if sec.dry else CHECK
    sec.triton_ok = True
    if not sec.dry:  # (the interpreter compiles nothing: in a dry run the one check below is the JIT pass)
        t0 = time.time()
        small = dict(N=512, H=256, V=CHECK["V"])
        sec.triton_ok = check_against_fp64(sec, small, [torch.bfloat16, torch.float32], ["triton"], jit=True)
        sec.result["triton_ok"] = sec.triton_ok
        sec.note(f"JIT pass at N, H, V = {tuple(small.values())}: {time.time() - t0:.1f} s; "
                 f"Triton {'ok' if sec.triton_ok else 'FAILED: later sections skip its rows'}")  # fmt: skip
    sec.note(f"N, H, V = {tuple(shape.values())}; fp32 matmuls in IEEE fp32 (TF32 off), as torch's default")
    ok = check_against_fp64(sec, shape, [torch.bfloat16, torch.float32], ["triton", "torch"])
    if sec.dry:
        sec.result["triton_ok"] = ok
        sec.save()
    if not (ok and sec.triton_ok):
        raise SystemExit("a correctness check failed (see the rows marked NO)")


def _loss_providers(sec, h, w, targets, mask, adv, compiled=False):
    """Forward+backward of the on-policy GRPO loss (beta 0, dapo) from hidden states, per provider (with
    `compiled`, naive torch under torch.compile too)."""
    from grpo_fast.kernels import fused_linear_grpo_loss

    def naive_loss():
        # plain PyTorch: full logits, fp32 log-softmax; only what autograd saves outlives this function
        logits = (h @ w.T).float()
        lp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
        ratio = torch.exp(lp - lp.detach())
        per_token = -(ratio * adv[:, None])
        return (per_token * mask).sum() / mask.sum()

    def step(loss_fn):
        def run():
            loss_fn().backward()
            h.grad = w.grad = None

        return run

    providers = {"naive torch": step(naive_loss)}
    if compiled:
        providers["naive torch, compiled"] = step(torch.compile(naive_loss))
    for impl, label in (("triton", "grpo_fast triton"), ("torch", "grpo_fast twin")):
        if impl == "triton" and not sec.triton_ok:
            providers[label] = "skipped: compile check failed"
            continue
        providers[label] = step(
            lambda impl=impl: fused_linear_grpo_loss(h, w, targets, mask, adv, impl=impl)[0]
        )
    try:  # last: its torch.compile takes tens of seconds, and the deadline should cut it rather than ours
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        liger = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, compiled=not sec.dry)
        providers["liger"] = step(lambda: liger(h, w, targets, mask, adv)[0])
    except Exception as exc:  # noqa: BLE001 - absent on a bare GPU machine unless its wheel is carried
        providers["liger"] = f"skipped: liger-kernel not importable ({type(exc).__name__})"
    return providers


def _measure_row(sec, label, fn, flops, extra, need_s=15.0):
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


SPEED_COLUMNS = [
    ["mode", "mode"],
    ["provider", "provider"],
    ["ms", "median ms"],
    ["min_ms", "min ms"],
    ["calls", "timed calls"],
    ["peak_mib", "peak MiB above inputs"],
    ["tflops", "TFLOP/s"],
    ["vs_naive", "time / naive"],
    ["note", "note"],
]


def _matmul_tflops(sec: Section, dtype) -> tuple[float, int]:
    """The dense matmul rate of this device in `dtype`, measured: (TFLOP/s, matrix size)."""
    n = 64 if sec.dry else 8192
    a = torch.randn(n, n, device=sec.device, dtype=dtype)
    mm = sec.timed(lambda: a @ a, budget_s=2)
    return 2 * n**3 / (mm["ms"] * 1e-3) / 1e12, n


def section_speed(sec: Section) -> None:
    """Time and peak memory of the GRPO loss from hidden states (fwd+bwd) and of the log-probs alone (fwd, the
    old/reference pass), bf16, against the bf16 matmul rate measured in the same process."""
    from grpo_fast.kernels import fused_linear_logprobs

    sec.result["columns"] = SPEED_COLUMNS
    N, H, V = (TINY if sec.dry else BIG).values()
    dtype = torch.float32 if sec.dry else torch.bfloat16
    hidden, weight, _, targets, mask, adv = _problem(N, H, V, dtype, sec.device)
    h, w = hidden.requires_grad_(True), weight.requires_grad_(True)
    peak, n_mm = _matmul_tflops(sec, dtype)
    sec.result["matmul_tflops"] = peak
    sec.note(f"N, H, V = {N}, {H}, {V}, {str(dtype)[6:]}; {n_mm}^3 matmul measured at {peak:.0f} TFLOP/s")
    loss = _loss_providers(sec, h, w, targets, mask, adv)
    liger = loss.pop("liger")
    loss["cut cross-entropy"] = _cce_provider(sec, h, w, targets, mask, adv)
    for label, fn in loss.items():
        _measure_row(sec, label, fn, 6 * N * H * V, dict(mode="loss fwd+bwd"))

    def naive_fwd():
        with torch.no_grad():
            torch.log_softmax((h @ w.T).float(), -1).gather(-1, targets[..., None])

    fwd = {"naive torch": naive_fwd}
    for impl, label in (("triton", "grpo_fast triton"), ("torch", "grpo_fast twin")):
        if impl == "triton" and not sec.triton_ok:
            fwd[label] = "skipped: compile check failed"
            continue

        def run(impl=impl):
            with torch.no_grad():
                fused_linear_logprobs(h, w, targets, impl=impl)

        fwd[label] = run
    fwd["cut cross-entropy"] = _cce_provider(sec, h, w, targets, mask, adv, forward_only=True)
    for label, fn in fwd.items():
        _measure_row(sec, label, fn, 2 * N * H * V, dict(mode="logprobs fwd"))
    _measure_row(sec, "liger", liger, 6 * N * H * V, dict(mode="loss fwd+bwd"))
    for r in sec.result["rows"]:
        base = next(
            (x for x in sec.result["rows"] if x["mode"] == r["mode"] and x["provider"] == "naive torch"), None
        )
        if base and "ms" in base and "ms" in r:
            r["vs_naive"] = r["ms"] / base["ms"]
    sec.save()


BACKWARD_SHAPES = {  # name: (N, H, V)
    "Qwen vocabulary, H 4096": (16384, 4096, 151936),
    "7B (Qwen2.5-7B head)": (16384, 3584, 152064),
    "SmolLM2-135M head": (16384, 576, 49152),
}
BACKWARD_COLUMNS = [
    ["shape", "shape (N, H, V)"],
    ["provider", "provider"],
    ["ms", "fwd+bwd median ms"],
    ["calls", "timed calls"],
    ["peak_mib", "peak MiB above inputs"],
    ["vs_naive", "time / naive"],
    ["mem_vs_naive", "memory / naive"],
    ["d_hidden_rel_err", "d hidden vs naive (rel)"],
    ["note", "note"],
]


def section_backward(sec: Section, names=("Qwen vocabulary, H 4096",)) -> None:
    """The on-policy GRPO loss from hidden states, forward+backward, bf16, at Qwen's LM-head shape: naive
    torch (and compiled, last), our Triton path's two backwards (chunked: GEMMs + row kernels, one writer per
    output, the default; atomic: tile kernels with atomics), the twin, Liger's fused linear GRPO loss and Cut
    Cross-Entropy's linear cross-entropy (its log-probs into the same loss) where their wheels are carried.
    Goal (issue 34): chunked <= 0.8x naive's time at <= 15% of its memory."""
    import grpo_fast.kernels.logprobs as lp

    sec.result["columns"] = BACKWARD_COLUMNS
    dtype = torch.float32 if sec.dry else torch.bfloat16
    shapes = {"tiny": tuple(TINY.values())} if sec.dry else {n: BACKWARD_SHAPES[n] for n in names}
    default = lp.TRITON_BACKWARD
    for name, (N, H, V) in shapes.items():
        hidden, weight, _, targets, mask, adv = _problem(N, H, V, dtype, sec.device)
        h, w = hidden.requires_grad_(True), weight.requires_grad_(True)
        first = name == next(iter(BACKWARD_SHAPES))  # torch.compile at Qwen's shape only: ~1 min to compile
        providers = _loss_providers(sec, h, w, targets, mask, adv, compiled=first and not sec.dry)
        triton = providers.pop("grpo_fast triton")
        for path in ("chunked", "atomic"):
            if isinstance(triton, str):
                providers[f"grpo_fast triton {path}"] = triton
                continue

            def run(path=path):
                lp.TRITON_BACKWARD = path
                try:
                    triton()
                finally:
                    lp.TRITON_BACKWARD = default

            providers[f"grpo_fast triton {path}"] = run
        providers["cut cross-entropy"] = _cce_provider(sec, h, w, targets, mask, adv)
        if sec.dry:
            providers["naive torch, compiled"] = "skipped: dry run (compiles for tens of seconds on a CPU)"
        order = ["naive torch", "grpo_fast triton chunked", "grpo_fast triton atomic", "grpo_fast twin",
                 "liger", "cut cross-entropy", "naive torch, compiled"]  # fmt: skip
        base, ref_gh = None, None
        for label in order:
            if label not in providers:
                continue
            fn = providers[label]
            if not isinstance(fn, str) and sec.left() < 20:
                fn = "skipped: section out of time"
            row = _measure_row(sec, label, fn, 6 * N * H * V, dict(shape=f"{name} ({N}, {H}, {V})"))
            if row is None or "ms" not in row:
                continue
            h.grad = w.grad = None
            _grad_of(fn, h)
            gh = h.grad.float()
            h.grad = w.grad = None
            if base is None:
                base, ref_gh = row, gh
            row["vs_naive"] = row["ms"] / base["ms"]
            if base["peak_mib"] > 0:
                row["mem_vs_naive"] = row["peak_mib"] / base["peak_mib"]
            row["d_hidden_rel_err"] = ((gh - ref_gh).abs().max() / ref_gh.abs().max()).item()
            sec.save()
        del hidden, weight, h, w, providers
        sec.free()


def section_backward_shapes(sec: Section) -> None:
    """The backward section at the two other LM-head shapes: Qwen2.5-7B's head and SmolLM2-135M's."""
    section_backward(sec, [n for n in BACKWARD_SHAPES if n != next(iter(BACKWARD_SHAPES))])


def _grad_of(step, h) -> None:
    """Run one provider step keeping its hidden gradient (the steps clear gradients after backward)."""
    saved = []
    hook = h.register_hook(lambda g: saved.append(g.detach().clone()))
    try:
        step()
    finally:
        hook.remove()
    h.grad = saved[-1]


def _cce_provider(sec, h, w, targets, mask, adv, forward_only=False):
    """Cut Cross-Entropy's log-probs (-its per-token cross-entropy, gradient filtering on, its default) in
    the naive loss (or alone, without grad); a note where its wheel is not carried."""
    try:
        from cut_cross_entropy import linear_cross_entropy
    except Exception as exc:  # noqa: BLE001 - absent on a bare GPU machine unless its wheel is carried
        return f"skipped: cut-cross-entropy not importable ({type(exc).__name__})"
    if sec.device.type != "cuda":
        return "skipped: its kernels need CUDA"
    if forward_only:

        def fwd():
            with torch.no_grad():
                linear_cross_entropy(h, w, targets, reduction="none")

        return fwd

    def run():
        lp = -linear_cross_entropy(h, w, targets, reduction="none")
        ratio = torch.exp(lp - lp.detach())
        ((-(ratio * adv[:, None])) * mask).sum().div(mask.sum()).backward()
        h.grad = w.grad = None

    return run


ATOMIC_COLUMNS = [
    ["provider", "backward variant"],
    ["ms", "fwd+bwd median ms"],
    ["calls", "timed calls"],
    ["peak_mib", "peak MiB"],
    ["tflops", "TFLOP/s"],
    ["d_weight_rel_err", "d weight vs the first row (rel)"],
    ["note", "note"],
]


def section_atomics(sec: Section) -> None:
    """fused_linear_logprobs forward+backward with each backward variant: Triton's chunked backward (GEMMs and
    row kernels, no atomics), its atomic one with acq_rel (Triton's default) or relaxed atomics, programs
    token-block-fastest or grouped; the PyTorch twin (cuBLAS matmuls, no atomics) with its CPU tile and a 4x
    larger one. At N=4096 (a quarter of the speed section's atomics, so
    that a slow variant cannot eat the suite); the speed section has the defaults at N=16384."""
    import grpo_fast.kernels.logprobs as lp
    from grpo_fast.kernels import fused_linear_logprobs

    sec.result["columns"] = ATOMIC_COLUMNS
    N, H, V = (TINY if sec.dry else CHECK).values()
    dtype = torch.float32 if sec.dry else torch.bfloat16
    hidden, weight, _, targets, _, _ = _problem(N, H, V, dtype, sec.device)
    h, w = hidden.requires_grad_(True), weight.requires_grad_(True)
    up = torch.randn(targets.shape, device=sec.device)
    sec.note(f"N, H, V = {N}, {H}, {V}, {str(dtype)[6:]}; one random upstream gradient")
    defaults = (lp.BWD_ATOMIC_SEM, lp.BWD_GROUP_N, lp.TWIN_TILE_ELEMS, lp.TRITON_BACKWARD)
    variants = [  # the most telling first: a variant the deadline cuts off is the least missed
        ("twin, tile 2^24 (default)", "torch", None, None, 1 << 24),
        ("triton chunked, no atomics (default)", "triton", None, None, None),
        ("triton atomic relaxed, grouped 16", "triton", "relaxed", 16, None),
        ("triton atomic acq_rel, token-fastest (first)", "triton", "acq_rel", 0, None),
        ("triton atomic relaxed, token-fastest", "triton", "relaxed", 0, None),
        ("triton atomic acq_rel, grouped 16", "triton", "acq_rel", 16, None),
        ("twin, tile 2^26", "torch", None, None, 1 << 26),
    ]
    ref_gw = None
    for label, impl, sem, group, tile in variants:
        if impl == "triton" and not sec.triton_ok:
            sec.add(dict(provider=label, note="skipped: compile check failed"))
            continue
        lp.BWD_ATOMIC_SEM = sem or defaults[0]
        lp.BWD_GROUP_N = defaults[1] if group is None else group
        lp.TWIN_TILE_ELEMS = tile or defaults[2]
        lp.TRITON_BACKWARD = "atomic" if "atomic" in label else "chunked"

        def step(impl=impl):
            h.grad = w.grad = None  # the last call's gradient stays for the check below
            fused_linear_logprobs(h, w, targets, impl=impl).backward(up)

        row = _measure_row(sec, label, step, 6 * N * H * V, {})
        if row is not None and "ms" in row:
            gw = w.grad.float()
            if ref_gw is None:
                ref_gw = gw
            row["d_weight_rel_err"] = ((gw - ref_gw).abs().max() / ref_gw.abs().max()).item()
            sec.save()
        h.grad = w.grad = None
        sec.free()
    lp.BWD_ATOMIC_SEM, lp.BWD_GROUP_N, lp.TWIN_TILE_ELEMS, lp.TRITON_BACKWARD = defaults
    done = [r for r in sec.result["rows"] if "ms" in r]
    best = {k: min((r for r in done if r["provider"].startswith(k)), key=lambda r: r["ms"], default=None)
            for k in ("twin", "triton")}  # fmt: skip
    if best["twin"] and best["triton"]:
        pick = "triton" if best["triton"]["ms"] < best["twin"]["ms"] else "torch"
        sec.result["auto_should_pick"] = pick
        sec.note(
            f"fastest Triton: {best['triton']['provider']} {best['triton']['ms']:.1f} ms; fastest twin: "
            f"{best['twin']['provider']} {best['twin']['ms']:.1f} ms -> impl='auto' should pick {pick!r} here"
        )


def section_prefix(sec: Section) -> None:
    """Training step (hidden states forward+backward) with each prompt once per group (attention per segment,
    and through a 4D mask) vs repeated G times, on a random-init Qwen2.5-0.5B-shaped model in bf16."""
    from bench.bench_prefix import make_model
    from grpo_fast.trainer.modeling import completion_hidden_states

    sec.result["columns"] = [["shared_prefix", "shared prefix"], ["P", "P"], ["C", "C"], ["G", "G"],
                             ["prompts", "prompts"], ["ms", "median ms"], ["peak_mib", "peak MiB"],
                             ["speedup", "speedup"], ["note", "note"]]  # fmt: skip
    P, C, G, n = (32, 8, 4, 1) if sec.dry else (512, 128, 8, 2)
    dtype = torch.float32 if sec.dry else torch.bfloat16
    model = make_model("tiny" if sec.dry else "0.5b").to(device=sec.device, dtype=dtype)
    V = model.config.vocab_size
    g = torch.Generator(device=sec.device).manual_seed(0)
    batch = (
        torch.randint(2, V, (n, P), device=sec.device, generator=g),
        torch.ones(n, P, dtype=torch.long, device=sec.device),
        torch.randint(2, V, (n * G, C), device=sec.device, generator=g),
        torch.ones(n * G, C, dtype=torch.long, device=sec.device),
    )
    from grpo_fast.models.shared_prefix import shared_prefix_forward

    # shared: the default layout (attention per segment); "shared, 4D mask": the same row through SDPA
    for name, shared, attention in (("unshared", False, None), ("shared", True, None),
                                    ("shared, 4D mask", True, "mask")):  # fmt: skip

        def step(shared=shared, attention=attention):
            if attention:
                h = shared_prefix_forward(model, *batch, attention=attention)
            else:
                h = completion_hidden_states(model, *batch, share_prefix=shared)
            h.float().square().mean().backward()
            model.zero_grad(set_to_none=True)

        note = {"note": "attention 'mask'"} if attention else {}
        _measure_row(sec, name, step, 0, dict(shared_prefix=shared, P=P, C=C, G=G, prompts=n, **note), 5.0)
    rows = sec.result["rows"]
    for row in rows[1:]:
        if "ms" in row and "ms" in rows[0]:
            row["speedup"] = rows[0]["ms"] / row["ms"]
    sec.save()


GEN_COLUMNS = [["provider", "provider"], ["prompts", "prompts"], ["layers", "layers"], ["P", "P"], ["G", "G"],
               ["C", "C"], ["ms", "ms"], ["tokens_per_s", "completion tokens/s"], ["vs_hf", "vs HF generate"],
               ["peak_mib", "peak MiB"], ["warmup_s", "warm-up s"], ["graphs", "graphs compiled"],
               ["note", "note"]]  # fmt: skip


def _generation_rows(sec: Section, plan, layers=None) -> None:
    """Rows of completion tokens/s for `plan` [(prompts, label, fn(model, ids, C, G) or a note)] on a
    random-init Qwen2.5-0.5B-shaped model in bf16 (`layers` of its 24), G=8, C=512, prompts of 128 tokens,
    no EOS (a random model: every sample runs C tokens). A warm-up (compiles, allocator) and one timed run
    each; a failure, the warm-up's included, is that provider's row; the compiled graphs counted."""
    import torch._dynamo.utils as dynamo_utils
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from bench.bench_prefix import QWEN2_SHAPES

    P, G, C = (8, 4, 8) if sec.dry else (128, 8, 512)
    shape = dict(QWEN2_SHAPES["tiny" if sec.dry else "0.5b"])
    shape["num_hidden_layers"] = layers or shape["num_hidden_layers"]
    torch.manual_seed(0)
    cfg = Qwen2Config(**shape, max_position_embeddings=4096)
    cfg._attn_implementation = "sdpa"
    dtype = torch.float32 if sec.dry else torch.bfloat16
    model = Qwen2ForCausalLM(cfg).to(device=sec.device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    for n, label, fn in plan:
        if isinstance(fn, str):
            sec.add(dict(provider=label, prompts=n, note=fn))
            continue
        if sec.left() < 25:
            sec.add(dict(provider=label, prompts=n, note="skipped: section out of time"))
            continue
        g = torch.Generator(device=sec.device).manual_seed(0)
        ids = torch.randint(2, cfg.vocab_size, (n, P), device=sec.device, generator=g)
        t = {}

        def timed_run(fn=fn, ids=ids):
            t0 = time.perf_counter()
            fn(model, ids, C, G)
            sec.sync()
            t["ms"] = (time.perf_counter() - t0) * 1e3

        graphs = dynamo_utils.counters["stats"]["unique_graphs"]
        try:
            t0 = time.perf_counter()
            fn(model, ids, 8, G)  # warm-up: kernels, allocator; a compiled engine compiles here
            fn(model, ids, min(C, 64), G)
            sec.sync()
            warm = time.perf_counter() - t0
            peak = sec.peak_mib(timed_run)  # one full run, timed and its peak taken
        except Exception as exc:  # noqa: BLE001 - a failing provider is a row, the next still runs
            sec.add(dict(provider=label, prompts=n, note=f"error: {type(exc).__name__}: {str(exc)[:160]}"))
            continue
        sec.add(dict(provider=label, prompts=n, layers=shape["num_hidden_layers"], P=P, G=G, C=C, ms=t["ms"],
                     warmup_s=warm, tokens_per_s=n * G * C / (t["ms"] / 1e3), peak_mib=peak,
                     graphs=dynamo_utils.counters["stats"]["unique_graphs"] - graphs))  # fmt: skip
        sec.save_compile_cache()
    rows = sec.result["rows"]
    for r in rows:
        hf_row = next((x for x in rows if x["provider"] == "HF generate" and x["prompts"] == r["prompts"]
                       and x.get("layers") == r.get("layers")), None)  # fmt: skip
        if hf_row and "tokens_per_s" in hf_row and "tokens_per_s" in r:
            r["vs_hf"] = r["tokens_per_s"] / hf_row["tokens_per_s"]
    sec.save()


def _hf(model, ids, c, G):
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                       top_k=0, top_p=1.0, max_new_tokens=c, num_return_sequences=G)  # fmt: skip


def _ours(engine, compile, rollout_dtype="model"):
    from grpo_fast.rollout import generate_groups

    def run(model, ids, c, G):
        generate_groups(model, ids, torch.ones_like(ids), G, c, temperature=1.0, eos_token_id=None,
                        engine=engine, compile=compile, rollout_dtype=rollout_dtype)  # fmt: skip

    return run


def section_generation(sec: Section) -> None:
    """Completion tokens/s of HF `generate(num_return_sequences=G)` and the native engine, eager, with the
    model's bf16 layers and with its decode layers in fp8 (e4m3, per-channel x per-token scales,
    torch._scaled_mm) on a random-init Qwen2.5-0.5B-shaped model, G=8, C=512, 8 and 32 prompts of 128
    tokens. Goal: native >= 5x HF. The compiled engine is the decode section's."""
    sec.result["columns"] = GEN_COLUMNS
    _generation_rows(sec, [  # the most telling first: the section's deadline cuts the tail
        (8, "native, eager", _ours("native", False)),
        (8, "HF generate", _hf),
        (8, "native, eager, rollout_dtype fp8", _ours("native", False, "fp8")),
        (32, "native, eager", _ours("native", False)),
        (32, "HF generate", _hf),
    ])  # fmt: skip


def section_decode(sec: Section) -> None:
    """The native engine's compiled decode (torch.compile, CUDA graphs), recompiles and graph breaks logged
    to the suite's log: on a 2-layer Qwen2.5-0.5B-shaped model first (its first compile never ended within
    170 s at 24 layers), then the 24 layers; the reference engine beside them. 8 prompts, G=8, C=512."""
    import torch._logging

    sec.result["columns"] = GEN_COLUMNS
    torch._logging.set_logs(recompiles=True, graph_breaks=True)
    compiled = "skipped: dry run (tests/test_rollout.py compiles the decode on a CPU)" if sec.dry else None
    compiled = compiled or _ours("native", True)
    eager = _ours("native", False)
    _generation_rows(sec, [(8, "native, compiled", compiled), (8, "native, eager", eager)], layers=2)
    _generation_rows(sec, [(8, "native, compiled", compiled), (8, "native, eager", eager),
                           (8, "reference engine", _ours("reference", "auto"))])  # fmt: skip


E2E_KEYS = ("provider", "step_s", "generate_s", "train_s", "tokens_per_s", "speedup_vs_trl", "peak_mem_mb",
            "mem_vs_trl", "skipped", "error")  # fmt: skip


def _e2e_rows(sec: Section, argv: list[str], keys=E2E_KEYS, extra=None) -> None:
    """bench_e2e with `argv`, each provider's row added as it ends (its own files in a temporary folder: the
    device returns 8 files), speed and memory against the TRL row before it, if any."""
    from bench import bench_e2e

    def on_row(r):
        rows = sec.result["rows"]
        trl = next((x for x in rows if x.get("provider") == "trl" and "tokens_per_s" in x), None)
        if trl and "tokens_per_s" in r:
            r = dict(r, speedup_vs_trl=r["tokens_per_s"] / trl["tokens_per_s"],
                     mem_vs_trl=r["peak_mem_mb"] / trl["peak_mem_mb"])  # fmt: skip
        sec.add({**(extra or {}), **{k: r[k] for k in keys if k in r}})

    with tempfile.TemporaryDirectory() as tmp:
        bench_e2e.main(["--out-dir", tmp, "--deadline", str(sec.deadline - 5), *argv], on_row=on_row)


def section_e2e(sec: Section) -> None:
    """bench_e2e's synthetic workload: TRL (fp32), grpo-fast at its default, grpo-fast fastest (colocated
    async --max-staleness 1 under --bf16), each provider's row as it ends."""
    sec.result["columns"] = [[k, k] for k in E2E_KEYS]
    providers = "trl,grpo_fast" if sec.dry else "trl,grpo_fast,grpo_fast_async_mp"
    _e2e_rows(sec, ["--providers", providers] + (["--quick"] if sec.dry else []))


def section_server(sec: Section) -> None:
    """Rollouts on a vLLM server of their own (bench_e2e's synthetic workload): colocated vs server vs server
    async (--max-staleness 1), the server on the last GPU and the trainer on cuda:0; sync seconds per step and
    the idle fractions. Needs vLLM (its interpreter: bench._utils.vllm_python) and two GPUs, else one row
    saying why."""
    from bench._utils import NO_VLLM, vllm_python

    why = NO_VLLM if vllm_python() is None else None
    if sec.dry:  # servers take ~40 s each to start on a CPU: tests/test_vllm_server.py covers them there
        why = "dry run: server mode runs in tests/test_vllm_server.py on a CPU"
    elif why is None and torch.cuda.device_count() < 2:
        why = f"needs two GPUs (one for the server, one for the trainer); {torch.cuda.device_count()} here"
    keys = ("provider", "step_s", "generate_s", "train_s", "sync_s", "push_s", "trainer_wait_s", "gen_idle_s",
            "tokens_per_s", "peak_mem_mb", "skipped", "error")  # fmt: skip
    sec.result["columns"] = [[k, k] for k in keys]
    if why:
        sec.add({"provider": "grpo_fast_server", "skipped": why})
        return
    _e2e_rows(sec, ["--providers", "grpo_fast,grpo_fast_server,grpo_fast_server_async", "--steps", "3"], keys)


# the memory section's configurations, those without a GPU measurement first (a loan's second call fits ~6
# at ~40 s each): full, full_beta_gc_unshared, lora_beta and lora_gc_unshared were measured in runs 4 and 6
GPU_MEMORY_ORDER = ["full_autocast_bf16", "full_bf16_master", "full_bf16_kahan", "full_async",
                    "full_bf16_beta_c512", "full_gc_g16_c512", "full_adamw_torch", "full_adamw_8bit",
                    "lora_beta", "lora_gc_unshared", "full", "full_beta_gc_unshared"]  # fmt: skip


def section_memory(sec: Section) -> None:
    """Peak memory (max_memory_allocated) of real `grpo-fast train` steps on a SmolLM2-135M-shaped model (30
    layers, random weights), one process per configuration (full / LoRA, beta 0 / 0.04, checkpointing off /
    on, sharing on / off, the precision recipes: bf16 weights with fp32 masters / Kahan, autocast, 8-bit
    AdamW; C up to 512, G up to 16), per step and phase, beside `grpo-fast estimate`'s prediction
    (bench/bench_memory.py)."""
    import importlib.util

    from bench import bench_memory

    sec.result["columns"] = [list(c) for c in bench_memory.COLUMNS]
    layers, steps = (2, 2) if sec.dry else (30, 3)
    # the dry run: one configuration, and one recipe at a short C (bf16 GEMMs crawl on CPUs without bf16)
    runs = [(["full_beta_gc_unshared"], None), (["full_bf16_master"], dict(C=8, G=2))] if sec.dry else [
        (list(GPU_MEMORY_ORDER), None)]  # fmt: skip
    for names, overrides in runs:
        for name in [n for n in names if bench_memory.CONFIGS[n].get("optim") == "adamw_8bit"]:
            if importlib.util.find_spec("bitsandbytes") is None:  # carried only on request: its wheel
                names.remove(name)  # (CUDA builds inside) and the compile cache overrun 64 MiB together
                sec.add(dict(config=name, note="skipped: no bitsandbytes (make gpu-wheels GPU_BNB=1)"))
        bench_memory.run(
            names, layers, steps, deadline=sec.deadline - 5, extra_flags=["--rollout-compile", "off"],
            on_row=lambda r: sec.add({k: v for k, v in r.items() if k != "flags"}), overrides=overrides,
        )  # fmt: skip
    sec.note(f"SmolLM2-135M shape, {layers} layers, {steps} steps each, native engine eager (compile off)")


def section_precision(sec: Section) -> None:
    """The mixed-precision step as TRL's users run it: end-to-end steps (bench_e2e's synthetic workload, 1
    warm-up + 1 measured) of TRL with bf16=True and ours with --bf16 (autocast on fp32 master weights, the
    rollout in bf16, corrected). The recipes' memory is the memory section's."""
    keys = ("provider", "step_s", "generate_s", "train_s", "tokens_per_s", "peak_mem_mb", "skipped", "error")
    sec.result["columns"] = [[k, k] for k in keys] + [["vs_trl_bf16", "tokens/s vs TRL bf16=True"]]
    argv = ["--providers", "trl_bf16,grpo_fast_mp", "--warmup", "1", "--steps", "1"]
    _e2e_rows(sec, argv + (["--quick"] if sec.dry else []), keys)
    rows = {r["provider"]: r for r in sec.result["rows"]}
    trl, ours = rows.get("trl_bf16", {}), rows.get("grpo_fast_mp", {})
    if "tokens_per_s" in trl and "tokens_per_s" in ours:
        ours["vs_trl_bf16"] = ours["tokens_per_s"] / trl["tokens_per_s"]
        sec.save()


TILE_COLUMNS = [
    ["kernel", "kernel"],
    ["tiles", "BLOCK_N x BLOCK_V x BLOCK_H, warps, stages"],
    ["ms", "median ms"],
    ["tflops", "TFLOP/s"],
    ["vs_default", "time / default"],
    ["max_diff", "max diff vs default"],
    ["note", "note"],
]
FWD_CANDIDATES = [  # (BLOCK_N, BLOCK_V, BLOCK_H, num_warps, num_stages); the first is the shipped one
    (128, 256, 64, 8, 3),
    (64, 128, 64, 8, None),
    (128, 128, 64, 8, 3),
    (64, 256, 64, 8, 3),
    (128, 128, 64, 4, 4),
    (128, 64, 64, 4, 4),
]
BWD_CANDIDATES = [
    (128, 256, 32, 8, None),
    (64, 128, 64, 8, None),
    (128, 128, 64, 8, None),
    (128, 128, 32, 8, None),
    (64, 256, 32, 8, None),
    (64, 128, 32, 4, None),
]


def section_tiles(sec: Section) -> None:
    """Tile sizes and launch options of the Triton log-prob kernels at N, H, V = 16384, 4096, 151936 bf16:
    the forward alone (no grad), and forward+backward with the shipped forward (the backward's share is the
    difference). Each candidate is checked against the shipped configuration's output."""
    import grpo_fast.kernels.logprobs as lp
    from grpo_fast.kernels import fused_linear_logprobs

    sec.result["columns"] = TILE_COLUMNS
    if not sec.triton_ok:
        sec.note("skipped: compile check failed")
        return
    N, H, V = (TINY if sec.dry else BIG).values()
    dtype = torch.float32 if sec.dry else torch.bfloat16
    hidden, weight, _, targets, _, _ = _problem(N, H, V, dtype, sec.device)
    h, w = hidden.requires_grad_(True), weight.requires_grad_(True)
    up = torch.randn(targets.shape, device=sec.device)
    shipped = (lp.FWD_TILES, lp.BWD_TILES)

    def fwd():
        with torch.no_grad():
            return fused_linear_logprobs(h, w, targets, impl="triton")

    def fwd_bwd():
        h.grad = w.grad = None
        fused_linear_logprobs(h, w, targets, impl="triton").backward(up)

    def tiles(c):
        out = dict(BLOCK_N=c[0], BLOCK_V=c[1], BLOCK_H=c[2], num_warps=c[3])
        return out if c[4] is None else dict(out, num_stages=c[4])

    ref = {}
    for kernel, candidates, fn, flops in (
        ("forward", FWD_CANDIDATES, fwd, 2 * N * H * V),
        ("forward+backward", BWD_CANDIDATES, fwd_bwd, 6 * N * H * V),
    ):
        for c in candidates:
            if sec.left() < 12:
                sec.add(dict(kernel=kernel, tiles=str(c), note="skipped: section out of time"))
                continue
            lp.FWD_TILES, lp.BWD_TILES = shipped
            if kernel == "forward":
                lp.FWD_TILES = {16: tiles(c), 32: tiles(c)}
            else:
                lp.BWD_TILES = {16: tiles(c), 32: tiles(c)}
            row = dict(kernel=kernel, tiles=f"{c[0]}x{c[1]}x{c[2]}, {c[3]}, {c[4] or 'default'}")
            try:
                t = sec.timed(fn, budget_s=2.0)
                out = fwd() if kernel == "forward" else w.grad.float()
                ref.setdefault(kernel, (out, t["ms"]))  # the shipped configuration comes first
                row.update(
                    ms=t["ms"], tflops=flops / (t["ms"] * 1e-3) / 1e12, vs_default=t["ms"] / ref[kernel][1]
                )
                row["max_diff"] = (out.float() - ref[kernel][0].float()).abs().max().item()
            except Exception as exc:  # noqa: BLE001 - a tile too large for shared memory or registers is a row
                row["note"] = f"error: {type(exc).__name__}: {str(exc)[:160]}"
            sec.add(row)
            sec.free()
    lp.FWD_TILES, lp.BWD_TILES = shipped


def main(argv) -> None:
    name, out, deadline = argv[0], Path(argv[1]), float(argv[2])
    sec = Section(name, out, deadline, "--dry-run" in argv, "--no-triton" not in argv)
    sec.save()
    sec.load_compile_cache()
    try:
        globals()[f"section_{name}"](sec)
    finally:
        sec.save_compile_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
