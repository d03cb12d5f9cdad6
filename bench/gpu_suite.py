"""GPU suite for one NVIDIA H200 (or any CUDA GPU), no network: kernel correctness and speed, one command.

    python -m bench.gpu_suite OUTDIR [--dry-run]

1. Correctness of the Triton kernels against their PyTorch twins at N=16384, H=4096, V=151,936 in bf16:
   fused_linear_logprobs (values and gradients) and fused_linear_grpo_loss.
2. Forward+backward time (triton.testing.do_bench) and max_memory_allocated of the GRPO loss from hidden
   states: naive torch (full logits), Liger's LigerFusedLinearGRPOLoss (when installed), ours; achieved
   TFLOP/s against the bf16 dense matmul peak measured in the same run (torch.mm).
3. Shared-prefix vs unshared training step on a random-init Qwen2.5-0.5B-shaped model.
4. End to end against TRL (bench.bench_e2e: TRL, TRL + our subclass, grpo-fast sharing off/on; TRL rows only
   when trl is installed from a wheel), when the time left allows.
Writes OUTDIR/gpu_suite.json and OUTDIR/report.md. --dry-run: tiny shapes and the torch twins, on CPU, so
that the suite is exercised by the test suite and does not rot.
"""

import json
import sys
import time
import traceback
from pathlib import Path

import torch


def _bench(fn, dry):
    """Median milliseconds and peak MiB above the start of one call."""
    if dry:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3, float("nan")
    import triton

    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return triton.testing.do_bench(fn, warmup=3, rep=20), peak


def _problem(N, H, V, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    T = min(N, 1024)
    B = N // T
    hidden = (torch.randn(B, T, H, device=device, generator=g) * 0.5).to(dtype)
    weight = (torch.randn(V, H, device=device, generator=g) / H**0.5).to(dtype)
    targets = torch.randint(0, V, (B, T), device=device, generator=g)
    mask = torch.ones(B, T, device=device)
    adv = torch.randn(B, device=device, generator=g)
    return hidden, weight, targets, mask, adv


def correctness(shape, dtype, device, impl):
    from grpo_fast.kernels import fused_linear_grpo_loss, fused_linear_logprobs

    N, H, V = shape
    hidden, weight, targets, mask, adv = _problem(N, H, V, dtype, device)
    out = {}
    grads = {}
    for which in (impl, "torch"):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp = fused_linear_logprobs(h, w, targets, impl=which)
        lp.float().sum().backward()
        grads[which] = (lp.detach(), h.grad, w.grad)
    for name, a, b in zip(("logp", "d hidden", "d weight"), grads[impl], grads["torch"]):
        out[f"logprobs {name} max abs diff"] = (a.float() - b.float()).abs().max().item()
    losses = {
        which: fused_linear_grpo_loss(hidden, weight, targets, mask, adv, impl=which)[0].item()
        for which in (impl, "torch")
    }
    out["loss triton"], out["loss twin"] = losses[impl], losses["torch"]
    return out


def speed(shape, dtype, device, dry):
    from grpo_fast.kernels import fused_linear_grpo_loss

    N, H, V = shape
    hidden, weight, targets, mask, adv = _problem(N, H, V, dtype, device)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)

    def naive():
        logits = (h @ w.T).float()
        lp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
        loss = -(lp * adv[:, None] * mask).sum() / mask.sum()
        loss.backward()
        h.grad = w.grad = None

    def ours():
        fused_linear_grpo_loss(h, w, targets, mask, adv, impl="torch" if dry else "triton")[0].backward()
        h.grad = w.grad = None

    providers = {"naive torch": naive, "grpo_fast": ours}
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        lg = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, compiled=not dry)

        def liger():
            lg(h, w, targets, mask, adv)[0].backward()
            h.grad = w.grad = None

        providers["liger"] = liger
    except Exception as exc:  # noqa: BLE001 - absent on the GPU machine unless wheels were carried
        print(f"liger-kernel not available, skipped ({type(exc).__name__}: {exc})", flush=True)
    rows = []
    flops = 3 * 2 * N * H * V  # forward logits, d hidden, d weight
    for name, fn in providers.items():
        try:
            ms, peak = _bench(fn, dry)
            rows.append({"provider": name, "ms": ms, "peak_mib": peak, "tflops": flops / (ms * 1e-3) / 1e12})
        except Exception as exc:  # noqa: BLE001 - an OOM of the naive path is a result, not a crash
            rows.append({"provider": name, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    a = torch.randn(8192, 8192, device=device, dtype=dtype)
    ms, _ = _bench(lambda: a @ a, dry)
    return rows, 2 * 8192**3 / (ms * 1e-3) / 1e12


def e2e_prefix(device, dry):
    from bench.bench_prefix import make_model
    from grpo_fast.modeling import completion_hidden_states

    # dry: a tiny model on the CPU; else Qwen2.5-0.5B's shape in bf16
    P, C, G, n = (32, 8, 4, 1) if dry else (512, 128, 8, 2)
    model = make_model("tiny" if dry else "0.5b").to(
        device=device, dtype=torch.float32 if dry else torch.bfloat16
    )
    cfg = model.config
    g = torch.Generator(device=device).manual_seed(0)
    batch = (
        torch.randint(2, cfg.vocab_size, (n, P), device=device, generator=g),
        torch.ones(n, P, dtype=torch.long, device=device),
        torch.randint(2, cfg.vocab_size, (n * G, C), device=device, generator=g),
        torch.ones(n * G, C, dtype=torch.long, device=device),
    )
    rows = []
    for shared in (False, True):

        def step():
            completion_hidden_states(model, *batch, share_prefix=shared).float().square().mean().backward()
            model.zero_grad(set_to_none=True)

        ms, peak = _bench(step, dry)
        rows.append(
            {"shared_prefix": shared, "ms": ms, "peak_mib": peak, "P": P, "C": C, "G": G, "prompts": n}
        )
    return rows


E2E_START_BY_S = 270  # the suite must end within 8 minutes: the end-to-end comparison needs about 3


def e2e_vs_trl(out: Path, dry: bool, start: float):
    """bench_e2e's providers in their own processes; rows land in OUTDIR/bench_e2e.{json,md,png}."""
    if time.time() - start > E2E_START_BY_S:
        return {"skipped": f"less than {480 - E2E_START_BY_S}s left of the suite's 8 minutes"}
    from bench import bench_e2e

    argv = ["--out-dir", str(out), "--worker-timeout", "150"]
    argv += ["--quick", "--providers", "trl,grpo_fast"] if dry else []
    bench_e2e.main(argv)
    rows = json.loads((out / ("bench_e2e_quick.json" if dry else "bench_e2e.json")).read_text())["rows"]
    keys = ("provider", "tokens_per_s", "speedup_vs_trl", "peak_mem_mb", "mem_vs_trl", "skipped", "error")
    return [{k: r[k] for k in keys if k in r} for r in rows]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    dry = "--dry-run" in argv
    args = [a for a in argv if not a.startswith("--")]
    out = Path(args[0] if args else "bench/results/h200")
    out.mkdir(parents=True, exist_ok=True)
    if not dry and not torch.cuda.is_available():
        raise SystemExit("gpu_suite: no CUDA device (use --dry-run for the CPU smoke run)")
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    shape = (64, 32, 1001) if dry else (16384, 4096, 151936)
    from bench._utils import machine_info

    result = {"machine": machine_info(), "dry_run": dry, "shape_NHV": shape, "dtype": str(dtype)}
    start = time.time()
    sections = [
        ("correctness", lambda: correctness(shape, dtype, device, "triton")),
        ("speed", lambda: speed(shape, dtype, device, dry)),
        ("e2e_prefix", lambda: e2e_prefix(device, dry)),
        ("e2e_vs_trl", lambda: e2e_vs_trl(out, dry, start)),
    ]
    for name, fn in sections:
        t0 = time.time()
        try:
            result[name] = fn()
        except Exception:  # noqa: BLE001 - report and go on: one broken section must not hide the others
            result[name] = {"error": traceback.format_exc()[-2000:]}
        print(f"{name}: {time.time() - t0:.0f}s", flush=True)
        (out / "gpu_suite.json").write_text(json.dumps(result, indent=2, default=str))
    lines = [
        f"# GPU suite{' (dry run, CPU)' if dry else ''}",
        "",
        f"Machine: {json.dumps(result['machine'])}",
        "",
        f"Shape N, H, V = {shape}, {dtype}.",
        "",
        "## Correctness (Triton vs twin)",
        "",
        "```",
        json.dumps(result["correctness"], indent=2),
        "```",
        "",
        "## Speed (fwd+bwd of the GRPO loss)",
        "",
    ]
    if isinstance(result["speed"], tuple | list) and len(result["speed"]) == 2:
        rows, peak = result["speed"]
        lines += [
            f"bf16 matmul peak measured: {peak:.0f} TFLOP/s",
            "",
            "| provider | ms | peak MiB | TFLOP/s |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {r['provider']} | {r.get('ms', float('nan')):.2f} | {r.get('peak_mib', float('nan')):.0f} | "
            f"{r.get('tflops', float('nan')):.1f} |"
            if "error" not in r
            else f"| {r['provider']} | {r['error']} |"
            for r in rows
        ]
    else:
        lines += ["```", str(result["speed"]), "```"]
    lines += [
        "",
        "## Training step, shared prefix vs unshared",
        "",
        "```",
        json.dumps(result["e2e_prefix"], indent=2),
        "```",
        "",
        "## End to end against TRL (bench_e2e.md has the table)",
        "",
        "```",
        json.dumps(result["e2e_vs_trl"], indent=2),
        "```",
    ]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}/gpu_suite.json and {out}/report.md")


if __name__ == "__main__":
    main()
