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
optimization -> log; `setup` builds the run (model, data, rewards, optimizer, resume) and `finish` ends it
(final eval, checkpoint, plot).

    python -m grpo_fast.train [--flag value ...]      (or: grpo-fast train ...)
"""

import copy
import json
import math
import os
import random
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..rewards import load_from_file, load_reward, reward_name
from ..rollout.server import ServerError
from ..rollout.tools import Toolbox
from . import checkpoint as ckpt_mod
from . import rollouts
from .batching import Packer
from .config import GRPOConfig, check_correction, collective_timeout_s, parse_config, to_dict
from .data import PromptSampler, check_rows, train_and_eval_rows
from .distributed import (
    DistInfo,
    all_gather_rows,
    all_sum,
    barrier,
    device_of,
    from_rank0,
    full_model_state,
    full_optimizer_state,
    init_distributed,
    load_full_optimizer_state,
    shutdown,
    wrap,
)
from .memory import map_large_allocations, peak_mib, release_free_memory, reset_peak
from .modeling import fp32_source, load_model_and_tokenizer, load_weights_from_checkpoint, model_path
from .optimizers import AdamW16, build_optimizer
from .plotting import pyplot
from .precision import Precision, kept_on_resume
from .precision import resolve_agreed as resolve_precision
from .step import encode_prompts, evaluate, optimize, rollout, score_rollout, server_mode, step_record
from .stopping import Signals, Stopping

__all__ = ["train", "main", "encode_prompts"]


@dataclass
class Run:
    """Everything a run holds: what setup builds, what the phases use, what the loop advances."""

    cfg: GRPOConfig
    dist: DistInfo
    device: torch.device
    out: Path
    model: torch.nn.Module
    tokenizer: object
    info: dict
    policy: torch.nn.Module  # the model behind DDP / FSDP hooks (distributed.Policy)
    ref_policy: torch.nn.Module | None
    params: list
    optimizer: torch.optim.Optimizer
    scheduler: object
    precision: Precision  # storage / compute dtypes, the optimizer (grpo_fast.trainer.precision)
    scaler: object  # fp16: torch.amp.GradScaler (the loss scaled); else None
    sampler: PromptSampler
    generator: torch.Generator
    reward_funcs: list
    reward_names: list
    reward_weights: list
    eval_rows: list
    resume_from: Path | None
    identity: str = ""  # the name vLLM servers know this run by, agreed by its ranks (checkpoint.run_id)
    step: int = 0
    elapsed_train: float = 0.0
    last_eval: dict = field(default_factory=dict)
    log: "MetricsLog | None" = None
    saved: dict = field(default_factory=dict)
    packer: Packer | None = None  # micro-batches packed to --max-memory-gb (grpo_fast.trainer.batching)
    tools: list = field(default_factory=list)  # --tools: multi-turn rollouts
    environment_factory: object = None  # --environment: one instance per rollout
    rollouts: object = None  # where each step's rollout comes from (grpo_fast.trainer.rollouts)
    rollout_copy: torch.nn.Module | None = None  # colocated async: the generation thread's weights
    signals: Signals = field(default_factory=Signals)  # SIGTERM / Ctrl-C (grpo_fast.trainer.stopping)

    @property
    def multi_turn(self) -> bool:
        return bool(self.tools) or self.environment_factory is not None


# --------------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------------
def train(cfg: GRPOConfig) -> dict:
    run = setup(cfg)
    if run.eval_rows and run.step == 0:
        evaluate_and_log(run)
        if run.dist.main:
            print(f"step 0: held-out accuracy {run.last_eval['eval_accuracy']:.3f}", flush=True)
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
            t2 = clock(run.device)
            metrics, grad_norm, micro = optimize(run, ro, sc)  # 3. the clipped loss through the fused kernels
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
                after_step(run, record, bar)
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


def after_step(run: Run, record: dict, bar) -> None:
    """Log the step, evaluate and checkpoint when due, show progress."""
    cfg = run.cfg
    bar.update(cfg.num_iterations)
    if run.step % cfg.logging_steps == 0 or run.step >= cfg.max_steps:
        log_record(run, record)
    if run.eval_rows and cfg.eval_steps and run.step % cfg.eval_steps == 0:
        evaluate_and_log(run)
    bar.set_postfix(
        reward=f"{record['reward_mean']:.3f}",
        acc=f"{run.last_eval.get('eval_accuracy', 0):.2f}",
        kl=f"{record['kl']:.3g}",
        len=f"{record['completion_len_mean']:.1f}",
        tok_s=f"{record['tokens_per_s']:.0f}",
    )
    if cfg.save_steps and run.step % cfg.save_steps == 0:
        save(run, run.step)


def evaluate_and_log(run: Run) -> None:
    run.last_eval = evaluate(
        run.policy, run.tokenizer, run.eval_rows, run.reward_funcs, run.cfg, run.device, run.dist,
        run.tools, run.environment_factory,
    )  # fmt: skip
    log_record(run, {"step": run.step, **run.last_eval})


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
# Setting up a run
# --------------------------------------------------------------------------------------------------------
def setup(cfg: GRPOConfig) -> Run:
    """Process group, seeds, model (+ reference), data, rewards, output dir and resume, optimizer, log."""
    out = Path(cfg.output_dir)
    timeout_s = collective_timeout_s(cfg)
    dist = init_distributed(cfg.distributed, timeout_s)
    if dist.main:
        out.mkdir(parents=True, exist_ok=True)
        if dist.on and timeout_s != cfg.dist_timeout_s:
            print(
                f"dist_timeout_s {cfg.dist_timeout_s:g} raised to {timeout_s:g} s in server mode: a rank may "
                "wait that long for another rank's server requests (vllm_request_timeout_s x (servers + 1))",
                flush=True,
            )
    # initialization agrees on every rank; sampling differs per rank (the generator below)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = device_of(dist)
    check_distributed(cfg, dist)
    cfg = kept_on_resume(cfg, device, dist.main)  # --resume: the run's own decisions, not a new measurement
    cfg, precision = resolve_precision(cfg, device, dist)  # --bf16 unset, auto: decided here, said once
    check_correction(cfg)
    # everything that reads only files is checked before anything heavy (memory probes, the model) runs
    model_path(cfg)
    train_rows, eval_rows, reward_funcs, reward_names = load_data_and_rewards(cfg)
    tools, env_factory = load_tools(cfg)
    weights = list(cfg.reward_weights or [1.0] * len(reward_funcs))
    if callable(getattr(env_factory, "get_reward", None)):  # TRL: the environment's reward, weight 1
        reward_funcs, reward_names = reward_funcs + [environment_reward(env_factory)], reward_names
        reward_names = reward_names + [env_factory.__name__]
        weights.append(1.0)
    cfg, memory_plan, packer = plan_memory(cfg, dist, device)
    model, tokenizer, info = load_model_and_tokenizer(cfg, device)
    info["memory_plan"] = memory_plan
    info["precision"] = {"storage": precision.storage, "compute": precision.compute, "optim": precision.optim,
                         "autocast": precision.autocast, "reason": precision.reason}  # fmt: skip
    # the reference policy: the base with adapters off (LoRA), else a frozen copy, only when beta != 0
    ref_model = None
    if cfg.beta != 0.0 and not info["lora"]:
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    sampler = PromptSampler(train_rows, cfg.prompts_per_step, cfg.seed)  # the global batch, on every rank
    generator = torch.Generator(device=device).manual_seed(cfg.seed + dist.rank)
    resume_from = prepare_output_dir(cfg, out, dist, device)
    if resume_from is not None:  # weights before wrapping: any world size wrote them whole
        load_weights_from_checkpoint(model, resume_from, info["lora"])
    # colocated asynchronous GRPO: the generation thread's own copy of the weights, whole (before FSDP2 shards
    # the policy), as resumed
    rollout_copy = copy.deepcopy(model) if cfg.max_staleness and not server_mode(cfg) else None
    # one module per model behind which every use of the parameters runs (DDP / FSDP hooks see them all)
    policy = wrap(model, dist)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = build_optimizer(
        params, cfg.optim, cfg.learning_rate, (cfg.adam_beta1, cfg.adam_beta2), cfg.weight_decay
    )
    if isinstance(optimizer, AdamW16) and resume_from is None:
        source = fp32_source(model, model_path(cfg))  # bf16 weights of an fp32 checkpoint: exact masters
        if source:
            optimizer.seed_from(source.get)
    run = Run(
        cfg=cfg, dist=dist, device=device, out=out, model=model, tokenizer=tokenizer, info=info,
        policy=policy,
        ref_policy=wrap(ref_model, dist, trainable=False) if ref_model is not None else None, params=params,
        optimizer=optimizer, scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg)),
        precision=precision,
        scaler=torch.amp.GradScaler(device.type) if precision.compute == "fp16" else None,
        sampler=sampler, generator=generator, reward_funcs=reward_funcs,
        reward_names=reward_names,
        reward_weights=weights,
        eval_rows=eval_rows[: cfg.eval_max_samples], resume_from=resume_from, packer=packer,
        tools=tools, environment_factory=env_factory, rollout_copy=rollout_copy,
        identity=from_rank0(lambda: ckpt_mod.run_id(out, cfg.resume), dist),
    )  # fmt: skip
    if resume_from is not None:
        resume(run)
    start_log(run, len(train_rows))
    return run


def load_data_and_rewards(cfg: GRPOConfig) -> tuple[list, list, list, list]:
    """The train and eval rows, the reward functions and their names; each row checked against what reads
    it (the train rows: every reward function; the eval rows: the first, which decides held-out accuracy)."""
    train_rows, eval_rows = train_and_eval_rows(cfg)
    reward_funcs = [
        load_reward(s, cfg.max_completion_length, cfg.allow_unsandboxed_code) for s in cfg.reward or ()
    ]
    names = [reward_name(f) for f in reward_funcs]
    check_rows(train_rows, f"--dataset {cfg.dataset or '(embedded)'}", reward_funcs, names)
    if eval_rows:
        check_rows(eval_rows, f"--eval-dataset {cfg.eval_dataset or '(embedded)'}", reward_funcs[:1], names)
    if cfg.prompts_per_step > len(train_rows):
        raise ValueError(
            f"prompts_per_step ({cfg.prompts_per_step}) is larger than the dataset ({len(train_rows)} "
            f"prompts): every step would train on some prompts twice; pass --prompts-per-step "
            f"{len(train_rows)} or fewer"
        )
    return train_rows, eval_rows, reward_funcs, names


def load_tools(cfg: GRPOConfig) -> tuple[list, object]:
    """--tools path/file.py:function (each checked: type hints, docstring) and --environment
    path/file.py:Class, TRL's tools= and environment_factory."""
    tools = [load_from_file(spec, "--tools") for spec in cfg.tools or ()]
    Toolbox(tools)  # every schema readable, no two names alike: fail before the model loads
    env = load_from_file(cfg.environment, "--environment", "class") if cfg.environment else None
    if env is not None and not callable(getattr(env, "reset", None)):
        raise ValueError(f"--environment {cfg.environment!r}: {env.__name__} has no reset(**row) method")
    return tools, env


def environment_reward(env_class):
    """The environment's own reward (`get_reward()` of each rollout's instance), as a reward function."""

    def reward(prompts, completions, environments, **_):
        return [e.get_reward() for e in environments]

    reward.__name__ = env_class.__name__
    return reward


def plan_memory(cfg: GRPOConfig, dist: DistInfo, device):
    """--max-memory-gb: gradient checkpointing and the micro-batch budget from the memory estimate
    (grpo_fast.trainer.estimate), printed and returned for config.json, with the Packer that cuts each step's
    groups into micro-batches from their real lengths (grpo_fast.trainer.batching); a ValueError naming what
    fits if nothing does. Returns (cfg, record or None, packer or None)."""
    if not cfg.max_memory_gb:
        return cfg, None, None
    import dataclasses

    from .estimate import MIB, Estimator, describe, plan

    map_large_allocations(device)  # CPU: the heap keeps no freed tensors; the peak is the tensors' (memory)

    local = dataclasses.replace(cfg, prompts_per_step=cfg.prompts_per_step // dist.world)
    est = Estimator(local, device.type)
    p, e = plan(local, cfg.max_memory_gb, device.type, est)
    cfg = dataclasses.replace(cfg, gradient_checkpointing=p.gradient_checkpointing)
    record = {
        "max_memory_gb": cfg.max_memory_gb,
        "gradient_checkpointing": cfg.gradient_checkpointing,
        "micro_batch_budget_mib": p.micro_batch_bytes / MIB,
        "micro_batches_at_longest": e["micro_batches"],
        "estimated_peak_mib": e["peak"] / MIB,
        "estimated_rollout_peak_mib": e["rollout_peak"] / MIB,
        "estimated_train_peak_mib": e["train_peak"] / MIB,
    }
    if dist.main:
        print(
            f"memory plan for --max-memory-gb {cfg.max_memory_gb:g}: {describe(p, e)}; estimated peak "
            f"{e['peak'] / MIB:.0f} MiB (rollout {e['rollout_peak'] / MIB:.0f}, training "
            f"{e['train_peak'] / MIB:.0f})",
            flush=True,
        )
    return cfg, record, est.packer(p)


def check_distributed(cfg: GRPOConfig, dist: DistInfo) -> None:
    if cfg.prompts_per_step % (dist.world * cfg.gradient_accumulation_steps):
        raise ValueError(
            f"prompts_per_step ({cfg.prompts_per_step}) must split evenly over {dist.world} rank(s) x "
            f"gradient_accumulation_steps ({cfg.gradient_accumulation_steps}): whole groups on each rank"
        )
    if dist.kind == "fsdp" and dist.on and cfg.lora_r > 0:
        raise ValueError(
            "--distributed fsdp with --lora-r > 0 is not supported: use --distributed ddp for LoRA"
        )
    if dist.on and dist.kind == "fsdp" and (cfg.tools or cfg.environment):
        raise ValueError(
            "--tools / --environment with --distributed fsdp: FSDP2 gathers the shards in every forward, so "
            "its ranks must run the same forwards, and trajectories take data-dependent numbers of turns "
            "(held-out evaluation runs them on the trainer's weights): use --distributed ddp, whose "
            "no-grad forwards are rank-local"
        )
    if dist.on and cfg.rollout == "vllm" and cfg.vllm_mode != "server":
        raise ValueError(
            "--rollout vllm --vllm-mode colocate under torchrun is not supported yet (vLLM sets up its own "
            "process group in each trainer process): use --vllm-mode server (the ranks share vLLM servers), "
            "--rollout native (or auto) with torchrun, or --rollout vllm in one process"
        )


def prepare_output_dir(cfg: GRPOConfig, out: Path, dist: DistInfo, device) -> Path | None:
    """The checkpoint to resume from (--resume), after refusing to mix runs and clearing stale saves."""
    resume_from = ckpt_mod.latest_checkpoint(out) if cfg.resume else None
    if dist.on:  # every rank must read the same checkpoint: one output dir on a filesystem they all share
        seen = all_gather_rows(torch.tensor([ckpt_mod.step_of(resume_from)], device=device), dist)
        if bool((seen != seen[0]).any()):
            raise ValueError(
                f"--resume: ranks see different latest checkpoints in {out} (steps {seen.tolist()}): the "
                "output dir must be on a filesystem every rank shares"
            )
    stale = [] if cfg.resume else ckpt_mod.list_checkpoints(out)
    if stale and not cfg.overwrite_output_dir:  # never mix two runs' checkpoints, never delete unasked
        raise ValueError(
            f"--output-dir {out} already holds checkpoints ({stale[-1].name}, ...): pass --resume to "
            "continue that run, --overwrite-output-dir to start afresh, or another --output-dir"
        )
    if dist.on:
        barrier(dist)  # every rank has looked before rank 0 deletes
    for old_ckpt in stale + ckpt_mod.torn_saves(out) if dist.main else []:
        shutil.rmtree(old_ckpt)
    return resume_from


def resume(run: Run) -> None:
    """Optimizer, scheduler, sampler position, RNG and step counters from `run.resume_from`."""
    cfg, dist = run.cfg, run.dist
    state = ckpt_mod.load_training_state(
        run.resume_from,
        lambda sd: load_full_optimizer_state(run.policy, run.optimizer, sd, dist),
        run.scheduler,
        run.generator if dist.world == 1 else None,
        run.scaler,
    )
    run.sampler.load_state_dict(state["sampler"])
    run.step, run.elapsed_train = state["step"], state.get("elapsed_train_s", 0.0)
    run.saved[run.step] = run.resume_from
    if dist.world > 1:  # per-rank sampling streams, reproducible from (seed, rank, step)
        run.generator.manual_seed(cfg.seed + dist.rank + 7919 * run.step)


def start_log(run: Run, n_train: int) -> None:
    cfg, dist, info = run.cfg, run.dist, run.info
    info.update(world_size=dist.world, distributed=dist.kind if dist.on else "none")
    resolved = {**to_dict(cfg), "resolved": info}
    if not dist.main:
        return
    (run.out / "config.json").write_text(json.dumps(resolved, indent=2))
    resumed = run.resume_from is not None
    run.log = MetricsLog(run.out, cfg.report_to, resolved, resume_step=run.step if resumed else None)
    print(
        f"grpo-fast: {info['model']} ({info['n_params'] / 1e6:.2f}M params, "
        f"{info['n_trainable'] / 1e6:.2f}M trainable) on {run.device} x {dist.world}; "
        f"{n_train} train / {len(run.eval_rows)} eval prompts; "
        f"output {run.out}\nconfig: {json.dumps(to_dict(cfg))}",
        flush=True,
    )


def save(run: Run, at_step: int) -> Path:
    """Checkpoint (atomic) at `at_step`, once: a step already saved (save_steps divides max_steps) is kept."""
    if at_step in run.saved:
        return run.saved[at_step]
    cfg, dist = run.cfg, run.dist
    extra = {"elapsed_train_s": run.elapsed_train, "config": to_dict(cfg), "world_size": dist.world}
    model_state = full_model_state(run.policy, dist) if dist.kind == "fsdp" and dist.on else None
    optimizer_state = full_optimizer_state(run.policy, run.optimizer, dist)  # a collective: every rank
    path = None
    if dist.main:
        path = ckpt_mod.save_checkpoint(
            run.out, at_step, run.model, run.tokenizer, optimizer_state, run.scheduler,
            sampler_state(run), run.generator, extra, cfg.save_total_limit, model_state=model_state,
            scaler=run.scaler,
        )  # fmt: skip
    barrier(dist)
    run.saved[at_step] = path or run.out / f"checkpoint-{at_step}"
    return run.saved[at_step]


def sampler_state(run: Run) -> dict:
    """The prompt sampler's position after the last trained batch (a generation thread may have "
    "drawn more)."""
    state = run.rollouts.sampler_state() if run.rollouts is not None else None
    return state if state is not None else run.sampler.state_dict()


# --------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------
def lr_lambda(cfg: GRPOConfig):
    """The learning-rate factor at each step: transformers' schedule named by lr_scheduler_type (what TRL's
    Trainer runs), its warmup from 0 over warmup_steps (a fraction < 1 of max_steps, rounded up)."""
    w = cfg.warmup_steps
    warm = int(w) if w >= 1 else math.ceil(w * cfg.max_steps)
    kind = cfg.lr_scheduler_type

    def f(step):
        if kind == "constant":
            return 1.0
        if step < warm:
            return step / max(1, warm)
        if kind == "constant_with_warmup":
            return 1.0
        if kind == "linear":
            return max(0.0, (cfg.max_steps - step) / max(1, cfg.max_steps - warm))
        progress = (step - warm) / max(1, cfg.max_steps - warm)
        return max(0.0, 0.5 * (1 + math.cos(math.pi * progress)))

    return f


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
