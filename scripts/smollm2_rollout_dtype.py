"""SmolLM2-135M-Instruct learning with the bf16 rollout (corrected) vs the fp32 rollout: the same GRPO run
(chat prompts "What is a + b?", a, b in 2..30; reward 1 when the completion states the sum: bench_e2e's
real_reward), reward and mismatch per step, plot + table in bench/results/<machine>/rollout-dtype/.

    python scripts/smollm2_rollout_dtype.py [--steps 20] [--seeds 1] [--out bench/results/cpu/rollout-dtype]
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

RUN = dict(
    num_generations=8, prompts_per_step=4, max_prompt_length=64, max_completion_length=64,
    learning_rate=1e-5, loss_type="dapo", temperature=1.0, save_steps=0,
)  # fmt: skip


def run(dtype: str, seed: int, steps: int, model_dir: Path, data: Path, work: Path) -> list[dict]:
    d = work / f"smollm2-{dtype}-{seed}"
    opts = {**RUN, "max_steps": steps, "seed": seed, "rollout_dtype": dtype}
    cmd = [sys.executable, "-m", "grpo_fast.train", "--model", str(model_dir), "--dataset", str(data)]
    cmd += ["--reward", f"{ROOT / 'bench' / 'bench_e2e.py'}:real_reward", "--output-dir", str(d)]
    cmd += ["--overwrite-output-dir"] + [f"--{k.replace('_', '-')}={v}" for k, v in opts.items()]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    return [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if '"reward_mean"' in x]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seeds", default="1")
    ap.add_argument("--out", default="bench/results/cpu/rollout-dtype")
    ap.add_argument("--work", default="/tmp/smollm2-rollout-dtype")
    args = ap.parse_args()
    from bench._utils import cpu_line, machine_info
    from grpo_fast.smollm2 import build

    out, work = ROOT / args.out, Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    model_dir, data = build(), work / "sums.jsonl"
    rng = random.Random(0)
    with data.open("w") as f:
        for _ in range(400):
            a, b = rng.randint(2, 30), rng.randint(2, 30)
            msg = [{"role": "user", "content": f"What is {a} + {b}? Answer with the number."}]
            f.write(json.dumps({"prompt": msg, "answer": a + b}) + "\n")
    curves, rows = {}, []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for dtype in ("fp32", "bf16"):  # interleaved
            recs = run(dtype, seed, args.steps, model_dir, data, work)
            curves[f"{dtype}-{seed}"] = recs
            r = [x["reward_mean"] for x in recs]
            half = len(r) // 2
            rows.append(
                dict(
                    dtype=dtype,
                    seed=seed,
                    steps=len(recs),
                    first_half=statistics.mean(r[:half]),
                    second_half=statistics.mean(r[half:]),
                    step_std=statistics.pstdev(r),
                    k3_mean=statistics.mean(x.get("loss/sampling_k3", 0.0) for x in recs),
                    k3_max=max(x.get("loss/sampling_k3", 0.0) for x in recs),
                    masked=statistics.mean(x.get("loss/is_masked_fraction", 0.0) for x in recs),
                    gen_s=statistics.mean(x["time_generate_s"] for x in recs),
                    train_s=statistics.mean(x["time_train_s"] for x in recs),
                )  # fmt: skip
            )
            print(rows[-1], flush=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for name, recs in curves.items():
        color = "C0" if name.startswith("fp32") else "C3"
        steps = [x["step"] for x in recs]
        ax.plot(steps, [x["reward_mean"] for x in recs], color=color, alpha=0.8, label=name + " rollout")
        if name.startswith("bf16"):
            bx.plot(steps, [x.get("loss/sampling_k3", 0.0) for x in recs], color=color, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("reward mean (accuracy of the 32 samples)")
    ax.legend()
    bx.set_xlabel("step")
    bx.set_ylabel("mismatch: mean k3 of KL(engine || trainer)")
    bx.legend()
    fig.suptitle("SmolLM2-135M-Instruct GRPO: bf16 rollout (sequence_mask correction) vs fp32 rollout")
    fig.tight_layout()
    fig.savefig(out / "smollm2_reward.png", dpi=120)
    cols = (
        "| rollout | seed | steps | reward, first half | second half | step-to-step std | k3 mean | k3 max | "
        "masked fraction | generation s/step | training s/step |"
    )
    lines = [cols, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['dtype']} | {r['seed']} | {r['steps']} | {r['first_half']:.3f} | {r['second_half']:.3f} | "
            f"{r['step_std']:.3f} | {r['k3_mean']:.2e} | {r['k3_max']:.2e} | {r['masked']:.3f} | "
            f"{r['gen_s']:.1f} | {r['train_s']:.1f} |"
        )
    info = machine_info()
    run_line = ", ".join(f"{k}={v}" for k, v in RUN.items())
    md = (
        f"# SmolLM2-135M-Instruct: bf16 rollout vs fp32 rollout, {args.steps} GRPO steps\n\nMachine: "
        f"{cpu_line(info)}, commit {info['git_commit']}; {run_line}; runs interleaved.\n\n"
        + "\n".join(lines)
        + "\n\n![reward](smollm2_reward.png)\n"
    )
    (out / "smollm2_rollout_dtype.md").write_text(md)
    (out / "smollm2_rollout_dtype.json").write_text(json.dumps({"rows": rows, "curves": curves}, indent=1))
    print(md)


if __name__ == "__main__":
    main()
