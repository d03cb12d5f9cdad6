"""Training with the G samples of a group sharing their prompt: one prompt forward per group. Exact, for any
Llama / Qwen2 / Mistral-style Hugging Face model.

Each group is laid out as one sequence [prompt; completion_1; ...; completion_G] (every completion sees the
prompt and, causally, itself) with RoPE positions of the unshared layout, so the prompt is run, and
differentiated, once per group (Prefix Grouper's construction). The attention runs per segment (the prompt,
each completion over [prompt; itself]) without an (L, L) mask; a 4D mask through the model's SDPA and, for
models loaded with a flash-attention implementation, variable-length packing are the other layouts.
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
    position_ids_from_mask,
    recomputes_attention_safely,
)


def _no_mask(*args, **kwargs):
    return None  # the attention below builds its own masks


# --------------------------------------------------------------------------------------------------------
# Training forward: [prompt; completion_1; ...; completion_G] per group
# --------------------------------------------------------------------------------------------------------
def group_layout(prompt_mask, completion_mask, G, with_mask=True):
    """Positions (n, L) and the 4D boolean mask (n, 1, L, L) of the grouped layout, L = P + G * C (None with
    with_mask=False)."""
    n, P = prompt_mask.shape
    C = completion_mask.shape[1]
    device = prompt_mask.device
    plen = prompt_mask.long().sum(1)
    pos = torch.cat(
        [position_ids_from_mask(prompt_mask), (plen[:, None] + torch.arange(C, device=device)).repeat(1, G)],
        dim=1,
    )
    if not with_mask:
        return pos, None
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


def packed_group_layout(prompt_mask, completion_mask, counts, with_mask=True):
    """The grouped layout with real tokens only: per group its prompt's tokens, then each completion's,
    padded at the end to the longest group (completions of one batch vary a lot in length: on SmolLM2 chat
    rollouts, 60% of a batch-padded layout was padding). counts[i]: the completions of prompt i (consecutive
    rows; groups may differ, as in micro-batches packed to a memory budget).

    Returns (src, pos, mask, pred): `src` (n, L) indices into the flat token pool [prompt_ids (n * P);
    completion_ids (rows * C)] (0 on padding), RoPE positions (n, L), the 4D boolean mask (n, 1, L, L), and
    `pred` (rows, C) indices into the flat (n * L) hidden states of the state predicting each completion
    token (0 beyond a completion's end). with_mask=False: no mask (None), for segment attention."""
    n, P = prompt_mask.shape
    rows, C = completion_mask.shape
    device = prompt_mask.device
    lens = completion_mask.long().sum(1).tolist()
    first = [0, *itertools.accumulate(counts)]  # each group's first row
    groups = []
    for i in range(n):
        p_idx = torch.nonzero(prompt_mask[i]).squeeze(1)
        p_len = len(p_idx)
        src, pos, seg = [i * P + p_idx], [torch.arange(p_len, device=device)], [torch.full((p_len,), -1)]
        for g in range(counts[i]):
            s = first[i] + g
            src.append(n * P + s * C + torch.arange(lens[s], device=device))
            pos.append(p_len + torch.arange(lens[s], device=device))
            seg.append(torch.full((lens[s],), g))
        groups.append((torch.cat(src), torch.cat(pos), torch.cat(seg).to(device), p_len))
    L = max(len(x[0]) for x in groups)
    src = torch.zeros(n, L, dtype=torch.long, device=device)
    pos = torch.zeros(n, L, dtype=torch.long, device=device)
    seg = torch.full((n, L), -2, dtype=torch.long, device=device)  # -2: padding
    pred = torch.zeros(rows, C, dtype=torch.long, device=device)
    for i, (s_i, p_i, g_i, p_len) in enumerate(groups):
        k = len(s_i)
        src[i, :k], pos[i, :k], seg[i, :k] = s_i, p_i, g_i
        start = p_len
        for g in range(counts[i]):
            s = first[i] + g
            ln = lens[s]
            if ln:  # token 0 is predicted by the prompt's last state, token j by completion token j - 1
                pred[s, :ln] = i * L + torch.cat(
                    [torch.tensor([p_len - 1], device=device), start + torch.arange(ln - 1, device=device)]
                )
            start += ln
    if not with_mask:
        return src, pos, None, pred
    idx = torch.arange(L, device=device)
    causal = idx[None, :] <= idx[:, None]
    same_or_prompt = (seg[:, None, :] == seg[:, :, None]) | (seg[:, None, :] == -1)
    mask = causal[None] & same_or_prompt & (seg[:, None, :] != -2)
    mask = mask | torch.eye(L, dtype=torch.bool, device=device)[None]  # padding rows see themselves
    return src, pos, mask[:, None], pred


def _segments(prompt_mask, completion_mask, counts):
    """Per group of the packed layout: (prompt length, [(completion length, its bottom-right causal mask over
    [prompt; itself])]), the masks built once per forward (every layer reuses them)."""
    lens = completion_mask.long().sum(1).tolist()
    plens = prompt_mask.long().sum(1).tolist()
    device = prompt_mask.device
    masks = {}
    out, first = [], 0
    for p, count in zip(plens, counts):
        comps = []
        for ln in lens[first : first + count]:
            if (p, ln) not in masks:
                masks[(p, ln)] = torch.ones(ln, p + ln, dtype=torch.bool, device=device).tril(p)
            comps.append((ln, masks[(p, ln)]))
        out.append((p, comps))
        first += count
    return out


def segment_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface function for the packed grouped layout (packed_group_layout) without an (L, L)
    mask: per group, its prompt attends causally to itself and each completion to [prompt; itself], one
    SDPA call each. The work is sum over completions of len * (prompt + len), where a masked SDPA over the
    whole group does L^2 (G times more for G equal completions); padding at a row's end gets zeros (no real
    token attends to it). The segments come in `grpo_fast_segments` (a forward keyword argument, so a
    checkpointed layer's recomputation sees them too)."""
    segments = kwargs["grpo_fast_segments"]
    n, h, L, d = query.shape
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
    rows = []
    for i, (p, comps) in enumerate(segments):
        # split, not sliced: the backward concatenates the segments' gradients once (a slice's backward
        # zero-fills the whole row for each segment)
        sizes = [p] + [ln for ln, _ in comps]
        sizes.append(L - sum(sizes))
        q, k, v = (t[i : i + 1].split(sizes, dim=2) for t in (query, key, value))
        outs = [sdpa(q[0], k[0], v[0], is_causal=True)] if p else []
        for j, (ln, mask) in enumerate(comps, start=1):
            if ln:
                kk, vv = torch.cat([k[0], k[j]], dim=2), torch.cat([v[0], v[j]], dim=2)
                outs.append(sdpa(q[j], kk, vv, attn_mask=mask))
        if sizes[-1]:
            outs.append(query.new_zeros(1, h, sizes[-1], d))
        rows.append(torch.cat(outs, dim=2))
    return torch.cat(rows).transpose(1, 2).contiguous(), None


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
    Grouper does) and run through flash-attn's varlen kernel when available. The packing comes in
    `grpo_fast_grouped` (a forward keyword argument: a checkpointed layer's recomputation sees it too)."""
    q_idx, k_idx, cu_q, cu_k, max_q, max_k = kwargs["grpo_fast_grouped"]
    n, h, L, d = query.shape
    kvh = key.shape[1]
    q = query.transpose(1, 2).reshape(n * L, h, d).index_select(0, q_idx)
    k = key.transpose(1, 2).reshape(n * L, kvh, d).index_select(0, k_idx)
    v = value.transpose(1, 2).reshape(n * L, kvh, d).index_select(0, k_idx)
    out = _varlen_kernel(query)(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scaling, causal=True)
    full = out.new_zeros(n * L, h, d).index_copy(0, q_idx, out)  # prompt padding: never a query, never a key
    return full.view(n, L, h, d), None


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

    attention: "segments" runs each group's real tokens packed in one row, the prompt and each completion as
    SDPA calls of their own (segment_attention: no (L, L) mask, G times less attention work than "mask" for
    G equal completions; measured 3x faster forward + backward per layer on a CPU); "mask" runs the same row
    with a 4D mask through SDPA (or eager); "varlen" packs the padded layout as variable-length sequences
    (flash-attn's varlen kernel on half-precision CUDA tensors when installed, a PyTorch equivalent
    otherwise); "auto" takes "varlen" for models loaded with a flash-attention implementation and equal
    groups, else "segments".

    counts: the completions of each prompt when groups differ (a list summing to the rows; not "varlen"), as
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
    ragged = len(set(counts)) > 1
    G = counts[0]
    impl = getattr(model.config, "_attn_implementation", "sdpa")
    # a layer recomputed in the backward by a checkpoint of someone else's runs the model's own attention:
    # only the 4D mask (a forward argument) reaches it (enable checkpointing with checkpointing_kwargs)
    own_attention_ok = recomputes_attention_safely(model)
    if attention == "auto":
        if not own_attention_ok:
            attention = "mask"
        else:
            attention = "varlen" if str(impl).startswith("flash_attention") and not ragged else "segments"
    if attention in ("segments", "varlen") and not own_attention_ok:
        raise ValueError(
            f"attention {attention!r} under gradient checkpointing needs the recomputation to run it too: "
            "enable checkpointing with gradient_checkpointing_kwargs=grpo_fast.models.model_parts."
            "checkpointing_kwargs(model), or use attention 'mask'"
        )
    if attention == "varlen" and ragged:
        raise ValueError("attention 'varlen' takes groups of one size: use 'segments' for ragged counts")
    if attention in ("segments", "mask"):  # real tokens only, each group one row (see packed_group_layout)
        segmented = attention == "segments"
        src, pos, mask, pred = packed_group_layout(prompt_mask, completion_mask, counts, not segmented)
        pool = torch.cat([prompt_ids.reshape(-1), completion_ids.reshape(-1)])
        extra = {"grpo_fast_segments": _segments(prompt_mask, completion_mask, counts)} if segmented else {}
        if segmented:
            ctx = attention_implementation(model, SEGMENTS_ATTN_NAME)
        else:
            ctx = attention_implementation(model, "sdpa") if impl not in ("sdpa", "eager") else nullcontext()
        with ctx:
            out = decoder_of(model)(
                input_ids=pool[src], attention_mask=mask, position_ids=pos, use_cache=False, **extra
            )
        hidden = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])
        return hidden[pred.reshape(-1)].view(rows, C, -1)
    ids = torch.cat([prompt_ids, completion_ids.reshape(n, G * C)], dim=1)
    pos, _ = group_layout(prompt_mask, completion_mask, G, with_mask=False)
    with attention_implementation(model, GROUPED_ATTN_NAME):
        hidden = decoder_of(model)(
            input_ids=ids, position_ids=pos, use_cache=False,
            grpo_fast_grouped=_grouped_packing(prompt_mask, G, C),
        )  # fmt: skip
    hidden = hidden.last_hidden_state
    # the state before completion token j: the prompt's last token for j = 0, else completion token j - 1
    j = torch.arange(C, device=ids.device)
    g = torch.arange(G, device=ids.device)
    src = torch.where(j[None, :] == 0, P - 1, P + g[:, None] * C + j[None, :] - 1)  # (G, C)
    out = hidden[:, src.reshape(-1)]  # (n, G * C, H)
    return out.reshape(n * G, C, -1)
