"""Shared-prefix vs unshared: training forward+backward and generation, on a random ~50M Qwen2-shaped model.

    python -m bench.models.prefix [--quick] [--full]

Training: time and peak memory of forward+backward of the completions' hidden states (the trainer's policy
pass) with each prompt run once per group (`shared_prefix_forward`) vs repeated G times. Generation: tokens/s
and prompt KV-cache bytes, prefilled once per prompt vs per sample. Each measurement in its own process.
"""

import argparse
import json
import sys
import time

import torch

from bench._utils import (
    RESULTS,
    cpu_line,
    machine_info,
    machine_name,
    markdown_table,
    measure,
    run_worker,
    worker_main,
    write_results,
)
from grpo_fast.trainer.plotting import pyplot

# (P, C, G): the default CPU subset of the grid P {128, 512, 2048} x C {64, 256} x G {4, 8, 16}
CPU_GRID = [(128, 64, 4), (512, 64, 4), (512, 64, 8), (512, 64, 16), (512, 256, 8), (2048, 64, 8)]
FULL_GRID = [(p, c, g) for p in (128, 512, 2048) for c in (64, 256) for g in (4, 8, 16)]
N_PROMPTS = 1


# Qwen2 shapes the benchmarks share (GQA; the larger ones with tied embeddings, as Qwen2.5)
QWEN2_SHAPES = {
    "tiny": dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    "50m": dict(vocab_size=32768, hidden_size=512, intermediate_size=1408, num_hidden_layers=10,
                num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True),
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
}  # fmt: skip


def make_model(size: str):
    """A random-init Qwen2ForCausalLM of one of QWEN2_SHAPES, SDPA attention, seed 0."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(**QWEN2_SHAPES[size], max_position_embeddings=4096)
    cfg._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(cfg)


def _inputs(P, C, G, V):
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(2, V, (N_PROMPTS, P), generator=g)
    prompt_mask = torch.ones(N_PROMPTS, P, dtype=torch.long)
    completion_ids = torch.randint(2, V, (N_PROMPTS * G, C), generator=g)
    completion_mask = torch.ones(N_PROMPTS * G, C, dtype=torch.long)
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def measure_one(a):
    from grpo_fast.rollout import generate_groups
    from grpo_fast.trainer.modeling import completion_hidden_states

    device = torch.device("cpu")
    model = make_model("tiny" if a["quick"] else "50m")
    V = model.config.vocab_size
    P, C, G, shared = a["P"], a["C"], a["G"], a["shared"]
    if a["kind"] == "train":
        batch = _inputs(P, C, G, V)
        model.train()

        def step():
            h = completion_hidden_states(model, *batch, share_prefix=shared)
            h.float().square().mean().backward()
            model.zero_grad(set_to_none=True)  # freed after the step: the next baseline holds inputs only

        res = measure(step, device, a["repeats"])
        res["tokens"] = N_PROMPTS * G * (P + C)
        res["tokens_per_s"] = res["tokens"] / (res["median_ms"] / 1e3)
        return res
    # generation: fixed length (no EOS), the KV of the prompt measured from the model's shapes
    model.eval()
    prompt_ids, prompt_mask, _, _ = _inputs(P, C, G, V)
    gen = torch.Generator().manual_seed(0)

    def step():
        generate_groups(
            model, prompt_ids, prompt_mask, G, C, temperature=1.0, share_prefix=shared, generator=gen
        )

    res = measure(step, device, a["repeats"])
    cfg = model.config
    kv_per_token = (
        2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    )
    res["prompt_kv_bytes"] = kv_per_token * P * (N_PROMPTS if shared else N_PROMPTS * G)
    res["completion_kv_bytes"] = kv_per_token * C * N_PROMPTS * G
    res["tokens_per_s"] = N_PROMPTS * G * C / (res["median_ms"] / 1e3)
    return res


COLUMNS = [
    ("kind", "kind"),
    ("P", "P"),
    ("C", "C"),
    ("G", "G"),
    ("shared", "shared"),
    ("median_ms", "median ms"),
    ("peak_mem_mb", "peak MiB"),
    ("tokens_per_s", "tokens/s"),
    ("speedup", "speedup"),
    ("theory", "token ratio G(P+C)/(P+GC)"),
    ("mem_ratio", "memory / unshared"),
    ("prompt_kv_bytes", "prompt KV bytes"),
    ("error", "error"),
]


def plot(rows, path):
    plt = pyplot(str(path))
    if plt is None:
        return

    train = [r for r in rows if r["kind"] == "train" and "error" not in r]
    labels = sorted({(r["P"], r["C"], r["G"]) for r in train})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = range(len(labels))
    for k, (key, title) in enumerate(
        [
            ("median_ms", "training fwd+bwd time (ms)"),
            ("peak_mem_mb", "training peak memory above inputs (MiB)"),
        ]
    ):
        for off, shared, name in ((-0.2, False, "unshared"), (0.2, True, "shared prefix")):
            vals = [
                next((r[key] for r in train if (r["P"], r["C"], r["G"]) == lab and r["shared"] == shared), 0)
                for lab in labels
            ]
            axes[k].bar([x + off for x in xs], vals, width=0.4, label=name)
        axes[k].set_xticks(list(xs), [f"P{p}\nC{c} G{g}" for p, c, g in labels], fontsize=8)
        axes[k].set(title=title)
        axes[k].legend()
        axes[k].grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="a tiny model and grid (smoke run)")
    ap.add_argument("--full", action="store_true", help="the whole P x C x G grid (slow on a CPU)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--points", default=None, help="training points P:C:G,... (default: the CPU grid)")
    ap.add_argument(
        "--kinds",
        default="train,generate",
        help="what to measure; rows of the other kind are kept from the last results file",
    )
    args = ap.parse_args(argv)
    kinds = args.kinds.split(",")
    grid = [(32, 8, 4), (64, 16, 8)] if args.quick else FULL_GRID if args.full else CPU_GRID
    if args.points:
        grid = [tuple(int(x) for x in pt.split(":")) for pt in args.points.split(",")]
    gen_point = (32, 8, 4) if args.quick else (512, 64, 8)
    jobs = [dict(kind="train", P=p, C=c, G=g) for p, c, g in grid] if "train" in kinds else []
    jobs += (
        [dict(kind="generate", P=gen_point[0], C=gen_point[1], G=gen_point[2])] if "generate" in kinds else []
    )
    name = "bench_prefix_quick" if args.quick else "bench_prefix"
    previous = RESULTS / machine_name() / f"{name}.json"
    rows = (
        [r for r in json.loads(previous.read_text())["rows"] if r["kind"] not in kinds]
        if previous.is_file()
        else []
    )
    for job in jobs:
        for shared in (False, True):
            args_ = dict(job, shared=shared, quick=args.quick, repeats=args.repeats)
            t0 = time.time()
            res = run_worker("models.prefix", args_)
            rows.append(dict(args_, **res))
            shown = res.get("error") or f"{res['median_ms']:.0f} ms, peak {res['peak_mem_mb']:.0f} MiB"
            print(
                f"  {job['kind']:<8} P={job['P']:<5} C={job['C']:<4} G={job['G']:<3} shared={shared!s:<5} "
                f"{shown}  ({time.time() - t0:.0f}s)",
                flush=True,
            )
    for r in rows:  # speedups against the unshared run of the same point
        base = next(
            (
                x
                for x in rows
                if x["kind"] == r["kind"]
                and (x["P"], x["C"], x["G"]) == (r["P"], r["C"], r["G"])
                and not x["shared"]
                and "error" not in x
            ),
            None,
        )
        if base and "error" not in r:
            r["speedup"] = base["median_ms"] / r["median_ms"]
            r["mem_ratio"] = r["peak_mem_mb"] / max(base["peak_mem_mb"], 1e-9)
            r["theory"] = (
                r["G"] * (r["P"] + r["C"]) / (r["P"] + r["G"] * r["C"]) if r["kind"] == "train" else None
            )
    info = machine_info()
    md = (
        f"# Shared prefix vs unshared ({'tiny' if args.quick else '~50M'} Qwen2-shaped model, fp32, "
        f"{N_PROMPTS} prompt per group)\n\nMachine: {cpu_line(info)}, torch "
        f"{info['versions']['torch']}, commit {info['git_commit']}.\n\n"
        + markdown_table(rows, COLUMNS)
        + "\n"
    )
    out = write_results(name, {"machine": info, "rows": rows}, md)
    plot(rows, out / f"{name}.png")
    print(md)
    print(f"wrote {out}/{name}.{{json,md,png}}")


if __name__ == "__main__":
    if not worker_main(measure_one):
        main(sys.argv[1:])
