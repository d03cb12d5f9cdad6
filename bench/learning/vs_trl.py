"""Learning against TRL, same everything: TRL 1.16's `GRPOTrainer` and `grpo-fast train` on
SmolLM2-135M-Instruct and the real-model task (`--task smollm2`: grpo_fast/tasks/arithmetic.py, its
`integer_answer` reward), with the same G, prompts per step, completion length, learning rate and schedule,
loss type, temperature and seeds; each run in its own process, one at a time.

    python -m bench.learning.vs_trl [--seeds 1,2,3] [--steps 30] [--eval-every 5]
        [--rows trl,ours,ours_fastest] [--set num_generations=8 prompts_per_step=4 ...]
        [--task smollm2|smollm2-two-step] [--time-budget-s S]
        [--out bench/results/<machine>] [--work DIR --reuse]

Rows: `trl` (TRL at its defaults for what is not shared: bf16=True, HF generate), `ours` (`grpo-fast train` at
its defaults: the precision this machine measured faster), `ours_fastest` (plus `--max-staleness 1
--rollout-dtype bf16`: both corrected by TRL's rollout-mismatch correction), and for diagnoses
`ours_uncorrected` (the defaults without the mismatch correction, as TRL's HF-generate path runs) and
`ours_fp32` (`--no-bf16`: fp32 training and rollouts).

`--task smollm2-two-step` runs the word problems alone at their preset (128-token completions) and
writes into <out>/learning-smollm2-two-step/. `--time-budget-s` stops each run when its steps' seconds reach
it (ours: its own --time-budget-s; TRL: a callback on the same clock), so both trainers get the same time:
--steps is then a ceiling.

Per step: the mean reward of the step's own samples (fresh training prompts) and the step's seconds
(generation, reward, training; no evaluation or checkpoint). Every --eval-every steps each run saves its
weights; one evaluator outside every trainer and independent of the training reward
(grpo_fast/tasks/arithmetic_eval.py: transformers' `generate`, greedy, fp32, the last integer of the answer,
and the share of answers that are expressions) scores them on the held-out split, so both trainers are judged
by the same code. One checkpoint's greedy accuracy swings by +-0.1 between evaluations a few steps apart, so a
run's held-out figure is the mean of its evaluations after the first half of the steps ("late").
Our rows also report the rollout mismatch the trainer measured (median over steps of the mean |log-prob
difference| per token and of the sequence-level correction's extreme ratios). Each scored run is kept in
--work as <row>-<seed>.json (<row>-<seed>-<task> for a task other than smollm2); --reuse takes those with the
same settings (seeds added later, or another day).
Writes learning_vs_trl.{md,json,png} and puts the summary keys into summary.json of --out (replacing every
earlier learning_* key there):
  learning_heldout_gain_strict   ours: late held-out accuracy minus at step 0, mean over seeds (and
                                 *_trl, *_fastest; *_se: the standard error over seeds)
  learning_heldout_gap_vs_trl_in_se   (ours - TRL) in held-out gain over the s.e. of the difference
  learning_heldout_expressions_max    the largest share of held-out answers that are expressions, any run
  learning_per_step_gap_vs_trl   mean over steps of |ours - TRL| in the step's mean reward, each the mean over
                                 seeds
  learning_seed_spread           the same statistic between TRL's own seeds (mean over pairs of seeds)
  learning_pair_gap_vs_trl       the like-for-like figure: the step-mean |ours seed i - TRL seed j| over all
                                 pairs, against learning_seed_spread
  learning_wall_speedup_vs_trl   TRL's seconds per step over ours' (medians over all steps of all seeds), and
                                 *_fastest for the fastest row
"""

import argparse
import itertools
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from grpo_fast.tasks.arithmetic_eval import TASKS, HeldOut  # noqa: E402

# our rows: the flags each adds to the shared settings
OUR_ROWS = {
    "ours": [],
    "ours_fastest": ["--max-staleness", "1", "--rollout-dtype", "bf16"],
    "ours_uncorrected": ["--no-vllm-importance-sampling-correction"],  # diagnoses: the correction off,
    "ours_fp32": ["--no-bf16"],  # fp32 training and rollouts (exact: nothing to correct)
}
ROW_TITLES = {
    "trl": "TRL 1.16 GRPOTrainer (its defaults: bf16=True)",
    "ours": "grpo-fast (its defaults)",
    "ours_fastest": "grpo-fast, fastest (--max-staleness 1 --rollout-dtype bf16)",
    "ours_uncorrected": "grpo-fast, no mismatch correction (--no-vllm-importance-sampling-correction)",
    "ours_fp32": "grpo-fast in fp32 (--no-bf16)",
}
SHARED = (
    "num_generations", "prompts_per_step", "max_completion_length", "learning_rate", "lr_scheduler_type"
)  # fmt: skip
# settings added after runs were kept: a kept run without them ran at these
LATER_SETTINGS = dict(task="smollm2", time_budget_s=0.0)


def shared_settings(task: str, steps: int, budget_s: float, overrides: dict) -> dict:
    """What both trainers run with: the task's preset, the loss and sampling settings TRL and we default to,
    and --set overrides (strings, as flags)."""
    from grpo_fast.trainer.config import TASK_PRESETS

    s = {k: TASK_PRESETS[task][k] for k in SHARED}
    s.update(loss_type="dapo", beta=0.0, temperature=1.0, max_grad_norm=1.0, max_steps=steps)
    for k, v in overrides.items():
        if k in LATER_SETTINGS:
            raise SystemExit(f"--set {k}: give it as --{k.replace('_', '-')}")
        s[k] = type(s[k])(v) if k in s else v
    return dict(s, task=task, time_budget_s=budget_s)


# ---------------------------------------------------------------------------------------------------------
# The runs, each in its own process
# ---------------------------------------------------------------------------------------------------------
def run_ours(extra: list, s: dict, seed: int, eval_every: int, out: Path) -> dict:
    flags = ["--seed", str(seed), "--eval-steps", "0", "--eval-max-samples", "0",
             "--save-steps", str(eval_every), "--save-total-limit", "1000",
             "--output-dir", str(out), "--overwrite-output-dir"]  # fmt: skip
    flags += [f"--{k.replace('_', '-')}={v}" for k, v in s.items()] + extra
    proc = subprocess.run([sys.executable, "-m", "grpo_fast.train", *flags], cwd=ROOT, capture_output=True,
                          text=True)  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"grpo-fast train {' '.join(flags)} failed:\n{proc.stderr[-3000:]}")
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [
        dict(step=r["step"], reward=r["reward_mean"], seconds=r["time_generate_s"] + r["time_reward_s"]
             + r["time_train_s"] + r.get("time_sync_s", 0.0))
        for r in recs if "loss" in r
    ]  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    weights = {int(d.name.split("-")[1]): str(d) for d in out.glob("checkpoint-*")}
    mismatch = {k: statistics.median(r[f"loss/{k}"] for r in recs if f"loss/{k}" in r)
                for k in ("sampling_logp_diff_mean", "is_ratio_min", "is_ratio_max")
                if any(f"loss/{k}" in r for r in recs)}  # fmt: skip
    return dict(steps=steps, weights=weights, flags=flags, mismatch=mismatch,
                precision=dict(bf16=config["bf16"], rollout_dtype=config["rollout_dtype"]))  # fmt: skip


def run_trl(s: dict, seed: int, eval_every: int, out: Path) -> dict:
    args = json.dumps(dict(settings=s, seed=seed, eval_every=eval_every, out=str(out)))
    proc = subprocess.run([sys.executable, "-m", "bench.learning.vs_trl", "--trl-worker", args], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"the TRL run failed:\n{proc.stderr[-3000:]}")
    r = json.loads((out / "trl_run.json").read_text())
    r["weights"] = {int(k): v for k, v in r["weights"].items()}  # JSON's keys are strings
    return r


def trl_worker(a: dict) -> None:
    """One TRL run (in its own process): the same rows and reward as ours, its step clock, weights saved every
    eval_every steps."""
    import warnings

    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback

    from grpo_fast.rewards import load_reward
    from grpo_fast.tasks import smollm2, task_rows
    from grpo_fast.trainer.config import TASK_PRESETS
    from grpo_fast.trainer.modeling import load_tokenizer

    warnings.simplefilter("ignore", FutureWarning)
    s, out, every = a["settings"], Path(a["out"]), a["eval_every"]
    model_dir = str(smollm2.build())
    steps = []

    class Clock(TrainerCallback):  # first in the list: the clock stops before the weights are saved
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            steps.append(dict(step=state.global_step, seconds=time.perf_counter() - self.t0))
            if s["time_budget_s"] and sum(x["seconds"] for x in steps) >= s["time_budget_s"]:
                control.should_training_stop = True  # as ours stops: after the step that reached it

    class Saver(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            if (
                state.global_step % every == 0
                or state.global_step == s["max_steps"]
                or control.should_training_stop
            ):
                model.save_pretrained(out / f"checkpoint-{state.global_step}", safe_serialization=True)

    torch.manual_seed(a["seed"])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = s["num_generations"] * s["prompts_per_step"]
    config = trl.GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        num_generations=s["num_generations"], max_completion_length=s["max_completion_length"],
        learning_rate=s["learning_rate"], lr_scheduler_type=s["lr_scheduler_type"],
        max_grad_norm=s["max_grad_norm"], loss_type=s["loss_type"],
        beta=s["beta"], temperature=s["temperature"], max_steps=s["max_steps"], seed=a["seed"],
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=[load_reward(r) for r in TASK_PRESETS[s["task"]]["reward"]], args=config,
        train_dataset=Dataset.from_list(task_rows(s["task"])[0]),
        processing_class=load_tokenizer(model_dir), callbacks=[Clock(), Saver()],
    )  # fmt: skip
    trainer.train()
    rewards = {r["step"]: r["reward"] for r in trainer.state.log_history if "reward" in r}
    for st in steps:
        st["reward"] = rewards[st["step"]]
    weights = {int(d.name.split("-")[1]): str(d) for d in out.glob("checkpoint-*")}
    (out / "trl_run.json").write_text(json.dumps(dict(steps=steps, weights=weights, precision=dict(
        bf16=config.bf16, rollout="HF generate, the training model"))))  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# Statistics, table, plot
# ---------------------------------------------------------------------------------------------------------
def mean_curve(runs: list[dict]) -> list[float]:
    n = min(len(r["steps"]) for r in runs)
    return [statistics.mean(r["steps"][i]["reward"] for r in runs) for i in range(n)]


def curve_gap(a: list[float], b: list[float]) -> float:
    return statistics.mean(abs(x - y) for x, y in zip(a, b))


def late_heldout(run: dict) -> float:
    """The mean held-out accuracy of a run's evaluations after the first half of its steps."""
    last = run["heldout"][-1][0]
    return statistics.mean(acc for step, acc in run["heldout"] if step > last / 2)


def heldout_gain(runs: list[dict]) -> tuple[float, float]:
    """(mean over seeds of late held-out minus step 0, its standard error over seeds)."""
    gains = [late_heldout(r) - r["heldout"][0][1] for r in runs]
    se = statistics.stdev(gains) / len(gains) ** 0.5 if len(gains) > 1 else float("nan")
    return statistics.mean(gains), se


def summarize(results: dict) -> dict:
    trl = results["trl"]
    pairs = list(itertools.combinations(trl, 2))
    single = lambda r: [s["reward"] for s in r["steps"]]  # noqa: E731
    step_s = lambda runs: statistics.median(s["seconds"] for r in runs for s in r["steps"])  # noqa: E731
    summary = {
        "learning_seed_spread": statistics.mean(curve_gap(single(a), single(b)) for a, b in pairs)
        if pairs
        else float("nan"),  # one seed: no spread to compare with
    }
    gain_trl, se_trl = heldout_gain(trl)
    summary["learning_heldout_gain_strict_trl"] = gain_trl
    summary["learning_heldout_gain_strict_trl_se"] = se_trl
    for row, runs in results.items():  # ours: the keys as named; our other rows suffixed (_fastest, ...)
        if row == "trl" or not runs:
            continue
        tail = row.removeprefix("ours")
        gain, se = heldout_gain(runs)
        summary[f"learning_heldout_gain_strict{tail}"] = gain
        summary[f"learning_heldout_gain_strict{tail}_se"] = se
        # the gap held out in standard errors of the difference (negative: ours below TRL)
        summary[f"learning_heldout_gap_vs_trl_in_se{tail}"] = (gain - gain_trl) / math.hypot(se, se_trl)
        summary[f"learning_per_step_gap_vs_trl{tail}"] = curve_gap(mean_curve(runs), mean_curve(trl))
        summary[f"learning_pair_gap_vs_trl{tail}"] = statistics.mean(
            curve_gap(single(a), single(b)) for a in runs for b in trl
        )
        summary[f"learning_wall_speedup_vs_trl{tail}"] = step_s(trl) / step_s(runs)
    # answers that are expressions instead of numbers, at any evaluation of any run (should be ~0)
    summary["learning_heldout_expressions_max"] = max(
        d["expressions"] for runs in results.values() for r in runs for d in r["heldout_detail"]
    )
    return summary


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for i, (row, runs) in enumerate(results.items()):
        color = f"C{i}"
        for j, r in enumerate(runs):
            steps = [s["step"] for s in r["steps"]]
            reward = [s["reward"] for s in r["steps"]]
            wall = list(itertools.accumulate(s["seconds"] for s in r["steps"]))
            label = ROW_TITLES[row] if j == 0 else None
            axes[0].plot(steps, reward, color=color, alpha=0.35, lw=1)
            axes[1].plot(wall, reward, color=color, alpha=0.35, lw=1, label=label)
            at, acc = zip(*r["heldout"])
            axes[2].plot(at, acc, color=color, alpha=0.6, marker="o", label=label)
        curve = mean_curve(runs)
        axes[0].plot(range(1, len(curve) + 1), curve, color=color, lw=2.5, label=f"{ROW_TITLES[row]}: mean")
    axes[0].set(xlabel="optimizer step", ylabel="mean reward of the step's samples", title="per step")
    axes[1].set(xlabel="seconds (generation + reward + training)", ylabel="mean reward", title="per second")
    axes[2].set(xlabel="optimizer step", ylabel="held-out greedy accuracy", title="held-out (one evaluator)")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(payload: dict) -> str:
    from bench._utils import cpu_line

    s, summary = payload["settings"], payload["summary"]
    task = {**LATER_SETTINGS, **s}["task"]
    kinds = TASKS[task]
    head = ["row", "seed", "held-out step 0", "held-out late", "held-out last",
            *(f"{k} (last)" for k in kinds), "expressions (last)", "reward, first quarter",
            "reward, last quarter", "steps", "s/step (median)", "precision", "rollout mismatch"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row, runs in payload["results"].items():
        for r in runs:
            rew = [x["reward"] for x in r["steps"]]
            q = max(1, len(rew) // 4)
            last = r["heldout_detail"][-1]
            step_s = statistics.median(x["seconds"] for x in r["steps"])
            mm = r.get("mismatch") or {}
            mismatch = (f"{mm['sampling_logp_diff_mean']:.3f}/token, ratio {mm['is_ratio_min']:.2f}-"
                        f"{mm['is_ratio_max']:.2f}" if "is_ratio_min" in mm else "-")  # fmt: skip
            lines.append(
                f"| {ROW_TITLES[row]} | {r['seed']} | {r['heldout'][0][1]:.3f} | {late_heldout(r):.3f} | "
                f"{r['heldout'][-1][1]:.3f} | "
                + "".join(f"{last[k]:.3f} | " for k in kinds)
                + f"{last['expressions']:.3f} | {statistics.mean(rew[:q]):.3f} | "
                f"{statistics.mean(rew[-q:]):.3f} | {len(rew)} | {step_s:.2f} | "
                f"{json.dumps(r['precision'])} | {mismatch} |"
            )
    keys = "\n".join(f"- `{k}`: " + (f"{v:.4g}" if v is not None else "- (needs two seeds or more)")
                     for k, v in summary.items())  # fmt: skip
    return (
        f"# Learning against TRL: SmolLM2-135M-Instruct on the real-model task (--task {task})\n\n"
        f"`{payload['command']}`. Shared: `{json.dumps(s)}`; {len(payload['seeds'])} seeds each, runs one "
        "at a time, interleaved by seed. Held-out: "
        f"{payload['n_eval']} problems of grpo_fast/tasks/arithmetic.py's eval split, greedy, scored by one "
        "evaluator (transformers' generate, fp32) on each run's saved weights; late: the mean of a run's "
        "evaluations after the first half of the steps; its answer is the last integer it states (not the "
        "training reward: grpo_fast/tasks/arithmetic_eval.py), and expressions is the share of answers that "
        "end in an expression. Rollout mismatch (ours): the trainer's median over "
        "steps of the mean |log-prob difference| per token between the rollout and the training forward, and "
        "of the smallest and largest sequence-level correction ratio.\n\n"
        + "\n".join(lines)
        + f"\n\nSummary (summary.json):\n{keys}\n\n![curves](learning_vs_trl.png)\n\n"
        f"Machine: {cpu_line(payload['machine'])}, commit {payload['machine'].get('git_commit')}.\n"
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument(
        "--n-eval", type=int, default=0, help="held-out problems, an equal share of each kind (0: all)"
    )
    ap.add_argument("--rows", default="trl,ours,ours_fastest")
    ap.add_argument("--set", nargs="*", default=[], help="shared settings to override, name=value")
    ap.add_argument("--task", default="smollm2", choices=tuple(TASKS), help="the task and its preset")
    ap.add_argument("--time-budget-s", type=float, default=0.0,
                    help="stop each run when its steps' seconds reach this (0: --steps steps)")  # fmt: skip
    ap.add_argument("--out", default="", help="results folder (default bench/results/<machine>)")
    ap.add_argument("--work", default="/tmp/learning-vs-trl")
    ap.add_argument("--reuse", action="store_true", help="take runs already scored in --work (same settings)")
    ap.add_argument("--trl-worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.trl_worker:
        return trl_worker(json.loads(args.trl_worker))
    from bench._utils import RESULTS, machine_info, machine_name

    s = shared_settings(args.task, args.steps, args.time_budget_s, dict(kv.split("=", 1) for kv in args.set))
    rows, seeds = args.rows.split(","), [int(x) for x in args.seeds.split(",")]
    if "trl" not in rows or not set(rows) & set(OUR_ROWS) or not set(rows) <= {"trl", *OUR_ROWS}:
        raise SystemExit(f"--rows: trl and one or more of {', '.join(OUR_ROWS)} (the summary compares them)")
    work, out = Path(args.work), Path(args.out) if args.out else RESULTS / machine_name()
    if args.task != "smollm2":  # the machine folder's summary keys are the main task's
        out = out / f"learning-{args.task}"
    work.mkdir(parents=True, exist_ok=True)
    evaluator = HeldOut(s["max_completion_length"], args.n_eval, task=args.task)
    base = evaluator(None)
    results = {row: [] for row in rows}
    for seed in seeds:
        for row in rows:
            name = f"{row}-{seed}" + ("" if args.task == "smollm2" else f"-{args.task}")
            d, record = work / name, work / f"{name}.json"
            if (
                args.reuse
                and record.is_file()
                and {**LATER_SETTINGS, **json.loads(record.read_text())["settings"]} == s
            ):
                results[row].append(json.loads(record.read_text())["run"])
                continue
            shutil.rmtree(d, ignore_errors=True)
            t0 = time.perf_counter()
            if row == "trl":
                r = run_trl(s, seed, args.eval_every, d)
            else:
                r = run_ours(OUR_ROWS[row], s, seed, args.eval_every, d)
            r["process_s"] = time.perf_counter() - t0
            scored = {step: evaluator(w) for step, w in sorted(r.pop("weights").items())}
            r["heldout"] = [(0, base["accuracy"])] + [(k, v["accuracy"]) for k, v in scored.items()]
            r["heldout_detail"] = [base] + list(scored.values())
            r["seed"] = seed
            shutil.rmtree(d, ignore_errors=True)  # checkpoints: gigabytes a run
            record.write_text(json.dumps(dict(settings=s, run=r)))  # a later --reuse takes it
            results[row].append(r)
            step_s = statistics.median(x["seconds"] for x in r["steps"])
            print(row, seed, r["heldout"], f"{step_s:.2f} s/step", flush=True)
    command = "python -m bench.learning.vs_trl " + " ".join(sys.argv[1:] if argv is None else argv)
    payload = dict(command=command, settings=s, seeds=seeds, n_eval=len(evaluator.rows),
                   machine=machine_info(), results=results)  # fmt: skip
    # JSON has no NaN: a figure that needs two seeds or more is null with one
    payload["summary"] = {k: v if math.isfinite(v) else None for k, v in summarize(results).items()}
    out.mkdir(parents=True, exist_ok=True)
    plot(results, out / "learning_vs_trl.png", f"SmolLM2-135M-Instruct, --task {args.task}: TRL vs grpo-fast")
    (out / "learning_vs_trl.json").write_text(json.dumps(payload, indent=1))
    md = render(payload)
    (out / "learning_vs_trl.md").write_text(md)
    summary_file = out / "summary.json"
    merged = {"machine": payload["machine"]}
    if summary_file.is_file():  # every learning_* key is this run's (earlier tasks' keys would mislead)
        earlier = json.loads(summary_file.read_text())
        merged = {k: v for k, v in earlier.items() if not k.startswith("learning_")}
    merged.update(payload["summary"])
    summary_file.write_text(json.dumps(merged, indent=2))
    print(md)


if __name__ == "__main__":
    main()
