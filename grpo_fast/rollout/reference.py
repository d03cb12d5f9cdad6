"""The reference engine: the model's own forward, eager, with a transformers cache, one token at a time.

Plain: every prompt repeated G times and prefilled per sample. Shared: each prompt prefilled once and its KV
kept once, the samples decoding through `shared_attention`. Exact and simple; the native engine is tested
against it and falls back to it for what it does not cover.
"""

import torch

from ..models.hf_compat import cache_kwargs, cache_of
from ..models.model_parts import position_ids_from_mask
from .sampling import check_counts, eos_and_pad, mark_seen, sample_next, seen_tokens
from .shared_attention import shared_prefix_attention_over


def decode(
    step, logits, max_new_tokens, *, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, eos_token_id=None,
    generator=None, all_done=None, return_logprobs=False, repetition_penalty=1.0, seen=None,
):  # fmt: skip
    """Sample up to `max_new_tokens` per row from `logits` (rows, V); `step(tokens)` feeds the sampled tokens
    to the model and returns the next logits. Rows stop at EOS (kept, mask 1); later tokens are padding.
    `all_done(local_done) -> bool`, when given, decides when to stop (the ranks of a sharded model step
    together). Under a repetition penalty, `seen` (rows, V) holds each row's prompt tokens (`seen_tokens`),
    and the row's own tokens join as it samples them. With return_logprobs also the sampled tokens' log-probs
    under softmax(logits / T) (T = 1 when greedy), before the penalty and top-k / top-p / min-p, as training
    computes them; 0 on padding."""
    device, rows = logits.device, logits.shape[0]
    eos, pad = eos_and_pad(eos_token_id)
    eos = torch.tensor(eos, dtype=torch.long, device=device)
    out = torch.full((rows, max_new_tokens), pad, dtype=torch.long, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    lengths = torch.zeros(rows, dtype=torch.long, device=device)
    logp = torch.zeros(rows, max_new_tokens, device=device) if return_logprobs else None
    if repetition_penalty == 1.0:
        seen = None
    for t in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_p, top_k, generator, min_p, seen, repetition_penalty)
        tok = torch.where(done, pad, nxt)
        if seen is not None:
            mark_seen(seen, tok, ~done)
        out[:, t] = tok
        if return_logprobs:
            scaled = logits.float() / temperature if temperature > 0 else logits.float()
            logp[:, t] = (
                torch.log_softmax(scaled, -1).gather(-1, tok[:, None]).squeeze(-1).masked_fill(done, 0.0)
            )
        lengths += (~done).long()
        if eos.numel():
            done |= torch.isin(tok, eos)
        finished = bool(done.all())
        if (all_done(finished) if all_done else finished) or t == max_new_tokens - 1:
            break
        logits = step(tok)
    width = int(lengths.max()) if rows else 0
    mask = (torch.arange(width, device=device)[None, :] < lengths[:, None]).long()
    return (out[:, :width], mask) if logp is None else (out[:, :width], mask, logp[:, :width])


def _penalized(sampling) -> bool:
    return sampling.get("repetition_penalty", 1.0) != 1.0


@torch.no_grad()
def generate_plain(model, prompt_ids, prompt_mask, num_generations, max_new_tokens, **sampling):
    """`generate_groups` (grpo_fast.rollout) with every prompt repeated G times and prefilled per sample;
    `sampling`: `decode`'s options (temperature, top_p, top_k, min_p, eos_token_id, generator, all_done,
    return_logprobs)."""
    check_counts(num_generations, max_new_tokens)
    ids = prompt_ids.repeat_interleave(num_generations, 0)
    mask = prompt_mask.repeat_interleave(num_generations, 0).long()
    pos = position_ids_from_mask(mask)
    res = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
    state = {"cache": cache_of(res), "mask": mask, "pos": pos[:, -1:] + 1}

    def step(tok):
        state["mask"] = torch.cat([state["mask"], torch.ones_like(state["mask"][:, :1])], dim=1)
        out = model(
            input_ids=tok[:, None],
            attention_mask=state["mask"],
            position_ids=state["pos"],
            use_cache=True,
            **cache_kwargs(model, state["cache"]),
        )
        state["cache"], state["pos"] = cache_of(out), state["pos"] + 1
        return out.logits[:, -1]

    seen = seen_tokens(ids, mask, res.logits.shape[-1]) if _penalized(sampling) else None
    return decode(step, res.logits[:, -1], max_new_tokens, seen=seen, **sampling)


@torch.no_grad()
def generate_shared(model, prompt_ids, prompt_mask, num_generations, max_new_tokens, **sampling):
    """`generate_groups` (grpo_fast.rollout) with each prompt prefilled once and its KV kept once;
    `sampling`: `decode`'s options, as `generate_plain`'s."""
    check_counts(num_generations, max_new_tokens)
    G = num_generations
    # 1. prefill each prompt once; its KV stays (n, kvh, P, d), shared by the group
    pos = position_ids_from_mask(prompt_mask)
    res = model(
        input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=pos, use_cache=True, logits_to_keep=1
    )
    cache = cache_of(res)
    keys, values = [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]
    state = {"cache": None, "pos": (pos[:, -1:] + 1).repeat_interleave(G, 0)}

    # 2. decode: every sample reads the shared prompt KV and its own completion KV
    def step(tok):
        extra = cache_kwargs(model, state["cache"])
        out = model(input_ids=tok[:, None], position_ids=state["pos"], use_cache=True, **extra)
        state["cache"], state["pos"] = cache_of(out), state["pos"] + 1
        return out.logits[:, -1]

    seen = None
    if _penalized(sampling):
        seen = seen_tokens(prompt_ids, prompt_mask, res.logits.shape[-1]).repeat_interleave(G, 0)
    with shared_prefix_attention_over(model, keys, values, prompt_mask, G):
        return decode(step, res.logits[:, -1].repeat_interleave(G, 0), max_new_tokens, seen=seen, **sampling)
