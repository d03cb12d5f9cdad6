"""The memory frontier: the longest completions that train within one memory budget, TRL vs grpo-fast.

    python -m bench.models.frontier [--budget-gb 2] [--layers 4] [--start 256] [--max-length 8192]
                                   [--precision fp32|bf16]      (make bench-frontier: fp32)

A model of SmolLM2-135M-Instruct's shape and vocabulary (49,152) with `--layers` of its 30 layers, random
weights (completions run to their full length: the case a budget has to hold), G=8, one prompt of 64 tokens
per step, fp32. Each trainer gets the same budget above its process's baseline (after imports, before the
model) and runs one step at C = start, 2 start, 4 start, ... until a step does not fit (its peak above the
baseline exceeds the budget; a watchdog stops a process 10% over it, so that the machine is never at risk)
or `--max-length` is reached.
- TRL 1.16 GRPOTrainer with its memory options that run on a CPU: gradient checkpointing and micro-batches
  of one completion (per_device_train_batch_size 1, gradient accumulation over the group: its log-probs are
  computed per micro-batch, so full logits exist for one completion at a time). Liger's fused loss is CUDA
  only.
- grpo-fast with `--max-memory-gb` (baseline + budget): the planner picks micro-batches, checkpointing and
  group splitting.
--precision bf16: each at its bf16 recipe, TRL with bf16=True (autocast on fp32 weights, its default) and the
same memory options, grpo-fast with --bf16 (autocast on fp32 master weights, rollouts in bf16) under the same
planner; results as bench_frontier_bf16. On CPUs without bf16 units (bench_precision) it runs ~25x slower.
Measured: peak resident set above the baseline (CUDA: max_memory_allocated), step time and its time per
completion token. Results: bench/results/<machine>/bench_frontier.{json,md,png}.
"""

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench._utils import machine_info, markdown_table, run_worker, worker_main, write_results

G, P = 8, 64
WATCH_S = 0.05


def _watchdog(limit_mib: float):
    """Stop this process (exit 3) once its resident set passes `limit_mib`."""
    from grpo_fast.trainer.memory import current_mib

    def watch():
        while True:
            if current_mib("cpu") > limit_mib:
                print(json.dumps({"over_budget": True, "error": f"resident set passed {limit_mib:.0f} MiB"}))
                os._exit(3)
            time.sleep(WATCH_S)

    threading.Thread(target=watch, daemon=True).start()


def measure_one(a: dict) -> dict:
    from bench.models import e2e as bench_e2e
    from grpo_fast.trainer.memory import current_mib

    bench_e2e._import_libraries()
    if not torch.cuda.is_available():
        _watchdog(current_mib("cpu") + 1.1 * a["budget_gb"] * 1024)
    return bench_e2e.measure_one(a)


def run(budget_gb: float, layers: int, start: int, max_length: int, precision: str = "fp32") -> dict:
    from bench.models.e2e import word_prompts
    from bench.models.memory import smollm2_shaped_dir

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = smollm2_shaped_dir(tmp / "model", layers)
        data = word_prompts(tmp / "prompts.jsonl", 16, P, 49152)
        common = dict(model_dir=str(model_dir), data=str(data), P=P, G=G, prompts_per_step=1, warmup=0,
                      steps=1, budget_gb=budget_gb)  # fmt: skip
        mp = precision == "bf16"
        providers = {
            "trl": dict(provider="trl_bf16" if mp else "trl", gradient_checkpointing=True, trl_micro_batch=1),
            "grpo_fast": dict(
                provider="grpo_fast_mp" if mp else "grpo_fast", budget_above_baseline_gb=budget_gb
            ),
        }
        for name, extra in providers.items():
            C = start
            while C <= max_length:
                t0 = time.time()
                res = run_worker("models.frontier", {**common, **extra, "C": C}, timeout=3600)
                row = dict(provider=name, C=C, wall_s=time.time() - t0)
                if "steps" in res:
                    peak = res["peak_mem_mb"]
                    row.update(peak_mib=peak, step_s=res["step_s"], generate_s=res["generate_s"],
                               train_s=res["train_s"], ms_per_token=1e3 * res["step_s"] / (G * C),
                               fits=peak <= budget_gb * 1024)  # fmt: skip
                else:
                    row.update(fits=False, note=res.get("error", "failed")[:160])
                rows.append(row)
                shown = {k: row.get(k) for k in ("provider", "C", "peak_mib", "step_s", "fits", "note")}
                print(
                    f"  {json.dumps(shown, default=lambda v: round(v, 1))}   ({row['wall_s']:.0f} s)",
                    flush=True,
                )
                if not row["fits"]:
                    break
                C *= 2
    largest = {
        name: max([r["C"] for r in rows if r["provider"] == name and r["fits"]], default=0)
        for name in providers
    }
    reached = {name: any(r["provider"] == name and not r["fits"] for r in rows) for name in providers}
    ratio = largest["grpo_fast"] / largest["trl"] if largest["trl"] else None
    both = [
        (t, o)
        for t in rows
        for o in rows
        if t["provider"] == "trl"
        and o["provider"] == "grpo_fast"
        and t["C"] == o["C"]
        and t["fits"]
        and o["fits"]
    ]
    time_ratio = max((o["ms_per_token"] / t["ms_per_token"] for t, o in both), default=None)
    return {
        "machine": machine_info(),
        "budget_gb": budget_gb,
        "precision": precision,
        "layers": layers,
        "G": G,
        "P": P,
        "rows": rows,
        "largest_completion_length": largest,
        "failed_within_range": reached,
        "frontier_completion_ratio_vs_trl": ratio,
        "worst_time_per_token_ratio_vs_trl": time_ratio,
    }


COLUMNS = [
    ("provider", "trainer"),
    ("C", "completion length"),
    ("fits", "fits"),
    ("peak_mib", "peak MiB above baseline"),
    ("step_s", "step s"),
    ("generate_s", "generation s"),
    ("train_s", "training s"),
    ("ms_per_token", "ms per completion token"),
    ("note", "note"),
]


def plot(payload: dict, path: Path) -> None:
    from grpo_fast.trainer.plotting import pyplot

    plt = pyplot(str(path))
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, color in (("trl", "#c44e52"), ("grpo_fast", "#4c72b0")):
        rs = [r for r in payload["rows"] if r["provider"] == name and "peak_mib" in r]
        ax1.plot([r["C"] for r in rs], [r["peak_mib"] / 1024 for r in rs], "o-", color=color, label=name)
        ax2.plot([r["C"] for r in rs], [r["ms_per_token"] for r in rs], "o-", color=color, label=name)
    ax1.axhline(payload["budget_gb"], color="gray", ls="--", label="budget")
    ax1.set(xscale="log", xlabel="completion length", ylabel="peak GiB above baseline", title="memory")
    ax2.set(xscale="log", xlabel="completion length", ylabel="ms per completion token", title="time")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"G={payload['G']}, SmolLM2-135M shape ({payload['layers']} layers), {payload['budget_gb']} GiB"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(payload: dict) -> str:
    largest, failed = payload["largest_completion_length"], payload["failed_within_range"]
    shown = {k: (f"{v}" if failed[k] else f">= {v} (not tried beyond)") for k, v in largest.items()}
    ratio = payload["frontier_completion_ratio_vs_trl"]
    tpt = payload["worst_time_per_token_ratio_vs_trl"]
    md = (
        f"# Memory frontier: longest completions within {payload['budget_gb']} GiB above the baseline\n\n"
        f"SmolLM2-135M-Instruct's shape and vocabulary with {payload['layers']} layers, random weights, G="
        f"{payload['G']}, one prompt of {payload['P']} tokens, {payload.get('precision', 'fp32')} (bf16: "
        "autocast on fp32 weights, TRL's bf16=True and our --bf16), one step per length. TRL: gradient "
        "checkpointing, micro-batches of one completion. grpo-fast: --max-memory-gb (baseline + budget).\n\n"
        f"Largest length that fits: TRL {shown['trl']}, grpo-fast {shown['grpo_fast']}"
        + (f" ({ratio:.0f}x)" if ratio else "")
        + (f"; where both fit, grpo-fast's time per token is at most {tpt:.2f}x TRL's" if tpt else "")
        + ".\n\n"
    )
    return md + markdown_table(payload["rows"], COLUMNS) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-gb", type=float, default=2.0, help="GiB above each process's baseline")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--start", type=int, default=256)
    ap.add_argument("--max-length", type=int, default=8192)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    payload = run(args.budget_gb, args.layers, args.start, args.max_length, args.precision)
    md = report(payload)
    name = "bench_frontier" + ("_bf16" if args.precision == "bf16" else "")
    out = write_results(name, payload, md, args.out_dir)
    plot(payload, out / f"{name}.png")
    print(md)
    print(f"results in {out}")


if __name__ == "__main__":
    if not worker_main(measure_one):
        main()
