"""Rollouts: G sampled completions per prompt from a Hugging Face causal LM, with a KV cache.

Prompts are left-padded; sample s belongs to prompt s // G. Sampling follows the usual order (temperature,
then top-k, then top-p) and stops per sample at EOS; tokens after EOS are padding with mask 0.
"""

import torch

from .hf_compat import cache_kwargs, cache_of


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """RoPE positions that ignore left padding: the first real token is position 0."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def sample_next(logits, temperature, top_p, top_k, generator):
    """One token per row from (rows, V) logits; temperature 0 is greedy."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, -1)
        # drop a token when the tokens before it already hold top_p of the mass (the first always stays)
        drop = probs.cumsum(-1) - probs > top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, -1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def decode(
    step, logits, max_new_tokens, *, temperature, top_p, top_k, eos_token_id, generator, all_done=None
):
    """Sample up to `max_new_tokens` per row from `logits` (rows, V); `step(tokens)` feeds the sampled tokens
    to the model and returns the next logits. Rows stop at EOS (kept, mask 1); later tokens are padding.
    `all_done(local_done) -> bool`, when given, decides when to stop (the ranks of a sharded model step
    together)."""
    device, rows = logits.device, logits.shape[0]
    eos = torch.tensor(
        [eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []), device=device
    )
    pad = int(eos[0]) if eos.numel() else 0
    out = torch.full((rows, max_new_tokens), pad, dtype=torch.long, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    lengths = torch.zeros(rows, dtype=torch.long, device=device)
    for t in range(max_new_tokens):
        tok = torch.where(done, pad, sample_next(logits, temperature, top_p, top_k, generator))
        out[:, t] = tok
        lengths += (~done).long()
        if eos.numel():
            done |= torch.isin(tok, eos)
        finished = bool(done.all())
        if (all_done(finished) if all_done else finished) or t == max_new_tokens - 1:
            break
        logits = step(tok)
    width = int(lengths.max()) if rows else 0
    return out[:, :width], (torch.arange(width, device=device)[None, :] < lengths[:, None]).long()


def check_counts(num_generations: int, max_new_tokens: int) -> None:
    if num_generations < 1 or max_new_tokens < 1:
        raise ValueError(
            f"num_generations and max_new_tokens must be >= 1, got {num_generations}, {max_new_tokens}"
        )


@torch.no_grad()
def generate_groups(
    model,
    prompt_ids,
    prompt_mask,
    num_generations,
    max_new_tokens,
    *,
    temperature=1.0,
    top_p=1.0,
    top_k=0,
    eos_token_id=None,
    generator=None,
    all_done=None,
):
    """`grpo_fast.generate_groups` with share_prefix=False (its docstring has the arguments): every prompt is
    repeated G times and prefilled once per sample, the plain way and the reference for the shared one."""
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

    return decode(
        step,
        res.logits[:, -1],
        max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        eos_token_id=eos_token_id,
        generator=generator,
        all_done=all_done,
    )
