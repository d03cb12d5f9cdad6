"""Where a training phase's time goes, per operator, and how close it runs to the machine's GEMM rate: the
trainer's own optimization phase (grpo_fast.trainer.step.optimize: the policy forward through the
shared-prefix layout, the fused loss, backward, clipping, the optimizer step) on bench_e2e's real workload
(SmolLM2-135M-Instruct, 2 chat prompts x G=8, C=256): a warm-up phase, then --repeats timed unprofiled phases,
each right after a measurement of the GEMM rate (the median pair reported), and one under the profiler (the
shares), all on one rollout, sampled in fp32 with the run's seed: `--bf16` trains on the same tokens.

    python -m bench.profiles.train [--top 15] [--bf16] [--optim adamw_torch_fused] [--attention mask]

The phase's GEMM work is counted exactly: each decoder layer's linear layers (forward, d input, d weight:
6 FLOPs per weight per token) over the tokens the forward runs (each prompt once per group), and the LM head
over the trained completion tokens; the machine's GEMM rate is measured in the same run at those shapes (one
layer's linear layers forward + backward over the same token count, fp32). `train_phase_gemm_fraction` is the
phase's achieved GFLOP/s over that rate (make bench's summary). Writes bench/results/<machine>/
profile_train.{json,md} with the CPU model and flags.
"""

import argparse
import functools
import resource
import tempfile
import time
from pathlib import Path

import torch

from bench._utils import cpu_line, machine_info, markdown_table, write_results

COLUMNS = [("op", "operator"), ("share", "share of self CPU time"), ("calls", "calls"),
           ("ms_per_call", "ms per call"), ("seconds", "seconds")]  # fmt: skip


def gemm_layer(tokens: int, config):
    """One decoder layer's linear layers at the model's shapes over `tokens` rows, fp32, with gradients: the
    leaves each GEMM-rate measurement reuses (made once, before the phases)."""
    H, F = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (getattr(config, "head_dim", None) or H // config.num_attention_heads)
    shapes = [(H, H), (kv, H), (kv, H), (H, H), (F, H), (F, H), (H, F)]
    g = torch.Generator().manual_seed(0)
    leaves = [(torch.randn(tokens, i, generator=g).requires_grad_(), torch.randn(o, i, generator=g) * 0.02)
              for o, i in shapes]  # fmt: skip
    for _, w in leaves:
        w.requires_grad_()
    return leaves


def gemm_rate(leaves, repeats: int = 3) -> float:
    """fp32 GFLOP/s of one decoder layer's linear layers (gemm_layer), forward + backward."""

    def layer():
        for x, w in leaves:
            torch.nn.functional.linear(x, w).sum().backward()

    layer()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        layer()
        times.append(time.perf_counter() - t0)
    flops = sum(6 * x.shape[0] * w.numel() for x, w in leaves)
    return flops / sorted(times)[len(times) // 2] / 1e9


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--top", type=int, default=15, help="operators shown")
    ap.add_argument("--bf16", action="store_true", help="train under bf16 autocast (default: fp32)")
    ap.add_argument("--optim", default="adamw_torch_fused")
    ap.add_argument(
        "--attention",
        default="auto",
        choices=("auto", "segments", "mask"),
        help="the shared-prefix attention layout (shared_prefix_forward's attention=)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="timed phases (the median is the rate's)")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    import grpo_fast.trainer.modeling as modeling
    import grpo_fast.trainer.train as train_mod
    from bench.models.e2e import SHAPES, build_real_work
    from grpo_fast.models.model_parts import decoder_of
    from grpo_fast.trainer.config import GRPOConfig
    from grpo_fast.trainer.step import optimize, rollout, score_rollout

    if args.attention != "auto":
        layout = functools.partial(modeling.shared_prefix_forward, attention=args.attention)
        modeling.shared_prefix_forward = layout
    shape = SHAPES["real"]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data, _ = build_real_work(Path(tmp), 8)
        cfg = GRPOConfig(
            model=str(model_dir), dataset=str(data),
            reward=[f"{Path(__file__).resolve().parents[1] / 'models' / 'e2e.py'}:real_reward"],
            num_generations=shape["G"], prompts_per_step=shape["prompts_per_step"],
            max_prompt_length=shape["P"], max_completion_length=shape["C"], learning_rate=1e-6,
            bf16=args.bf16, optim=args.optim, output_dir=str(Path(tmp) / "run"),
            max_steps=10**6,  # optimize stops at max_steps: room for every phase this runs
            rollout_dtype="fp32",  # the same rollout (seed, fp32 sampling) whatever the training precision
            skip_zero_advantage_groups=False,  # the whole phase, every group trained
        )  # fmt: skip
        run = train_mod.setup(cfg)
        rows = run.sampler.next()
        ro = rollout(run, rows)
        sc = score_rollout(run, rows, ro)
        config = run.model.config
        tokens_run = int(ro.prompt_mask.sum() + ro.completion_mask.sum())  # prefix sharing: each prompt once
        leaves = gemm_layer(tokens_run, config)
        gemm_rate(leaves)
        optimize(run, ro, sc)  # warm-up: allocator, packed weights, first-call paths
        # unprofiled phases (the profiler's cost is not the phase's), each right after a GEMM-rate measurement
        # at the model's shapes: a shared machine's speed drifts, so each phase is set against its own rate
        times, rates, system = [], [], []
        for _ in range(args.repeats):
            rates.append(gemm_rate(leaves))
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            optimize(run, ro, sc)
            times.append(time.perf_counter() - t0)
            system.append(resource.getrusage(resource.RUSAGE_SELF).ru_stime - r0.ru_stime)
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            optimize(run, ro, sc)
        profiled_s = time.perf_counter() - t0
        trained = int(sc.loss_mask.sum())
        linear_params = sum(
            m.weight.numel() for m in decoder_of(run.model).layers.modules() if isinstance(m, torch.nn.Linear)
        )
        head = config.vocab_size * config.hidden_size
        flops = 6 * tokens_run * linear_params + 6 * trained * head
        train_mod.release(run)
    ops = sorted(((e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()), key=lambda o: -o[1])
    total = sum(o[1] for o in ops) or 1
    top = [dict(op=op, share=us / total, calls=calls, ms_per_call=us / 1e3 / calls, seconds=us / 1e6)
           for op, us, calls in ops[: args.top]]  # fmt: skip
    fractions = [flops / t / 1e9 / r for t, r in zip(times, rates)]
    mid = sorted(range(len(times)), key=lambda i: fractions[i])[len(times) // 2]  # the median pair
    phase_s, rate, fraction = times[mid], rates[mid], fractions[mid]
    achieved = flops / phase_s / 1e9
    summary = dict(phase_s=phase_s, phase_s_all=times, system_s_all=system, profiled_s=profiled_s,
                   attention=args.attention,
                   tokens_run=tokens_run, trained_tokens=trained, gemm_tflop=flops / 1e12,
                   achieved_gflops=achieved, gemm_rate_gflops=rate, train_phase_gemm_fraction=fraction,
                   fractions=fractions, gemm_rates=rates,
                   precision="bf16 autocast" if args.bf16 else "fp32", optim=args.optim)  # fmt: skip
    info = machine_info()
    md = (
        "# Training phase profile per operator (torch.profiler, self CPU time)\n\n"
        f"Machine: {cpu_line(info)}, torch {info['versions']['torch']}, commit {info['git_commit']}; "
        f"SmolLM2-135M-Instruct, 2 chat prompts x G={shape['G']}, C<={shape['C']}, {summary['precision']}, "
        f"--optim {args.optim}, shared-prefix attention {args.attention}; a warm-up phase, "
        f"{args.repeats} timed phases, each after a GEMM-rate measurement (the median pair), and a profiled "
        "one on the same rollout.\n\n"
        f"Phase {phase_s:.2f} s (of {', '.join(f'{t:.2f}' for t in times)}, of which the kernel's time, "
        f"page faults mostly: {', '.join(f'{t:.2f}' for t in system)}; {profiled_s:.2f} s under "
        f"the profiler) for {tokens_run} tokens run ({trained} trained): "
        f"{flops / 1e12:.2f} TFLOP of GEMMs at {achieved:.1f} GFLOP/s; this machine's fp32 GEMM rate at the "
        f"model's shapes {rate:.1f} GFLOP/s (of {', '.join(f'{r:.0f}' for r in rates)}): "
        f"**train_phase_gemm_fraction {fraction:.2f}** (of {', '.join(f'{f:.2f}' for f in fractions)}).\n\n"
        + markdown_table(top, COLUMNS)
        + "\n"
    )
    out = write_results("profile_train", {"machine": info, "summary": summary, "ops": top}, md,
                        Path(args.out_dir) if args.out_dir else None)  # fmt: skip
    print(md)
    print(f"wrote {out}/profile_train.{{json,md}}")


if __name__ == "__main__":
    main()
