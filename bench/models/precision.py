"""What a precision recipe costs and keeps, on this machine: bf16 autocast and bf16 weights vs fp32 GEMMs at a
real model's training shapes, what `grpo-fast train` measures to choose, and every optimizer's step time,
bytes per parameter and exactness.

    python -m bench.models.precision [--tokens 256 4096] [--repeats 5]

0. `calibration`: grpo_fast.trainer.calibrate's measurement at SmolLM2-135M's shapes (what --bf16 unset and
   --rollout-dtype auto decide by), its choices and its cost in seconds.
1. `linears`: one SmolLM2-135M decoder layer's linear layers (q, k, v, o, gate, up, down) forward + backward
   over each `--tokens` count, fp32 vs bf16 autocast (fp32 weights, casts per GEMM) vs bf16 weights and
   activations (no casts); the last count's layer ratio is the row of grpo_fast/trainer/precision.py's
   CPU_BF16_TRAIN_SPEEDUP (the fallback with measuring off) for this CPU's vendor and instruction set;
   fp32 GFLOP/s beside it.
2. `optimizers`: a step of each `--optim` on SmolLM2-135M's parameters (random, its shapes), weights fp32 or
   bf16 (and torch's plain AdamW stepping bf16 weights in place, the path before
   grpo_fast.trainer.optimizers): median step seconds and the state's bytes per parameter; and on one 1536 x
   576 layer (std 0.02, 12 steps, lr 1e-5, the same gradients) the weights' movement on the bf16 grid over
   fp64 AdamW's, and the kept weight's (master, weight + compensation, weight) largest error over the mean
   movement.

Writes bench/results/<machine>/bench_precision.{json,md} with the CPU model and flags.
"""

import argparse
import gc
import time
from pathlib import Path

import torch

from bench._utils import cpu_line, machine_info, markdown_table, write_results

H, FF, KV = 576, 1536, 192  # SmolLM2-135M: hidden, MLP, k/v width (3 of 9 heads x 64)
LAYER = {"q": (H, H), "k": (KV, H), "v": (KV, H), "o": (H, H),
         "gate": (FF, H), "up": (FF, H), "down": (H, FF)}  # fmt: skip


def _median_s(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


RECIPES = ("fp32", "bf16_autocast", "bf16_weights")  # grpo_fast.trainer.calibrate's training recipes


def linears(tokens: int, repeats: int) -> list[dict]:
    """Each linear of a layer forward + backward over `tokens` tokens in each recipe: fp32; bf16 autocast on
    fp32 weights (a cast of the input and the weight per GEMM, gradients back to fp32); bf16 weights and
    activations (no casts: --dtype bf16, whose optimizer keeps the fp32 masters)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    total = dict.fromkeys(RECIPES, 0.0)
    for name, (out_f, in_f) in LAYER.items():
        x32 = torch.randn(tokens, in_f, generator=g)
        w32 = torch.randn(out_f, in_f, generator=g) * 0.02
        up32 = torch.randn(tokens, out_f, generator=g)

        def step(recipe):
            dtype = torch.bfloat16 if recipe == "bf16_weights" else torch.float32
            x, w = (t.to(dtype).requires_grad_() for t in (x32, w32))
            up = up32.to(torch.bfloat16 if recipe != "fp32" else torch.float32)

            def run():
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe == "bf16_autocast"):
                    y = torch.nn.functional.linear(x, w)
                y.backward(up)
                x.grad = w.grad = None

            return run

        t = {r: _median_s(step(r), repeats) for r in RECIPES}
        for r in RECIPES:
            total[r] += t[r]
        flops = 6 * tokens * in_f * out_f  # forward, d input, d weight
        rows.append(_linear_row(f"{name} {in_f}->{out_f}", tokens, t, flops))
    rows.append(_linear_row("the layer", tokens, total, sum(6 * tokens * i * o for o, i in LAYER.values())))
    return rows


def _linear_row(name: str, tokens: int, t: dict, flops: float) -> dict:
    return dict(linear=name, tokens=tokens, fp32_ms=t["fp32"] * 1e3, bf16_ms=t["bf16_autocast"] * 1e3,
                speedup=t["fp32"] / t["bf16_autocast"], bf16w_ms=t["bf16_weights"] * 1e3,
                bf16w_speedup=t["fp32"] / t["bf16_weights"], fp32_gflops=flops / t["fp32"] / 1e9)  # fmt: skip


OPTIMIZER_ROWS = [
    ("fp32", "adamw_torch"), ("fp32", "adamw_torch_fused"), ("fp32", "adamw_8bit"),
    ("bf16", "adamw_torch_fused"), ("bf16", "adamw_torch"), ("bf16", "adamw_kahan"),
    ("bf16", "adamw_stochastic"), ("bf16", "plain torch AdamW"),
]  # fmt: skip


def _smollm2_params(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.models.memory import SMOLLM2_SHAPE

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).to(dtype)
    return [p for p in model.parameters()]


def _optimizer(params, optim, lr):
    from grpo_fast.trainer.optimizers import build_optimizer

    if optim == "plain torch AdamW":
        return torch.optim.AdamW(params, lr=lr)
    return build_optimizer(params, optim, lr)


def _fp64_adamw(w0, grads, lr, betas=(0.9, 0.999), eps=1e-8):
    w, m, v = w0.double().clone(), torch.zeros_like(w0, dtype=torch.float64), 0
    v = torch.zeros_like(m)
    for t, gr in enumerate(grads, 1):
        m = betas[0] * m + (1 - betas[0]) * gr.double()
        v = betas[1] * v + (1 - betas[1]) * gr.double() ** 2
        w = w - lr / (1 - betas[0] ** t) * m / ((v / (1 - betas[1] ** t)).sqrt() + eps)
    return w


def step_transient(storage: str, optim: str) -> float:
    """Bytes per element a step allocates while it steps one tensor (SmolLM2's embedding, 28.3M elements):
    the process's resident-set peak above its level, allocations mapped on their own
    (grpo_fast.trainer.memory), after a first step made the state. grpo_fast/trainer/optimizers.py's
    OPTIMIZERS step_bytes are these figures."""
    from grpo_fast.trainer.memory import current_mib, peak_mib, reset_peak

    cpu = torch.device("cpu")
    n = 49152 * H
    p = torch.nn.Parameter((torch.randn(n) * 0.02).to(torch.float32 if storage == "fp32" else torch.bfloat16))
    opt = _optimizer([p], optim, 1e-5)
    p.grad = torch.randn_like(p)
    opt.step()
    gc.collect()
    base = current_mib("cpu")
    reset_peak(cpu)
    opt.step()
    return (peak_mib(cpu) - base) * 2**20 / n


def exactness(storage: str, optim: str) -> dict:
    g = torch.Generator().manual_seed(1)
    dtype = torch.float32 if storage == "fp32" else torch.bfloat16
    w0 = (torch.randn(FF, H, generator=g) * 0.02).to(dtype)
    grads = [torch.randn(FF, H, generator=g).to(dtype) for _ in range(12)]
    lr = 1e-5
    ref = _fp64_adamw(w0, grads, lr)
    p = torch.nn.Parameter(w0.clone())
    opt = _optimizer([p], optim, lr)
    for gr in grads:
        p.grad = gr.clone()
        opt.step()
    st = opt.state[p]
    kept = p.double()
    if "master" in st:
        kept = st["master"].double()
    elif "compensation" in st:
        kept = kept + st["compensation"].double()
    grid = lambda t: t.float().bfloat16().double()  # noqa: E731
    moved = (grid(p.detach()) - grid(w0)).abs().mean().item()
    ref_moved = (grid(ref) - grid(w0)).abs().mean().item()
    mean_move = (ref - w0.double()).abs().mean().item()
    return dict(
        grid_movement=moved / ref_moved,
        changed=(p.detach() != w0).float().mean().item(),
        max_err=(kept - ref).abs().max().item() / mean_move,
    )


def optimizers(repeats: int) -> list[dict]:
    rows = []
    for storage, optim in OPTIMIZER_ROWS:
        row = dict(weights=storage, optim=optim)
        try:
            params = _smollm2_params(torch.float32 if storage == "fp32" else torch.bfloat16)
            opt = _optimizer(params, optim, 1e-5)
            g = torch.Generator().manual_seed(0)
            for p in params:
                p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(p.dtype)
            step_s = _median_s(opt.step, repeats)
            n = sum(p.numel() for p in params)
            tensors = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
            state = sum(t.numel() * t.element_size() for t in tensors)
            weights = sum(p.numel() * p.element_size() for p in params)
            row.update(step_s=step_s, state_bytes_per_param=state / n,
                       bytes_per_param=(state + 2 * weights) / n, **exactness(storage, optim))  # fmt: skip
            del params, opt, tensors
            row["step_transient"] = step_transient(storage, optim)
        except (ImportError, ValueError, RuntimeError) as exc:
            row["note"] = f"{type(exc).__name__}: {exc}"[:120]
        rows.append(row)
        print(f"  {row}", flush=True)
    return rows


LINEAR_COLUMNS = [("linear", "linear"), ("tokens", "tokens"), ("fp32_ms", "fp32 ms"),
                  ("bf16_ms", "bf16 autocast ms"), ("speedup", "autocast speed over fp32"),
                  ("bf16w_ms", "bf16 weights ms"), ("bf16w_speedup", "bf16 weights speed over fp32"),
                  ("fp32_gflops", "fp32 GFLOP/s")]  # fmt: skip
OPT_COLUMNS = [
    ("weights", "weights"), ("optim", "--optim"), ("step_s", "step s (134.5M params)"),
    ("state_bytes_per_param", "state bytes / param"), ("bytes_per_param", "+ weights + grads"),
    ("step_transient", "step transient bytes / element of a tensor"),
    ("grid_movement", "movement on the bf16 grid / fp64 AdamW's"), ("changed", "weights changed"),
    ("max_err", "kept weight's max error / mean movement"), ("note", "note"),
]  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[256, 4096],
        help="tokens of the linear layers' batch, each (256: the calibration's; 4096: a step's)",
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    from grpo_fast.trainer.memory import map_large_allocations

    map_large_allocations(torch.device("cpu"))  # before anything is allocated: step_transient's peaks
    info = machine_info()
    from grpo_fast.trainer import calibrate

    cal = calibrate.report()  # what `grpo-fast train` measures to choose, and its choices
    lin = [row for tokens in args.tokens for row in linears(tokens, args.repeats)]
    opt = optimizers(args.repeats)
    from grpo_fast.trainer.precision import cpu_class

    vendor, isa = cpu_class()
    layer = lin[-1]["speedup"]
    ratios = lambda d: ", ".join(f"{k} {v:.2f}x" for k, v in d.items())  # noqa: E731
    md = (
        f"# Precision recipes on {cpu_line(info)}\n\n"
        f"torch {torch.__version__}; vendor `{vendor}`, instruction-set class `{isa}`: bf16 autocast trains "
        f"a layer's linears at **{layer:.2f}x** fp32 over {lin[-1]['tokens']} tokens (the measurement-off "
        f"fallback, grpo_fast/trainer/precision.py's CPU_BF16_TRAIN_SPEEDUP row for ({vendor!r}, "
        f"{isa!r})).\n\n"
        f"## The calibration (`grpo-fast train` with --bf16 unset, --rollout-dtype auto)\n\n"
        f"A decoder layer at SmolLM2-135M's widths over {cal['key'].split('tokens=')[-1]} tokens, forward + "
        f"backward: {ratios(cal['train'])}; a decode step: {ratios(cal['decode'])} (fp32's time over the "
        f"recipe's). Training: {'bf16 autocast' if cal['train_choice'][0] else 'fp32'}; rollouts: "
        f"{cal['rollout_choice'][0].replace('model', 'fp32')}. Measuring took {cal['seconds']:.1f} s.\n\n"
        f"## Linear layers, forward + backward (one SmolLM2-135M layer)\n\n"
        + markdown_table(lin, LINEAR_COLUMNS)
        + "\n\n## Optimizers: a step of SmolLM2-135M's parameters; exactness on one layer "
        "(12 steps, lr 1e-5)\n\n" + markdown_table(opt, OPT_COLUMNS) + "\n"
    )
    payload = {"machine": info, "vendor": vendor, "isa": isa, "tokens": args.tokens, "calibration": cal,
               "linears": lin, "optimizers": opt}  # fmt: skip
    out = write_results("bench_precision", payload, md, Path(args.out_dir) if args.out_dir else None)
    print(md)
    print(f"results in {out}")


if __name__ == "__main__":
    main()
