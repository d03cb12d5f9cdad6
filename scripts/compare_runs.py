"""The same GRPO run under different settings, side by side: learning curves (plot + table) and, with
--movement, how far each run moved the saved weights from the base on the bf16 grid.

    python scripts/compare_runs.py demo --compare precision [--seeds 1,2,3]
    python scripts/compare_runs.py demo --compare rollouts --seeds 1,2,3 --steps 300 \\
        --out bench/results/zen3/server
    python scripts/compare_runs.py demo-tools --compare async --seeds 1,2,3 --steps 100 \\
        --out bench/results/zen3/demo-tools
    python scripts/compare_runs.py smollm2 --compare precision [--steps 20] [--seeds 1]
    python scripts/compare_runs.py smollm2 --compare bf16-weights --movement --steps 12 --seeds 5 \\
        --set num_generations=4 prompts_per_step=2 max_completion_length=24

Workloads: `demo` (the embedded default, `make demo`; held-out greedy accuracy, 400 steps, no time budget so
every variant runs the same steps), `demo-tools` (the same with the calculator tool, `make demo-tools`),
`smollm2` (SmolLM2-135M-Instruct, chat prompts "What is a + b?", a, b in
2..30, reward 1 when the completion states the sum: bench_e2e's real_reward; reward per step).
Comparisons (each variant a set of `grpo-fast train` flags; runs interleaved by seed):
  rollout-dtype  fp32 rollout vs a bf16 copy of the policy (corrected)
  precision      fp32 vs --bf16 (bf16 autocast on fp32 master weights; rollouts in bf16, corrected)
  bf16-weights   fp32 weights vs --dtype bf16 with each optimizer's way of keeping updates
  rollouts       colocated (this process's engine) vs rollouts on a vLLM server (started per run on its own
                 core, the trainer on the others), synchronous and asynchronous (--max-staleness 1)
  async          colocated synchronous vs colocated asynchronous (--max-staleness 1: a thread samples a copy
                 of the weights while the trainer trains)
Writes bench/results/<machine>/<--out>/<workload>_<compare>.{md,json,png}.
"""

import argparse
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SERVER = ["--rollout", "vllm", "--vllm-mode", "server"]  # run() starts a server (grpo-fast serve's launcher)
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
COMPARISONS = {
    "rollout-dtype": {"fp32": ["--no-bf16"], "bf16 rollout": ["--no-bf16", "--rollout-dtype", "bf16"]},
    "precision": {"fp32": ["--no-bf16"], "bf16 mixed": ["--bf16"]},
    "rollouts": {
        "colocated": [],
        "server, synchronous": [*SERVER, "--max-staleness", "0"],
        "server, async S=1": [*SERVER, "--max-staleness", "1"],
    },
    "async": {"colocated": [], "colocated, async S=1": ["--max-staleness", "1"]},
    "bf16-weights": {
        "fp32": ["--no-bf16"],
        "bf16 weights + fp32 masters": ["--dtype", "bf16"],
        "bf16 weights + Kahan": ["--dtype", "bf16", "--optim", "adamw_kahan"],
        "bf16 weights + stochastic rounding": ["--dtype", "bf16", "--optim", "adamw_stochastic"],
    },
}
SMOLLM2_RUN = dict(
    num_generations=8, prompts_per_step=4, max_prompt_length=64, max_completion_length=64,
    learning_rate=1e-5, loss_type="dapo", temperature=1.0, save_steps=0,
)  # fmt: skip


HELD_OUT = ("demo", "demo-tools")  # workloads scored by held-out greedy accuracy
CURVE_KEYS = ("step", "eval_accuracy", "reward_mean", "loss", "loss/sampling_k3", "time_train_s")


def sums_dataset(path: Path) -> Path:
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(400):
            a, b = rng.randint(2, 30), rng.randint(2, 30)
            msg = [{"role": "user", "content": f"What is {a} + {b}? Answer with the number."}]
            f.write(json.dumps({"prompt": msg, "answer": a + b}) + "\n")
    return path


def workload_flags(workload: str, steps: int, work: Path, overrides: dict) -> tuple[list, str | None]:
    """(flags, model directory or None for the embedded default)."""
    if workload in HELD_OUT:
        flags = ["--time-budget-s", "0", "--save-steps", "0"] + (
            ["--task", "shop-tools"] if workload == "demo-tools" else []
        )
        flags += ["--max-steps", str(steps)] if steps else []
        return flags + [f"--{k.replace('_', '-')}={v}" for k, v in overrides.items()], None
    from grpo_fast.tasks.smollm2 import build

    model_dir = build()
    opts = {**SMOLLM2_RUN, "max_steps": steps or 20, **overrides}
    flags = ["--model", str(model_dir), "--dataset", str(sums_dataset(work / "sums.jsonl"))]
    flags += ["--reward", f"{ROOT / 'bench' / 'models' / 'e2e.py'}:real_reward"]
    return flags + [f"--{k.replace('_', '-')}={v}" for k, v in opts.items()], str(model_dir)


def run(flags: list, out: Path, model_dir: str | None = None) -> list[dict]:
    cmd = [sys.executable, "-m", "grpo_fast.trainer.train", *flags, "--output-dir", str(out)]
    cmd.append("--overwrite-output-dir")
    if "server" in flags and "--vllm-mode" in flags:
        proc = run_with_server(cmd, out, model_dir)
    else:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    (out / "command.json").write_text(json.dumps(flags))
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def run_with_server(cmd: list, out: Path, model_dir: str | None):
    """`cmd` against a vLLM server started for it on its own core (grpo-fast serve's launcher), the trainer
    on the others; the server stopped after."""
    import socket

    from grpo_fast.rollout.server import serve
    from grpo_fast.tasks import default_task

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server_cores, trainer_cores = serve.split_cores()
    out.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}-server.log", "w") as log, serve.launch(
        model_dir or str(default_task.ASSET_DIR), port=port, python=str(VLLM_PYTHON), cores=server_cores,
        max_model_len=512 if model_dir else 64, log=log,
    ) as url:  # fmt: skip
        cmd = [*cmd, "--vllm-server-base-url", url]
        if trainer_cores:
            cmd = ["taskset", "-c", trainer_cores, *cmd]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)


def finished(out: Path, flags: list) -> list[dict] | None:
    """The records of a run in `out` that ran these flags to its last step, else None."""
    try:
        cmd = json.loads((out / "command.json").read_text())
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        return None
    steps = json.loads((out / "config.json").read_text())["max_steps"]
    done = [r for r in recs if "loss" in r and r["step"] == steps]
    return recs if cmd == flags and done else None


def movement(run_dir: Path, base: dict) -> float:
    """Mean |saved - base| over every weight, both rounded to bf16 (as the issue measured it)."""
    import torch
    from safetensors.torch import load_file

    ckpt = sorted(run_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    saved = load_file(ckpt / "model.safetensors")
    total = n = 0
    for name, w in saved.items():
        d = (w.to(torch.bfloat16).double() - base[name].to(torch.bfloat16).double()).abs()
        total, n = total + d.sum().item(), n + d.numel()
    return total / n


def base_weights(model_dir: str | None) -> dict:
    from safetensors.torch import load_file

    from grpo_fast.tasks import default_task

    path = Path(model_dir) if model_dir else default_task.ASSET_DIR
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def summarize(workload: str, name: str, seed: int, recs: list[dict]) -> dict:
    steps = [r for r in recs if "loss" in r]
    n = max(1, len(steps))
    row = dict(variant=name, seed=seed, steps=len(steps),
               k3_mean=sum(r.get("loss/sampling_k3", 0.0) for r in steps) / n,
               masked=sum(r.get("loss/is_masked_fraction", 0.0) for r in steps) / n,
               gen_s=sum(r["time_generate_s"] for r in steps) / n,
               train_s=sum(r["time_train_s"] for r in steps) / n)  # fmt: skip
    if workload in HELD_OUT:
        ev = [r["eval_accuracy"] for r in recs if "eval_accuracy" in r]
        row.update(first=ev[0], last=ev[-1], best=max(ev))
    else:
        r = [x["reward_mean"] for x in steps]
        half = len(r) // 2
        row.update(first=statistics.mean(r[:half]), last=statistics.mean(r[half:]),
                   step_std=statistics.pstdev(r))  # fmt: skip
    return row


def plot(workload: str, names: list, curves: dict, path: Path, compare: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (name, seed), recs in curves.items():
        if workload in HELD_OUT:
            pts = [(r["step"], r["eval_accuracy"]) for r in recs if "eval_accuracy" in r]
        else:
            pts = [(r["step"], r["reward_mean"]) for r in recs if "reward_mean" in r]
        first = seed == min(s for n, s in curves if n == name)
        ax.plot([s for s, _ in pts], [a for _, a in pts], color=f"C{names.index(name)}", alpha=0.8,
                label=name if first else None)  # fmt: skip
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out greedy accuracy" if workload in HELD_OUT else "reward mean of the step's samples")
    ax.set_title(f"{workload}: {compare}, {len({s for _, s in curves})} seed(s) each")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", choices=("demo", "demo-tools", "smollm2"))
    ap.add_argument("--compare", choices=tuple(COMPARISONS), required=True)
    ap.add_argument("--seeds", default="1")
    ap.add_argument("--steps", type=int, default=0, help="optimizer steps (default: demo 400, smollm2 20)")
    ap.add_argument("--set", nargs="*", default=[], help="train fields to override, name=value")
    ap.add_argument("--movement", action="store_true", help="also the saved weights' movement from the base")
    ap.add_argument("--only", default="", help="comma-separated variants of the comparison (default: all)")
    ap.add_argument("--out", default="bench/results/zen3/precision")
    ap.add_argument("--work", default="/tmp/compare-runs")
    ap.add_argument("--reuse", action="store_true", help="keep finished runs found in --work (same flags)")
    args = ap.parse_args()
    from bench._utils import cpu_line, machine_info

    out, work = ROOT / args.out, Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    overrides = dict(kv.split("=", 1) for kv in args.set)
    flags, model_dir = workload_flags(args.workload, args.steps, work, overrides)
    base = base_weights(model_dir) if args.movement else None
    variants = COMPARISONS[args.compare]
    if args.only:
        variants = {n: variants[n] for n in args.only.split(",")}
    curves, rows = {}, []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name, extra in variants.items():  # interleaved
            d = work / f"{args.workload}-{args.compare}-{name.replace(' ', '_').replace('+', 'and')}-{seed}"
            recs = finished(d, flags + extra + ["--seed", str(seed)]) if args.reuse else None
            recs = recs or run(flags + extra + ["--seed", str(seed)], d, model_dir)
            curves[(name, seed)] = recs
            rows.append(summarize(args.workload, name, seed, recs))
            if base is not None:
                rows[-1]["movement"] = movement(d, base)
            print(rows[-1], flush=True)
    if base is not None:
        for r in rows:
            ref = next(x["movement"] for x in rows if x["seed"] == r["seed"] and x["variant"] == "fp32")
            r["movement_vs_fp32"] = r["movement"] / ref
    stem = f"{args.workload}_{args.compare.replace('-', '_')}"
    plot(args.workload, list(variants), curves, out / f"{stem}.png", args.compare)
    metric = ("held-out accuracy before", "after", "best") if args.workload in HELD_OUT else (
        "reward, first half", "second half", "step-to-step std")  # fmt: skip
    keys = ("first", "last", "best" if args.workload in HELD_OUT else "step_std")
    head = ["variant", "seed", "steps", *metric, "mismatch k3 mean", "masked fraction", "generation s/step",
            "training s/step"]  # fmt: skip
    head += ["weights moved (bf16 grid)", "/ fp32's"] if base is not None else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["variant"], r["seed"], r["steps"], *(f"{r[k]:.3f}" for k in keys), f"{r['k3_mean']:.2e}",
                 f"{r['masked']:.3f}", f"{r['gen_s']:.2f}", f"{r['train_s']:.2f}"]  # fmt: skip
        if base is not None:
            cells += [f"{r['movement']:.3g}", f"{r['movement_vs_fp32']:.3f}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    info = machine_info()
    md = (
        f"# {args.workload}: {args.compare}\n\n"
        f"Machine: {cpu_line(info)}, commit {info['git_commit']}; flags `{' '.join(flags)}` plus each "
        f"variant's: "
        + "; ".join(f"{n}: `{' '.join(f)}`" for n, f in variants.items())
        + ". Runs interleaved by seed.\n\n"
        + "\n".join(lines)
        + f"\n\n![curves]({stem}.png)\n"
    )
    (out / f"{stem}.md").write_text(md)
    payload = {"machine": info, "flags": flags, "rows": rows,
               "curves": {f"{n}-{s}": [{k: r[k] for k in CURVE_KEYS if k in r} for r in c]
                          for (n, s), c in curves.items()}}  # fmt: skip
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=1))
    print(md)


if __name__ == "__main__":
    main()
