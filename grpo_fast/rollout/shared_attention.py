"""Decode-time attention of G samples over their prompt's one KV copy and their own completion's KV.

An attention function registered with transformers' `AttentionInterface`: a partial attention over the group's
shared prompt KV (the G samples and GQA's query heads as rows of one product, so the prompt KV is read once
per group and never copied per sample) and one over the sample's own completion KV, merged through their log-
sum-exps (as Hydragen and cascade attention do). The reference engine's shared path decodes through it.
"""

import threading
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ..models.model_parts import attention_implementation

ATTN_NAME = "grpo_fast_shared_prefix"
_state = threading.local()  # the prefix KV of the generation in progress (one per thread)


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


def no_mask(*args, **kwargs):
    return None  # the attention above builds its own masks


AttentionInterface.register(ATTN_NAME, shared_prefix_attention)
AttentionMaskInterface.register(ATTN_NAME, no_mask)


@contextmanager
def shared_prefix_attention_over(model, keys, values, prefix_mask, G):
    """Route `model`'s attention through `shared_prefix_attention` with this prompt KV (per layer, (n, kvh, P,
    d)) and its (n, P) mask, for n * G decoding samples."""
    # (n, 1, 1, P) key mask of the prompts' left padding; None when no prompt is padded
    mask = None if bool(prefix_mask.bool().all()) else prefix_mask.bool()[:, None, None, :]
    _state.ctx = {"keys": keys, "values": values, "prefix_mask": mask, "G": G}
    try:
        with attention_implementation(model, ATTN_NAME):
            yield
    finally:
        _state.ctx = None
