"""Peak memory of real training steps (`grpo-fast train`, a fresh process per configuration), per step and per
phase, beside `grpo-fast estimate`'s prediction for the same flags.

    python -m bench.models.memory [--layers 30] [--steps 3] [--configs a,b,...] [--out-dir DIR]

The model has SmolLM2-135M-Instruct's shape and vocabulary (Llama, hidden 576, 9/3 heads, vocabulary 49,152,
tied embeddings; `--layers` of its 30), random weights and a word-level tokenizer, so that every prompt is
exactly P tokens and completions (no EOS from random weights, in practice) run to C: the worst case a budget
has to hold. Measured: on CUDA `max_memory_allocated`, on the CPU the resident set's high-water mark (the
whole process: Python and torch included), each reset at the step's start (grpo_fast.trainer.memory).
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench._utils import machine_info, markdown_table, run_worker, worker_main, write_results

SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                     rms_norm_eps=1e-5, max_position_embeddings=8192)  # fmt: skip
BASE = dict(P=64, C=128, G=8, prompts_per_step=2)
# the four axes: full / LoRA, beta 0 / 0.04, gradient checkpointing off / on, sharing on / off
CONFIGS = {
    "full": dict(),
    "full_beta_gc_unshared": dict(beta=0.04, gradient_checkpointing=True, share_prefix=False),
    "lora_beta": dict(lora_r=16, beta=0.04),
    "lora_gc_unshared": dict(lora_r=16, gradient_checkpointing=True, share_prefix=False),
    "full_bf16_beta_c512": dict(dtype="bf16", beta=0.04, C=512),
    "full_gc_g16_c512": dict(gradient_checkpointing=True, G=16, C=512),
    # the precision recipes (grpo_fast.trainer.precision): bf16 weights with fp32 masters / a Kahan
    # compensation, bf16 autocast on fp32 weights, 8-bit AdamW states; and torch's unfused AdamW
    "full_bf16_master": dict(dtype="bf16"),
    "full_bf16_kahan": dict(dtype="bf16", optim="adamw_kahan"),
    "full_autocast_bf16": dict(bf16=True),
    "full_adamw_8bit": dict(optim="adamw_8bit"),
    "full_adamw_torch": dict(optim="adamw_torch"),
    # colocated asynchronous GRPO: the generation thread's copy of the weights, and the next batch's rollout
    # running through this step's training (the last step has no next batch: measure 3 steps or more)
    "full_async": dict(max_staleness=1),
}
# the recipes' rows (make bench-frontier and tests/test_estimate.py run them)
RECIPES = ["full", "full_bf16_master", "full_bf16_kahan", "full_autocast_bf16", "full_adamw_8bit"]


def smollm2_shaped_dir(out: Path, layers: int) -> Path:
    """A random-init model of SmolLM2-135M-Instruct's shape (`layers` decoder layers) with a word-level
    tokenizer, saved to out/ (built once)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.models.e2e import save_word_level

    if (out / "config.json").is_file():
        return out
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**SMOLLM2_SHAPE, "num_hidden_layers": layers}))
    return save_word_level(model, out)


def train_flags(model_dir: Path, data: Path, out: Path, c: dict, steps: int) -> list[str]:
    """`grpo-fast train` flags of one configuration (also what `grpo-fast estimate` is given)."""
    flags = ["--model", str(model_dir), "--dataset", str(data), "--output-dir", str(out),
             "--overwrite-output-dir", "--max-steps", str(steps), "--reward",
             f"{Path(__file__).resolve().parent / 'e2e.py'}:bench_reward",
             "--num-generations", str(c["G"]), "--prompts-per-step", str(c["prompts_per_step"]),
             "--max-completion-length", str(c["C"]), "--max-prompt-length", str(c["P"]),
             "--learning-rate", "1e-6", "--save-total-limit", "1"]  # fmt: skip
    for key in ("dtype", "beta", "lora_r", "gradient_accumulation_steps", "optim", "max_staleness"):
        if key in c:
            flags += ["--" + key.replace("_", "-"), str(c[key])]
    for key in ("gradient_checkpointing", "share_prefix", "bf16"):
        if key in c:
            flags.append(("--" if c[key] else "--no-") + key.replace("_", "-"))
    return flags


def measure_one(a: dict) -> dict:
    """Worker: train `steps` steps of one configuration; the per-step peaks from its metrics.jsonl."""
    from grpo_fast.trainer.config import parse_config
    from grpo_fast.trainer.memory import current_mib
    from grpo_fast.trainer.train import train

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.get("map_large"):
        from grpo_fast.trainer.memory import map_large_allocations

        map_large_allocations(device)
    base = current_mib(device)
    t0 = time.time()
    train(parse_config(a["flags"]))
    recs = [json.loads(x) for x in (Path(a["out"]) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "peak_mem_mb" in r]
    return {
        "start_mib": base,
        "peaks": [r["peak_mem_mb"] for r in steps],
        "rollout_peaks": [r["peak_mem_rollout_mb"] for r in steps],
        "train_peaks": [r["peak_mem_train_mb"] for r in steps],
        "step_s": [r["time_generate_s"] + r["time_reward_s"] + r["time_train_s"] for r in steps],
        "completion_len_mean": [r["completion_len_mean"] for r in steps],
        "completion_len_max": [r["completion_len_max"] for r in steps],
        "micro_batches": [r.get("micro_batches", 1) for r in steps],
        "wall_s": time.time() - t0,
        "memory_plan": json.loads((Path(a["out"]) / "config.json").read_text())["resolved"].get(
            "memory_plan"
        ),
    }


def estimate_of(flags: list[str], device: str) -> dict | None:
    """`grpo-fast estimate`'s peak and its parts for the same flags, in a fresh process as a user runs it (on
    a CPU its runtime part is that process's own resident set)."""
    return run_worker("models.memory", {"estimate": flags, "device": device})


def _worker(a: dict) -> dict:
    if "estimate" in a:
        from grpo_fast.trainer.estimate import estimate_from_flags

        return estimate_from_flags(a["estimate"], a["device"])
    return measure_one(a)


COLUMNS = [
    ("config", "configuration"),
    ("settings", "settings"),
    ("measured_mib", "measured peak MiB (largest step after the first)"),
    ("estimate_mib", "estimate MiB"),
    ("error_pct", "estimate error %"),
    ("rollout_mib", "rollout peak"),
    ("train_mib", "train peak"),
    ("step_s", "step s"),
    ("note", "note"),
]


def run(
    names,
    layers: int,
    steps: int,
    deadline=None,
    extra_flags=(),
    on_row=None,
    map_large: bool = False,
    overrides=None,
) -> dict:
    """Every configuration of `names` in its own process; rows with the estimate beside the measurement,
    each handed to `on_row` as it lands. map_large: on a CPU, the allocator as the trainer holds it under
    --max-memory-gb (grpo_fast.trainer.memory.map_large_allocations), else glibc's default. overrides:
    settings over every configuration's (e.g. a shorter C)."""
    import subprocess

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = smollm2_shaped_dir(tmp / "model", layers)
        from bench.models.e2e import word_prompts

        for name in names:
            c = {**BASE, **CONFIGS[name], **(overrides or {})}
            settings = ", ".join(f"{k}={v}" for k, v in c.items())
            if deadline is not None and time.time() > deadline - 30:
                rows.append(dict(config=name, settings=settings, note="skipped: out of time"))
                continue
            data = word_prompts(tmp / f"prompts_{c['P']}.jsonl", 64, c["P"], SMOLLM2_SHAPE["vocab_size"])
            flags = train_flags(model_dir, data, tmp / f"run_{name}", c, steps) + list(extra_flags)
            timeout = 1800 if deadline is None else max(30.0, deadline - time.time())
            t0 = time.time()
            try:
                res = run_worker(
                    "models.memory",
                    {"flags": flags, "out": str(tmp / f"run_{name}"), "map_large": map_large},
                    timeout=timeout,
                )
            except subprocess.TimeoutExpired:
                res = {"error": f"did not finish within {timeout:.0f} s"}
            row = dict(config=name, settings=settings, flags=flags, **res)
            if "peaks" in res and res["peaks"]:
                after_first = res["peaks"][1:] or res["peaks"]  # the first step's one-time costs left out
                last = res["peaks"].index(max(after_first), len(res["peaks"]) - len(after_first))
                row.update(measured_mib=res["peaks"][last], rollout_mib=res["rollout_peaks"][last],
                           train_mib=res["train_peaks"][last], step_s=res["step_s"][last])  # fmt: skip
                est = estimate_of(flags, device)
                if "peak_mib" in est:
                    row["estimate"] = est
                    row["estimate_mib"] = est["peak_mib"]
                    row["error_pct"] = 100 * (est["peak_mib"] / row["measured_mib"] - 1)
            else:
                row["note"] = f"error: {res.get('error', 'no steps')}"[:200]
            rows.append(row)
            if on_row is not None:
                on_row(row)
            shown = {k: row.get(k) for k in ("config", "measured_mib", "estimate_mib", "error_pct", "note")}
            print(f"  {json.dumps(shown, default=str)}   ({time.time() - t0:.0f} s)", flush=True)
    return {"machine": machine_info(), "layers": layers, "steps": steps, "device": device, "rows": rows}


def creep(steps: int, out_dir: Path | None, max_memory_gb: float = 0.0) -> dict:
    """`steps` steps of the real model (SmolLM2-135M-Instruct, chat prompts, completions of varying length:
    C=128, G=8, 2 prompts) in one process: each step's peak, and the largest after step 3 against step 3's;
    with `max_memory_gb`, under the trainer's plan for that budget (micro-batches packed from the real
    lengths: the peak is the plan's, not the batch's). Written as bench_memory_creep[_<budget>gb]."""
    from bench.models.e2e import build_real_work

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data, _ = build_real_work(Path(tmp), 64)
        c = dict(P=128, C=128, G=8, prompts_per_step=2)
        flags = train_flags(model_dir, data, Path(tmp) / "run", c, steps)
        flags[flags.index("--reward") + 1] = f"{Path(__file__).resolve().parent / 'e2e.py'}:real_reward"
        if max_memory_gb:
            flags += ["--max-memory-gb", str(max_memory_gb)]
        res = run_worker("models.memory", {"flags": flags, "out": str(Path(tmp) / "run")}, timeout=7200)
    if "peaks" not in res:
        raise SystemExit(f"creep run failed: {res.get('error')}")
    p = res["peaks"]
    growth = max(p[3:]) / p[2] - 1 if len(p) > 3 else 0.0
    payload = {"machine": machine_info(), "steps": steps, "settings": c, "max_memory_gb": max_memory_gb,
               **res, "growth_after_step3": growth,
               "change_after_step3": [min(p[3:]) / p[2] - 1, growth]}  # fmt: skip
    budget = f", --max-memory-gb {max_memory_gb:g}" if max_memory_gb else ""
    md = f"# Peak memory per step over {steps} steps (SmolLM2-135M-Instruct, chat prompts, C=128, G=8"
    md += f"{budget})\n\n"
    md += "| step | peak MiB | rollout peak | train peak | step s | mean / max completion length |\n"
    md += "|---|---|---|---|---|---|\n"
    cols = zip(p, res["rollout_peaks"], res["train_peaks"], res["step_s"], res["completion_len_mean"],
               res["completion_len_max"])  # fmt: skip
    for i, (a, b, t, s_, lm, lx) in enumerate(cols):
        md += f"| {i + 1} | {a:.0f} | {b:.0f} | {t:.0f} | {s_:.1f} | {lm:.0f} / {lx} |\n"
    lo = payload["change_after_step3"][0]
    md += f"\nPeaks after step 3 vs step 3: from {100 * lo:+.1f}% to {100 * growth:+.1f}%\n"
    write_results(
        "bench_memory_creep" + (f"_{max_memory_gb:g}gb" if max_memory_gb else ""), payload, md, out_dir
    )
    print(md)
    return payload


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30, help="decoder layers of SmolLM2's 30")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--creep", type=int, default=0, help="instead: N steps of SmolLM2, peak per step")
    ap.add_argument("--max-memory-gb", type=float, default=0.0, help="with --creep: the trainer's budget")
    ap.add_argument(
        "--map-large",
        action="store_true",
        help="CPU: the allocator as under --max-memory-gb (grpo_fast.trainer.memory)",
    )
    args = ap.parse_args(argv)
    if args.creep:
        creep(args.creep, args.out_dir, args.max_memory_gb)
        return
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: expected names from {', '.join(CONFIGS)}, got {unknown}")
    payload = run(names, args.layers, args.steps, map_large=args.map_large)
    payload["map_large"] = args.map_large
    md = f"# Peak memory of a training step: measured vs estimated ({payload['device']})\n\n"
    md += f"SmolLM2-135M-Instruct's shape with {args.layers} layers, {args.steps} steps per configuration"
    if args.map_large and payload["device"] == "cpu":
        md += "; allocator as under --max-memory-gb (allocations from 128 KiB mapped on their own)"
    md += ".\n\n"
    md += markdown_table(payload["rows"], COLUMNS) + "\n"
    out = write_results("bench_memory" + ("_mapped" if args.map_large else ""), payload, md, args.out_dir)
    print(md)
    print(f"results in {out}")


if __name__ == "__main__":
    if not worker_main(_worker):
        main()
