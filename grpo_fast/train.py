"""GRPO training loop, top to bottom.

Variant: GRPO (DeepSeekMath) with TRL 1.16 GRPOTrainer semantics. Per step: sample G completions for each of
`prompts_per_step` prompts; score them with the reward functions (weighted sum, None = no opinion); advantages
`(r - group mean) / (group std + eps)` (or batch std, or unscaled: `scale_rewards`); then `num_iterations`
AdamW updates on the clipped probability-ratio loss, two-sided clip [1 - epsilon, 1 + epsilon_high], token-
or sequence-level (GSPO) ratios, optional k3 KL to the reference model (beta), normalized as `loss_type`
(default "dapo": summed over tokens, divided by the active tokens of the whole step). With num_iterations 1
the update is on-policy (ratio 1, old log-probs never computed). Log-probs come from the model's last hidden
state and LM head through `fused_linear_grpo_loss`: the (tokens x vocab) logits are never materialized.
Under torchrun (DDP or FSDP2, `distributed.py`) each rank takes whole groups of the same global batch;
advantages and the dapo normalizer are the global batch's, so a step equals the single-process step.

    python -m grpo_fast.train [--flag value ...]      (or: grpo-fast train ...)
"""

import copy
import json
import math
import os
import random
import resource
import shutil
import signal
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from . import checkpoint as ckpt_mod
from .config import GRPOConfig, parse_config, to_dict
from .data import PromptSampler, render_prompt, train_and_eval_rows
from .distributed import (
    DistInfo,
    all_done,
    all_gather_rows,
    all_sum,
    barrier,
    device_of,
    full_model_state,
    full_optimizer_state,
    full_tensor,
    gradient_sync,
    init_distributed,
    load_full_optimizer_state,
    shutdown,
    wrap,
)
from .kernels import fused_linear_grpo_loss, fused_linear_logprobs, group_advantages
from .model_parts import lm_head_of
from .modeling import completion_hidden_states, load_model_and_tokenizer, load_weights_from_checkpoint
from .plotting import pyplot
from .rewards import load_reward, reward_name, score
from .rollout import generate_groups

# --------------------------------------------------------------------------------------------------------
# Pieces of one step
# --------------------------------------------------------------------------------------------------------


def encode_prompts(rows, tokenizer, max_prompt_length, device):
    texts = [render_prompt(r["prompt"], tokenizer) for r in rows]
    tokenizer.padding_side, tokenizer.truncation_side = "left", "left"
    enc = tokenizer(
        texts,
        return_tensors="pt",
        padding=True,
        truncation=True,
        max_length=max_prompt_length,
        add_special_tokens=False,
    )
    return texts, enc.input_ids.to(device), enc.attention_mask.to(device)


def reward_columns(rows, G, completion_ids, completion_mask):
    """Every dataset column but `prompt`, repeated per completion, plus the completions' token ids."""
    cols = {k: [r[k] for r in rows for _ in range(G)] for k in rows[0] if k != "prompt"}
    cols["completion_ids"] = [ids[m.bool()].tolist() for ids, m in zip(completion_ids, completion_mask)]
    return cols


def advantages_of(rewards: torch.Tensor, G: int, scale: str) -> torch.Tensor:
    """Group advantages; samples no reward function scored (NaN) get 0 and do not move their group."""
    nan = rewards.isnan()
    if nan.any():
        groups = rewards.view(-1, G)
        fill = torch.nan_to_num(groups.nanmean(dim=1, keepdim=True), nan=0.0).expand_as(groups)
        rewards = torch.where(groups.isnan(), fill, groups).reshape(-1)
    adv = group_advantages(rewards, G, scale=scale)
    return adv.masked_fill(nan.to(adv.device), 0.0)


def engine_options(cfg: GRPOConfig) -> dict:
    """The rollout engine and its compile setting, as `generate_groups` takes them."""
    return {"engine": cfg.rollout, "compile": {"auto": "auto", "on": True, "off": False}[cfg.rollout_compile]}


@torch.no_grad()
def sequence_logps(model, batch, cfg: GRPOConfig):
    """Per-token log-probs (no grad) of the completions, through the fused kernel (old / reference)."""
    hidden = completion_hidden_states(model, *batch, share_prefix=cfg.share_prefix)
    head = lm_head_of(model)
    return fused_linear_logprobs(hidden, head.weight, batch[2], bias=head.bias, temperature=cfg.temperature)


def policy_loss(model, batch, loss_mask, advantages, old_logps, ref_logps, cfg: GRPOConfig, n_items):
    """The GRPO loss of one micro-batch, from the policy's last hidden states through the fused kernel."""
    hidden = completion_hidden_states(model, *batch, share_prefix=cfg.share_prefix)
    head = lm_head_of(model)
    return fused_linear_grpo_loss(
        hidden,
        head.weight,
        batch[2],
        loss_mask,
        advantages,
        bias=head.bias,
        temperature=cfg.temperature,
        old_logps=old_logps,
        ref_logps=ref_logps,
        beta=cfg.beta,
        epsilon_low=cfg.epsilon,
        epsilon_high=cfg.epsilon_high,
        loss_type=cfg.loss_type,
        importance_sampling_level=cfg.importance_sampling_level,
        max_completion_length=cfg.max_completion_length,
        num_items_in_batch=n_items,
    )


@torch.no_grad()
def evaluate(policy, tokenizer, rows, reward_funcs, cfg, device, dist: DistInfo | None = None) -> dict:
    """Greedy accuracy on held-out prompts: the share whose first reward function pays its full 1.0.
    Distributed, each rank takes every world-th prompt; all ranks run the same number of chunks."""
    dist = dist or DistInfo()
    policy.eval()
    mine = rows[dist.rank :: dist.world]
    n_chunks = math.ceil(len(rows) / (64 * dist.world))
    hits = total = 0
    for k in range(n_chunks):
        chunk = mine[k * 64 : (k + 1) * 64]
        counted = len(chunk)
        chunk = chunk or rows[:1]  # a rank with nothing left still steps with the others (FSDP)
        texts, ids, mask = encode_prompts(chunk, tokenizer, cfg.max_prompt_length, device)
        comp, cmask = policy(
            generate_groups,
            ids,
            mask,
            1,
            cfg.max_completion_length,
            temperature=0.0,
            eos_token_id=tokenizer.eos_token_id,
            share_prefix=False,
            all_done=(lambda done: all_done(done, dist)) if dist.on else None,
            **engine_options(cfg),
        )
        completions = tokenizer.batch_decode(comp * cmask, skip_special_tokens=True)
        cols = reward_columns(chunk, 1, comp, cmask)
        values = score(reward_funcs[:1], [1.0], texts, completions, cols, on_error="skip").per_func[:, 0]
        hits += int((values[:counted] >= 1.0 - 1e-6).sum())
        total += counted
    hits, total = all_sum(torch.tensor([hits, total], device=device), dist).tolist()
    return {"eval_accuracy": hits / max(1, total), "eval_samples": int(total)}


def reduce_metrics(metrics: dict, n_active, dist: DistInfo) -> dict:
    """One value per metric for the global batch: the loss is already a share of the global loss (mean over
    ranks, as the gradients); per-token metrics (kl, clip ratios) are weighted by each rank's active
    tokens."""
    keys = sorted(metrics)
    vals = torch.stack([torch.as_tensor(metrics[k], dtype=torch.float32) for k in keys]).to(n_active.device)
    is_loss = torch.tensor([k == "loss" for k in keys], device=vals.device)
    weights = torch.where(is_loss, 1.0, n_active.float())
    totals = all_sum(torch.cat([vals * weights, weights]), dist)
    return dict(zip(keys, (totals[: len(keys)] / totals[len(keys) :].clamp(min=1e-12)).tolist()))


def lr_lambda(cfg: GRPOConfig):
    warm = int(cfg.warmup_ratio * cfg.max_steps)

    def f(step):
        if step < warm:
            return (step + 1) / (warm + 1)
        if cfg.lr_scheduler_type == "constant":
            return 1.0
        progress = (step - warm) / max(1, cfg.max_steps - warm)
        return (
            max(0.0, 1 - progress)
            if cfg.lr_scheduler_type == "linear"
            else 0.5 * (1 + math.cos(math.pi * progress))
        )

    return f


def peak_mem_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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


@contextmanager
def stop_on_signals():
    """SIGTERM and Ctrl-C set a flag; the loop saves a checkpoint at the end of the step, then exits."""
    flag = {"stop": False}

    def handler(signum, frame):
        flag["stop"] = True

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield flag
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# --------------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------------
def train(cfg: GRPOConfig) -> dict:
    out = Path(cfg.output_dir)
    dist = init_distributed(cfg.distributed, cfg.dist_timeout_s)
    if dist.main:
        out.mkdir(parents=True, exist_ok=True)
    # initialization agrees on every rank; sampling differs per rank (the generator below)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = device_of(dist)
    if cfg.prompts_per_step % (dist.world * cfg.gradient_accumulation_steps):
        raise ValueError(
            f"prompts_per_step ({cfg.prompts_per_step}) must split evenly over {dist.world} rank(s) x "
            f"gradient_accumulation_steps ({cfg.gradient_accumulation_steps}): whole groups on each rank"
        )
    if dist.kind == "fsdp" and dist.on and cfg.lora_r > 0:
        raise ValueError(
            "--distributed fsdp with --lora-r > 0 is not supported: use --distributed ddp for LoRA"
        )

    model, tokenizer, info = load_model_and_tokenizer(cfg, device)
    # the reference policy: the base with adapters off (LoRA), else a frozen copy, only when beta != 0
    ref_model = None
    if cfg.beta != 0.0 and not info["lora"]:
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    train_rows, eval_rows = train_and_eval_rows(cfg)
    eval_rows = eval_rows[: cfg.eval_max_samples]
    reward_funcs = [load_reward(s, cfg.max_completion_length) for s in cfg.reward]
    names = [reward_name(f) for f in reward_funcs]
    weights = cfg.reward_weights or [1.0] * len(reward_funcs)
    G = cfg.num_generations
    sampler = PromptSampler(train_rows, cfg.prompts_per_step, cfg.seed)  # the global batch, on every rank
    generator = torch.Generator(device=device).manual_seed(cfg.seed + dist.rank)

    step, elapsed_train = 0, 0.0
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
    if resume_from is not None:  # weights before wrapping: any world size wrote them whole
        load_weights_from_checkpoint(model, resume_from, info["lora"])

    # one module per model behind which every use of the parameters runs (DDP / FSDP hooks see them all)
    policy = wrap(model, dist)
    ref_policy = wrap(ref_model, dist, trainable=False) if ref_model is not None else None
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    if resume_from is not None:
        state = ckpt_mod.load_training_state(
            resume_from,
            lambda sd: load_full_optimizer_state(policy, optimizer, sd, dist),
            scheduler,
            generator if dist.world == 1 else None,
        )
        sampler.load_state_dict(state["sampler"])
        step, elapsed_train = state["step"], state.get("elapsed_train_s", 0.0)
        if dist.world > 1:  # per-rank sampling streams, reproducible from (seed, rank, step)
            generator.manual_seed(cfg.seed + dist.rank + 7919 * step)
    info.update(world_size=dist.world, distributed=dist.kind if dist.on else "none")
    resolved = {**to_dict(cfg), "resolved": info}
    log = None
    if dist.main:
        (out / "config.json").write_text(json.dumps(resolved, indent=2))
        log = MetricsLog(out, cfg.report_to, resolved, resume_step=step if resume_from is not None else None)
        print(
            f"grpo-fast: {info['model']} ({info['n_params'] / 1e6:.2f}M params, "
            f"{info['n_trainable'] / 1e6:.2f}M trainable) on {device} x {dist.world}; "
            f"{len(train_rows)} train / {len(eval_rows)} eval prompts; "
            f"output {out}\nconfig: {json.dumps(to_dict(cfg))}",
            flush=True,
        )
    finished = (lambda done: all_done(done, dist)) if dist.on else None
    local_prompts = cfg.prompts_per_step // dist.world

    saved = {step: resume_from} if resume_from is not None else {}

    def save(at_step):
        if at_step in saved:  # already written at this step (save_steps divides max_steps): keep that one
            return saved[at_step]
        extra = {"elapsed_train_s": elapsed_train, "config": to_dict(cfg), "world_size": dist.world}
        model_state = full_model_state(policy, dist) if dist.kind == "fsdp" and dist.on else None
        optimizer_state = full_optimizer_state(policy, optimizer, dist)  # a collective: every rank
        path = None
        if dist.main:
            path = ckpt_mod.save_checkpoint(
                out,
                at_step,
                model,
                tokenizer,
                optimizer_state,
                scheduler,
                sampler.state_dict(),
                generator,
                extra,
                cfg.save_total_limit,
                model_state=model_state,
            )
        barrier(dist)
        saved[at_step] = path or out / f"checkpoint-{at_step}"
        return saved[at_step]

    def log_record(record):
        if log is not None:
            log.write(record)

    last_eval = {}
    if eval_rows and step == 0:
        last_eval = evaluate(policy, tokenizer, eval_rows, reward_funcs, cfg, device, dist)
        log_record({"step": 0, **last_eval})
        if dist.main:
            print(f"step 0: held-out accuracy {last_eval['eval_accuracy']:.3f}", flush=True)

    bar = tqdm(
        total=cfg.max_steps,
        initial=step,
        desc="grpo",
        dynamic_ncols=True,
        disable=None if dist.main else True,
    )
    with stop_on_signals() as signals:
        stopped = False
        while step < cfg.max_steps:
            stopped, over_budget = agreed(
                [signals["stop"], cfg.time_budget_s and elapsed_train >= cfg.time_budget_s], dist
            )
            if stopped:
                break
            if over_budget:
                if dist.main:
                    print(f"time budget of {cfg.time_budget_s:.0f}s reached at step {step}", flush=True)
                break
            t0 = clock(device)
            # 1. rollout: G completions per prompt; this rank's share of the global batch
            rows = sampler.next()[dist.rank * local_prompts : (dist.rank + 1) * local_prompts]
            texts, p_ids, p_mask = encode_prompts(rows, tokenizer, cfg.max_prompt_length, device)
            policy.eval()
            with torch.no_grad():
                c_ids, c_mask = policy(
                    generate_groups,
                    p_ids,
                    p_mask,
                    G,
                    cfg.max_completion_length,
                    temperature=cfg.temperature,
                    top_p=cfg.top_p,
                    top_k=cfg.top_k,
                    eos_token_id=tokenizer.eos_token_id,
                    share_prefix=cfg.share_prefix,
                    generator=generator,
                    all_done=finished,
                    **engine_options(cfg),
                )
            t1 = clock(device)
            # 2. rewards, then group advantages over the global batch (rewards all-gathered)
            completions = tokenizer.batch_decode(c_ids * c_mask, skip_special_tokens=True)
            prompts_g = [t for t in texts for _ in range(G)]
            scores = score(
                reward_funcs,
                weights,
                prompts_g,
                completions,
                reward_columns(rows, G, c_ids, c_mask),
                on_error=cfg.on_reward_error,
            )
            all_rewards = all_gather_rows(scores.rewards.to(device), dist)
            mine = slice(dist.rank * len(completions), (dist.rank + 1) * len(completions))
            advantages = advantages_of(all_rewards, G, cfg.scale_rewards)[mine]
            loss_mask = c_mask.clone()
            loss_mask[scores.failed.to(device)] = 0
            if cfg.mask_truncated_completions:
                ended = (c_ids == tokenizer.eos_token_id) & c_mask.bool()
                loss_mask[~ended.any(dim=1)] = 0
            t2 = clock(device)
            # 3. the loss on hidden states through the fused kernel; old / reference log-probs only if needed.
            # dapo divides by the active tokens of all ranks; DDP / FSDP average the ranks' gradients: / world
            n_items = all_sum(loss_mask.sum().float(), dist).clamp(min=1) / dist.world
            # micro-batches of whole groups: (prompts, their G completions each)
            micro_prompts = torch.arange(len(rows), device=device).chunk(cfg.gradient_accumulation_steps)
            micro = [(pi[:, None] * G + torch.arange(G, device=device)).reshape(-1) for pi in micro_prompts]
            batches = [(p_ids[pi], p_mask[pi], c_ids[i], c_mask[i]) for pi, i in zip(micro_prompts, micro)]
            with torch.no_grad():
                old = [policy(sequence_logps, b, cfg) for b in batches] if cfg.num_iterations > 1 else None
                ref = None
                if cfg.beta != 0.0:
                    ctx = model.disable_adapter() if info["lora"] else nullcontext()
                    with ctx:
                        ref = [(ref_policy or policy)(sequence_logps, b, cfg) for b in batches]
            policy.train()
            for _ in range(cfg.num_iterations):
                metrics_acc = {}
                for k, (i, b) in enumerate(zip(micro, batches)):
                    with gradient_sync(policy, k == len(micro) - 1):
                        loss, m = policy(
                            policy_loss,
                            b,
                            loss_mask[i],
                            advantages[i],
                            old[k] if old else None,
                            ref[k] if ref else None,
                            cfg,
                            n_items,
                        )
                        # dapo is already normalized over the whole step; the others average the micro-batches
                        (loss if cfg.loss_type == "dapo" else loss / len(micro)).backward()
                    metrics_acc["loss"] = metrics_acc.get("loss", 0.0) + loss.detach() * (
                        1 if cfg.loss_type == "dapo" else 1 / len(micro)
                    )
                    for key, v in m.items():
                        metrics_acc[key] = metrics_acc.get(key, 0.0) + v.detach() / len(micro)
                grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)).item()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                bar.update(1)
            t3 = clock(device)
            elapsed_train += t3 - t0
            # 4. log: the loss summed over ranks' shares, token metrics weighted by each rank's active tokens,
            # rewards and tokens of the global batch
            metrics_acc = reduce_metrics(metrics_acc, loss_mask.sum(), dist)
            all_scores = all_gather_rows(scores.per_func.to(device), dist).cpu()
            counts = all_sum(torch.stack([p_mask.sum() * G + c_mask.sum(), c_mask.sum()]).float(), dist)
            n_tokens, n_completion_tokens = counts.tolist()  # tokens as if unshared: comparable across modes
            valid = all_rewards[~all_rewards.isnan()]
            record = {
                "step": step,
                "reward_mean": float(all_rewards.nanmean()),
                "reward_std": float(valid.std()) if len(valid) > 1 else 0.0,
                **{f"rewards/{n}_mean": float(all_scores[:, j].nanmean()) for j, n in enumerate(names)},
                "kl": metrics_acc.get("kl", 0.0),
                "clip_ratio": metrics_acc["clip_ratio"],
                "loss": metrics_acc["loss"],
                "grad_norm": grad_norm,
                "completion_len_mean": n_completion_tokens / len(all_rewards),
                "tokens_per_s": n_tokens / (t3 - t0),
                "peak_mem_mb": peak_mem_mb(device),
                "lr": scheduler.get_last_lr()[0],
                "time_generate_s": t1 - t0,
                "time_reward_s": t2 - t1,
                "time_train_s": t3 - t2,
                "elapsed_s": elapsed_train,
            }
            if step % cfg.logging_steps == 0 or step >= cfg.max_steps:
                log_record(record)
            if eval_rows and cfg.eval_steps and step % cfg.eval_steps == 0:
                last_eval = evaluate(policy, tokenizer, eval_rows, reward_funcs, cfg, device, dist)
                log_record({"step": step, **last_eval})
            bar.set_postfix(
                reward=f"{record['reward_mean']:.3f}",
                acc=f"{last_eval.get('eval_accuracy', 0):.2f}",
                kl=f"{record['kl']:.3g}",
                len=f"{record['completion_len_mean']:.1f}",
                tok_s=f"{record['tokens_per_s']:.0f}",
            )
            if cfg.save_steps and step % cfg.save_steps == 0:
                save(step)
        if not stopped:  # a signal during the last step
            (stopped,) = agreed([signals["stop"]], dist)
    bar.close()
    if stopped:
        path = save(step)
        if dist.main:
            print(f"interrupted: checkpoint saved to {path}", flush=True)
            log.close()
        policy = ref_policy = model = ref_model = params = optimizer = scheduler = None  # see shutdown()
        shutdown(dist)
        sys.exit(130)
    if eval_rows and (not last_eval or not cfg.eval_steps or step % cfg.eval_steps):
        last_eval = evaluate(policy, tokenizer, eval_rows, reward_funcs, cfg, device, dist)
        log_record({"step": step, **last_eval})
    final = save(step)
    summary = {
        "step": step,
        "elapsed_train_s": elapsed_train,
        **last_eval,
        "checkpoint": str(final),
        "metrics": str(out / "metrics.jsonl"),
    }
    if dist.main:
        log.close()
        drawn = plot_curves(out / "metrics.jsonl", out / "curves.png")
        summary["plot"] = str(out / "curves.png") if drawn else None
        print(f"done: {json.dumps(summary)}", flush=True)
        print(
            f"outputs in {out}/: metrics.jsonl (per-step metrics, eval records), "
            f"{'curves.png, ' if drawn else ''}config.json, {final.name}/",
            flush=True,
        )
    policy = ref_policy = model = ref_model = params = optimizer = scheduler = None  # see shutdown()
    shutdown(dist)
    return summary


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
