"""The GRPO loss straight from the last hidden state: LM head, log-softmax, gather, clipped loss in one call.

    hidden (B, T, H), weight (V, H), targets (B, T) int64, mask (B, T), advantages (B,) -> fp32 loss, metrics
Only active (mask != 0) tokens are scored. Triton: the fused log-prob kernels (logits never whole) feed the
loss kernel, whose gradient flows back through the log-prob backward. PyTorch twin: at token level one pass
over chunks of tokens computes logits, log-probs, the loss and, since the loss is then known, every gradient
(three matmuls, as plain PyTorch); at sequence level (GSPO) a first pass takes the log-probs and a second
the gradients.
"""

import torch

from ._common import check_tensor, resolve_impl
from .logprobs import (
    _twin_bwd,
    _twin_fwd,
    check_logprob_inputs,
    linear_logprobs,
    twin_accumulate,
    twin_chunk_rows,
    twin_grad_from_probs,
    twin_logits,
)
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


def _one_pass(h, weight, bias, tgt, inv_t, w, adv, old, sampling, ref, m, params, need_grad, need_w=True):
    """Token-local options (`params.token_local`) over active tokens (flat): loss, metric sums, the detached
    log-probs and, when asked, every gradient (d weight only with need_w)."""
    N, H = h.shape
    grad_h = torch.zeros(N, H, dtype=h.dtype, device=h.device) if need_grad else None
    grad_w = None  # started by the first chunk with a gradient
    grad_b = (
        torch.zeros(weight.shape[0], dtype=torch.float32, device=h.device)
        if need_grad and bias is not None
        else None
    )
    sums = torch.zeros(5, dtype=torch.float32, device=h.device)  # loss, kl, low, high, region
    logps = torch.empty(N, dtype=torch.float32, device=h.device)
    step = twin_chunk_rows(weight.shape[0])
    buf = torch.empty(min(N, step) * weight.shape[0], dtype=torch.float32, device=h.device)
    part = lambda x, sl: None if x is None else x[sl]  # noqa: E731
    for i in range(0, N, step):
        sl = slice(i, i + step)
        # 1. logits tile, log-probs
        z = twin_logits(h[sl], weight, bias, inv_t, out=buf)
        zt = z.gather(1, tgt[sl, None]).squeeze(1)
        m_max = z.amax(dim=1)
        p = z.sub_(m_max[:, None]).exp_()  # the tile becomes the softmax in place: no second tile
        s = p.sum(1)
        p.div_(s[:, None])
        logp = zt - (m_max + torch.log(s))
        logps[sl] = logp
        # 2. the chunk's gates, loss and d loss / d logp (per token: the loss is known here)
        gate = loss_gates(logp, part(old, sl), part(sampling, sl), None, adv[sl], m[sl], params).gate
        with torch.enable_grad():
            lp = logp.requires_grad_(True)
            pt, kl, low, high = per_token_terms(
                lp, part(old, sl), part(ref, sl), adv[sl], m[sl], params, gate
            )
            loss_c = (w[sl] * pt).sum()
            g = torch.autograd.grad(loss_c, lp)[0] if need_grad else None
        low_s, high_s, region_s, _ = clip_metric_sums(low, high, m[sl], False)
        kl_s = (kl.detach() * m[sl]).sum() if kl is not None else sums.new_zeros(())
        sums += torch.stack([loss_c.detach(), kl_s, low_s, high_s, region_s])
        # 3. gradients of this chunk: d logits in place of z, then d hidden, d weight, d bias
        if need_grad and bool(g.any()):
            dz = twin_grad_from_probs(p, tgt[sl], g, inv_t)
            grad_h[sl], grad_w = twin_accumulate(dz, h[sl], weight, grad_w, grad_b, need_w)
    if need_grad and need_w and grad_w is None:
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
    return sums, logps, grad_h, grad_w, grad_b


def _two_pass(h, weight, bias, tgt, inv_t, B, T, idx, mask, adv, old, sampling, ref, params, n_items, need_w):
    """Options that need whole rows (or every token's entropy): log-probs (and entropies) of active tokens
    first, then the loss on (B, T), then the gradients."""
    logp_act, lse, ent_act, ez = _twin_fwd(h, weight, bias, tgt, inv_t, params.needs_entropy)

    def scatter(x):  # active tokens -> (B, T), 0 on padding
        return torch.zeros(B * T, dtype=torch.float32, device=h.device).index_copy_(0, idx, x).view(B, T)

    ent = None if ent_act is None else scatter(ent_act)
    loss, g, g_ent, metrics = loss_and_grads(
        scatter(logp_act), ent, adv, mask, old, sampling, ref, params, n_items, "torch"
    )
    if need_w is None:  # no gradient wanted
        return loss, metrics, None, None, None
    g_ent_act = None if g_ent is None else g_ent.reshape(-1)[idx]
    grad_h, grad_w, grad_b = _twin_bwd(
        h, weight, bias, tgt, inv_t, lse, g.reshape(-1)[idx], g_ent_act, ez, need_w
    )
    return loss, metrics, grad_h, grad_w, grad_b


def _fused_twin(hidden, weight, targets, mask, advantages, bias, inv_t, old, sampling, ref, params, n_items):
    B, T, H = hidden.shape
    need_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    need_w = need_grad and weight.requires_grad  # a frozen head (LoRA): no d weight at all
    # only active tokens are scored: padding costs nothing
    idx = mask.reshape(-1).nonzero().squeeze(1)
    h = hidden.detach().reshape(-1, H).index_select(0, idx)
    tgt = targets.reshape(-1).long().index_select(0, idx)
    wt, bs = weight.detach(), None if bias is None else bias.detach()
    adv = advantages.reshape(-1).float()
    old, sampling, ref = (None if t is None else t.float() for t in (old, sampling, ref))
    if not params.token_local or not need_grad:
        loss, metrics, gh, gw, gb = _two_pass(
            h, wt, bs, tgt, inv_t, B, T, idx, mask, adv, old, sampling, ref, params, n_items,
            need_w if need_grad else None,
        )  # fmt: skip
    else:
        flat = lambda x: None if x is None else x.reshape(-1).index_select(0, idx)  # noqa: E731
        adv_tok, m_tok = flat(adv[:, None].expand(B, T)), flat(mask.float())
        w = token_weights(mask, params, n_items)
        sums, logps, gh, gw, gb = _one_pass(
            h, wt, bs, tgt, inv_t, flat(w), adv_tok, flat(old), flat(sampling), flat(ref), m_tok, params,
            need_grad, need_w,
        )  # fmt: skip
        loss = sums[0]
        n_tok = mask.float().sum()
        metrics = finish_metrics(
            sums[2], sums[3], sums[4], n_tok, sums[1], n_tok, ref is not None, params.kind
        )
        gates = loss_gates(logps, flat(old), flat(sampling), None, adv_tok, m_tok, params)
        metrics.update({k: v.detach().float() for k, v in gates.metrics.items()})
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
    impl="auto",
    **options,
):
    """The GRPO loss family from the LM head's input, never materializing the (tokens x vocab) logits.

    Same semantics and options as `grpo_loss` (TRL 1.16 GRPOTrainer), with the policy log-probs taken as
    `log_softmax((hidden @ weight.T + bias) / temperature)[targets]`, plus the two options that need the
    entropy, computed in the same sweep over the vocabulary. Memory: Triton holds one (64 x 128) fp32 logits
    tile per program; the twin one fp32 tile of about 2**24 elements (C x V, C = 128 tokens at V=151,936;
    see `twin_chunk_rows`), at most one temporary of that size, and the fp32 weight gradient. Passes: the
    twin scores and differentiates each chunk of tokens at once when every factor of a token's loss is
    known from that token (token level, token-mode corrections); options that need whole rows or every
    token's entropy (sequence level, sequence-mode corrections, the off-policy mask, vespo,
    top_entropy_quantile, entropy_coef) take a scoring pass first, as Triton always does.

    Args:
        hidden: (B, T, H) float tensor, the LM head's input at the positions predicting `targets`.
        weight: (V, H) LM head weight, hidden's dtype.
        targets: (B, T) int64 completion token ids in [0, V).
        mask: (B, T) completion mask; tokens with mask 0 are neither scored nor differentiated.
        advantages: (B,) float advantages.
        bias: optional (V,) LM head bias.
        temperature: float > 0 dividing the logits (the sampling temperature).
        old_logps, ref_logps, sampling_logps, num_items_in_batch: (B, T) tensors / normalizer as in
            `grpo_loss`.
        top_entropy_quantile: train only on the active tokens whose entropy is in this top fraction of the
            batch's (TRL; 1.0 = all tokens).
        entropy_coef: entropy bonus: the loss minus entropy_coef x the mean entropy of those tokens (TRL).
        **options: every other keyword of `grpo_loss` (beta, epsilon_low, epsilon_high, loss_type,
            importance_sampling_level, max_completion_length, use_bias_correction_kl, delta,
            sampling_correction, sampling_clip_max, sampling_clip_min, off_policy_mask_threshold, sapo_*,
            vespo_*), with its defaults.
        impl: "auto" (Triton for CUDA tensors, else the twin), "triton" or "torch".

    Returns:
        (loss, metrics) as `grpo_loss` (plus `entropy`, the masked mean, when it is computed); the loss is
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
        **options,
    )
    impl = resolve_impl(
        impl, hidden, weight, targets, mask, advantages, bias, old_logps, ref_logps, sampling_logps
    )
    if impl == "torch":
        return _fused_twin(
            hidden, weight, targets, mask, advantages, bias, 1.0 / float(temperature), old_logps,
            sampling_logps, ref_logps, params, num_items_in_batch,
        )  # fmt: skip
    # Triton: score the active tokens with the fused log-prob kernels, then the loss kernel
    B, T = mask.shape
    active = mask.reshape(-1) != 0
    logp_act, ent_act = linear_logprobs(
        flat_h[active], weight, bias, flat_t[active], float(temperature), params.needs_entropy, "triton"
    )
    logps = logp_act.new_zeros(B * T).masked_scatter(active, logp_act).view(B, T)
    ent = None if ent_act is None else ent_act.new_zeros(B * T).masked_scatter(active, ent_act).view(B, T)
    return grpo_loss_from_params(
        logps,
        ent,
        advantages,
        mask,
        old_logps,
        sampling_logps,
        ref_logps,
        params,
        num_items_in_batch,
        "triton",
    )


__all__ = ["fused_linear_grpo_loss"]
