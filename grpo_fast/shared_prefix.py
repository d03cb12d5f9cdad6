"""The G samples of a group share their prompt: one prefill and one prompt KV in generation, one prompt
forward in training. Exact, for any Llama / Qwen2 / Mistral-style Hugging Face model.

Generation: each prompt is prefilled once and its KV cache kept once; while decoding, the n*G samples attend
through an attention function registered with transformers' `AttentionInterface`: a partial attention over
their prompt's shared KV and one over their own completion's KV, merged through their log-sum-exps (as
Hydragen and cascade attention do). No copy of the prompt KV is ever made per sample.

Training: each group is laid out as one sequence [prompt; completion_1; ...; completion_G] with a 4D mask
(every completion sees the prompt and, causally, itself) and RoPE positions of the unshared layout, so the
prompt is run, and differentiated, once per group (Prefix Grouper's construction).
"""

import threading
from contextlib import contextmanager, nullcontext

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .rollout import cache_of, decode, position_ids_from_mask
from .rollout import generate_groups as plain_generate_groups

ATTN_NAME = "grpo_fast_shared_prefix"
_state = threading.local()  # the prefix KV of the generation in progress (one per thread)


# --------------------------------------------------------------------------------------------------------
# Decode-time attention over [shared prefix | own completion]
# --------------------------------------------------------------------------------------------------------
def _partial(q, k, v, scaling, mask=None):
    """Attention of q over (k, v) with its log-sum-exp: out (.., q, d) and lse (.., q), fp32 softmax."""
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scaling
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(s - lse).to(v.dtype), v), lse


def shared_prefix_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface function: query (n*G, h, q, d); key/value (n*G, kvh, k, d) hold the completions
    only; the prompt's KV (n, kvh, P, d) comes from the generation in progress."""
    st = _state.ctx
    pk, pv = st["keys"][module.layer_idx], st["values"][module.layer_idx]
    n, kvh, P, d = pk.shape
    G = st["G"]
    h, q_len, k_len = query.shape[1], query.shape[2], key.shape[2]
    rep = h // kvh
    scaling = scaling if scaling is not None else d**-0.5
    # 1. over the shared prefix: the group's G samples (and GQA's query heads) become rows of one product
    #    with the prompt's keys, so the prompt KV is read once per group and never copied per sample
    q_grp = (
        query.reshape(n, G, kvh, rep, q_len, d).permute(0, 2, 1, 3, 4, 5).reshape(n, kvh, G * rep * q_len, d)
    )
    o_pre, lse_pre = _partial(q_grp, pk, pv, scaling, st["prefix_mask"])
    o_pre = o_pre.view(n, kvh, G, rep, q_len, d).permute(0, 2, 1, 3, 4, 5).reshape(n * G, kvh, rep * q_len, d)
    lse_pre = (
        lse_pre.view(n, kvh, G, rep, q_len, 1).permute(0, 2, 1, 3, 4, 5).reshape(n * G, kvh, rep * q_len, 1)
    )
    # 2. over its own completion, causally (the q new tokens are the last q of the k keys)
    q_own = query.reshape(n * G, kvh, rep * q_len, d)
    causal = None
    if q_len > 1:
        causal = (
            torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len).repeat(rep, 1)
        )
    o_own, lse_own = _partial(q_own, key, value, scaling, causal)
    # 3. merge the two partial softmaxes through their log-sum-exps
    lse = torch.logaddexp(lse_pre, lse_own)
    out = o_pre.float() * torch.exp(lse_pre - lse) + o_own.float() * torch.exp(lse_own - lse)
    return out.to(query.dtype).reshape(n * G, h, q_len, d).transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    return None  # the attention above builds its own masks


AttentionInterface.register(ATTN_NAME, shared_prefix_attention)
AttentionMaskInterface.register(ATTN_NAME, _no_mask)


@contextmanager
def _attention_implementation(model, name):
    """Temporarily route every attention module of `model` through the implementation `name`."""
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values()
    saved = [(c, c._attn_implementation) for c in configs]
    for c, _ in saved:
        c._attn_implementation = name
    try:
        yield
    finally:
        for c, impl in saved:
            c._attn_implementation = impl


@contextmanager
def _shared_prefix_attention(model, keys, values, prefix_mask, G):
    # (n, 1, 1, P) key mask of the prompts' left padding; None when no prompt is padded
    mask = None if bool(prefix_mask.bool().all()) else prefix_mask.bool()[:, None, None, :]
    _state.ctx = {"keys": keys, "values": values, "prefix_mask": mask, "G": G}
    try:
        with _attention_implementation(model, ATTN_NAME):
            yield
    finally:
        _state.ctx = None


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
    share_prefix=True,
    generator=None,
):
    """G sampled completions per prompt; sample s belongs to prompt s // G.

    Args:
        model: a Hugging Face causal LM (Llama / Qwen2 / Mistral style).
        prompt_ids, prompt_mask: (n_prompts, P) left-padded prompts and their attention mask.
        num_generations: G. max_new_tokens: C, the longest completion.
        temperature, top_p, top_k: sampling (temperature 0 = greedy).
        eos_token_id: int or list of ints ending a completion (kept, mask 1).
        share_prefix: prefill each prompt once and keep its KV once (True), or repeat it G times (False).
        generator: torch.Generator for reproducible sampling.

    Returns:
        (completion_ids, completion_mask), (n_prompts * G, C') with C' <= C the longest completion.
    """
    kw = dict(
        temperature=temperature, top_p=top_p, top_k=top_k, eos_token_id=eos_token_id, generator=generator
    )
    if not share_prefix:
        return plain_generate_groups(model, prompt_ids, prompt_mask, num_generations, max_new_tokens, **kw)
    if num_generations < 1 or max_new_tokens < 1:
        raise ValueError(
            f"num_generations and max_new_tokens must be >= 1, got {num_generations}, {max_new_tokens}"
        )
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
        extra = {"cache": state["cache"]} if state["cache"] is not None else {}
        out = model(input_ids=tok[:, None], position_ids=state["pos"], use_cache=True, **extra)
        state["cache"], state["pos"] = cache_of(out), state["pos"] + 1
        return out.logits[:, -1]

    with _shared_prefix_attention(model, keys, values, prompt_mask, G):
        return decode(step, res.logits[:, -1].repeat_interleave(G, 0), max_new_tokens, **kw)


# --------------------------------------------------------------------------------------------------------
# Training forward: [prompt; completion_1; ...; completion_G] per group
# --------------------------------------------------------------------------------------------------------
def group_layout(prompt_mask, completion_mask, G):
    """Positions (n, L) and the 4D boolean mask (n, 1, L, L) of the grouped layout, L = P + G * C."""
    n, P = prompt_mask.shape
    C = completion_mask.shape[1]
    device = prompt_mask.device
    plen = prompt_mask.long().sum(1)
    pos = torch.cat(
        [position_ids_from_mask(prompt_mask), (plen[:, None] + torch.arange(C, device=device)).repeat(1, G)],
        dim=1,
    )
    seg = torch.cat(
        [torch.full((P,), -1, device=device), torch.arange(G, device=device).repeat_interleave(C)]
    )
    valid = torch.cat([prompt_mask.bool(), completion_mask.view(n, G * C).bool()], dim=1)
    idx = torch.arange(P + G * C, device=device)
    causal = idx[None, :] <= idx[:, None]  # (L_q, L_k)
    same_or_prompt = (seg[None, :] == seg[:, None]) | (seg[None, :] == -1)
    mask = (causal & same_or_prompt)[None] & valid[:, None, :]
    mask = mask | torch.eye(P + G * C, dtype=torch.bool, device=device)[None]  # padding rows see themselves
    return pos, mask[:, None]


def shared_prefix_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """Final hidden states (n_prompts * G, C, H) of the completions, each prompt run once per group.

    `[s, j]` is the state that predicts completion token j of sample s: equal to a plain forward of that
    sample's unpadded prompt followed by its completion, at position len(prompt) - 1 + j.
    """
    n, P = prompt_ids.shape
    rows, C = completion_ids.shape
    if rows % n:
        raise ValueError(f"completion_ids has {rows} rows for {n} prompts: expected a multiple")
    G = rows // n
    ids = torch.cat([prompt_ids, completion_ids.reshape(n, G * C)], dim=1)
    pos, mask = group_layout(prompt_mask, completion_mask, G)
    from .modeling import decoder_of

    impl = getattr(model.config, "_attn_implementation", "sdpa")
    # the grouped layout needs a 4D mask: flash-attention kernels take none, so those models run it with SDPA
    ctx = _attention_implementation(model, "sdpa") if impl not in ("sdpa", "eager") else nullcontext()
    with ctx:
        hidden = decoder_of(model)(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
    hidden = hidden.last_hidden_state
    # the state before completion token j: the prompt's last token for j = 0, else completion token j - 1
    j = torch.arange(C, device=ids.device)
    g = torch.arange(G, device=ids.device)
    src = torch.where(j[None, :] == 0, P - 1, P + g[:, None] * C + j[None, :] - 1)  # (G, C)
    out = hidden[:, src.reshape(-1)]  # (n, G * C, H)
    return out.reshape(n * G, C, -1)
