"""Where a rollout's time goes, per operator: the native engine (each rollout dtype asked for) and HF
`generate` on the real workload (SmolLM2-135M-Instruct, bench_generate's chat prompts, T=1), under
torch.profiler. For finding why one machine's native lead differs from another's: run it on both.

    python -m bench.profile_decode [--dtypes model,bf16] [--C 64] [--top 12]

Writes bench/results/<machine>/profile_decode.{json,md}: per provider the seconds, completion tokens, and
the operators with the most self CPU time (their share of the call, calls, ms per call), with the CPU model
and flags (a profile holds for that instruction set).
"""

import argparse
import time

import torch

from bench._utils import cpu_line, machine_info, markdown_table, write_results
from bench.bench_generate import _hf, _work

COLUMNS = [
    ("provider", "provider"),
    ("op", "operator"),
    ("share", "share of self CPU time"),
    ("calls", "calls"),
    ("ms_per_call", "ms per call"),
]


def profile(fn) -> tuple[float, list]:
    """(seconds, tokens, [(op, self CPU us, calls)]) of one call of fn under the profiler, after a warm-up."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        tokens = fn()
        secs = time.perf_counter() - t0
    ops = [(e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()]
    return secs, tokens, sorted(ops, key=lambda o: -o[1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="model,bf16", help="native engine rollout dtypes to profile")
    ap.add_argument("--C", type=int, default=64, help="completion tokens per sample")
    ap.add_argument("--top", type=int, default=12, help="operators shown per provider")
    args = ap.parse_args(argv)
    from grpo_fast.rollout import generate_groups

    torch.manual_seed(0)
    model, ids, mask, eos = _work("real", dict(prompts=2, quick=False))
    G, C = 8, args.C

    def native(dtype):
        def run():
            out = generate_groups(
                model, ids, mask, G, C, temperature=1.0, eos_token_id=eos, engine="native", compile=False,
                rollout_dtype=dtype, generator=torch.Generator().manual_seed(0),
            )  # fmt: skip
            return int(out[1].sum())

        return run

    providers = {f"native {d}": native(d) for d in args.dtypes.split(",")}
    providers["hf"] = lambda: _hf(model, ids, mask, G, C, eos, 0)  # completion tokens, as bench_generate
    rows, summary = [], []
    with torch.no_grad():
        for name, fn in providers.items():
            secs, tokens, ops = profile(fn)
            total = sum(o[1] for o in ops) or 1
            summary.append(dict(provider=name, seconds=secs, tokens=tokens, tokens_per_s=tokens / secs))
            for op, us, calls in ops[: args.top]:
                share, per_call = us / total, us / 1e3 / calls
                rows.append(dict(provider=name, op=op, share=share, calls=calls, ms_per_call=per_call))
            print(f"{name}: {secs:.2f} s, {tokens} tokens", flush=True)
    info = machine_info()
    md = (
        "# Rollout profile per operator (torch.profiler, self CPU time)\n\n"
        f"Machine: {cpu_line(info)}, torch {info['versions']['torch']}, commit {info['git_commit']}; "
        f"SmolLM2-135M-Instruct, 2 prompts x G={G}, C={C}, T=1, one profiled call after a warm-up call.\n\n"
        + markdown_table(
            summary,
            [
                ("provider", "provider"),
                ("seconds", "seconds"),
                ("tokens", "tokens"),
                ("tokens_per_s", "tokens/s (profiled)"),
            ],
        )  # fmt: skip
        + "\n\n"
        + markdown_table(rows, COLUMNS)
        + "\n"
    )
    out = write_results("profile_decode", {"machine": info, "summary": summary, "rows": rows}, md)
    print(md)
    print(f"wrote {out}/profile_decode.{{json,md}}")


if __name__ == "__main__":
    main()
