"""The real-model task's held-out evaluator, independent of the training reward and of every trainer:
transformers' `generate` (greedy, fp32, left-padded batches) on the held-out split, each answer read by its
own rule (the last integer in the text), and the share of answers that end in an expression instead of a
number (a policy that learned to copy the question or box "19 + 61" shows there, not as accuracy); an answer
cut by the token budget mid-sum ("First, we add them: 61 + 33") is counted as cut, not as an expression.

    python -m grpo_fast.tasks.arithmetic_eval RUN_DIR [--checkpoint DIR] [--n-eval N] [--task TASK]

scores the base model and the run's last checkpoint (or --checkpoint), prints both and the gain, and writes
RUN_DIR/heldout_eval.json (`make demo-smollm2` ends with it). bench/learning/vs_trl.py scores every run's
saved weights, ours and TRL's, with the same class.

Nothing here is shared with the `integer_answer` reward (grpo_fast/rewards): the two read answers by different
rules, so a completion one of them misreads shows as a gap between the trainer's held-out figure and this one.
"""

import argparse
import json
import re
import statistics
import time
from pathlib import Path

from . import arithmetic, smollm2

TASKS = arithmetic.TASK_KINDS  # --task name -> its kinds of problem
_DIGITS = re.compile(r"\d+")
# an answer that ends in an expression: a boxed content with an operator, or an operator just before the last
# number with no "=" after it ("The answer is 19 + 61.", "23 + 4 x 6")
_BOXED_EXPR = re.compile(r"\\boxed\{[^{}]*(?:[+*/×x÷-]|\\times|\\cdot)[^{}]*\}")
_TRAILING_EXPR = re.compile(r"\d\s*(?:[+*/×x÷-]|\\times|\\cdot)\s*\d+[^\d=]*$")


def last_integer(text: str) -> int | None:
    """The last run of digits in the text (thousands commas joined), or None."""
    runs = _DIGITS.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", text))
    return int(runs[-1]) if runs else None


def ends_in_expression(text: str) -> bool:
    return bool(_BOXED_EXPR.search(text) or _TRAILING_EXPR.search(text.strip()))


class HeldOut:
    """Greedy held-out accuracy of saved weights on the task's eval split (`n_eval` problems, an equal share
    of each of the task's kinds; 0: all of them), with `max_new_tokens` as the runs' completion length.
    Calling it with a checkpoint directory (a `save_pretrained` one: model.safetensors) or None (the base
    model) gives accuracy, per kind, and the share of answers that are expressions."""

    def __init__(self, max_new_tokens: int, n_eval: int = 0, model_dir: str | None = None,
                 task: str = "smollm2"):  # fmt: skip
        if task not in TASKS:
            raise ValueError(f"task: one of {tuple(TASKS)} (the arithmetic tasks), got {task!r}")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.dir = model_dir or str(smollm2.build())
        self.tok = AutoTokenizer.from_pretrained(self.dir)
        self.tok.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(self.dir, dtype=torch.float32).eval()
        self.base = {k: v.clone() for k, v in self.model.state_dict().items()}
        rows = arithmetic.dataset_rows("eval", TASKS[task])
        kinds = sorted({r["kind"] for r in rows})
        per_kind = n_eval // len(kinds) if n_eval else None
        self.rows = [r for k in kinds for r in [x for x in rows if x["kind"] == k][:per_kind]]
        self.max_new_tokens = max_new_tokens

    def load(self, weights: str | None) -> None:
        from safetensors.torch import load_file

        saved = load_file(str(Path(weights) / "model.safetensors")) if weights else {}
        state = {**self.base, **saved}
        if self.model.config.tie_word_embeddings and "lm_head.weight" not in saved:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied: saved once, as the embedding
        self.model.load_state_dict(state)

    def answers(self) -> tuple[list[str], list[bool]]:
        """The greedy answers' texts, and whether each ended (EOS) within the token budget."""
        import torch

        texts, ended = [], []
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        for i in range(0, len(self.rows), 32):
            chunk = self.rows[i : i + 32]
            prompts = [self.tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
                       for r in chunk]  # fmt: skip
            enc = self.tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                ids = self.model.generate(
                    **enc, max_new_tokens=self.max_new_tokens, do_sample=False, pad_token_id=pad
                )
            new = ids[:, enc["input_ids"].shape[1] :]
            texts += self.tok.batch_decode(new, skip_special_tokens=True)
            ended += (new == self.tok.eos_token_id).any(dim=1).tolist()
        return texts, ended

    def __call__(self, weights: str | None) -> dict:
        self.load(weights)
        texts, ended = self.answers()
        hits = [float(last_integer(t) == int(r["answer"])) for t, r in zip(texts, self.rows)]
        expr = [float(e and ends_in_expression(t)) for t, e in zip(texts, ended)]
        out = {"accuracy": statistics.mean(hits), "expressions": statistics.mean(expr),
               "cut": 1.0 - statistics.mean(map(float, ended))}  # fmt: skip
        for kind in sorted({r["kind"] for r in self.rows}):
            out[kind] = statistics.mean(h for h, r in zip(hits, self.rows) if r["kind"] == kind)
        out["examples"] = texts[:: max(1, len(texts) // 8)][:8]  # a few answers, both kinds
        return out


def last_checkpoint(run_dir: Path) -> Path:
    found = sorted(run_dir.glob("checkpoint-*"), key=lambda d: int(d.name.split("-")[1]))
    if not found:
        raise SystemExit(f"{run_dir}: no checkpoint-* to evaluate")
    return found[-1]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "run_dir", type=Path, help="a `grpo-fast train --task smollm2[-two-step]` output directory"
    )
    ap.add_argument("--checkpoint", type=Path, default=None, help="weights to score (default: the last)")
    ap.add_argument("--n-eval", type=int, default=0, help="held-out problems (default: all of the task's)")
    ap.add_argument("--task", choices=tuple(TASKS), default=None,
                    help="the held-out problems of this task (default: the run's --task; needed for a run "
                    "trained on these problems through --dataset)")  # fmt: skip
    args = ap.parse_args(argv)
    ckpt = args.checkpoint or last_checkpoint(args.run_dir)
    config = json.loads((args.run_dir / "config.json").read_text())
    task = args.task or config.get("task", "smollm2")
    if task not in TASKS:
        raise SystemExit(f"{args.run_dir} was trained with --task {task} (or its own --dataset): name the "
                         f"held-out problems with --task, one of {', '.join(TASKS)}")  # fmt: skip
    t0 = time.perf_counter()
    ev = HeldOut(config["max_completion_length"], args.n_eval, config.get("model") or None, task)
    base, trained = ev(None), ev(str(ckpt))
    result = dict(checkpoint=str(ckpt), n_eval=len(ev.rows), max_new_tokens=ev.max_new_tokens, base=base,
                  trained=trained, gain=trained["accuracy"] - base["accuracy"],
                  seconds=time.perf_counter() - t0)  # fmt: skip
    (args.run_dir / "heldout_eval.json").write_text(json.dumps(result, indent=1))
    print(f"held-out, independent evaluator (transformers generate, greedy, last integer; {len(ev.rows)} "
          f"problems, {ev.max_new_tokens} new tokens):")  # fmt: skip
    for name, r in (("base", base), (ckpt.name, trained)):
        kinds = ", ".join(f"{k} {r[k]:.3f}" for k in TASKS[task])
        print(f"  {name:>14}: accuracy {r['accuracy']:.3f} ({kinds}), answers that are expressions "
              f"{r['expressions']:.3f}, cut by the budget {r['cut']:.3f}")  # fmt: skip
    print(f"  gain {result['gain']:+.3f}; written to {args.run_dir / 'heldout_eval.json'}")


if __name__ == "__main__":
    main()
