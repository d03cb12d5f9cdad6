"""Held-out evaluation: greedy accuracy on prompts the run does not train on, and with
--num-generations-eval sampled accuracy and pass@n, scored by the first reward function (a task's own
evaluator, where it has one: grpo_fast.trainer.setup)."""

import math

import torch

from ..rewards import score
from ..rollout import generate_groups
from ..rollout.trajectories import generate_trajectories
from .config import GRPOConfig
from .distributed import DistInfo, all_done, all_sum
from .precision import of_config as precision_of
from .step import draw_options, encode_prompts, engine_options, reward_columns


def eval_engine_options(cfg: GRPOConfig) -> dict:
    """`engine_options` for held-out accuracy: the training precision (the policy's own, or its bf16 / fp16
    copy under autocast), never a lower one asked for rollouts; except on vLLM, whose dtype is fixed when it
    starts (its evaluation runs in the rollout dtype). The native engine eager, not on CUDA graphs."""
    opts = engine_options(cfg)
    if opts["compile"] in ("auto", "graphs"):  # its shapes are not training's: CUDA graphs of its own would
        opts["compile"] = False  # replace training's buffers and graphs (one call shape is kept), and back
    if cfg.rollout == "vllm" and cfg.vllm_mode == "server":  # the trainer's own weights, not the server's
        return {"engine": "auto", "compile": opts["compile"]}
    if cfg.rollout != "vllm":
        opts.pop("rollout_dtype", None)
        if precision_of(cfg).rollout_dtype != "model":
            opts["rollout_dtype"] = precision_of(cfg).rollout_dtype
    return opts


EVAL_CHUNK_ROWS = 64  # completions per held-out generation call


@torch.no_grad()
def evaluate(
    policy, tokenizer, rows, reward_funcs, cfg, device, dist: DistInfo | None = None, tools=None, env=None
) -> dict:
    """Greedy accuracy on held-out prompts: the share whose first reward function pays its full 1.0 (with
    tools / an environment: of greedy multi-turn trajectories). With num_generations_eval = N also N sampled
    completions a prompt, as training samples them (temperature, top-p / top-k / min-p, repetition penalty)
    from a generator seeded alike at every evaluation (paired draws: two evaluations differ by the policy
    only): `eval_sampled_accuracy`, the share of those completions paid in full (pass@1 at that temperature),
    and `eval_pass_at_n`, the share of prompts with at least one. Distributed, each rank takes every
    world-th prompt; all ranks run the same number of chunks."""
    dist = dist or DistInfo()
    policy.eval()
    mine = rows[dist.rank :: dist.world]
    hits = held_out_hits(policy, tokenizer, rows, mine, 1, reward_funcs, cfg, device, dist, tools, env)
    greedy = all_sum(torch.tensor([float(hits.sum()), hits.numel()], device=device), dist).tolist()
    out = {"eval_accuracy": greedy[0] / max(1, greedy[1]), "eval_samples": int(greedy[1])}
    N = cfg.num_generations_eval
    if N:
        generator = torch.Generator(device=device).manual_seed(cfg.seed + 104729 + dist.rank)
        hits = held_out_hits(
            policy, tokenizer, rows, mine, N, reward_funcs, cfg, device, dist, tools, env, generator
        ).view(-1, N)
        sums = [float(hits.sum()), hits.numel(), float(hits.any(1).sum()), hits.shape[0]]
        sums = all_sum(torch.tensor(sums, device=device), dist).tolist()
        out["eval_sampled_accuracy"] = sums[0] / max(1, sums[1])
        out["eval_pass_at_n"] = sums[2] / max(1, sums[3])
    return out


def held_out_hits(
    policy, tokenizer, rows, mine, G, reward_funcs, cfg, device, dist, tools, env, generator=None
) -> torch.Tensor:
    """(len(mine) * G,) bool: which of G completions of each of this rank's held-out prompts `mine` (of all
    `rows`) the first reward function pays in full; greedy (G = 1, no generator) or sampled as training
    samples (from `generator`). Chunks of EVAL_CHUNK_ROWS completions, as many on every rank."""
    per_chunk = max(1, EVAL_CHUNK_ROWS // G)
    n_chunks = math.ceil(len(rows) / (per_chunk * dist.world))
    sampling = dict(temperature=0.0) if generator is None else dict(**draw_options(cfg), generator=generator)
    sampling.update(eval_engine_options(cfg))
    hits = []
    for k in range(n_chunks):
        chunk = mine[k * per_chunk : (k + 1) * per_chunk]
        counted = len(chunk) * G
        chunk = chunk or rows[:1]  # a rank with nothing left still steps with the others (FSDP)
        if tools or env is not None:
            tr = policy(
                generate_trajectories, tokenizer, [r["prompt"] for r in chunk], G, cfg.max_completion_length,
                tools=tools, environment_factory=env, rows=chunk,
                max_tool_calling_iterations=cfg.max_tool_calling_iterations,
                tool_timeout_s=cfg.tool_timeout_s, max_prompt_length=cfg.max_prompt_length,
                chat_template_kwargs=cfg.chat_template_kwargs, eos_token_id=tokenizer.eos_token_id,
                **sampling,
            )  # fmt: skip
            prompts, completions = tr.texts, tr.messages
            cols = reward_columns(chunk, G, tr.completion_ids, tr.completion_mask * tr.tool_mask)
            if tr.environments is not None:
                cols["environments"] = tr.environments
        else:
            prompts, ids, mask = encode_prompts(
                chunk, tokenizer, cfg.max_prompt_length, device, cfg.chat_template_kwargs
            )
            comp, cmask = policy(
                generate_groups, ids, mask, G, cfg.max_completion_length, eos_token_id=tokenizer.eos_token_id,
                share_prefix=G > 1, all_done=(lambda done: all_done(done, dist)) if dist.on else None,
                **sampling,
            )  # fmt: skip
            completions = tokenizer.batch_decode(comp * cmask, skip_special_tokens=True)
            cols = reward_columns(chunk, G, comp, cmask)
        texts = [t for t in prompts for _ in range(G)]
        values = score(reward_funcs[:1], [1.0], texts, completions, cols, on_error="skip").per_func[:, 0]
        hits.append(values[:counted] >= 1.0 - 1e-6)
    return torch.cat(hits) if hits else torch.zeros(0, dtype=torch.bool)
