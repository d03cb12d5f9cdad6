"""A run's log: metrics.jsonl (one JSON object per record; TensorBoard / W&B too when asked), its curves."""

import json
from pathlib import Path

from .plotting import pyplot


class MetricsLog:
    """metrics.jsonl (one JSON object per record), plus TensorBoard / W&B when asked and installed."""

    def __init__(self, out_dir: Path, report_to: str, cfg: dict, resume_step: int | None = None):
        """resume_step: continue a run's log, dropping records of steps after that checkpoint (they are
        redone)."""
        self.path = out_dir / "metrics.jsonl"
        self.fh = _open_log(self.path, resume_step)
        self.completions_path = out_dir / "completions.jsonl"  # --log-completions: opened at its first write
        self.resume_step, self.completions = resume_step, None
        if resume_step is None:  # a fresh run: no older run's samples beside its metrics
            self.completions_path.unlink(missing_ok=True)
        self.tb = self.wb = None
        if report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out_dir / "tensorboard"))
        elif report_to == "wandb":
            import wandb

            self.wb = wandb.init(project="grpo-fast", config=cfg, dir=str(out_dir))

    def write(self, record: dict) -> None:
        self.fh.write(json.dumps(record) + "\n")
        self.fh.flush()
        for k, v in record.items():
            if self.tb is not None and k != "step" and isinstance(v, (int, float)):
                self.tb.add_scalar(k, v, record["step"])
        if self.wb is not None:
            self.wb.log(record, step=record["step"])

    def write_completions(self, samples: list[dict]) -> None:
        """A logged step's samples (--log-completions), one JSON object each, into completions.jsonl."""
        if self.completions is None:
            self.completions = _open_log(self.completions_path, self.resume_step)
        self.completions.write("".join(json.dumps(x) + "\n" for x in samples))
        self.completions.flush()

    def close(self):
        self.fh.close()
        if self.completions is not None:
            self.completions.close()
        if self.tb is not None:
            self.tb.close()
        if self.wb is not None:
            self.wb.finish()


def _open_log(path: Path, resume_step: int | None):
    """A JSONL log for appending: a fresh run's afresh; a resumed run's without the records of steps after
    its checkpoint (they are redone)."""
    if resume_step is not None and path.is_file():
        kept = [x for x in path.read_text().splitlines() if json.loads(x).get("step", 0) <= resume_step]
        path.write_text("".join(x + "\n" for x in kept))
    return open(path, "a" if resume_step is not None else "w")


def print_completions(samples: list[dict], limit: int | None) -> None:
    """The first `limit` (None: all) of a step's samples, as TRL's log_completions prints them: prompt,
    completion (a multi-turn one's last message), each reward and the advantage."""
    for x in samples[:limit]:
        completion = x["completion"]
        if isinstance(completion, list):
            completion = completion[-1].get("content", "") if completion else ""
        scores = "  ".join(f"{k} {v:.3g}" for k, v in x["rewards"].items() if v is not None)
        print(f"--- step {x['step']}  {scores}  advantage {x['advantage']:.3g}\n[prompt] {x['prompt']}\n"
              f"[completion] {completion}", flush=True)  # fmt: skip


def plot_curves(metrics_path: Path, png: Path) -> bool:
    """Reward and held-out accuracy per step into `png`; False when matplotlib is not installed."""
    plt = pyplot(str(png))
    if plt is None:
        return False

    recs = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = [r for r in recs if "reward_mean" in r]
    evals = [r for r in recs if "eval_accuracy" in r]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if train:
        ax.plot(
            [r["step"] for r in train],
            [r["reward_mean"] for r in train],
            label="train reward (mean)",
            alpha=0.7,
        )
    if evals:
        ax.plot(
            [r["step"] for r in evals],
            [r["eval_accuracy"] for r in evals],
            "o-",
            label="held-out accuracy (greedy)",
        )
    sampled = [r for r in evals if "eval_sampled_accuracy" in r]
    for key, label in (("eval_sampled_accuracy", "held-out, sampled (pass@1)"), ("eval_pass_at_n", "pass@n")):
        if sampled:
            ax.plot([r["step"] for r in sampled], [r[key] for r in sampled], "s--", label=label, alpha=0.8)
    ax.set(xlabel="optimizer step", ylabel="reward / accuracy", title="GRPO training", ylim=(-0.02, 1.02))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True
