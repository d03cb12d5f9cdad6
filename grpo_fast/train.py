"""GRPO training loop, top to bottom.

Variant: GRPO (DeepSeekMath) with TRL 1.16 GRPOTrainer semantics. Per step: sample G completions for each of
`prompts_per_step` prompts; score them with the reward functions (weighted sum, None = no opinion); advantages
`(r - group mean) / (group std + eps)` (or batch std, or unscaled: `scale_rewards`); then `num_iterations`
AdamW updates on the clipped probability-ratio loss, two-sided clip [1 - epsilon, 1 + epsilon_high], token-
or sequence-level (GSPO) ratios, optional k3 KL to the reference model (beta), normalized as `loss_type`
(default "dapo": summed over tokens, divided by the active tokens of the whole step). With num_iterations 1
the update is on-policy (ratio 1, old log-probs never computed). Log-probs come from the model's last hidden
state and LM head through `fused_linear_grpo_loss`: the (tokens x vocab) logits are never materialized.

    python -m grpo_fast.train [--flag value ...]      (or: grpo-fast train ...)
"""

import copy
import json
import math
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
from .kernels import fused_linear_grpo_loss, fused_linear_logprobs, group_advantages
from .modeling import (
    completion_hidden_states,
    lm_head_of,
    load_model_and_tokenizer,
    load_weights_from_checkpoint,
)
from .rewards import load_reward, reward_name, score
from .shared_prefix import generate_groups

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
def evaluate(model, tokenizer, rows, reward_funcs, cfg, device) -> dict:
    """Greedy accuracy on held-out prompts: the share whose first reward function pays its full 1.0."""
    model.eval()
    hits, total = [], 0.0
    for i in range(0, len(rows), 64):
        chunk = rows[i : i + 64]
        texts, ids, mask = encode_prompts(chunk, tokenizer, cfg.max_prompt_length, device)
        comp, cmask = generate_groups(
            model,
            ids,
            mask,
            1,
            cfg.max_completion_length,
            temperature=0.0,
            eos_token_id=tokenizer.eos_token_id,
            share_prefix=False,
        )
        completions = tokenizer.batch_decode(comp * cmask, skip_special_tokens=True)
        cols = reward_columns(chunk, 1, comp, cmask)
        values = score(reward_funcs[:1], [1.0], texts, completions, cols, on_error="skip").per_func[:, 0]
        hits += (values >= 1.0 - 1e-6).tolist()
        total += len(chunk)
    return {"eval_accuracy": sum(hits) / max(1.0, total), "eval_samples": int(total)}


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

    def __init__(self, out_dir: Path, report_to: str, cfg: dict, append: bool):
        self.path = out_dir / "metrics.jsonl"
        self.fh = open(self.path, "a" if append else "w")
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


def plot_curves(metrics_path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    out.mkdir(parents=True, exist_ok=True)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

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

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    sampler = PromptSampler(train_rows, cfg.prompts_per_step, cfg.seed)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)

    step, elapsed_train = 0, 0.0
    resume_from = ckpt_mod.latest_checkpoint(out) if cfg.resume else None
    stale = [] if cfg.resume else ckpt_mod.list_checkpoints(out)
    if stale and not cfg.overwrite_output_dir:  # never mix two runs' checkpoints, never delete unasked
        raise ValueError(
            f"--output-dir {out} already holds checkpoints ({stale[-1].name}, ...): pass --resume to "
            "continue that run, --overwrite-output-dir to start afresh, or another --output-dir"
        )
    for old_ckpt in stale:
        shutil.rmtree(old_ckpt)
    if resume_from is not None:
        load_weights_from_checkpoint(model, resume_from, info["lora"])
        state = ckpt_mod.load_training_state(resume_from, optimizer, scheduler, generator)
        sampler.load_state_dict(state["sampler"])
        step, elapsed_train = state["step"], state.get("elapsed_train_s", 0.0)
    resolved = {**to_dict(cfg), "resolved": info}
    (out / "config.json").write_text(json.dumps(resolved, indent=2))
    log = MetricsLog(out, cfg.report_to, resolved, append=resume_from is not None)
    print(
        f"grpo-fast: {info['model']} ({info['n_params'] / 1e6:.2f}M params, {info['n_trainable'] / 1e6:.2f}M "
        f"trainable) on {device}; {len(train_rows)} train / {len(eval_rows)} eval prompts; output {out}\n"
        f"config: {json.dumps(to_dict(cfg))}",
        flush=True,
    )

    def save(at_step):
        extra = {"elapsed_train_s": elapsed_train, "config": to_dict(cfg)}
        return ckpt_mod.save_checkpoint(
            out,
            at_step,
            model,
            tokenizer,
            optimizer,
            scheduler,
            sampler.state_dict(),
            generator,
            extra,
            cfg.save_total_limit,
        )

    last_eval = {}
    if eval_rows and step == 0:
        last_eval = evaluate(model, tokenizer, eval_rows, reward_funcs, cfg, device)
        log.write({"step": 0, **last_eval})
        print(f"step 0: held-out accuracy {last_eval['eval_accuracy']:.3f}", flush=True)

    bar = tqdm(total=cfg.max_steps, initial=step, desc="grpo", dynamic_ncols=True, disable=None)
    with stop_on_signals() as signals:
        while step < cfg.max_steps and not signals["stop"]:
            if cfg.time_budget_s and elapsed_train >= cfg.time_budget_s:
                print(f"time budget of {cfg.time_budget_s:.0f}s reached at step {step}", flush=True)
                break
            t0 = time.perf_counter()
            # 1. rollout: G completions per prompt
            rows = sampler.next()
            texts, p_ids, p_mask = encode_prompts(rows, tokenizer, cfg.max_prompt_length, device)
            model.eval()
            c_ids, c_mask = generate_groups(
                model,
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
            )
            t1 = time.perf_counter()
            # 2. rewards, then group advantages
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
            advantages = advantages_of(scores.rewards, G, cfg.scale_rewards).to(device)
            loss_mask = c_mask.clone()
            loss_mask[scores.failed.to(device)] = 0
            if cfg.mask_truncated_completions:
                ended = (c_ids == tokenizer.eos_token_id) & c_mask.bool()
                loss_mask[~ended.any(dim=1)] = 0
            t2 = time.perf_counter()
            # 3. the loss on hidden states through the fused kernel; old / reference log-probs only if needed
            n_items = loss_mask.sum().clamp(min=1).float()
            # micro-batches of whole groups: (prompts, their G completions each)
            micro_prompts = torch.arange(len(rows), device=device).chunk(cfg.gradient_accumulation_steps)
            micro = [(pi[:, None] * G + torch.arange(G, device=device)).reshape(-1) for pi in micro_prompts]
            batches = [(p_ids[pi], p_mask[pi], c_ids[i], c_mask[i]) for pi, i in zip(micro_prompts, micro)]
            old = [sequence_logps(model, b, cfg) for b in batches] if cfg.num_iterations > 1 else None
            ref = None
            if cfg.beta != 0.0:
                ctx = model.disable_adapter() if info["lora"] else nullcontext()
                with ctx:
                    ref = [sequence_logps(ref_model or model, b, cfg) for b in batches]
            model.train()
            for _ in range(cfg.num_iterations):
                metrics_acc = {}
                for k, (i, b) in enumerate(zip(micro, batches)):
                    loss, m = policy_loss(
                        model,
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
                    metrics_acc["loss"] = metrics_acc.get("loss", 0.0) + loss.item() * (
                        1 if cfg.loss_type == "dapo" else 1 / len(micro)
                    )
                    for key, v in m.items():
                        metrics_acc[key] = metrics_acc.get(key, 0.0) + v.item() / len(micro)
                grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm).item()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                bar.update(1)
            t3 = time.perf_counter()
            elapsed_train += t3 - t0
            # 4. log
            n_tokens = int(p_mask.sum() * G + c_mask.sum())  # as if unshared: comparable across modes
            record = {
                "step": step,
                "reward_mean": float(scores.rewards.nanmean()),
                "reward_std": float(scores.rewards[~scores.rewards.isnan()].std())
                if len(completions) > 1
                else 0.0,
                **{f"rewards/{n}_mean": float(scores.per_func[:, j].nanmean()) for j, n in enumerate(names)},
                "kl": metrics_acc.get("kl", 0.0),
                "clip_ratio": metrics_acc["clip_ratio"],
                "loss": metrics_acc["loss"],
                "grad_norm": grad_norm,
                "completion_len_mean": float(c_mask.sum(1).float().mean()),
                "tokens_per_s": n_tokens / (t3 - t0),
                "peak_mem_mb": peak_mem_mb(device),
                "lr": scheduler.get_last_lr()[0],
                "time_generate_s": t1 - t0,
                "time_reward_s": t2 - t1,
                "time_train_s": t3 - t2,
                "elapsed_s": elapsed_train,
            }
            if step % cfg.logging_steps == 0 or step >= cfg.max_steps:
                log.write(record)
            if eval_rows and cfg.eval_steps and step % cfg.eval_steps == 0:
                last_eval = evaluate(model, tokenizer, eval_rows, reward_funcs, cfg, device)
                log.write({"step": step, **last_eval})
            bar.set_postfix(
                reward=f"{record['reward_mean']:.3f}",
                acc=f"{last_eval.get('eval_accuracy', 0):.2f}",
                kl=f"{record['kl']:.3g}",
                len=f"{record['completion_len_mean']:.1f}",
                tok_s=f"{record['tokens_per_s']:.0f}",
            )
            if cfg.save_steps and step % cfg.save_steps == 0:
                save(step)
    bar.close()
    if signals["stop"]:
        path = save(step)
        print(f"interrupted: checkpoint saved to {path}", flush=True)
        log.close()
        sys.exit(130)
    if eval_rows and (not last_eval or not cfg.eval_steps or step % cfg.eval_steps):
        last_eval = evaluate(model, tokenizer, eval_rows, reward_funcs, cfg, device)
        log.write({"step": step, **last_eval})
    final = save(step)
    log.close()
    plot_curves(out / "metrics.jsonl", out / "curves.png")
    summary = {
        "step": step,
        "elapsed_train_s": elapsed_train,
        **last_eval,
        "checkpoint": str(final),
        "metrics": str(out / "metrics.jsonl"),
        "plot": str(out / "curves.png"),
    }
    print(f"done: {json.dumps(summary)}", flush=True)
    print(
        f"outputs in {out}/: metrics.jsonl (per-step metrics, eval records), curves.png, config.json, "
        f"{final.name}/",
        flush=True,
    )
    return summary


def main(argv=None) -> None:
    try:
        train(parse_config(argv))
    except ValueError as err:  # bad input: flags, files, data, reward functions
        print(f"grpo-fast: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
