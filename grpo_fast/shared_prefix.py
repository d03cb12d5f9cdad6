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
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .hf_compat import cache_kwargs, cache_of
from .rollout import check_counts, decode, position_ids_from_mask
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
    all_done=None,
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
        all_done: optional `f(local_done) -> bool` deciding when decoding stops (distributed: every rank
            steps until all are done, so that a sharded model's collectives match).

    Returns:
        (completion_ids, completion_mask), (n_prompts * G, C') with C' <= C the longest completion.
    """
    kw = dict(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        eos_token_id=eos_token_id,
        generator=generator,
        all_done=all_done,
    )
    if not share_prefix:
        return plain_generate_groups(model, prompt_ids, prompt_mask, num_generations, max_new_tokens, **kw)
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


def _varlen_attention_reference(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=True):
    """flash_attn_varlen_func's contract in PyTorch: packed q (total_q, h, d), k/v (total_k, kvh, d), causal
    aligned bottom-right (query i of a sequence sees keys up to len_k - len_q + i). The CPU path and the
    test double."""
    outs = []
    rep = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qi = q[cu_q[i] : cu_q[i + 1]].transpose(0, 1)
        ki = k[cu_k[i] : cu_k[i + 1]].transpose(0, 1).repeat_interleave(rep, 0)
        vi = v[cu_k[i] : cu_k[i + 1]].transpose(0, 1).repeat_interleave(rep, 0)
        lq, lk = qi.shape[1], ki.shape[1]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq) if causal else None
        outs.append(
            F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=softmax_scale).transpose(0, 1)
        )
    return torch.cat(outs)


def _varlen_kernel(query):
    """flash-attn's varlen kernel for half-precision CUDA tensors when it is installed, else the reference."""
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        try:
            from flash_attn import flash_attn_varlen_func

            return flash_attn_varlen_func
        except ImportError:
            pass
    return _varlen_attention_reference


def _grouped_packing(prompt_mask, G, C):
    """Varlen packing of the grouped layout: per group, the prompt (causal) then each completion over
    [prompt; itself] (bottom-right causal). Indices into the flattened (n * L) positions."""
    n, P = prompt_mask.shape
    L = P + G * C
    device = prompt_mask.device
    q_idx, k_idx, len_q, len_k = [], [], [], []
    for i in range(n):
        prompt = i * L + torch.nonzero(prompt_mask[i]).squeeze(1)
        q_idx.append(prompt)
        k_idx.append(prompt)
        len_q.append(len(prompt))
        len_k.append(len(prompt))
        for g in range(G):
            comp = i * L + P + g * C + torch.arange(C, device=device)
            q_idx.append(comp)
            k_idx += [prompt, comp]
            len_q.append(C)
            len_k.append(len(prompt) + C)
    cu = lambda lens: torch.tensor([0, *lens], device=device).cumsum(0).to(torch.int32)  # noqa: E731
    return torch.cat(q_idx), torch.cat(k_idx), cu(len_q), cu(len_k), max(len_q), max(len_k)


def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface function for the grouped training layout without a 4D mask: the prompt and each
    completion are packed as variable-length sequences (the prompt's keys repeated per completion, as Prefix
    Grouper does) and run through flash-attn's varlen kernel when available."""
    q_idx, k_idx, cu_q, cu_k, max_q, max_k = _state.grouped
    n, h, L, d = query.shape
    kvh = key.shape[1]
    q = query.transpose(1, 2).reshape(n * L, h, d).index_select(0, q_idx)
    k = key.transpose(1, 2).reshape(n * L, kvh, d).index_select(0, k_idx)
    v = value.transpose(1, 2).reshape(n * L, kvh, d).index_select(0, k_idx)
    out = _varlen_kernel(query)(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scaling, causal=True)
    full = out.new_zeros(n * L, h, d).index_copy(0, q_idx, out)  # prompt padding: never a query, never a key
    return full.view(n, L, h, d), None


GROUPED_ATTN_NAME = "grpo_fast_grouped"
AttentionInterface.register(GROUPED_ATTN_NAME, grouped_attention)
AttentionMaskInterface.register(GROUPED_ATTN_NAME, _no_mask)


def shared_prefix_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, attention="auto"):
    """Final hidden states (n_prompts * G, C, H) of the completions, each prompt run once per group.

    `[s, j]` is the state that predicts completion token j of sample s: equal to a plain forward of that
    sample's unpadded prompt followed by its completion, at position len(prompt) - 1 + j.

    attention: "mask" runs the grouped layout with a 4D mask through SDPA (or eager); "varlen" packs it as
    variable-length sequences (flash-attn's varlen kernel on half-precision CUDA tensors when installed, a
    PyTorch equivalent otherwise); "auto" takes "varlen" for models loaded with a flash-attention
    implementation and "mask" otherwise.
    """
    n, P = prompt_ids.shape
    rows, C = completion_ids.shape
    if rows % n:
        raise ValueError(f"completion_ids has {rows} rows for {n} prompts: expected a multiple")
    if attention not in ("auto", "mask", "varlen"):
        raise ValueError(f"attention must be 'auto', 'mask' or 'varlen', got {attention!r}")
    G = rows // n
    ids = torch.cat([prompt_ids, completion_ids.reshape(n, G * C)], dim=1)
    pos, mask = group_layout(prompt_mask, completion_mask, G)
    from .modeling import decoder_of

    impl = getattr(model.config, "_attn_implementation", "sdpa")
    if attention == "auto":
        attention = "varlen" if str(impl).startswith("flash_attention") else "mask"
    if attention == "varlen":
        _state.grouped = _grouped_packing(prompt_mask, G, C)
        ctx, mask = _attention_implementation(model, GROUPED_ATTN_NAME), None
    else:  # a 4D mask: eager and SDPA take one
        ctx = _attention_implementation(model, "sdpa") if impl not in ("sdpa", "eager") else nullcontext()
    try:
        with ctx:
            hidden = decoder_of(model)(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
    finally:
        _state.grouped = None
    hidden = hidden.last_hidden_state
    # the state before completion token j: the prompt's last token for j = 0, else completion token j - 1
    j = torch.arange(C, device=ids.device)
    g = torch.arange(G, device=ids.device)
    src = torch.where(j[None, :] == 0, P - 1, P + g[:, None] * C + j[None, :] - 1)  # (G, C)
    out = hidden[:, src.reshape(-1)]  # (n, G * C, H)
    return out.reshape(n * G, C, -1)
