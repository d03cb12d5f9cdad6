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
        if resume_step is not None and self.path.is_file():
            kept = [
                x for x in self.path.read_text().splitlines() if json.loads(x).get("step", 0) <= resume_step
            ]
            self.path.write_text("".join(x + "\n" for x in kept))
        self.fh = open(self.path, "a" if resume_step is not None else "w")
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

    def close(self):
        self.fh.close()
        if self.tb is not None:
            self.tb.close()
        if self.wb is not None:
            self.wb.finish()


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
    ax.set(xlabel="optimizer step", ylabel="reward / accuracy", title="GRPO training", ylim=(-0.02, 1.02))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True
