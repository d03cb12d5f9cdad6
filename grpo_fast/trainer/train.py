"""GRPO training loop, top to bottom.

Variant: GRPO (DeepSeekMath) with TRL 1.16 GRPOTrainer semantics. Per step: sample G completions for each of
`prompts_per_step` prompts; score them with the reward functions (weighted sum, None = no opinion); advantages
`(r - group mean) / (group std + eps)` (or batch std, or unscaled: `scale_rewards`); then `num_iterations`
AdamW updates on the clipped probability-ratio loss, two-sided clip [1 - epsilon, 1 + epsilon_high], token-
or sequence-level (GSPO) ratios, optional k3 KL to the reference model (beta), normalized as `loss_type`
(default "dapo": summed over tokens, divided by the active tokens of the whole step), or any other loss type
of TRL 1.16 (cispo, sapo, luspo, vespo) with its options (delta, the off-policy mask, the entropy mask and
bonus). With num_iterations 1 the update is on-policy (ratio 1, old log-probs never computed). The rollout
engine's log-probs of its samples travel to the loss: their mismatch to the trainer's is logged every step,
and for an engine that is not the training forward (vLLM) TRL's importance-sampling correction (default
sequence_mask, clip 3) multiplies each sample's loss. Log-probs come from the model's last hidden
state and LM head through `fused_linear_grpo_loss`: the (tokens x vocab) logits are never materialized.
Under torchrun (DDP or FSDP2, `distributed.py`) each rank takes whole groups of the same global batch;
advantages and the dapo normalizer are the global batch's, so a step equals the single-process step.

The loop reads as its phases (grpo_fast/trainer/step.py): rollout -> rewards and group advantages ->
optimization -> log; `setup` (grpo_fast/trainer/setup.py) builds the run (model, data, rewards, optimizer,
resume) and `finish` ends it (final eval, checkpoint, plot).

    python -m grpo_fast.train [--flag value ...]      (or: grpo-fast train ...)
"""

import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

from ..rollout.server import ServerError
from . import checkpoint as ckpt_mod
from . import rollouts
from .config import GRPOConfig, generation_steps, parse_config, to_dict
from .distributed import (
    DistInfo,
    all_sum,
    barrier,
    device_of,
    full_model_state,
    full_optimizer_state,
    shutdown,
)
from .evaluate import evaluate
from .log import plot_curves, print_completions
from .memory import peak_mib, release_free_memory, reset_peak
from .setup import Run, setup
from .step import completion_samples, encode_prompts, optimize, rollout, score_rollout, step_record
from .stopping import Stopping

__all__ = ["train", "main", "encode_prompts"]


# --------------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------------
def train(cfg: GRPOConfig) -> dict:
    run = setup(cfg)
    if run.eval_rows and run.step == 0:
        evaluate_and_log(run)
        if run.dist.main:
            print(f"step 0: held-out {eval_line(run.last_eval)}", flush=True)
    bar = tqdm(total=cfg.max_steps, initial=run.step, desc="grpo", dynamic_ncols=True,
               disable=None if run.dist.main else True)  # fmt: skip
    with run.signals.install() as signals, serving(run):
        stopped = False
        while run.step < cfg.max_steps:
            stopped = should_stop(run, signals)
            if stopped or stopped is None:
                break
            t0 = clock(run.device)
            reset_peak(run.device)
            try:
                rows, ro, extra = run.rollouts.next()  # 1. G completions per prompt (this rank's share)
            except Stopping:  # a signal while waiting for it: nothing of this step trained
                stopped = True
                break
            rollout_peak = peak_mib(run.device)
            # CPU: what the rollout freed (packed weights, buffers) goes back under a memory budget, or when
            # the machine runs short (else it is the next step's working set: grpo_fast.trainer.memory)
            release_free_memory(run.device, under_pressure_only=not cfg.max_memory_gb)
            t1 = clock(run.device)
            reset_peak(run.device)
            sc = score_rollout(run, rows, ro)  # 2. rewards, group advantages over the global batch
            t2, start = clock(run.device), run.step
            metrics, grad_norm, micro = optimize(run, ro, sc)  # 3. the clipped loss through the fused kernels
            # a rollout cut by max_steps in its first pass leaves its later steps' prompts untrained
            run.untrained_prompts = max(0, generation_steps(cfg) - (run.step - start)) * cfg.prompts_per_step
            peaks = (rollout_peak, peak_mib(run.device))
            release_free_memory(run.device, under_pressure_only=not cfg.max_memory_gb)  # the same
            t3 = clock(run.device)
            try:
                extra.update(run.rollouts.after_update(run.step))  # servers: the new weights pushed, verified
            except Stopping:  # a signal during the push: the step is trained, the next run pushes it whole
                stopped = True
            finally:  # a push that failed still leaves this step trained: logged (and saved) before it stops
                t4 = clock(run.device)
                run.elapsed_train += t4 - t0
                record = step_record(run, ro, sc, metrics, grad_norm, (t0, t1, t2, t3), peaks, micro)
                record.update(extra, time_sync_s=t4 - t3)  # 4. log
                record["tokens_per_s"] *= (t3 - t0) / (t4 - t0)  # over the whole step, the push included
                done = run.step - start
                log_them = cfg.log_completions and logged(run, done)
                samples = completion_samples(run, ro, sc) if log_them else None
                after_step(run, record, bar, done, samples)
            if stopped:
                break
        if not stopped:  # a signal during the last step
            (stopped,) = agreed([signals.stop], run.dist)
    bar.close()
    return finish(run, bool(stopped))


@contextmanager
def serving(run: Run):
    """The run's rollout source (grpo_fast.trainer.rollouts) for the loop's duration. A vLLM server that fails
    stops the run with its error after the last completed step is saved; `--resume` continues from there."""
    start = run.step
    try:
        run.rollouts = rollouts.for_run(run, rollout)
        yield
    except ServerError as exc:
        if run.rollouts is not None:
            run.rollouts.close()
        if run.dist.main:
            run.log.close()
        again = "run the same command again" + (" (with --resume)" if start else "")
        if run.step == start:  # nothing trained here: no checkpoint (at step 0 none that --resume would need)
            raise SystemExit(
                f"grpo-fast: stopped at step {run.step} before training a step: {exc}\nonce the server is "
                f"back (or the cause above is fixed), {again}"
            ) from exc
        path = save(run, run.step)
        raise SystemExit(
            f"grpo-fast: stopped at step {run.step}: {exc}\nthe last completed step is saved in {path}; once "
            "the server is back (or the cause above is fixed), run again with --resume to continue from it"
        ) from exc
    finally:
        if run.rollouts is not None:
            run.rollouts.close()


def should_stop(run: Run, signals) -> bool | None:
    """True on a signal (any rank), None at the time budget; every rank agrees (one all-reduce)."""
    cfg = run.cfg
    stopped, over_budget = agreed(
        [signals.stop, cfg.time_budget_s and run.elapsed_train >= cfg.time_budget_s], run.dist
    )
    if stopped:
        return True
    if over_budget:
        if run.dist.main:
            print(f"time budget of {cfg.time_budget_s:.0f}s reached at step {run.step}", flush=True)
        return None
    return False


def due(run: Run, done: int, every: int) -> bool:
    """Whether the `done` optimizer steps a rollout just trained passed a multiple of `every` (0: never)."""
    return bool(every) and run.step // every > (run.step - done) // every


def logged(run: Run, done: int) -> bool:
    """Whether this rollout's step is logged (every logging_steps, and the last)."""
    return due(run, done, run.cfg.logging_steps) or run.step >= run.cfg.max_steps


def after_step(run: Run, record: dict, bar, done: int, samples: list | None = None) -> None:
    """Log the rollout's steps (`done` optimizer steps; and its completions, `samples`, with
    --log-completions), evaluate and checkpoint when due, show progress."""
    cfg = run.cfg
    bar.update(done)
    if logged(run, done):
        log_record(run, record)
    if samples and run.log is not None:
        run.log.write_completions(samples)
        bar.clear()
        print_completions(samples, cfg.num_completions_to_print)
    if run.eval_rows and due(run, done, cfg.eval_steps):
        evaluate_and_log(run)
    bar.set_postfix(
        reward=f"{record['reward_mean']:.3f}",
        acc=f"{run.last_eval.get('eval_accuracy', 0):.2f}",
        kl=f"{record['kl']:.3g}",
        len=f"{record['completion_len_mean']:.1f}",
        tok_s=f"{record['tokens_per_s']:.0f}",
    )
    if due(run, done, cfg.save_steps):
        save(run, run.step)


def evaluate_and_log(run: Run) -> None:
    run.last_eval = evaluate(
        run.policy, run.tokenizer, run.eval_rows, run.reward_funcs, run.cfg, run.device, run.dist,
        run.tools, run.environment_factory,
    )  # fmt: skip
    log_record(run, {"step": run.step, **run.last_eval})


def eval_line(ev: dict) -> str:
    """An evaluation in a line: greedy accuracy, and with --num-generations-eval the sampled figures."""
    line = f"accuracy {ev['eval_accuracy']:.3f}"
    if "eval_sampled_accuracy" in ev:
        line += f", sampled {ev['eval_sampled_accuracy']:.3f}, pass@n {ev['eval_pass_at_n']:.3f}"
    return line


def log_record(run: Run, record: dict) -> None:
    if run.log is not None:
        run.log.write(record)


def finish(run: Run, stopped: bool) -> dict:
    """Interrupted: checkpoint and exit 130. Done: final evaluation, checkpoint, plot, summary."""
    cfg, dist, out = run.cfg, run.dist, run.out
    if stopped:
        path = save(run, run.step) if run.step else None  # no checkpoint-0: the run is the same run again
        if dist.main:
            said = f"checkpoint saved to {path}" if path else "before step 1, nothing to save: run it again"
            print(f"interrupted: {said}", flush=True)
            run.log.close()
        release(run)
        sys.exit(130)
    if run.eval_rows and (not run.last_eval or not cfg.eval_steps or run.step % cfg.eval_steps):
        evaluate_and_log(run)
    final = save(run, run.step)
    summary = {
        "step": run.step,
        "elapsed_train_s": run.elapsed_train,
        **run.last_eval,
        "checkpoint": str(final),
        "metrics": str(out / "metrics.jsonl"),
    }
    if dist.main:
        run.log.close()
        drawn = plot_curves(out / "metrics.jsonl", out / "curves.png")
        summary["plot"] = str(out / "curves.png") if drawn else None
        print(f"done: {json.dumps(summary)}", flush=True)
        print(
            f"outputs in {out}/: metrics.jsonl (per-step metrics, eval records), "
            f"{'completions.jsonl (logged steps), ' if cfg.log_completions else ''}"
            f"{'curves.png, ' if drawn else ''}config.json, {final.name}/",
            flush=True,
        )
    release(run)
    return summary


def release(run: Run) -> None:
    """Drop the modules, then the process group (see distributed.shutdown)."""
    run.policy = run.ref_policy = run.model = run.rollout_copy = None
    run.params = run.optimizer = run.scheduler = None
    shutdown(run.dist)


# --------------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------------
def save(run: Run, at_step: int) -> Path:
    """Checkpoint (atomic) at `at_step`, once: a step already saved (save_steps divides max_steps) is kept."""
    if at_step in run.saved:
        return run.saved[at_step]
    cfg, dist = run.cfg, run.dist
    extra = {"elapsed_train_s": run.elapsed_train, "config": to_dict(cfg), "world_size": dist.world}
    if cfg.use_adaptive_entropy:
        extra["entropy_control"] = run.entropy.state_dict()
    model_state = full_model_state(run.policy, dist) if dist.kind == "fsdp" and dist.on else None
    optimizer_state = full_optimizer_state(run.policy, run.optimizer, dist)  # a collective: every rank
    # a moving reference (sync_ref_model) is no longer the base a resumed run would rebuild: saved with it
    reference = full_model_state(run.ref_policy, dist) if cfg.sync_ref_model else None
    path = None
    if dist.main:
        path = ckpt_mod.save_checkpoint(
            run.out, at_step, run.model, run.tokenizer, optimizer_state, run.scheduler,
            sampler_state(run), run.generator, extra, cfg.save_total_limit, model_state=model_state,
            scaler=run.scaler, reference_state=reference,
        )  # fmt: skip
    barrier(dist)
    run.saved[at_step] = path or run.out / f"checkpoint-{at_step}"
    return run.saved[at_step]


def sampler_state(run: Run) -> dict:
    """The prompt sampler's position after the last trained batch (a generation thread may have drawn
    more), before the prompts of the steps that batch left untrained (cut by max_steps: a --resume with a
    higher max_steps trains them, as the uninterrupted run does)."""
    state = run.rollouts.sampler_state() if run.rollouts is not None else None
    state = state if state is not None else run.sampler.state_dict()
    return run.sampler.rewound(state, run.untrained_prompts)


# --------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------
def agreed(flags: list[bool], dist: DistInfo) -> list[bool]:
    """Each flag true on any rank is true on every rank (one all-reduce, called by every rank): a signal
    or a time budget that only some ranks see still stops all of them at the same step."""
    if not dist.on:
        return [bool(f) for f in flags]
    return [bool(v) for v in all_sum(torch.tensor([int(f) for f in flags], device=device_of(dist)), dist)]


def clock(device) -> float:
    """Wall time after the device's queued work: step phases are timed, not their launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def main(argv=None) -> None:
    try:
        train(parse_config(argv))
    except ValueError as err:  # bad input: flags, files, data, reward functions
        print(f"grpo-fast: error: {err}", file=sys.stderr)
        sys.exit(2)
    except RuntimeError as err:  # a rank died or stalled: fail with a clear error, never hang
        if not is_collective_failure(err):
            raise
        rank = os.environ.get("RANK", "?")
        print(
            f"grpo-fast: error: rank {rank}: a collective with the other ranks failed (a rank died, or none "
            f"answered within --dist-timeout-s): {type(err).__name__}: {str(err).splitlines()[0]}",
            file=sys.stderr,
        )
        sys.exit(3)


def is_collective_failure(err: RuntimeError) -> bool:
    """NCCL / c10d errors are DistError; gloo's lost peers and timeouts are plain RuntimeErrors."""
    if isinstance(err, torch.distributed.DistError):
        return True
    lost = ("gloo", "connection reset", "connection closed", "timed out", "timeout", "socket")
    in_dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    return in_dist and any(word in str(err).lower() for word in lost)


if __name__ == "__main__":
    main()
