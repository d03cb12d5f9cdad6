"""`make demo` with the rollout in a bf16 copy of the policy vs the fp32 rollout, several seeds each: held-out
accuracy curves (plot + table) in bench/results/<machine>/rollout-dtype/.

    python scripts/demo_rollout_dtype.py [--seeds 1,2,3] [--out bench/results/cpu/rollout-dtype]
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(dtype: str, seed: int, out: Path) -> list[dict]:
    d = out / f"demo-{dtype}-{seed}"
    cmd = [
        sys.executable,
        "-m",
        "grpo_fast.train",
        "--output-dir",
        str(d),
        "--overwrite-output-dir",
        "--seed",
        str(seed),
        "--rollout-dtype",
        dtype,
        "--save-steps",
        "0",
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    return [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--out", default="bench/results/cpu/rollout-dtype")
    ap.add_argument("--work", default="/tmp/demo-rollout-dtype")
    args = ap.parse_args()
    out, work = ROOT / args.out, Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    curves, rows = {}, []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for dtype in ("model", "bf16"):  # interleaved
            recs = run(dtype, seed, work)
            ev = [(r["step"], r["eval_accuracy"]) for r in recs if "eval_accuracy" in r]
            steps = [r for r in recs if "loss" in r]
            k3 = [r.get("loss/sampling_k3", 0.0) for r in steps]
            curves[(dtype, seed)] = ev
            n = max(1, len(steps))
            rows.append(
                dict(
                    dtype="fp32" if dtype == "model" else dtype,
                    seed=seed,
                    steps=len(steps),
                    first=ev[0][1],
                    last=ev[-1][1],
                    best=max(a for _, a in ev),
                    k3_mean=sum(k3) / max(1, len(k3)),
                    k3_max=max(k3, default=0.0),
                    is_ratio_mean=sum(r.get("loss/is_ratio_mean", 1.0) for r in steps) / n,
                    gen_s=sum(r["time_generate_s"] for r in steps) / n,
                )
            )
            print(rows[-1], flush=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (dtype, seed), ev in curves.items():
        ax.plot(
            [s for s, _ in ev],
            [a for _, a in ev],
            color="C0" if dtype == "model" else "C3",
            alpha=0.8,
            label=None if seed != 1 else ("fp32" if dtype == "model" else dtype) + " rollout",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title("make demo: bf16 rollout (corrected) vs fp32 rollout, 3 seeds each")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "demo_accuracy.png", dpi=120)
    head = (
        "| rollout | seed | steps | accuracy before | after | best | mismatch k3 mean | k3 max | "
        "IS ratio mean | generation s/step |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        lines.append(
            f"| {r['dtype']} | {r['seed']} | {r['steps']} | {r['first']:.3f} | {r['last']:.3f} | "
            f"{r['best']:.3f} | {r['k3_mean']:.2e} | {r['k3_max']:.2e} | {r['is_ratio_mean']:.4f} | "
            f"{r['gen_s']:.2f} |"
        )
    sys.path.insert(0, str(ROOT))
    from bench._utils import cpu_line, machine_info

    info = machine_info()
    md = (
        f"# make demo: bf16 rollout vs fp32 rollout\n\nMachine: {cpu_line(info)}, "
        f"commit {info['git_commit']}; "
        "the embedded default (time budget 280 s each), seeds interleaved.\n\n"
        + "\n".join(lines)
        + "\n\n![accuracy](demo_accuracy.png)\n"
    )
    (out / "demo_rollout_dtype.md").write_text(md)
    (out / "demo_rollout_dtype.json").write_text(
        json.dumps({"rows": rows, "curves": {f"{d}-{s}": c for (d, s), c in curves.items()}}, indent=1)
    )
    print(md)


if __name__ == "__main__":
    main()
