"""The rollout against this machine's floor, and where its time goes.

    python -m bench.profiles.decode [--dtypes model,bf16] [--C 256] [--repeats 3] [--vllm] [--ops]
                                   [--torch-ops] [--repetition-penalty P] [--out-dir DIR]

The work: bench_generate's real workload (SmolLM2-135M-Instruct, 2 chat prompts x G=8 = 16 rows), C tokens
per row, T=1, no EOS (every row decodes all C tokens, so every call does the same work). Per rollout dtype
(`--dtypes`, the native engine's `rollout_dtype`), `--repeats` calls after a warm-up call, each right after a
measurement of the machine's read bandwidth (a 512 MiB fp32 sum on all threads); the engine's own phase
timers (`NativeEngine.last_call`) split each call into prefill, weight packing and decode.

The floor of a decode step is what it must read and what it must compute:
- bytes: every linear layer's weights in the rollout dtype's format and the LM head (read once per token
  step, whatever the row count), plus the KV the step attends (each group's real prompt tokens, each row's
  completion tokens so far; the KV in the engine's KV dtype: the policy's, fp32, or a bf16 rollout's bf16);
- FLOPs: 2 x rows x those weights, plus the attention's products.
`decode_bandwidth_fraction` = bytes x steps / (decode seconds x read bandwidth); `decode_roofline_fraction`
= max(bytes / bandwidth, FLOPs / the dtype's peak) / seconds, the peak the fastest of what this machine is
measured to do: a 2048^3 product in that dtype, one in fp32 (16-bit weights can always be widened and
multiplied in fp32: without AVX512-BF16 torch's bf16 product runs at a fraction of a GFLOP/s on a Zen 3, no
floor), and fp32 FMAs on registers alone on all threads (`fma_peak`: no GEMM goes faster; on a Zen 3 torch's
fp32 product reaches ~0.8 of it). On a 2-core CPU a 16-row step can be compute-bound: its floor is then the
FLOPs', and `decode_bandwidth_fraction_ceiling` = bandwidth floor / floor is the most bandwidth fraction
the machine allows that dtype (1 where the bandwidth bounds it). The
prefill is held against the fp32 peak (`prefill_gemm_fraction`: it runs the model's own forward). `--vllm`
adds vLLM CPU (the `.venv-vllm` engine, `make setup-vllm`) on the same rows, C and dtype, no EOS, its time
per token step (prefill included) against the same floor. `--torch-ops` adds the native engine through
PyTorch ops (no CPU decode kernels), `--repetition-penalty P` the native engine under that penalty (its cost,
`decode_repetition_penalty_cost_<dtype>`, x the unpenalized step), each interleaved call by call. `--ops`
adds the per-operator profile (torch.profiler, self CPU time) of one call per dtype.

Writes <out-dir, default bench/results/<machine>>/profile_decode.{json,md} with the CPU model and flags; the
summary keys (`decode_bandwidth_fraction_fp32`, `_bf16`, ...) reach summary.json through bench.report.
"""

import argparse
import statistics
import time

import torch

from bench._utils import (
    NO_VLLM,
    cpu_line,
    machine_info,
    markdown_table,
    run_worker,
    vllm_python,
    write_results,
)
from bench.models.generate import _work
from grpo_fast.rollout.native import kv_dtype

G = 8
PROMPTS = 2
DTYPE_BYTES = {"model": 4, "fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "fp8": 1}
HEAD_BYTES = {"model": 4, "fp32": 4, "bf16": 2, "fp16": 2, "int8": 4, "fp8": 4}  # 8-bit: an fp32 head
PEAK_DTYPE = {"model": torch.float32, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
              "int8": torch.float32, "fp8": torch.float32}  # fmt: skip
OP_COLUMNS = [("provider", "provider"), ("op", "operator"), ("share", "share of self CPU time"),
              ("calls", "calls"), ("ms_per_call", "ms per call")]  # fmt: skip


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """GB/s of a sum over `gib` GiB of fp32 on all threads (median of `repeats`, after one untimed pass)."""
    # random values: pages of one repeated value can be merged by the host (KSM) and read from cache
    x = torch.rand(int(gib * 2**30) // 4, generator=torch.Generator().manual_seed(0))
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times) / 1e9


def gemm_peak(dtype, n: int = 2048, repeats: int = 3) -> float:
    """GFLOP/s of an n x n x n product in `dtype` (median of `repeats`, after one untimed)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e9


_FMA_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <chrono>
#if defined(__AVX512F__)
typedef float vf __attribute__((vector_size(64)));
#else
typedef float vf __attribute__((vector_size(32)));
#endif
// GFLOP/s of `iters` x 12 independent vector FMA chains per thread, all threads at once
double fma_rate(int64_t iters) {
  const int64_t threads = at::get_num_threads();
  const auto t0 = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    const vf x = (vf){} + 0.999f, y = (vf){} + 1e-4f;
    vf a0 = (vf){} + 1.f, a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0,
       a10 = a0, a11 = a0;  // named, not an array: an array's chains go through the stack
    for (int64_t it = 0; it < iters; ++it) {
      a0 = a0 * x + y; a1 = a1 * x + y; a2 = a2 * x + y; a3 = a3 * x + y;
      a4 = a4 * x + y; a5 = a5 * x + y; a6 = a6 * x + y; a7 = a7 * x + y;
      a8 = a8 * x + y; a9 = a9 * x + y; a10 = a10 * x + y; a11 = a11 * x + y;
      __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7),
                       "+x"(a8), "+x"(a9), "+x"(a10), "+x"(a11));
    }
    volatile float sink = (a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11)[0];
    (void)sink;
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return 2.0 * 12 * (sizeof(vf) / 4) * iters * threads / s / 1e9;
}
"""


def fma_peak(repeats: int = 5) -> float:
    """fp32 GFLOP/s of FMAs on registers alone on all threads (the median of `repeats` ~0.2 s runs): the
    machine's arithmetic ceiling, which no product of matrices passes."""
    from torch.utils.cpp_extension import load_inline

    mod = load_inline(
        name="grpo_fast_bench_fma", cpp_sources=[_FMA_SOURCE], functions=["fma_rate"],
        extra_cflags=["-O2", "-march=native", "-ffp-contract=fast", "-fopenmp"], extra_ldflags=["-fopenmp"],
    )  # fmt: skip
    t0 = time.perf_counter()
    mod.fma_rate(1_000_000)
    iters = max(1, int(1_000_000 * 0.2 / (time.perf_counter() - t0)))  # ~0.2 s a run
    return statistics.median(mod.fma_rate(iters) for _ in range(repeats))


def decode_work(model, prompt_tokens: int, groups: int, rows: int, steps: int, dtype: str) -> dict:
    """Bytes and FLOPs that `steps` decode steps of `rows` rows in `groups` groups (`prompt_tokens` real
    prompt tokens in all) must read and compute (module docstring), summed over the steps."""
    cfg = model.config
    layers = model.model.layers
    linear = sum(m.weight.numel() for m in layers.modules() if isinstance(m, torch.nn.Linear))
    head = cfg.vocab_size * cfg.hidden_size
    weights = linear * DTYPE_BYTES[dtype] + head * HEAD_BYTES[dtype]
    kvh, heads = cfg.num_key_value_heads, cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_elem = kv_dtype(dtype, next(model.parameters()).dtype).itemsize  # the engine's KV dtype
    # step s attends each group's real prompt tokens once and each row's s + 1 completion slots
    slots = steps * prompt_tokens + rows * steps * (steps + 1) // 2
    kv_bytes = len(layers) * 2 * kvh * d * kv_elem * slots
    # attention products per query head: scores and the weighted sum over the keys a row sees
    seen = rows // groups * prompt_tokens * steps + rows * steps * (steps + 1) // 2
    attn_flops = len(layers) * heads * 4 * d * seen
    return dict(
        weight_bytes=weights * steps, kv_bytes=kv_bytes, bytes=weights * steps + kv_bytes,
        flops=2 * rows * (linear + head) * steps + attn_flops,
    )  # fmt: skip


def prefill_flops(model, prompt_tokens: int) -> int:
    params = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    return 2 * prompt_tokens * params + 2 * PROMPTS * model.config.vocab_size * model.config.hidden_size


def measure_native(model, ids, mask, C, dtype, repeats, torch_ops=False, penalty=1.0) -> tuple[list, ...]:
    """(calls through the CPU decode kernels, calls through PyTorch ops: empty unless `torch_ops`, calls
    under a repetition penalty: empty unless `penalty` != 1), each call's phases with the read bandwidth
    measured before it; the kinds interleave call by call, so that a shared machine's drift falls on all."""
    from grpo_fast.rollout import cpu_decode, generate_groups, native

    eng = native.engine_for(model)

    def call(seed, kernels, repetition_penalty):
        cpu_decode.ENABLED = kernels
        try:
            generate_groups(
                model, ids, mask, G, C, temperature=1.0, eos_token_id=None, engine="native", compile=False,
                rollout_dtype=dtype, generator=torch.Generator().manual_seed(seed),
                repetition_penalty=repetition_penalty,
            )  # fmt: skip
        finally:
            cpu_decode.ENABLED = True
        return dict(eng.last_call)

    modes = [(True, 1.0)] + [(False, 1.0)] * torch_ops + [(True, penalty)] * (penalty != 1.0)
    for mode in modes:
        call(99, *mode)  # warm-up: allocator, oneDNN primitives for these shapes
    calls = {m: [] for m in modes}
    for seed in range(repeats):
        for mode in modes:
            bw = read_bandwidth()
            calls[mode].append(dict(call(seed, *mode), bandwidth_gbs=bw))
    penalized = calls[(True, penalty)] if penalty != 1.0 else []
    return calls[(True, 1.0)], calls.get((False, 1.0), []), penalized


def measure_vllm(dtype, C, repeats) -> dict:
    python = vllm_python()
    if python is None:
        return {"error": NO_VLLM}
    provider = "vllm" if dtype in ("model", "fp32") else f"vllm_{dtype}"
    job = dict(workload="real", provider=provider, prompts=PROMPTS, G=G, C=C, no_eos=True, quick=False,
               repeats=repeats)  # fmt: skip
    return run_worker("models.generate", job, timeout=1800, python=python)


def fractions(work: dict, steps: int, decode_s: float, bw: float, peak: float) -> dict:
    floor_bw = work["bytes"] / (bw * 1e9)
    floor = max(floor_bw, work["flops"] / (peak * 1e9))
    return dict(
        ms_per_step=1e3 * decode_s / steps, floor_ms_per_step=1e3 * floor / steps,
        bandwidth_fraction=floor_bw / decode_s, roofline_fraction=floor / decode_s,
        bandwidth_fraction_ceiling=floor_bw / floor,
        bound="bandwidth" if floor == floor_bw else "compute",
    )  # fmt: skip


def op_profile(model, ids, mask, C, dtype, top) -> list:
    """The operators with the most self CPU time in one call (after a warm-up call)."""
    from torch.profiler import ProfilerActivity, profile

    from grpo_fast.rollout import generate_groups

    def run():
        generate_groups(
            model, ids, mask, G, C, temperature=1.0, eos_token_id=None, engine="native", compile=False,
            rollout_dtype=dtype, generator=torch.Generator().manual_seed(0),
        )  # fmt: skip

    run()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    ops = sorted(((e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()), key=lambda o: -o[1])
    total = sum(o[1] for o in ops) or 1
    return [dict(provider=f"native {dtype}", op=op, share=us / total, calls=n, ms_per_call=us / 1e3 / n)
            for op, us, n in ops[:top]]  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="model,bf16", help="native engine rollout dtypes")
    ap.add_argument("--C", type=int, default=256, help="tokens per row (no EOS)")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per dtype (the median is reported)")
    ap.add_argument("--vllm", action="store_true", help="vLLM CPU beside (its own environment)")
    ap.add_argument("--ops", action="store_true", help="add the per-operator profile of one call per dtype")
    ap.add_argument(
        "--torch-ops", action="store_true",
        help="the native engine through PyTorch ops too (no CPU decode kernels), interleaved call by call",
    )  # fmt: skip
    ap.add_argument(
        "--repetition-penalty", type=float, default=1.0,
        help="the native engine under this repetition penalty too (1: not run), interleaved call by call",
    )  # fmt: skip
    ap.add_argument("--top", type=int, default=12, help="operators shown per dtype (--ops)")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    from pathlib import Path

    torch.manual_seed(0)
    model, ids, mask, _ = _work("real", dict(prompts=PROMPTS, quick=False))
    R, C, steps = PROMPTS * G, args.C, args.C - 1  # the first token comes from the prefill's logits
    prompt_tokens = int(mask.sum())
    measured, ops, vllm = [], [], {}
    fma = fma_peak()
    print(f"fp32 FMA peak (registers, all threads): {fma:.0f} GFLOP/s", flush=True)
    with torch.no_grad():
        for dtype in args.dtypes.split(","):
            name = "fp32" if dtype == "model" else dtype
            peak = max(gemm_peak(PEAK_DTYPE[dtype]), gemm_peak(torch.float32), fma)
            calls, ops_calls, pen_calls = measure_native(
                model, ids, mask, C, dtype, args.repeats, args.torch_ops, args.repetition_penalty
            )
            assert all(c["decode_steps"] == steps for c in calls + ops_calls + pen_calls), calls + ops_calls
            assert all(c["kernel_steps"] in (0, steps) for c in calls), calls  # all steps, or none can
            work = decode_work(model, prompt_tokens, PROMPTS, R, steps, dtype)
            pre = prefill_flops(model, prompt_tokens) / gemm_peak(torch.float32) / 1e9
            measured.append((name, "native", calls, work, peak, pre))
            penalized = f"native, repetition penalty {args.repetition_penalty:g}"
            if ops_calls:
                measured.append((name, "native, PyTorch ops", ops_calls, work, peak, pre))
            if pen_calls:
                measured.append((name, penalized, pen_calls, work, peak, pre))
            for engine, cs in (("native", calls), ("native, PyTorch ops", ops_calls), (penalized, pen_calls)):
                if cs:
                    per_step = [round(1e3 * c["decode_s"] / steps, 1) for c in cs]
                    print(f"{engine} {name}: {per_step} ms per step", flush=True)
            if args.vllm:
                vllm[name] = measure_vllm(dtype, C, args.repeats)
                print(f"vllm {name}: {vllm[name].get('error') or vllm[name]['tokens_per_s']}", flush=True)
            if args.ops:
                ops += op_profile(model, ids, mask, min(C, 64), dtype, args.top)
    # one bandwidth for the run: the median of every measurement (a shared host's rate swings 30-60 GB/s
    # between seconds here), the range beside it
    bws = [c["bandwidth_gbs"] for _, _, calls, *_ in measured for c in calls]
    bw = statistics.median(bws)
    rows, summary = [], {"read_bandwidth_gbs": bw, "read_bandwidth_gbs_range": [min(bws), max(bws)]}
    for name, engine, calls, work, peak, pre_s in measured:
        per = [fractions(work, steps, c["decode_s"], bw, peak) for c in calls]
        mid = sorted(range(len(per)), key=lambda i: per[i]["ms_per_step"])[len(per) // 2]  # the median call
        c, f = calls[mid], per[mid]
        pre = pre_s / c["prefill_s"]
        if engine != "native":  # an A/B row (PyTorch ops, a penalty): its time, its ratio to the native one
            rows.append(dict(engine=engine, dtype=name, **f, bandwidth_gbs=bw, gemm_peak_gflops=peak,
                             ms_per_step_all=[p["ms_per_step"] for p in per]))  # fmt: skip
            ratio = f["ms_per_step"] / summary[f"decode_ms_per_step_{name}"]
            if engine.startswith("native, repetition penalty"):
                summary[f"decode_ms_per_step_{name}_penalized"] = f["ms_per_step"]
                summary[f"decode_repetition_penalty_cost_{name}"] = ratio  # x the unpenalized step
            else:
                summary[f"decode_ms_per_step_{name}_torch_ops"] = f["ms_per_step"]
                summary[f"decode_kernels_speedup_{name}"] = ratio
            continue
        rows.append(dict(engine="native", dtype=name, **f, bandwidth_gbs=bw, gemm_peak_gflops=peak,
                         kernels="yes" if c["kernel_steps"] else "no",
                         gbytes_per_step=work["bytes"] / steps / 1e9,
                         gflop_per_step=work["flops"] / steps / 1e9, prefill_ms=1e3 * c["prefill_s"],
                         pack_ms=1e3 * c["pack_s"], prefill_gemm_fraction=pre,
                         ms_per_step_all=[p["ms_per_step"] for p in per]))  # fmt: skip
        summary[f"decode_bandwidth_fraction_{name}"] = f["bandwidth_fraction"]
        summary[f"decode_roofline_fraction_{name}"] = f["roofline_fraction"]
        summary[f"decode_bandwidth_fraction_ceiling_{name}"] = f["bandwidth_fraction_ceiling"]
        summary[f"decode_ms_per_step_{name}"] = f["ms_per_step"]
        summary[f"prefill_gemm_fraction_{name}"] = pre
        print(f"native {name}: {f['ms_per_step']:.1f} ms/step (floor {f['floor_ms_per_step']:.1f}, "
              f"{f['bound']}-bound), bandwidth fraction {f['bandwidth_fraction']:.2f}, roofline "
              f"{f['roofline_fraction']:.2f}", flush=True)  # fmt: skip
        res = vllm.get(name)
        if res is not None and "error" in res:
            rows.append(dict(engine="vllm", dtype=name, error=res["error"]))
        elif res is not None:  # its seconds per token step (prefill included) against the same floor
            v = fractions(work, steps, res["seconds"] / (res["tokens"] / R) * steps, bw, peak)
            rows.append(dict(engine="vllm", dtype=name, **v, env=res.get("env")))
            summary[f"decode_ms_per_step_vllm_{name}"] = v["ms_per_step"]
            summary[f"decode_bandwidth_fraction_vllm_{name}"] = v["bandwidth_fraction"]
    info = machine_info()
    columns = [("engine", "engine"), ("dtype", "rollout dtype"), ("kernels", "CPU decode kernels"),
               ("ms_per_step", "ms per token step"),
               ("floor_ms_per_step", "floor ms"), ("bound", "floor bound by"),
               ("bandwidth_fraction", "decode_bandwidth_fraction"),
               ("roofline_fraction", "roofline fraction"),
               ("bandwidth_fraction_ceiling", "bandwidth fraction ceiling"),
               ("gbytes_per_step", "GB per step"), ("gflop_per_step", "GFLOP per step"),
               ("bandwidth_gbs", "read GB/s"), ("gemm_peak_gflops", "peak GFLOP/s"),
               ("prefill_ms", "prefill ms"), ("prefill_gemm_fraction", "prefill GEMM fraction"),
               ("pack_ms", "weight packing ms"), ("env", "environment"), ("error", "note")]  # fmt: skip
    op_md = f"\n## Operators (one call, C={min(C, 64)})\n\n{markdown_table(ops, OP_COLUMNS)}\n" if ops else ""
    md = (
        "# The rollout against the machine's floor\n\n"
        f"Machine: {cpu_line(info)}, torch {info['versions']['torch']}, commit {info['git_commit']}; "
        f"SmolLM2-135M-Instruct, {PROMPTS} chat prompts x G={G} = {R} rows, C={C}, T=1, no EOS ({steps} "
        f"decode steps a call); {args.repeats} calls per dtype after a warm-up, the median call shown "
        "(`python -m bench.profiles.decode`, module docstring for the floor); read bandwidth the median of "
        "the run's "
        f"{len(bws)} measurements ({min(bws):.0f}-{max(bws):.0f} GB/s).\n\n"
        + markdown_table(rows, columns)
        + "\n"
        + op_md
    )
    summary["fma_peak_gflops"] = fma
    payload = {"machine": info, "summary": summary, "rows": rows, "ops": ops, "C": C, "rows_n": R}
    out = write_results("profile_decode", payload, md, Path(args.out_dir) if args.out_dir else None)
    print(md)
    print(f"wrote {out}/profile_decode.{{json,md}}")


if __name__ == "__main__":
    main()
