"""Training with the G samples of a group sharing their prompt: one prompt forward per group. Exact, for any
Llama / Qwen2 / Mistral-style Hugging Face model.

Each group is laid out as one sequence [prompt; completion_1; ...; completion_G] of its real tokens (every
completion sees the prompt and, causally, itself) with RoPE positions of the unshared layout, so the prompt is
run, and differentiated, once per group (Prefix Grouper's construction). By default every group of a
micro-batch runs in one row with no padding (packed_row), its attention per segment (the prompt, each
completion over [prompt; itself]) without an (L, L) mask; variable-length packing of the same row (for models
loaded with a flash-attention implementation) and a row per group with a 4D mask through the model's SDPA are
the other layouts.
"""

import functools
import itertools
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .model_parts import (
    attention_implementation,
    decoder_of,
    recomputes_attention_safely,
)


def _no_mask(*args, **kwargs):
    return None  # the attention below builds its own masks


# --------------------------------------------------------------------------------------------------------
# Training forward: [prompt; completion_1; ...; completion_G] per group, real tokens only
# --------------------------------------------------------------------------------------------------------
def _groups(prompt_mask, completion_mask, counts):
    """Per group, its real tokens in layout order: (src, pos, sizes). `src` indexes the flat token pool
    [prompt_ids (n * P); completion_ids (rows * C)], `pos` are the unshared layout's RoPE positions, `sizes`
    = [prompt length, each completion's length]. counts[i]: the completions of prompt i (consecutive rows;
    groups may differ, as in micro-batches packed to a memory budget)."""
    n, P = prompt_mask.shape
    C = completion_mask.shape[1]
    device = prompt_mask.device
    lens = completion_mask.long().sum(1).tolist()
    first = [0, *itertools.accumulate(counts)]  # each group's first row
    out = []
    for i in range(n):
        p_idx = torch.nonzero(prompt_mask[i]).squeeze(1)
        p_len = len(p_idx)
        src, pos = [i * P + p_idx], [torch.arange(p_len, device=device)]
        for s in range(first[i], first[i + 1]):
            src.append(n * P + s * C + torch.arange(lens[s], device=device))
            pos.append(p_len + torch.arange(lens[s], device=device))
        out.append((torch.cat(src), torch.cat(pos), [p_len, *lens[first[i] : first[i + 1]]]))
    return out


def _segments(sizes, starts=None):
    """Walks groups laid out one after another (or from `starts`, where each begins): per group, (where its
    prompt starts, the prompt's length, [(where each completion starts, its length)])."""
    at = 0
    for i, (p, *lens) in enumerate(sizes):
        start = at = starts[i] if starts is not None else at
        at += p
        comps = []
        for ln in lens:
            comps.append((at, ln))
            at += ln
        yield start, p, comps


def _predictors(sizes, rows, C, device, starts=None):
    """(rows, C) indices into the flat hidden states of the state predicting each completion token (0 beyond a
    completion's end), the groups laid out as _segments walks them."""
    pred = torch.zeros(rows, C, dtype=torch.long, device=device)
    s = 0
    for start, p, comps in _segments(sizes, starts):
        for at, ln in comps:
            if ln:  # token 0 is predicted by the prompt's last state, token j by completion token j - 1
                pred[s, 0] = start + p - 1
                pred[s, 1:ln] = at + torch.arange(ln - 1, device=device)
            s += 1
    return pred


def packed_group_layout(prompt_mask, completion_mask, counts):
    """The grouped layout with real tokens only, one row per group: its prompt's tokens, then each
    completion's, padded at the end to the longest group; for attention through a 4D mask (attention="mask").

    Returns (src, pos, mask, pred): `src` (n, L) indices into the flat token pool [prompt_ids (n * P);
    completion_ids (rows * C)] (0 on padding), RoPE positions (n, L), the 4D boolean mask (n, 1, L, L), and
    `pred` (rows, C) indices into the flat (n * L) hidden states of the state predicting each completion
    token (0 beyond a completion's end)."""
    n = prompt_mask.shape[0]
    rows, C = completion_mask.shape
    device = prompt_mask.device
    groups = _groups(prompt_mask, completion_mask, counts)
    L = max(len(x[0]) for x in groups)
    src = torch.zeros(n, L, dtype=torch.long, device=device)
    pos = torch.zeros(n, L, dtype=torch.long, device=device)
    seg = torch.full((n, L), -2, dtype=torch.long, device=device)  # -2: padding, -1: prompt, g: completion g
    for i, (s_i, p_i, sizes) in enumerate(groups):
        k = len(s_i)
        src[i, :k], pos[i, :k] = s_i, p_i
        seg[i, :k] = torch.arange(-1, len(sizes) - 1, device=device).repeat_interleave(
            torch.tensor(sizes, device=device)
        )
    pred = _predictors([g[2] for g in groups], rows, C, device, starts=[i * L for i in range(n)])
    idx = torch.arange(L, device=device)
    causal = idx[None, :] <= idx[:, None]
    same_or_prompt = (seg[:, None, :] == seg[:, :, None]) | (seg[:, None, :] == -1)
    mask = causal[None] & same_or_prompt & (seg[:, None, :] != -2)
    mask = mask | torch.eye(L, dtype=torch.bool, device=device)[None]  # padding rows see themselves
    return src, pos, mask[:, None], pred


def packed_row(prompt_mask, completion_mask, counts):
    """Every group's real tokens in one row, one group after another, with no padding at all: the layout of
    the per-segment attentions ("segments", "varlen"), which never attend across segments, so the linear
    layers, norms and MLPs run on real tokens only (a row per group padded to the longest group was 27%
    padding on SmolLM2's real workload, 2 groups of 8).

    Returns (src, pos, pred, sizes): `src` and `pos` (1, T) as in packed_group_layout, `pred` (rows, C)
    indices into the T hidden states, and `sizes` per group [prompt length, each completion's length]
    (summing to T)."""
    rows, C = completion_mask.shape
    groups = _groups(prompt_mask, completion_mask, counts)
    sizes = [g[2] for g in groups]
    src = torch.cat([g[0] for g in groups])[None]
    pos = torch.cat([g[1] for g in groups])[None]
    return src, pos, _predictors(sizes, rows, C, prompt_mask.device), sizes


def _segment_masks(sizes, device):
    """Per group of packed_row: (prompt length, [(completion length, its bottom-right causal mask over
    [prompt; itself])]), the masks built once per forward (every layer reuses them)."""
    masks, out = {}, []
    for _, p, comps in _segments(sizes):
        for _, ln in comps:
            if (p, ln) not in masks:
                masks[(p, ln)] = torch.ones(ln, p + ln, dtype=torch.bool, device=device).tril(p)
        out.append((p, [(ln, masks[(p, ln)]) for _, ln in comps]))
    return out


def segment_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface function for packed_row's layout without an (L, L) mask: per group, its prompt
    attends causally to itself and each completion to [prompt; itself], one SDPA call each. The work is sum
    over completions of len * (prompt + len), where a masked SDPA over the whole group does L^2 (G times more
    for G equal completions). The segments come in `grpo_fast_segments` (a forward keyword argument, so a
    checkpointed layer's recomputation sees them too)."""
    segments = kwargs["grpo_fast_segments"]
    h = query.shape[1]
    if query.device.type == "cpu" and (query.dtype != torch.float32 or torch.is_autocast_enabled("cpu")):
        # fp32 on a CPU, autocast off (it casts SDPA's inputs to bf16): forward + backward of these
        # per-segment products run 2.2x faster in fp32 than in bf16 at 32-token completions, 1.4x at 256
        # (Intel Sapphire Rapids, ATen AVX2 and AVX512 alike), and the rollout engines attend in fp32 too
        with torch.autocast("cpu", enabled=False):
            out, _ = segment_attention(
                module, query.float(), key.float(), value.float(), attention_mask, scaling, dropout, **kwargs
            )
        return out.to(query.dtype), None
    sdpa = functools.partial(
        F.scaled_dot_product_attention, dropout_p=dropout, scale=scaling, enable_gqa=key.shape[1] != h
    )
    # split, not sliced: the backward concatenates the segments' gradients once (a slice's backward
    # zero-fills the whole row for each segment)
    sizes = [size for p, comps in segments for size in (p, *(ln for ln, _ in comps))]
    q, k, v = (t.split(sizes, dim=2) for t in (query, key, value))
    outs, j = [], 0
    for p, comps in segments:
        kp, vp = k[j], v[j]
        if p:
            outs.append(sdpa(q[j], kp, vp, is_causal=True))
        for ln, mask in comps:
            j += 1
            if ln:
                outs.append(
                    sdpa(q[j], torch.cat([kp, k[j]], dim=2), torch.cat([vp, v[j]], dim=2), attn_mask=mask)
                )
        j += 1
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


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


def _varlen_packing(sizes, device):
    """Variable-length sequences over packed_row's layout: per group, the prompt (causal) then each completion
    over [prompt; itself] (bottom-right causal), empty segments left out. The queries are the row itself, in
    order; the keys are gathered (the prompt's keys repeated per completion, as Prefix Grouper does): returns
    (k_idx, cu_q, cu_k, max_q, max_k)."""
    k_idx, len_q, len_k = [], [], []
    for start, p, comps in _segments(sizes):
        prompt = torch.arange(start, start + p, device=device)
        if p:
            k_idx.append(prompt)
            len_q.append(p)
            len_k.append(p)
        for at, ln in comps:
            if ln:
                k_idx += [prompt, torch.arange(at, at + ln, device=device)]
                len_q.append(ln)
                len_k.append(p + ln)
    cu = lambda lens: torch.tensor([0, *lens], device=device).cumsum(0).to(torch.int32)  # noqa: E731
    return torch.cat(k_idx), cu(len_q), cu(len_k), max(len_q), max(len_k)


def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface function for packed_row's layout through flash-attn's varlen kernel when available:
    the prompt and each completion as variable-length sequences. The packing comes in `grpo_fast_grouped` (a
    forward keyword argument: a checkpointed layer's recomputation sees it too)."""
    k_idx, cu_q, cu_k, max_q, max_k = kwargs["grpo_fast_grouped"]
    _, h, T, d = query.shape
    q = query[0].transpose(0, 1).contiguous()  # (T, h, d): every token is a query, in order
    k = key[0].transpose(0, 1).index_select(0, k_idx)
    v = value[0].transpose(0, 1).index_select(0, k_idx)
    out = _varlen_kernel(query)(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scaling, causal=True)
    return out.view(1, T, h, d), None


GROUPED_ATTN_NAME = "grpo_fast_grouped"
SEGMENTS_ATTN_NAME = "grpo_fast_segments"
for _name, _fn in ((GROUPED_ATTN_NAME, grouped_attention), (SEGMENTS_ATTN_NAME, segment_attention)):
    AttentionInterface.register(_name, _fn)
    AttentionMaskInterface.register(_name, _no_mask)


def shared_prefix_forward(
    model, prompt_ids, prompt_mask, completion_ids, completion_mask, attention="auto", counts=None
):
    """Final hidden states (n_prompts * G, C, H) of the completions, each prompt run once per group.

    `[s, j]` is the state that predicts completion token j of sample s: equal to a plain forward of that
    sample's unpadded prompt followed by its completion, at position len(prompt) - 1 + j.

    attention: "segments" runs every group's real tokens packed in one row (packed_row: no padding, so the
    linear layers run on real tokens only), the prompt and each completion as SDPA calls of their own
    (segment_attention: no (L, L) mask, G times less attention work than "mask" for G equal completions;
    measured 3x faster forward + backward per layer on a CPU); "varlen" runs the same row through flash-attn's
    varlen kernel (on half-precision CUDA tensors when installed, a PyTorch equivalent otherwise); "mask"
    runs a row per group, padded to the longest, with a 4D mask through SDPA (or eager); "auto" takes
    "varlen" for models loaded with a flash-attention implementation, else "segments".

    counts: the completions of each prompt when groups differ (a list summing to the rows), as
    in micro-batches packed to a memory budget; None: rows / n each.
    """
    n, P = prompt_ids.shape
    rows, C = completion_ids.shape
    if attention not in ("auto", "segments", "mask", "varlen"):
        raise ValueError(f"attention must be 'auto', 'segments', 'mask' or 'varlen', got {attention!r}")
    if counts is None:
        if rows % n:
            raise ValueError(f"completion_ids has {rows} rows for {n} prompts: expected a multiple")
        counts = [rows // n] * n
    elif len(counts) != n or sum(counts) != rows:
        raise ValueError(
            f"counts must give each of the {n} prompts its completions ({rows} rows), got {counts}"
        )
    impl = getattr(model.config, "_attn_implementation", "sdpa")
    # a layer recomputed in the backward by a checkpoint of someone else's runs the model's own attention:
    # only the 4D mask (a forward argument) reaches it (enable checkpointing with checkpointing_kwargs)
    own_attention_ok = recomputes_attention_safely(model)
    if attention == "auto":
        if not own_attention_ok:
            attention = "mask"
        else:
            attention = "varlen" if str(impl).startswith("flash_attention") else "segments"
    if attention in ("segments", "varlen") and not own_attention_ok:
        raise ValueError(
            f"attention {attention!r} under gradient checkpointing needs the recomputation to run it too: "
            "enable checkpointing with gradient_checkpointing_kwargs=grpo_fast.models.model_parts."
            "checkpointing_kwargs(model), or use attention 'mask'"
        )
    pool = torch.cat([prompt_ids.reshape(-1), completion_ids.reshape(-1)])
    if attention == "mask":  # a row per group, through the model's SDPA (or eager) with a 4D mask
        src, pos, mask, pred = packed_group_layout(prompt_mask, completion_mask, counts)
        ctx = attention_implementation(model, "sdpa") if impl not in ("sdpa", "eager") else nullcontext()
        with ctx:
            out = decoder_of(model)(
                input_ids=pool[src], attention_mask=mask, position_ids=pos, use_cache=False
            )
    else:  # every group in one row, no padding, attention per segment
        src, pos, pred, sizes = packed_row(prompt_mask, completion_mask, counts)
        if attention == "segments":
            name, extra = SEGMENTS_ATTN_NAME, {"grpo_fast_segments": _segment_masks(sizes, prompt_ids.device)}
        else:
            name, extra = GROUPED_ATTN_NAME, {"grpo_fast_grouped": _varlen_packing(sizes, prompt_ids.device)}
        with attention_implementation(model, name):
            out = decoder_of(model)(input_ids=pool[src], position_ids=pos, use_cache=False, **extra)
    hidden = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])
    return hidden[pred.reshape(-1)].view(rows, C, -1)
