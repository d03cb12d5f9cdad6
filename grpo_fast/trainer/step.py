"""One GRPO step in its phases: rollout -> rewards and group advantages -> optimization -> its log record.

Each phase is a function of the run (grpo_fast.trainer.setup.Run) and the previous phase's result;
`grpo_fast.trainer.train` calls them in order. Distributed (torchrun), each rank runs them on its share of
the global batch: rewards are all-gathered so that advantages are the global batch's, and the dapo token
count is all-reduced.
"""

import math
import os
import socket
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..kernels import fused_linear_grpo_loss, fused_linear_logprobs, group_advantages
from ..kernels._common import autocast_off
from ..kernels.loss_variants import adaptive_entropy_coef
from ..models.model_parts import lm_head_of
from ..rewards import score, weighted_sum
from ..rollout import generate_groups, is_exact, native, resolve_engine, server, vllm_engine
from ..rollout.trajectories import generate_trajectories
from .batching import partition, split_to
from .config import GRPOConfig, generation_steps, server_urls
from .data import render_prompt
from .distributed import DistInfo, all_done, all_gather_rows, all_sum, full_tensor, gradient_sync
from .modeling import completion_hidden_states
from .precision import of_config as precision_of
from .precision import rollout_dtype_of


@dataclass
class Rollout:
    texts: list  # the prompts as rendered (chat template applied)
    prompt_ids: torch.Tensor  # (n, P) left-padded
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor  # (n * G, C)
    completion_mask: torch.Tensor
    sampling_logps: torch.Tensor  # (n * G, C) the engine's log-probs of its samples (rollout mismatch)
    engine: str  # the engine that ran: native | reference | vllm
    rollout_dtype: str = "model"  # the precision it ran in ("model": the policy's own)
    # multi-turn (tools / environments): 1 on the model's tokens, 0 on the tools' (None: single-turn)
    tool_mask: torch.Tensor | None = None
    messages: list | None = None  # per completion: its assistant and tool messages
    environments: list | None = None  # per completion, with an environment
    tool_metrics: dict | None = None  # tools/call_frequency, tools/failure_frequency, turns_mean

    @property
    def model_mask(self) -> torch.Tensor:
        """The tokens the model wrote (what the loss and every token count see)."""
        return self.completion_mask if self.tool_mask is None else self.completion_mask * self.tool_mask


@dataclass
class Scored:
    scores: object  # rewards.Scores of this rank's completions
    all_scores: torch.Tensor  # (global n * G, functions) each reward function's, NaN where it did not score
    all_rewards: torch.Tensor  # (global n * G,) weighted rewards, NaN where no function scored
    advantages: torch.Tensor  # (n * G,) this rank's
    zero_std: torch.Tensor  # (global n * G,) TRL's is_std_zero: the std the row's advantage divides by is 0
    completions: list  # (n * G,) this rank's, as the reward functions read them (texts, or messages)
    loss_mask: torch.Tensor  # (n * G, C) completion mask minus failed / truncated samples


# --------------------------------------------------------------------------------------------------------
# 1. rollout
# --------------------------------------------------------------------------------------------------------
def encode_prompts(rows, tokenizer, max_prompt_length, device, template_kwargs=None):
    texts = [render_prompt(r["prompt"], tokenizer, template_kwargs) for r in rows]
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


def engine_options(cfg: GRPOConfig, identity: str = "") -> dict:
    """The rollout engine and its settings, as `generate_groups` takes them; `identity`: the name vLLM servers
    know the run by (Run.identity; default `run_name`)."""
    compile = {"auto": "auto", "graphs": "graphs", "on": True, "off": False}[cfg.rollout_compile]
    opts = {"engine": cfg.rollout, "compile": compile}
    if rollout_dtype_of(cfg) != "model":
        opts["rollout_dtype"] = rollout_dtype_of(cfg)
    if cfg.rollout == "vllm" and cfg.vllm_mode == "server":
        opts["vllm_options"] = {
            "mode": "server", "urls": server_urls(cfg), "wait_s": cfg.vllm_server_timeout,
            "timeout": cfg.vllm_request_timeout_s, "weight_dir": cfg.vllm_weight_dir,
            "auto_push": cfg.max_staleness == 0,  # asynchronous: the trainer pushes after each step
            "run": identity or run_name(cfg), "context": cfg.max_prompt_length + cfg.max_completion_length,
            "adapters_allowed": cfg.max_staleness + 1,  # LoRA adapters pushed alone: a warning beyond
        }  # fmt: skip
    elif cfg.rollout == "vllm":
        opts["vllm_options"] = {
            "max_model_len": cfg.max_prompt_length + cfg.max_completion_length,
            "gpu_memory_utilization": cfg.vllm_gpu_memory_utilization,
            "kv_cache_gb": cfg.vllm_kv_cache_gb,
            # the training temperature, even in eval
            "logprobs_mode": vllm_engine.logprobs_mode_for(cfg.temperature),
        }
    return opts


def run_name(cfg: GRPOConfig) -> str:
    """The name a vLLM server knows a run by where the trainer gave none (a bare `generate_groups` call): the
    host and the output directory. The trainer's own (Run.identity) is stored in the output directory and
    agreed by its ranks, so that ranks on several hosts and a --resume on another host are the same run."""
    return f"{socket.gethostname()}:{os.path.abspath(cfg.output_dir)}"


def rollout(run, rows, generator=None) -> Rollout:
    """G completions for each of `rows`' prompts, sampled by the policy (eval mode, no grad); `generator`:
    another sampling stream than the run's (asynchronous generation, on its own thread)."""
    if run.multi_turn:
        return multi_turn_rollout(run, rows, generator)
    cfg = run.cfg
    texts, p_ids, p_mask = encode_prompts(
        rows, run.tokenizer, cfg.max_prompt_length, run.device, cfg.chat_template_kwargs
    )
    through = generating_through(run)
    finished = (lambda done: all_done(done, run.dist)) if run.dist.on and not server_mode(cfg) else None
    with torch.no_grad():
        c_ids, c_mask, c_logp = through(
            generate_groups,
            p_ids,
            p_mask,
            cfg.num_generations,
            cfg.max_completion_length,
            all_done=finished,
            return_logprobs=True,
            **sampling_options(run, generator),
            **engine_options(cfg, run.identity),
        )
    return Rollout(texts, p_ids, p_mask, c_ids, c_mask, c_logp, *engine_that_ran(run))


def generating_through(run):
    """What a rollout runs through: `fn(model, ...)`. The policy (DDP / FSDP hooks see the parameters' use),
    in eval mode; on vLLM servers the bare model, never its parameters: it may train meanwhile, and (torchrun)
    no collective may run on the generation thread."""
    if server_mode(run.cfg):
        return lambda fn, *args, **kwargs: fn(run.model, *args, **kwargs)
    run.policy.eval()
    return run.policy


def server_mode(cfg: GRPOConfig) -> bool:
    return cfg.rollout == "vllm" and cfg.vllm_mode == "server"


def sampling_options(run, generator=None) -> dict:
    """How rollouts sample, as `generate_groups` / `generate_trajectories` take it."""
    return dict(
        **draw_options(run.cfg), eos_token_id=run.tokenizer.eos_token_id, share_prefix=run.cfg.share_prefix,
        generator=run.generator if generator is None else generator,
    )  # fmt: skip


def draw_options(cfg: GRPOConfig) -> dict:
    """The options that shape each draw: temperature, the filters, the repetition penalty."""
    return dict(
        temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, min_p=cfg.min_p or 0.0,
        repetition_penalty=cfg.repetition_penalty,
    )  # fmt: skip


def engine_that_ran(run) -> tuple[str, str]:
    """(engine, rollout dtype) of the rollout just made: what decides the mismatch correction."""
    if server_mode(run.cfg):
        dtype = server.engine_for(run.model).dtype
        short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)
        return "vllm", "model" if dtype == str(run.model.dtype).removeprefix("torch.") else short
    engine, _ = resolve_engine(run.model, run.cfg.rollout)
    if engine == "native":
        return engine, native.engine_for(run.model).rollout_dtype
    return engine, vllm_engine.engine_for(run.model).rollout_dtype if engine == "vllm" else "model"


def server_metrics(run) -> dict:
    """A LoRA run pushing its adapter alone to vLLM servers: the adapters the fullest server holds after the
    last push, and the unloads that failed so far (each retried at the next push)."""
    if not server_mode(run.cfg):
        return {}
    engine = server.engine_for(run.model)
    if not engine.adapters:
        return {}
    return {"vllm/adapters_loaded": engine.stats["adapters_loaded"],
            "vllm/failed_unloads": engine.stats["failed_unloads"]}  # fmt: skip


def native_metrics(run) -> dict:
    """The native engine on batch buckets (CUDA graphs, its default on CUDA): the graphs it holds and the
    seconds spent capturing them so far (a new call shape captures again)."""
    if server_mode(run.cfg) or resolve_engine(run.model, run.cfg.rollout)[0] != "native":
        return {}
    engine = native.engine_for(run.rollout_copy or run.model)
    if not engine.last_call.get("buckets"):
        return {}
    return {"rollout/cuda_graphs": engine.stats["graphs"], "rollout/capture_s": engine.stats["capture_s"]}


def multi_turn_rollout(run, rows, generator=None) -> Rollout:
    """G trajectories for each of `rows`' prompts in which the model may call tools (grpo_fast.rollout.
    trajectories): one completion per trajectory, model and tool turns interleaved, `tool_mask` telling them
    apart."""
    cfg = run.cfg
    with torch.no_grad():
        tr = generating_through(run)(
            generate_trajectories,
            run.tokenizer,
            [r["prompt"] for r in rows],
            cfg.num_generations,
            cfg.max_completion_length,
            tools=run.tools,
            environment_factory=run.environment_factory,
            rows=rows,
            max_tool_calling_iterations=cfg.max_tool_calling_iterations,
            tool_timeout_s=cfg.tool_timeout_s,
            max_prompt_length=cfg.max_prompt_length,
            chat_template_kwargs=cfg.chat_template_kwargs,
            **sampling_options(run, generator),
            **engine_options(cfg, run.identity),
        )
    n = len(tr.turns)
    metrics = {
        "tools/call_frequency": sum(tr.tool_calls) / n,
        "tools/failure_frequency": sum(tr.tool_failures) / max(1, sum(tr.tool_calls)),
        "turns_mean": sum(tr.turns) / n,
        "tool_tokens_mean": float((tr.completion_mask * (1 - tr.tool_mask)).sum()) / n,
    }
    return Rollout(
        tr.texts, tr.prompt_ids, tr.prompt_mask, tr.completion_ids, tr.completion_mask, tr.logprobs,
        *engine_that_ran(run), tr.tool_mask, tr.messages, tr.environments, metrics,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------------
# 2. rewards and advantages
# --------------------------------------------------------------------------------------------------------
def reward_columns(rows, G, completion_ids, completion_mask):
    """Every dataset column but `prompt`, repeated per completion, plus the completions' token ids."""
    cols = {k: [r[k] for r in rows for _ in range(G)] for k in rows[0] if k != "prompt"}
    cols["completion_ids"] = [ids[m.bool()].tolist() for ids, m in zip(completion_ids, completion_mask)]
    return cols


def reward_function_metrics(run) -> dict:
    """What reward functions report of their last call (`f.last_metrics`: the code reward's sandbox
    failures), this rank's, as rewards/<name>/<key>."""
    return {
        f"rewards/{name}/{k}": v
        for f, name in zip(run.reward_funcs, run.reward_names)
        for k, v in (getattr(f, "last_metrics", None) or {}).items()
    }


EPS = 1e-4  # TRL's, added to every std an advantage divides by


def _nanstd(x: torch.Tensor, dim=None) -> torch.Tensor:
    """The unbiased std of the values that are not NaN (TRL's nanstd): NaN where fewer than two are."""
    keep = dim is not None
    mean = x.nanmean(dim=dim, keepdim=True) if keep else x.nanmean()
    count = (~x.isnan()).sum(dim=dim, keepdim=keep) if keep else (~x.isnan()).sum()
    var = ((x - mean) ** 2).nanmean(dim=dim, keepdim=keep) * count / (count - 1)
    return var.masked_fill(count < 2, float("nan")).sqrt()


def normalized(x: torch.Tensor, G: int, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x (rows,) less its group's mean, over the group's std + EPS ("group"), the batch's ("batch") or
    nothing ("none"), as TRL's advantages: NaN-aware (NaN values neither counted nor given a value; a std
    over fewer than two values is NaN, and so are the advantages it divides), exactly 0 where a group's
    values are all equal (as the kernel gives); and TRL's is_std_zero per row. Finite x runs the
    group-advantage kernel."""
    groups = x.view(-1, G)
    if scale == "batch":
        std = (_nanstd(x) if x.numel() > 1 else x.new_zeros(())).expand_as(groups)
    else:
        std = (_nanstd(groups, 1) if G > 1 else groups.new_zeros(len(groups), 1)).expand_as(groups)
    zero = torch.isclose(std, torch.zeros_like(std)).reshape(-1)
    if not x.isnan().any():
        return group_advantages(x, G, scale=scale, eps=EPS), zero
    nan = groups.isnan()
    equal = groups.masked_fill(nan, -torch.inf).amax(1) == groups.masked_fill(nan, torch.inf).amin(1)
    adv = (groups - groups.nanmean(1, keepdim=True)).masked_fill(equal[:, None], 0.0)
    return (adv if scale == "none" else adv / (std + EPS)).reshape(-1), zero


def advantages_of(per_func: torch.Tensor, weights, G: int, scale: str, aggregation: str):
    """TRL 1.16's advantages from each reward function's scores `per_func` (rows, functions; NaN where one
    did not score a row): sum_then_normalize, the weighted sum normalized within its group as `scale` says;
    normalize_then_sum (GDPO), each function's scores normalized within their group, their weighted sum over
    the batch (`scale` unused). A row no function scored, or whose advantage is otherwise NaN, gets 0: it
    does not move the policy. Returns the weighted sums (the logged rewards: NaN where no function scored),
    the advantages and TRL's is_std_zero per row."""
    rewards = weighted_sum(per_func, weights)
    if aggregation == "normalize_then_sum":
        each = torch.stack([normalized(f, G, "group")[0] for f in per_func.unbind(1)], 1)
        w = torch.as_tensor(weights, dtype=each.dtype, device=each.device)
        summed = (each * w).nansum(1).masked_fill(rewards.isnan(), float("nan"))  # NaN: no function scored
        adv, zero = normalized(summed, len(summed), "group")
    else:
        adv, zero = normalized(rewards, G, scale)
    return rewards, adv.nan_to_num(0.0), zero


def score_rollout(run, rows, ro: Rollout) -> Scored:
    """Rewards of this rank's completions, group advantages over the global batch, the loss mask."""
    cfg, G, dist = run.cfg, run.cfg.num_generations, run.dist
    columns = reward_columns(rows, G, ro.completion_ids, ro.model_mask)
    if ro.messages is not None:  # multi-turn: the trajectory's messages, as TRL passes them
        completions = ro.messages
        if ro.environments is not None:
            columns["environments"] = ro.environments
    else:
        completions = run.tokenizer.batch_decode(
            ro.completion_ids * ro.completion_mask, skip_special_tokens=True
        )
    scores = score(
        run.reward_funcs,
        run.reward_weights,
        [t for t in ro.texts for _ in range(G)],
        completions,
        columns,
        on_error=cfg.on_reward_error,
    )
    all_scores = all_gather_rows(scores.per_func.to(run.device), dist)
    all_rewards, advantages, zero_std = advantages_of(
        all_scores, run.reward_weights, G, cfg.scale_rewards, cfg.multi_objective_aggregation
    )
    advantages = advantages[dist.rank * len(completions) : (dist.rank + 1) * len(completions)]
    loss_mask = ro.model_mask.clone()  # tool tokens are attended, never trained on nor counted
    loss_mask[scores.failed.to(run.device)] = 0
    if cfg.mask_truncated_completions:  # truncated: the last token is not EOS
        last = (ro.completion_mask.sum(1) - 1).clamp(min=0)
        ended = ro.completion_ids.gather(1, last[:, None]).squeeze(1) == run.tokenizer.eos_token_id
        loss_mask[~(ended & ro.completion_mask.any(1).bool())] = 0
    return Scored(scores, all_scores, all_rewards, advantages, zero_std, completions, loss_mask)


def completion_samples(run, ro: Rollout, sc: Scored) -> list[dict]:
    """The step's samples for --log-completions, every rank's on the main rank ([] elsewhere): the prompt and
    the completion as the reward functions read them, each function's score (None: not scored), the
    advantage."""
    G, dist = run.cfg.num_generations, run.dist
    first = dist.rank * len(sc.completions)
    advantages, scores = sc.advantages.tolist(), sc.all_scores[first : first + len(sc.completions)].tolist()
    mine = [
        {"step": run.step, "prompt": ro.texts[i // G], "completion": c, "advantage": advantages[i],
         "rewards": {n: None if math.isnan(v) else v for n, v in zip(run.reward_names, scores[i])}}
        for i, c in enumerate(sc.completions)
    ]  # fmt: skip
    if not dist.on:
        return mine
    every = [None] * dist.world
    torch.distributed.all_gather_object(every, mine)
    return [x for part in every for x in part] if dist.main else []


# --------------------------------------------------------------------------------------------------------
# 3. optimization
# --------------------------------------------------------------------------------------------------------
@torch.no_grad()
def sequence_logps(model, batch, cfg: GRPOConfig):
    """Per-token log-probs (no grad) of the completions, through the fused kernel (old / reference), in the
    training precision."""
    device = batch[0].device
    with precision_of(cfg).autocast_context(device):
        hidden = completion_hidden_states(model, *batch[:4], share_prefix=cfg.share_prefix, counts=batch[4])
        head = lm_head_of(model)
        hidden, precision = head_input(hidden, cfg)
        with precision:
            return fused_linear_logprobs(
                hidden, head.weight, batch[2], bias=head.bias, temperature=cfg.temperature
            )


def head_input(hidden, cfg: GRPOConfig):
    """The LM head's input and the precision its GEMM runs in: the training forward's (under --bf16 / --fp16
    a 16-bit GEMM, fp32 accumulation in the kernels), or under cast_lm_head_to_fp32 (TRL's, the ScaleRL
    recipe) fp32, outside the autocast region, on the fp32 weights."""
    if not cfg.cast_lm_head_to_fp32:
        return hidden, nullcontext()
    return hidden.float(), autocast_off(hidden.device)


def sampling_correction(cfg: GRPOConfig, engine: str, rollout_dtype: str = "model"):
    """The rollout-mismatch correction mode, or None when the engine is the training forward (TRL's
    vllm_importance_sampling_correction, on for every engine or rollout dtype that is not exact; in 16-bit
    training no engine is: its decode-shaped GEMMs round differently from the training forward's; nor is any
    under --max-staleness > 0, whose samples may come from older weights)."""
    exact = is_exact(engine, rollout_dtype) and precision_of(cfg).exact_rollout_possible
    exact = exact and not cfg.max_staleness
    if exact or not cfg.vllm_importance_sampling_correction:
        return None
    return cfg.vllm_importance_sampling_mode


def loss_options(cfg: GRPOConfig, engine: str, rollout_dtype: str = "model") -> dict:
    """The fused loss's options from the config (TRL's names mapped to the kernel's)."""
    return dict(
        beta=cfg.beta,
        use_bias_correction_kl=cfg.use_bias_correction_kl,
        epsilon_low=cfg.epsilon,
        epsilon_high=cfg.epsilon_high,
        loss_type=cfg.loss_type,
        importance_sampling_level=cfg.importance_sampling_level,
        max_completion_length=cfg.max_completion_length,
        delta=cfg.delta,
        sampling_correction=sampling_correction(cfg, engine, rollout_dtype),
        sampling_clip_max=cfg.vllm_importance_sampling_clip_max,
        sampling_clip_min=cfg.vllm_importance_sampling_clip_min,
        off_policy_mask_threshold=cfg.off_policy_mask_threshold,
        sapo_temperature_pos=cfg.sapo_temperature_pos,
        sapo_temperature_neg=cfg.sapo_temperature_neg,
        vespo_k_pos=cfg.vespo_k_pos,
        vespo_lambda_pos=cfg.vespo_lambda_pos,
        vespo_k_neg=cfg.vespo_k_neg,
        vespo_lambda_neg=cfg.vespo_lambda_neg,
        top_entropy_quantile=cfg.top_entropy_quantile,
    )


def policy_loss(
    model, batch, loss_mask, advantages, old_logps, ref_logps, sampling_logps, n_items, cfg, options
):
    """The GRPO loss of one micro-batch, from the policy's last hidden states through the fused kernel (the
    caller runs it inside the training precision's autocast region)."""
    hidden = completion_hidden_states(model, *batch[:4], share_prefix=cfg.share_prefix, counts=batch[4])
    head = lm_head_of(model)
    hidden, precision = head_input(hidden, cfg)
    with precision:
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
            sampling_logps=sampling_logps,
            num_items_in_batch=n_items,
            **options,
        )


def micro_batches(ro: Rollout, loss_mask, cfg: GRPOConfig, packer=None, dist: DistInfo | None = None):
    """Each optimizer step's micro-batches: a list, a step each (`generation_steps`: the rollout's prompts cut
    in order), of (prompt indices, completion rows, completions per prompt, loss weight) lists
    (grpo_fast.trainer.batching: the configured layout, or packed to `packer`'s budget from the real lengths;
    distributed ranks agree on each step's count). The weights make a step's summed gradients those of its
    whole chunks: dapo, cispo and vespo are normalized over the step already (1); grpo and dr_grpo average a
    chunk's rows, bnpo divides by its active tokens, so a micro-batch counts as its share of its chunk's rows
    (tokens), and each chunk as 1 / gradient_accumulation_steps."""
    n, P = ro.prompt_ids.shape
    G, C = cfg.num_generations, ro.completion_ids.shape[1]
    prompt_lens = ro.prompt_mask.sum(1).tolist()
    completion_lens = ro.completion_mask.sum(1).tolist()
    chunks, steps = cfg.gradient_accumulation_steps, generation_steps(cfg)
    parts = partition(prompt_lens, completion_lens, G, chunks * steps, P, C, cfg.group_split, packer)
    by_step = [parts[j * chunks : (j + 1) * chunks] for j in range(steps)]
    if packer is not None and dist is not None and dist.on:
        count = torch.tensor([[sum(len(p) for p in step)] for step in by_step], device=ro.prompt_ids.device)
        most = all_gather_rows(count, dist).view(-1, steps).max(0).values.tolist()
        by_step = [split_to(step, int(c)) for step, c in zip(by_step, most)]
    device = loss_mask.device
    tokens = loss_mask.sum(1).float().tolist()
    out = []
    for step in by_step:
        prompts, rows, counts, weights = [], [], [], []
        for chunk in step:
            chunk_rows = [r for part in chunk for _, rs in part for r in rs]
            for part in chunk:
                r = [x for _, rs in part for x in rs]
                if cfg.loss_type in ITEM_NORMALIZED:  # normalized over the whole step already
                    w = 1.0
                elif cfg.loss_type == "bnpo":
                    w = sum(tokens[x] for x in r) / max(1.0, sum(tokens[x] for x in chunk_rows)) / chunks
                else:
                    w = len(r) / len(chunk_rows) / chunks
                prompts.append(torch.tensor([i for i, _ in part], device=device))
                rows.append(torch.tensor(r, device=device))
                counts.append([len(rs) for _, rs in part])
                weights.append(w)
        out.append((prompts, rows, counts, weights))
    return out


# how each loss type normalizes a micro-batch (kernels.loss_variants.NORMALIZERS): by its rows, by its active
# tokens, or by a count fixed for the whole step (num_items_in_batch)
ROW_NORMALIZED = ("grpo", "sapo", "dr_grpo", "luspo")
TOKEN_NORMALIZED = ("bnpo",)
ITEM_NORMALIZED = ("dapo", "cispo", "vespo")
CLIP_KEYS = ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "cispo_clip_ratio")


def skips_zero_advantage(cfg: GRPOConfig, dist: DistInfo) -> bool:
    """Whether groups whose every advantage is 0 may leave the optimization: exact when every per-token
    loss is proportional to the advantage (no KL term, no entropy bonus) and no token's gate depends on the
    micro-batch it is in (top_entropy_quantile); not under torchrun, whose ranks must run as many micro-
    batches each."""
    return (
        cfg.skip_zero_advantage_groups and cfg.beta == 0.0 and not entropy_bonus(cfg)
        and cfg.top_entropy_quantile >= 1.0 and not dist.on
    )  # fmt: skip


def drop_zero_advantage_groups(micro_prompts, micro, counts, weights, advantages, loss_mask, loss_type):
    """The micro-batches without their groups (or a split group's part) whose every row has advantage 0 or no
    trained token: such rows add exactly 0 to the loss and its gradient, so leaving them out changes neither
    once each micro-batch's weight keeps its normalizer's count (rows or active tokens) of the full micro-
    batch. Micro-batches left empty are dropped. Returns the four lists and the groups (parts) dropped."""
    still = ((advantages == 0) | (loss_mask.sum(1) == 0)).tolist()
    tokens = loss_mask.sum(1).float().tolist()
    out, dropped = ([], [], [], []), 0
    for prompts, rows, count, w in zip(micro_prompts, micro, counts, weights):
        rows_l, keep_p, keep_r, keep_c, start = rows.tolist(), [], [], [], 0
        for j, k in enumerate(count):
            part = rows_l[start : start + k]
            start += k
            if all(still[r] for r in part):
                dropped += 1
                continue
            keep_p.append(j)
            keep_r += part
            keep_c.append(k)
        if not keep_r:
            continue
        if loss_type in ROW_NORMALIZED:
            w = w * len(keep_r) / len(rows_l)
        elif loss_type in TOKEN_NORMALIZED:
            w = w * sum(tokens[r] for r in keep_r) / max(1.0, sum(tokens[r] for r in rows_l))
        out[0].append(prompts[torch.tensor(keep_p, device=prompts.device)])
        out[1].append(torch.tensor(keep_r, device=rows.device))
        out[2].append(keep_c)
        out[3].append(w)
    return (*out, dropped)


def accumulate(key, total, value, share):
    """A micro-batch's metric into the step's: min / max over micro-batches, else the token-share mean."""
    if total is None:
        return value if key.endswith(("_min", "_max")) else value * share
    if key.endswith("_min"):
        return torch.minimum(total, value)
    if key.endswith("_max"):
        return torch.maximum(total, value)
    return total + value * share


def optimize(run, ro: Rollout, sc: Scored) -> tuple[dict, float, int]:
    """The rollout's optimizer steps on the clipped loss: `generation_steps` of them (each on its share of the
    prompts), `num_iterations` times over; old / reference log-probs only when needed (taken before the
    first step, as TRL takes them at generation). Stops at max_steps. Returns the metrics (the last pass's,
    summed over its micro-batches; loss: the mean of its steps), the last gradient norm and the micro-
    batches of a pass."""
    cfg, dist = run.cfg, run.dist
    # dapo divides by the active tokens of all ranks: TRL's num_items_in_batch spans the generation, which
    # each of its steps divides by its share of it (/ generation_steps); DDP / FSDP average the ranks'
    # gradients: / world
    active = sc.loss_mask.sum().float()
    n_items = all_sum(active, dist).clamp(min=1) / dist.world / generation_steps(cfg)
    steps = micro_batches(ro, sc.loss_mask, cfg, run.packer, dist)
    tokens = lambda rows: sum((sc.loss_mask[i].sum() for i in rows), active.new_zeros(())).float()  # noqa
    active_of = [tokens(rows) for _, rows, _, _ in steps]  # before zero-advantage groups leave
    skipped = 0
    if skips_zero_advantage(cfg, dist):
        kept = []
        for step in steps:
            *parts, dropped = drop_zero_advantage_groups(*step, sc.advantages, sc.loss_mask, cfg.loss_type)
            kept.append(parts)
            skipped += dropped
        steps = kept
    trained_of = [tokens(rows) for _, rows, _, _ in steps]
    batches = [
        [(ro.prompt_ids[pi], ro.prompt_mask[pi], ro.completion_ids[i], ro.completion_mask[i], k)
         for pi, i, k in zip(prompts, rows, counts)]
        for prompts, rows, counts, _ in steps
    ]  # fmt: skip
    with torch.no_grad():
        # old log-probs for the steps that train off-policy: the first step of a single pass is on-policy
        # (its ratio 1 exactly, old = the loss's own log-probs detached), no forward for it
        old = None
        if len(steps) > 1 or cfg.num_iterations > 1:
            on_policy = 1 if cfg.num_iterations == 1 else 0  # steps that need none
            old = [None] * on_policy + [
                [run.policy(sequence_logps, b, cfg) for b in step] for step in batches[on_policy:]
            ]
        ref = None
        if cfg.beta != 0.0:
            policy = run.ref_policy or run.policy
            with run.model.disable_adapter() if run.info["lora"] else nullcontext():
                ref = [[policy(sequence_logps, b, cfg) for b in step] for step in batches]
    options = loss_options(cfg, ro.engine, ro.rollout_dtype)
    run.policy.train()
    for _ in range(cfg.num_iterations):
        todo = min(len(steps), cfg.max_steps - run.step)  # the last rollout may end inside a pass
        if todo < 1:
            break
        # the token metrics are means over the pass's trained tokens; clip ratios are TRL's share of all its
        # active tokens (a zero-advantage token is never clipped)
        trained, metrics, losses = sum(trained_of[:todo]), {}, []
        pass_active = sum(active_of[:todo])
        for j in range(todo):
            _, rows, _, weights = steps[j]
            loss, grad_norm = optimizer_step(
                run, ro, sc, batches[j], rows, weights, old and old[j], ref and ref[j], n_items, options,
                (trained_of[j], trained), metrics,
            )  # fmt: skip
            losses.append(loss)
    for key in CLIP_KEYS:
        if key in metrics:
            metrics[key] = metrics[key] * trained / pass_active.clamp(min=1)
    metrics["loss"] = sum(losses) / len(losses)
    metrics["zero_advantage_groups_skipped"] = float(skipped)
    return metrics, grad_norm, sum(len(rows) for _, rows, _, _ in steps)


def entropy_bonus(cfg: GRPOConfig) -> bool:
    """Whether the loss holds an entropy bonus: a coefficient, or the adaptive control of one (TRL's
    _entropy_bonus_enabled: on for the run, whatever the coefficient has become)."""
    return cfg.entropy_coef != 0.0 or cfg.use_adaptive_entropy


@dataclass
class EntropyControl:
    """The entropy bonus's coefficient, and under use_adaptive_entropy Skywork-OR1's control of it, as TRL
    1.16 runs it: a step applies the coefficient only where the step before measured a mean entropy at or
    below entropy_target (none measured before the first step: no bonus there); after each step the step's
    mean entropy, over the tokens the bonus acts on, all ranks, moves it (`adaptive_entropy_coef`)."""

    coef: float
    last_entropy: float = math.inf

    def applied(self, cfg: GRPOConfig) -> float:
        if cfg.use_adaptive_entropy and not self.last_entropy <= cfg.entropy_target:
            return 0.0
        return self.coef

    def update(self, cfg: GRPOConfig, entropy: float) -> None:
        self.coef = adaptive_entropy_coef(
            self.coef, entropy, target=cfg.entropy_target, delta=cfg.entropy_coef_delta,
            coef_min=cfg.entropy_coef_min, coef_max=cfg.entropy_coef_max,
        )  # fmt: skip
        self.last_entropy = entropy

    def state_dict(self) -> dict:
        return {"entropy_coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.coef, self.last_entropy = float(state["entropy_coef"]), float(state["last_entropy"])


def optimizer_step(run, ro, sc, batches, micro, weights, old, ref, n_items, options, tokens, metrics):
    """One optimizer step over its micro-batches (their gradients summed, clipped, stepped), the step's token
    metrics accumulated into `metrics` (their share of the pass's tokens). `tokens`: the trained tokens of
    the step and of the pass. Returns the step's loss and gradient norm."""
    cfg = run.cfg
    autocast = run.precision.autocast_context(run.device)  # the forward only; backward runs as recorded
    scale = run.scaler.scale if run.scaler is not None else (lambda x: x)  # fp16: the loss scaled
    step_tokens, trained = tokens
    total = torch.zeros((), device=trained.device)
    adaptive, applied = cfg.use_adaptive_entropy, run.entropy.applied(cfg)
    measured = torch.zeros(2, device=trained.device)  # the bonus's tokens: entropy sum, count
    for k, (i, b) in enumerate(zip(micro, batches)):
        share = sc.loss_mask[i].sum() / trained.clamp(min=1)  # token metrics: their mean
        # the entropy bonus is a mean over the step's tokens: this micro-batch's share of it
        in_step = float(sc.loss_mask[i].sum() / step_tokens.clamp(min=1))
        coef = applied * in_step / weights[k] if applied else 0.0
        with gradient_sync(run.policy, k == len(micro) - 1):
            with autocast:
                loss, m = run.policy(
                    policy_loss,
                    b,
                    sc.loss_mask[i],
                    sc.advantages[i],
                    old[k] if old else None,
                    ref[k] if ref else None,
                    ro.sampling_logps[i],
                    n_items,
                    cfg,
                    {**options, "entropy_coef": coef, "compute_entropy": adaptive},
                )
            scale(loss * weights[k]).backward()
        total = total + loss.detach() * weights[k]
        tokens, entropy = m.pop("bonus_tokens", None), m.pop("bonus_entropy", None)
        if adaptive:
            measured += torch.stack([entropy * tokens, tokens]).to(measured)
        for key, v in m.items():
            metrics[key] = accumulate(key, metrics.get(key), v.detach(), share)
    if not micro:  # every group had advantage 0: the optimizer still steps, on zero gradients (as TRL's)
        for p in run.params:
            p.grad = torch.zeros_like(p)
    if run.scaler is not None:
        run.scaler.unscale_(run.optimizer)
    grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(run.params, cfg.max_grad_norm)).item()
    if run.scaler is not None:  # a step with inf / NaN gradients is skipped and the scale lowered
        run.scaler.step(run.optimizer)
        run.scaler.update()
    else:
        run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    if adaptive:  # the step's token-weighted mean over all ranks sets the next step's coefficient
        entropy_sum, count = all_sum(measured, run.dist).tolist()
        run.entropy.update(cfg, entropy_sum / max(count, 1.0))
    if cfg.sync_ref_model and run.step % cfg.ref_model_sync_steps == 0:
        sync_reference(run.ref_policy, run.policy, cfg.ref_model_mixup_alpha)
    return total, grad_norm


@torch.no_grad()
def sync_reference(ref, policy, alpha: float) -> None:
    """TR-DPO's reference update (TRL's sync_ref_model): ref = alpha x policy + (1 - alpha) x ref, parameter
    by parameter, in place (each rank its own replica or shard: FSDP2 modules resharded first, since a
    forward without backward leaves the root's parameters whole)."""
    for module in (*ref.modules(), *policy.modules()):
        if callable(getattr(module, "reshard", None)):  # torch.distributed.fsdp.FSDPModule
            module.reshard()
    for r, p in zip(ref.parameters(), policy.parameters(), strict=True):
        r.mul_(1.0 - alpha).add_(p.detach(), alpha=alpha)


# --------------------------------------------------------------------------------------------------------
# 4. the step's record
# --------------------------------------------------------------------------------------------------------
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


def step_record(run, ro: Rollout, sc: Scored, metrics: dict, grad_norm: float, times, peaks, micro=1) -> dict:
    """The metrics.jsonl record of a step: the loss summed over ranks' shares, token metrics weighted by each
    rank's active tokens, rewards and tokens of the global batch. `times`: clock at start, after rollout,
    after scoring, at the end; `peaks`: this rank's peak memory (MiB) in the rollout and in scoring plus
    optimization; `micro`: the micro-batches it trained in."""
    t0, t1, t2, t3 = times
    dist, G = run.dist, run.cfg.num_generations
    metrics = dict(metrics)
    skipped = metrics.pop("zero_advantage_groups_skipped", 0.0)
    metrics = reduce_metrics(metrics, sc.loss_mask.sum(), dist)
    all_scores = sc.all_scores.cpu()
    model_tokens = ro.model_mask.sum()  # the model's tokens (a tool's turn is not the model's)
    counts = all_sum(
        torch.stack([ro.prompt_mask.sum() * G + ro.completion_mask.sum(), model_tokens]).float(), dist
    )
    n_tokens, n_completion_tokens = counts.tolist()  # tokens as if unshared: comparable across modes
    rewards = sc.all_rewards
    valid = rewards[~rewards.isnan()]
    return {
        "step": run.step,
        "reward_mean": float(rewards.nanmean()),
        "reward_std": float(valid.std()) if len(valid) > 1 else 0.0,
        "frac_reward_zero_std": float(sc.zero_std.float().mean()),
        "zero_advantage_groups_skipped": int(skipped),
        **{f"rewards/{n}_mean": float(all_scores[:, j].nanmean()) for j, n in enumerate(run.reward_names)},
        **reward_function_metrics(run),
        "kl": metrics.pop("kl", 0.0),
        "clip_ratio": metrics.pop("clip_ratio", 0.0),
        "loss": metrics.pop("loss"),
        **{f"loss/{k}": v for k, v in metrics.items()},  # the loss type's clip ratios, the mismatch, masks
        **({"entropy_coef": run.entropy.coef} if entropy_bonus(run.cfg) else {}),  # after the last step
        "grad_norm": grad_norm,
        "completion_len_mean": n_completion_tokens / len(rewards),
        "completion_len_max": int(all_gather_rows(ro.model_mask.sum(1), dist).max()),
        **(ro.tool_metrics or {}),
        **server_metrics(run),
        **native_metrics(run),
        "tokens_per_s": n_tokens / (t3 - t0),
        "peak_mem_mb": max(peaks),  # this step's, this rank's (grpo_fast.trainer.memory)
        "peak_mem_rollout_mb": peaks[0],
        "peak_mem_train_mb": peaks[1],
        "micro_batches": micro,
        "lr": run.scheduler.get_last_lr()[0],
        "time_generate_s": t1 - t0,
        "time_reward_s": t2 - t1,
        "time_train_s": t3 - t2,
        "elapsed_s": run.elapsed_train,
    }
