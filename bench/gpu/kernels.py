"""The GPU suite's kernel sections: correctness (Triton and the twin against fp64), speed (loss and
log-probs against naive torch, Liger, CCE), backward and backward_shapes (chunked vs atomic vs naive),
atomics, tiles."""

import time

import torch

from bench.gpu.section import (
    BIG,
    CHECK,
    TINY,
    Section,
    _problem,
    _run,
    measure_row,
    ref_grpo_loss,
    ref_logprobs,
)

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
        measure_row(sec, label, fn, 6 * N * H * V, dict(mode="loss fwd+bwd"))

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
        measure_row(sec, label, fn, 2 * N * H * V, dict(mode="logprobs fwd"))
    measure_row(sec, "liger", liger, 6 * N * H * V, dict(mode="loss fwd+bwd"))
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
            row = measure_row(sec, label, fn, 6 * N * H * V, dict(shape=f"{name} ({N}, {H}, {V})"))
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

        row = measure_row(sec, label, step, 6 * N * H * V, {})
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
