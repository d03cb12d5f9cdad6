"""The GRPO loss straight from the last hidden state: LM head, log-softmax, gather, clipped loss in one call.

    hidden (B, T, H), weight (V, H), targets (B, T) int64, mask (B, T), advantages (B,) -> fp32 loss, metrics
Only active (mask != 0) tokens are scored. One pass over chunks of tokens computes logits, log-probs, the
loss and, since the loss is then known, every gradient (three matmuls): the twin with torch's ops, Triton
(logprobs.TRITON_BACKWARD "chunked") with cuBLAS GEMMs and the row kernels of rows.py, one writer per output.
Where a scoring pass is needed, or with the "atomic" backward, Triton's fused log-prob kernels (logits never
whole) feed the loss kernel, whose gradient flows back through the log-prob backward. Chunks: options that
need a whole row (sequence level, sequence-mode corrections, the off-policy mask, VESPO) take the same single
pass over chunks of whole rows; only every token's entropy
(top_entropy_quantile, entropy_coef) or a row longer than a chunk needs a scoring pass before the gradients.
Mixed precision as in logprobs.py: the GEMMs run in `compute_dtype(hidden, weight)` (autocast's dtype, else
the shared one, else the 16-bit one), with autocast off inside and the twin's weight cast once per call;
gradients come back in hidden's, weight's and bias's own dtypes (an fp32 master weight's accumulated in fp32).
"""

import torch

from . import logprobs as _logprobs
from ._common import autocast_off, check_tensor, compute_dtype, resolve_impl
from .logprobs import TwinRows, _chunked_bwd, _twin_fwd, check_logprob_inputs, linear_logprobs
from .loss import (
    LOSS_DEFAULTS,
    attach_grads,
    clip_metric_sums,
    finish_metrics,
    grpo_loss_from_params,
    loss_and_grads,
    loss_options,
    per_token_terms,
)
from .loss_variants import loss_gates, token_weights
from .rows import TritonRows


def _row_chunks(mask, step):
    """Chunks of whole rows with at most `step` active tokens each, as (first row, end row, first token, end
    token) over the flat active tokens; None when a row alone holds more than `step`."""
    counts = mask.reshape(mask.shape[0], -1).ne(0).sum(1).tolist()
    if max(counts, default=0) > step:
        return None
    chunks, r0, t0, n = [], 0, 0, 0
    for r, c in enumerate(counts):
        if n + c > step:
            chunks.append((r0, r, t0, t0 + n))
            r0, t0, n = r, t0 + n, 0
        n += c
    if n:
        chunks.append((r0, len(counts), t0, t0 + n))
    return chunks


def _one_pass(
    h, weight, bias, tgt, inv_t, w, adv, old, sampling, ref, m, params, need_grad, need_w, rows, ops
):  # fmt: skip
    """One sweep over chunks of active tokens: loss, metric sums, the detached log-probs and, when asked,
    every gradient (d weight only with need_w), each chunk's gradient taken while its logits are at hand.
    `weight` comes as `ops.operand` made it, `h` in hidden's dtype (cast per chunk); `ops`: logprobs.TwinRows
    or rows.TritonRows (the chunk's matmuls and row operations).

    rows None: token-local options (`params.token_local`), flat chunks, every tensor flat over active tokens.
    Otherwise `rows` = (chunks from `_row_chunks`, positions of the active tokens in (B * T), T): each chunk
    holds whole rows, so a row's gates (sequence-mode correction, off-policy mask, VESPO's phi) and a
    sequence-level ratio are known inside it; w, adv, old, sampling, ref, m are then (B, T) (adv (B, 1))."""
    N, H = h.shape
    grad_h = torch.zeros(N, H, dtype=h.dtype, device=h.device) if need_grad else None
    grad_w = None  # started by the first chunk with a gradient
    grad_b = (
        torch.zeros(weight.shape[0], dtype=torch.float32, device=h.device)
        if need_grad and bias is not None
        else None
    )
    sums = torch.zeros(6, dtype=torch.float32, device=h.device)  # loss, kl, low, high, region, count
    logps = torch.empty(N, dtype=torch.float32, device=h.device)
    step = ops.chunk_rows(weight.shape[0])
    if rows is None:
        chunks = [(i, min(i + step, N), slice(i, i + step)) for i in range(0, N, step)]
    else:
        row_chunks, pos, T = rows
        chunks = [(t0, t1, slice(r0, r1)) for r0, r1, t0, t1 in row_chunks]
    buf = torch.empty(min(N, step) * weight.shape[0], dtype=torch.float32, device=h.device)
    part = lambda x, sl: None if x is None else x[sl]  # noqa: E731
    for t0, t1, sl in chunks:
        tok = slice(t0, t1)
        # 1. logits tile, log-probs (hidden cast to the compute dtype per chunk; weight already is)
        h_c = ops.operand(h[tok])
        z = ops.logits(h_c, weight, bias, inv_t, out=buf)
        logp, lse = ops.score(z, tgt[tok])  # the twin turns the tile into the softmax in place
        logps[tok] = logp
        # 2. the chunk's gates, loss and d loss / d logp (the loss is known here)
        with torch.enable_grad():
            lp = logp.requires_grad_(True)
            x = lp
            if rows is not None:  # the chunk's rows as (r, T), zeros on padding
                r = sl.stop - sl.start
                x = lp.new_zeros(r * T).index_copy(0, pos[tok] - sl.start * T, lp).view(r, T)
            gates = loss_gates(x.detach(), part(old, sl), part(sampling, sl), None, adv[sl], m[sl], params)
            pt, kl, low, high = per_token_terms(
                x, part(old, sl), part(ref, sl), adv[sl], m[sl], params, gates.gate, gates.phi
            )
            loss_c = (w[sl] * pt).sum()
            g = torch.autograd.grad(loss_c, lp)[0] if need_grad else None
        clip_s = clip_metric_sums(low, high, m[sl], params.sequence_level)
        kl_s = (kl.detach() * m[sl]).sum() if kl is not None else sums.new_zeros(())
        sums += torch.stack([loss_c.detach(), kl_s, *clip_s])
        # 3. gradients of this chunk: d logits in place of z, then d hidden, d weight, d bias
        if need_grad and bool(g.any()):
            dz = ops.grad(z, lse, tgt[tok], g, inv_t)
            grad_h[tok], grad_w = ops.accumulate(dz, h_c, weight, grad_w, grad_b, need_w)
    if need_grad and need_w and grad_w is None:
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
    return sums, logps, grad_h, grad_w, grad_b


def _two_pass(h, weight, bias, tgt, inv_t, B, T, idx, mask, adv, old, sampling, ref, params, n_items, need_w):
    """Options that need whole rows (or every token's entropy): log-probs (and entropies) of active tokens
    first, then the loss on (B, T), then the gradients."""
    cdtype = weight.dtype  # the caller cast the weight to the compute dtype
    logp_act, lse, ent_act, ez = _twin_fwd(h, weight, bias, tgt, inv_t, params.needs_entropy, cdtype)

    def scatter(x):  # active tokens -> (B, T), 0 on padding
        return torch.zeros(B * T, dtype=torch.float32, device=h.device).index_copy_(0, idx, x).view(B, T)

    ent = None if ent_act is None else scatter(ent_act)
    loss, g, g_ent, metrics = loss_and_grads(
        scatter(logp_act), ent, adv, mask, old, sampling, ref, params, n_items, "torch"
    )
    if need_w is None:  # no gradient wanted
        return loss, metrics, None, None, None
    g_ent_act = None if g_ent is None else g_ent.reshape(-1)[idx]
    grad_h, grad_w, grad_b = _chunked_bwd(
        h, weight, bias, tgt, inv_t, lse, g.reshape(-1)[idx], g_ent_act, ez, need_w, TwinRows(cdtype)
    )
    return loss, metrics, grad_h, grad_w, grad_b


def _fused_chunked(
    hidden, weight, targets, mask, advantages, bias, inv_t, old, sampling, ref, params, n_items, ops
):
    """The loss over chunks of tokens with `ops` (logprobs.TwinRows: the twin, any case; rows.TritonRows:
    only where one pass does it all, else None for the caller's Triton path)."""
    B, T, H = hidden.shape
    need_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    need_w = need_grad and weight.requires_grad  # a frozen head (LoRA): no d weight at all
    # only active tokens are scored: padding costs nothing
    idx = mask.reshape(-1).nonzero().squeeze(1)
    h = hidden.detach().reshape(-1, H).index_select(0, idx)
    tgt = targets.reshape(-1).long().index_select(0, idx)
    row_chunks = None
    if need_grad and not params.token_local and not params.needs_entropy:
        row_chunks = _row_chunks(mask, ops.chunk_rows(weight.shape[0]))
    one_pass = need_grad and (params.token_local or row_chunks is not None)
    if not one_pass and not isinstance(ops, TwinRows):
        return None
    # the weight in the compute dtype once per call (a no-op when it is already); hidden per chunk
    wt, bs = ops.operand(weight.detach()), None if bias is None else bias.detach()
    adv = advantages.reshape(-1).float()
    old, sampling, ref = (None if t is None else t.float() for t in (old, sampling, ref))
    if one_pass:
        w = token_weights(mask, params, n_items)
        if params.token_local:  # flat over active tokens
            flat = lambda x: None if x is None else x.reshape(-1).index_select(0, idx)  # noqa: E731
            args = (flat(w), flat(adv[:, None].expand(B, T)), flat(old), flat(sampling), flat(ref))
            m, rows = flat(mask.float()), None
        else:  # (B, T): each chunk whole rows
            args = (w, adv[:, None], old, sampling, ref)
            m, rows = mask.float(), (row_chunks, idx, T)
        sums, logps, gh, gw, gb = _one_pass(
            h, wt, bs, tgt, inv_t, *args, m, params, need_grad, need_w, rows, ops
        )  # fmt: skip
        loss = sums[0]
        metrics = finish_metrics(*sums[2:6], sums[1], mask.float().sum(), ref is not None, params.kind)
        if rows is not None:  # the gates' metrics over the whole batch, on (B, T)
            logps = logps.new_zeros(B * T).index_copy_(0, idx, logps).view(B, T)
        gates = loss_gates(logps, args[2], args[3], None, args[1], m, params)
        metrics.update({k: v.detach().float() for k, v in gates.metrics.items()})
    else:  # entropy options, rows longer than a chunk, no gradient: score all, then differentiate
        loss, metrics, gh, gw, gb = _two_pass(
            h, wt, bs, tgt, inv_t, B, T, idx, mask, adv, old, sampling, ref, params, n_items,
            need_w if need_grad else None,
        )  # fmt: skip
    if not need_grad:
        return loss, metrics
    grad_hidden = torch.zeros(B * T, H, dtype=hidden.dtype, device=hidden.device)
    grad_hidden.index_copy_(0, idx, gh.to(hidden.dtype))
    grads = (
        grad_hidden.view(B, T, H),
        None if gw is None else gw.to(weight.dtype),
        None if gb is None else gb.to(bias.dtype),
    )
    return attach_grads(loss, (hidden, weight, bias), grads), metrics


def fused_linear_grpo_loss(
    hidden,
    weight,
    targets,
    mask,
    advantages,
    *,
    bias=None,
    temperature=1.0,
    old_logps=None,
    ref_logps=None,
    sampling_logps=None,
    num_items_in_batch=None,
    top_entropy_quantile=1.0,
    entropy_coef=0.0,
    compute_entropy=False,
    impl="auto",
    **options,
):
    """The GRPO loss family from the LM head's input, never materializing the (tokens x vocab) logits.

    Same semantics and options as `grpo_loss` (TRL 1.16 GRPOTrainer), with the policy log-probs taken as
    `log_softmax((hidden @ weight.T + bias) / temperature)[targets]`, plus the two options that need the
    entropy, computed in the same sweep over the vocabulary. Memory: Triton holds one (64 x 128) fp32 logits
    tile per program; the twin one fp32 tile of about 2**24 elements (C x V, C = 128 tokens at V=151,936;
    see `twin_chunk_rows`), at most one temporary of that size, and the fp32 weight gradient. Passes: the
    twin scores and differentiates each chunk at once: chunks of tokens when every factor of a token's loss
    is known from that token, chunks of whole rows for options that need a row (sequence level,
    sequence-mode corrections, the off-policy mask, vespo). Options that need every token's entropy
    (top_entropy_quantile, entropy_coef), and rows longer than a chunk, take a scoring pass first, as Triton
    always does.

    Mixed precision as `fused_linear_logprobs`: the matmuls run in autocast's dtype when autocast is enabled
    for the inputs' device type, else in hidden's and weight's shared dtype, else in the 16-bit one of the two
    (bf16 hidden on an fp32 master weight), with fp32 accumulation; the loss and metrics are fp32 and the
    gradients come back in each input's dtype (an fp32 weight's accumulated in fp32).

    Args:
        hidden: (B, T, H) float tensor, the LM head's input at the positions predicting `targets`.
        weight: (V, H) float LM head weight: hidden's dtype, or fp32 with 16-bit hidden (or 16-bit with fp32
            hidden); bf16 with fp16 is a TypeError (outside autocast).
        targets: (B, T) int64 completion token ids in [0, V).
        mask: (B, T) completion mask; tokens with mask 0 are neither scored nor differentiated.
        advantages: (B,) float advantages.
        bias: optional (V,) LM head bias, any float dtype (added to the logits in fp32).
        temperature: float > 0 dividing the logits (the sampling temperature).
        old_logps, ref_logps, sampling_logps, num_items_in_batch: (B, T) tensors / normalizer as in
            `grpo_loss`.
        top_entropy_quantile: train only on the active tokens whose entropy is in this top fraction of the
            batch's (TRL; 1.0 = all tokens).
        entropy_coef: entropy bonus: the loss minus entropy_coef x the mean entropy of those tokens (TRL).
        compute_entropy: compute every active token's entropy even where no option needs it, for its
            metrics (a controller of entropy_coef measuring the entropy at a coefficient of 0).
        **options: every other keyword of `grpo_loss` (beta, epsilon_low, epsilon_high, loss_type,
            importance_sampling_level, max_completion_length, use_bias_correction_kl, delta,
            sampling_correction, sampling_clip_max, sampling_clip_min, off_policy_mask_threshold, sapo_*,
            vespo_*), with its defaults.
        impl: "auto" (Triton for CUDA tensors, else the twin), "triton" or "torch".

    Returns:
        (loss, metrics) as `grpo_loss`, plus, when the entropy is computed, `entropy` (the masked mean) and
        `bonus_entropy` / `bonus_tokens` (the mean entropy and the count of the tokens the bonus acts on:
        the active ones, under top_entropy_quantile those it keeps); the loss is
        differentiable w.r.t. hidden, weight and bias. A weight that does not require grad (a frozen head, as
        under LoRA) gets no gradient computed at all: no fp32 weight-sized buffer, a third fewer matmuls in
        the backward.
    """
    check_tensor("hidden", hidden, (3,))
    flat_h, flat_t = check_logprob_inputs(hidden, weight, targets, bias, temperature)
    options = {**LOSS_DEFAULTS, **options}
    unknown = sorted(set(options) - set(LOSS_DEFAULTS))
    if unknown:
        raise TypeError(f"fused_linear_grpo_loss got unexpected keyword arguments {unknown}")
    params, ref_logps = loss_options(
        hidden.shape[:2],
        advantages,
        mask,
        old_logps,
        ref_logps,
        num_items_in_batch,
        sampling_logps,
        top_entropy_quantile=top_entropy_quantile,
        entropy_coef=entropy_coef,
        compute_entropy=compute_entropy,
        **options,
    )
    impl = resolve_impl(
        impl, hidden, weight, targets, mask, advantages, bias, old_logps, ref_logps, sampling_logps
    )
    cdtype = compute_dtype(hidden, weight)  # decided here, ambient autocast included; then autocast is off
    with autocast_off(hidden.device):
        if impl == "torch" or _logprobs.TRITON_BACKWARD == "chunked":
            ops = TwinRows(cdtype) if impl == "torch" else TritonRows(cdtype)
            done = _fused_chunked(
                hidden, weight, targets, mask, advantages, bias, 1.0 / float(temperature), old_logps,
                sampling_logps, ref_logps, params, num_items_in_batch, ops,
            )  # fmt: skip
            if done is not None:
                return done
        # Triton, a scoring pass (no gradient, entropy options, rows longer than a chunk, or the atomic
        # backward): the fused log-prob kernels score the active tokens, then the loss kernel
        B, T = mask.shape
        active = mask.reshape(-1) != 0
        logp_act, ent_act = linear_logprobs(
            flat_h[active], weight, bias, flat_t[active], float(temperature), params.needs_entropy, "triton",
            cdtype,
        )  # fmt: skip
        logps = logp_act.new_zeros(B * T).masked_scatter(active, logp_act).view(B, T)
        ent = None if ent_act is None else ent_act.new_zeros(B * T).masked_scatter(active, ent_act).view(B, T)
        return grpo_loss_from_params(
            logps, ent, advantages, mask, old_logps, sampling_logps, ref_logps, params, num_items_in_batch,
            "triton",
        )  # fmt: skip


__all__ = ["fused_linear_grpo_loss"]
