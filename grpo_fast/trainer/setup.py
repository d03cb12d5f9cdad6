"""Setting up a run: `Run` (everything a run holds) and `setup`, which builds it: the process group, seeds,
the precision (kept on --resume), data and rewards (each row checked against what reads it), tools, the
memory plan, the model (+ reference), the output directory and the run's id, the optimizer, the resume, the
log. The loop that runs it is grpo_fast/trainer/train.py."""

import copy
import json
import math
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..rewards import load_from_file, load_reward, reward_name
from ..rollout.tools import Toolbox
from . import checkpoint as ckpt_mod
from .batching import Packer
from .config import (
    GRPOConfig,
    check_correction,
    collective_timeout_s,
    generation_steps,
    prompts_per_rollout,
    to_dict,
)
from .data import PromptSampler, check_rows, train_and_eval_rows
from .distributed import (
    DistInfo,
    all_gather_rows,
    barrier,
    device_of,
    from_rank0,
    init_distributed,
    load_full_optimizer_state,
    wrap,
)
from .log import MetricsLog
from .memory import hold_freed_memory, map_large_allocations
from .modeling import fp32_source, load_model_and_tokenizer, load_weights_from_checkpoint, model_path
from .optimizers import AdamW16, build_optimizer
from .precision import Precision, kept_on_resume
from .precision import resolve_agreed as resolve_precision
from .step import EntropyControl, server_mode
from .stopping import Signals


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
    untrained_prompts: int = 0  # of the last rollout, cut by max_steps: its checkpoint draws them again
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
    entropy: EntropyControl | None = None  # the entropy bonus's coefficient (adaptive: its controller)

    @property
    def multi_turn(self) -> bool:
        return bool(self.tools) or self.environment_factory is not None


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
    if cfg.sync_ref_model and ref_model is None:  # a config built in Python skips validate()
        raise ValueError("sync_ref_model needs a reference model of its own to move: beta != 0, no LoRA")
    # the global batch, on every rank
    sampler = PromptSampler(train_rows, prompts_per_rollout(cfg), cfg.seed, cfg.shuffle_dataset)
    generator = torch.Generator(device=device).manual_seed(cfg.seed + dist.rank)
    resume_from = prepare_output_dir(cfg, out, dist, device)
    if resume_from is not None:  # weights before wrapping: any world size wrote them whole
        load_weights_from_checkpoint(model, resume_from, info["lora"])
        if cfg.sync_ref_model and not ckpt_mod.load_reference(ref_model, resume_from) and dist.main:
            print(f"grpo-fast: {resume_from} holds no synced reference (its run did not sync one): the "
                  "reference starts again from the base model", flush=True)  # fmt: skip
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
        entropy=EntropyControl(cfg.entropy_coef),
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
    if prompts_per_rollout(cfg) > len(train_rows):
        steps = generation_steps(cfg)
        per = f" x {steps} steps per generation" if steps > 1 else ""
        raise ValueError(
            f"prompts_per_step ({cfg.prompts_per_step}){per} is larger than the dataset ({len(train_rows)} "
            f"prompts): every rollout would hold some prompts twice; pass --prompts-per-step "
            f"{len(train_rows) // steps} or fewer"
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
        hold_freed_memory(device)  # CPU: the heap keeps freed tensors for the next step (memory)
        return cfg, None, None
    import dataclasses

    from .estimate import MIB, Estimator, describe, plan

    map_large_allocations(device)  # CPU: the heap keeps no freed tensors; the peak is the tensors' (memory)

    gbs = cfg.generation_batch_size
    local = dataclasses.replace(
        cfg, prompts_per_step=cfg.prompts_per_step // dist.world,
        generation_batch_size=gbs // dist.world if gbs is not None else None,
    )  # fmt: skip
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
    if cfg.use_adaptive_entropy and "entropy_control" in state:  # the coefficient where the run left it
        run.entropy.load_state_dict(state["entropy_control"])
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
