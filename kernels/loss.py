"""The GRPO loss family on per-token log-probs, with TRL 1.16's `GRPOTrainer._compute_loss` semantics.

logps, old_logps, ref_logps, sampling_logps, mask: (B, T)   advantages: (B,)   ->  fp32 scalar loss, metrics
per_token = gate * policy_term(r, A) + beta * (exp(ref - logp) - (ref - logp) - 1), loss = sum(w * per_token)
The policy terms (clip family, cispo, sapo, vespo), the normalizers w and the detached gates (rollout-mismatch
ratio, off-policy sequence mask, top-entropy mask) are the table in loss_variants.py; the gates are computed
there in PyTorch ((B, T) elementwise work), the loss and its gradient d loss / d logp here in one kernel.
"""

import inspect

import torch
import triton
import triton.language as tl

from ._common import check_shape, check_tensor, resolve_impl
from .loss_variants import (
    CLIP_METRICS,
    POLICY_TERMS,
    LossParams,
    clip_flags,
    entropy_bonus,
    loss_gates,
    make_loss_params,
    token_weights,
)


def loss_options(
    logps_shape, advantages, mask, old_logps, ref_logps, num_items_in_batch, sampling_logps, **options
):
    """Validate tensors and options once; returns (LossParams, ref_logps, or None when beta == 0)."""
    params = make_loss_params(**options)
    check_loss_tensors(
        logps_shape, advantages, mask, old_logps, ref_logps, sampling_logps, params, num_items_in_batch
    )
    return params, (ref_logps if params.beta != 0.0 else None)


def check_loss_tensors(
    logps_shape, advantages, mask, old_logps, ref_logps, sampling_logps, params, num_items_in_batch
):
    """Shape checks shared by grpo_loss and fused_linear_grpo_loss; returns (B, T)."""
    if len(logps_shape) != 2:
        raise ValueError(f"per-token tensors must be (B, T), got shape {tuple(logps_shape)}")
    B, T = logps_shape
    check_tensor("advantages", advantages, (1, 2))
    check_shape(
        "advantages",
        advantages.reshape(-1) if advantages.dim() == 2 and advantages.shape[1] == 1 else advantages,
        (B,),
    )
    check_tensor("mask", mask, (2,), floating=False)
    check_shape("mask", mask, (B, T))
    for name, t in (("old_logps", old_logps), ("ref_logps", ref_logps), ("sampling_logps", sampling_logps)):
        if t is not None:
            check_tensor(name, t, (2,))
            check_shape(name, t, (B, T))
    if params.beta != 0.0 and ref_logps is None:
        raise ValueError("beta != 0 needs ref_logps (the reference model's per-token log-probs), got None")
    if params.correction is not None and sampling_logps is None:
        raise ValueError(
            f"sampling_correction={params.correction!r} needs sampling_logps (the rollout engine's per-token "
            "log-probs of the sampled tokens), got None"
        )
    if num_items_in_batch is not None:
        n = float(num_items_in_batch)
        if not n > 0:
            raise ValueError(f"num_items_in_batch must be > 0, got {num_items_in_batch!r}")
    return B, T


def per_token_terms(logps, old_logps, ref_logps, advantages, mask, params: LossParams, gate=None, phi=None):
    """TRL's per-token loss (differentiable in logps), the per-token KL, and the clip flags (None for the
    variants without a hard clip).

    At token level every tensor may be any shape broadcastable to logps; at sequence level they are (B, T)
    and the importance ratio is the masked mean over each row.
    """
    old = logps.detach() if old_logps is None else old_logps.float()
    log_ratio = logps - old
    if params.sequence_level:
        m = mask.float()
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    per_token = POLICY_TERMS[params.loss_type](logps, coef_1, advantages, params, phi)
    if gate is not None:
        per_token = per_token * gate
    kl = None
    if params.beta != 0.0:
        delta = ref_logps.float() - logps
        kl = torch.exp(delta) - delta - 1
        if params.use_bias_correction_kl:
            kl = kl * coef_1
        per_token = per_token + params.beta * kl
    low, high = clip_flags(coef_1.detach(), advantages, params)
    return per_token, kl, low, high


def clip_metric_sums(low, high, mask, sequence_level):
    """(sum, count) pairs behind TRL's clip ratios: over tokens, or over sequences at sequence level."""
    if low is None:
        z = mask.new_zeros((), dtype=torch.float32)
        return z, z, z, z + 1.0
    if sequence_level:
        n = torch.tensor(float(low.shape[0]), device=low.device)
        return low.float().sum(), high.float().sum(), (low | high).float().sum(), n
    m = mask.float()
    low, high = low.expand_as(m), high.expand_as(m)
    return (low * m).sum(), (high * m).sum(), ((low | high) * m).sum(), m.sum()


def finish_metrics(low_s, high_s, region_s, count, kl_s, token_count, with_kl, kind=0):
    count = count.clamp(min=1.0)
    names = CLIP_METRICS.get(kind, ())
    metrics = {n: s / count for n, s in zip(names, (low_s, high_s, region_s)) if n is not None}
    if with_kl:
        metrics["kl"] = kl_s / token_count.clamp(min=1.0)
    return {k: v.detach() for k, v in metrics.items()}


# --------------------------------------------------------------------------------------------------------
# Triton: one program per sequence computes the loss, the metrics' sums, and d loss / d logp
# --------------------------------------------------------------------------------------------------------
@triton.jit
def _policy_term(
    r, lp, a, phi, lo, hi, cap, delta, tau_pos, tau_neg, KIND: tl.constexpr, HAS_DELTA: tl.constexpr
):
    """(loss, d loss / d log r, d loss / d logp at fixed r) of a token's policy term (loss_variants.py)."""
    zero = tl.zeros_like(r)
    if KIND == 0:  # clip family: -min(min(r, delta) A, clip(r) A); torch.min splits a tie's gradient
        c1 = r
        d1 = r * a
        if HAS_DELTA:
            c1 = tl.minimum(r, delta)
            d1 = tl.where(r <= delta, d1, 0.0)
        u = c1 * a
        c = tl.minimum(tl.maximum(r, lo), hi) * a
        d2 = tl.where((r >= lo) & (r <= hi), r * a, 0.0)
        d_logr = -tl.where(u < c, d1, tl.where(u > c, d2, 0.5 * (d1 + d2)))
        return -tl.minimum(u, c), d_logr, zero
    elif KIND == 1:  # cispo: -sg(min(r, eps_high)) A logp
        c = tl.minimum(r, cap) * a
        return -c * lp, zero, -c
    elif KIND == 2:  # sapo: -sigmoid(tau (r - 1)) 4 / tau A
        tau = tl.where(a > 0, tau_pos, tau_neg)
        s = tl.sigmoid(tau * (r - 1.0))
        return -s * 4.0 / tau * a, -4.0 * a * s * (1.0 - s) * r, zero
    else:  # vespo: -sg(phi) A logp
        return -phi * a * lp, zero, -phi * a


@triton.jit
def _clip_flags(r, a, lo, hi, cap, delta, KIND: tl.constexpr, HAS_DELTA: tl.constexpr):
    """(low, high) float flags of the clip metrics (loss_variants.clip_flags)."""
    zero = tl.zeros_like(r)
    if KIND == 0:
        c1 = r
        if HAS_DELTA:
            c1 = tl.minimum(r, delta)
        return tl.where(c1 < lo, 1.0, 0.0) * tl.where(a < 0, 1.0, 0.0), tl.where(
            c1 > hi, 1.0, 0.0
        ) * tl.where(a > 0, 1.0, 0.0)
    elif KIND == 1:
        return zero, tl.where(r > cap, 1.0, 0.0) * tl.where(a > 0, 1.0, 0.0)
    else:
        return zero, zero


@triton.heuristics(
    {
        "HAS_OLD": lambda args: args["old_ptr"] is not None,
        "HAS_REF": lambda args: args["ref_ptr"] is not None,
        "HAS_GATE": lambda args: args["gate_ptr"] is not None,
        "HAS_PHI": lambda args: args["phi_ptr"] is not None,
    }
)
@triton.jit
def _grpo_loss_fwd_kernel(
    logp_ptr,
    old_ptr,
    ref_ptr,
    adv_ptr,
    w_ptr,
    mask_ptr,
    gate_ptr,
    phi_ptr,
    grad_ptr,
    row_ptr,
    T,
    beta,
    eps_low,
    eps_high,
    delta,
    tau_pos,
    tau_neg,
    HAS_OLD: tl.constexpr,
    HAS_REF: tl.constexpr,
    HAS_GATE: tl.constexpr,
    HAS_PHI: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    KIND: tl.constexpr,
    SEQ_LEVEL: tl.constexpr,
    BIAS_KL: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64 before pointer math
    base = row * T
    a = tl.load(adv_ptr + row)
    lo = 1.0 - eps_low
    hi = 1.0 + eps_high
    phi = 0.0
    if HAS_PHI:
        phi = tl.load(phi_ptr + row)
    zero = tl.zeros((BLOCK_T,), dtype=tl.float32)

    # 1. sequence level: the row's masked-mean log-ratio comes before any token's gradient
    if SEQ_LEVEL:
        log_v = zero
        n_v = zero
        for t0 in range(0, T, BLOCK_T):
            offs = t0 + tl.arange(0, BLOCK_T)
            tm = offs < T
            m = tl.load(mask_ptr + base + offs, mask=tm, other=0.0)
            if HAS_OLD:
                lp = tl.load(logp_ptr + base + offs, mask=tm, other=0.0)
                old = tl.load(old_ptr + base + offs, mask=tm, other=0.0)
                log_v += (lp - old) * m
            n_v += m
        inv_len = 1.0 / tl.maximum(tl.sum(n_v, axis=0), 1.0)
        r_seq = tl.exp(tl.sum(log_v, axis=0) * inv_len)

    # 2. per token: weighted loss, d loss / d logp, KL and clip sums (fp32 vector accumulators)
    loss_v = zero
    kl_v = zero
    seq_v = zero  # sequence level: sum_t w_t d loss_t / d log r, reaching every token through the mean
    low_v = zero
    high_v = zero
    region_v = zero
    for t0 in range(0, T, BLOCK_T):
        offs = t0 + tl.arange(0, BLOCK_T)
        tm = offs < T
        lp = tl.load(logp_ptr + base + offs, mask=tm, other=0.0)
        w = tl.load(w_ptr + base + offs, mask=tm, other=0.0)
        m = tl.load(mask_ptr + base + offs, mask=tm, other=0.0)
        if SEQ_LEVEL:
            r = zero + r_seq
        elif HAS_OLD:
            r = tl.exp(lp - tl.load(old_ptr + base + offs, mask=tm, other=0.0))
        else:
            r = zero + 1.0
        loss_t, d_logr, d_lp = _policy_term(
            r, lp, a, phi, lo, hi, eps_high, delta, tau_pos, tau_neg, KIND, HAS_DELTA
        )
        if HAS_GATE:
            g = tl.load(gate_ptr + base + offs, mask=tm, other=0.0)
            loss_t = loss_t * g
            d_logr = d_logr * g
            d_lp = d_lp * g
        if SEQ_LEVEL:
            seq_v += w * d_logr
            grad_t = d_lp
        else:
            grad_t = d_logr + d_lp  # d log r / d logp = 1 at token level
            low, high = _clip_flags(r, a, lo, hi, eps_high, delta, KIND, HAS_DELTA)
            low_v += low * m
            high_v += high * m
            region_v += tl.maximum(low, high) * m
        if HAS_REF:
            ref = tl.load(ref_ptr + base + offs, mask=tm, other=0.0)
            e = tl.exp(ref - lp)
            kl = e - (ref - lp) - 1.0
            dkl = 1.0 - e
            if BIAS_KL:
                dkl = dkl * r
                if SEQ_LEVEL:
                    seq_v += w * beta * kl * r  # the bias-corrected KL reaches the sequence ratio too
                else:
                    dkl += kl * r  # d r / d logp = r at token level
                kl = kl * r
            loss_t += beta * kl
            grad_t += beta * dkl
            kl_v += kl * m
        loss_v += w * loss_t
        tl.store(grad_ptr + base + offs, w * grad_t, mask=tm)

    # 3. sequence level: add the gradient through the mean log-ratio, m_t / len to every token
    if SEQ_LEVEL:
        g_seq = tl.sum(seq_v, axis=0)
        for t0 in range(0, T, BLOCK_T):
            offs = t0 + tl.arange(0, BLOCK_T)
            tm = offs < T
            m = tl.load(mask_ptr + base + offs, mask=tm, other=0.0)
            g = tl.load(grad_ptr + base + offs, mask=tm, other=0.0)
            tl.store(grad_ptr + base + offs, g + g_seq * m * inv_len, mask=tm)
        low_s, high_s = _clip_flags(r_seq, a, lo, hi, eps_high, delta, KIND, HAS_DELTA)
        region_s = tl.maximum(low_s, high_s)
    else:
        low_s = tl.sum(low_v, axis=0)
        high_s = tl.sum(high_v, axis=0)
        region_s = tl.sum(region_v, axis=0)

    tl.store(row_ptr + row * 5 + 0, tl.sum(loss_v, axis=0))
    tl.store(row_ptr + row * 5 + 1, tl.sum(kl_v, axis=0))
    tl.store(row_ptr + row * 5 + 2, low_s)
    tl.store(row_ptr + row * 5 + 3, high_s)
    tl.store(row_ptr + row * 5 + 4, region_s)


def _loss_triton(logps, old_logps, ref_logps, advantages, mask, w, params: LossParams, gate, phi):
    B, T = logps.shape
    grad = torch.empty(B, T, dtype=torch.float32, device=logps.device)
    rows = torch.empty(B, 5, dtype=torch.float32, device=logps.device)
    mask_f = mask.float().contiguous()
    _grpo_loss_fwd_kernel[(B,)](
        logps,
        old_logps,
        ref_logps,
        advantages,
        w,
        mask_f,
        None if gate is None else gate.float().expand(B, T).contiguous(),
        None if phi is None else phi.float().reshape(B).contiguous(),
        grad,
        rows,
        T,
        params.beta,
        params.epsilon_low,
        params.epsilon_high,
        0.0 if params.delta is None else params.delta,
        params.sapo_temperature_pos,
        params.sapo_temperature_neg,
        HAS_DELTA=params.delta is not None,
        KIND=params.kind,
        SEQ_LEVEL=params.sequence_level,
        BIAS_KL=params.use_bias_correction_kl,
        BLOCK_T=min(1024, max(16, triton.next_power_of_2(T))),
    )
    sums = rows.sum(0)
    count = torch.tensor(float(B), device=logps.device) if params.sequence_level else mask_f.sum()
    metrics = finish_metrics(
        sums[2], sums[3], sums[4], count, sums[1], mask_f.sum(), ref_logps is not None, params.kind
    )
    return sums[0], grad, metrics


def _loss_torch(logps, old_logps, ref_logps, advantages, mask, w, params: LossParams, gate, phi):
    with torch.enable_grad():
        lp = logps.detach().requires_grad_(True)
        per_token, kl, low, high = per_token_terms(
            lp, old_logps, ref_logps, advantages[:, None], mask, params, gate, phi
        )
        loss = (w * per_token).sum()
        (grad,) = torch.autograd.grad(loss, lp)
    low_s, high_s, region_s, count = clip_metric_sums(low, high, mask, params.sequence_level)
    kl_s = (kl.detach() * mask).sum() if kl is not None else None
    metrics = finish_metrics(
        low_s, high_s, region_s, count, kl_s, mask.float().sum(), kl is not None, params.kind
    )
    return loss.detach(), grad, metrics


def loss_and_grads(
    logps, entropies, advantages, mask, old_logps, sampling_logps, ref_logps, params, n_items, impl
):
    """The loss on detached fp32 (B, T) log-probs (and entropies, when the options need them) with its
    gradients: (value, d loss / d logp, d loss / d entropy or None, metrics)."""
    f32 = lambda t: None if t is None else t.float().contiguous()  # noqa: E731
    old, ref, sampling = f32(old_logps), f32(ref_logps), f32(sampling_logps)
    adv = advantages.reshape(-1).float().contiguous()
    w = token_weights(mask, params, n_items).contiguous()
    gates = loss_gates(logps, old, sampling, entropies, adv[:, None], mask, params)
    fn = _loss_triton if impl == "triton" else _loss_torch
    value, grad, metrics = fn(logps, old, ref, adv, mask.contiguous(), w, params, gates.gate, gates.phi)
    metrics.update({k: v.detach().float() for k, v in gates.metrics.items()})
    g_ent = None
    if entropies is not None:
        m = mask.float()
        metrics["entropy"] = (entropies * m).sum().detach() / m.sum().clamp(min=1.0)
        # the tokens the entropy bonus acts on (under top_entropy_quantile, those the mask keeps): their count
        # and mean entropy, for a controller of the coefficient (TRL's use_adaptive_entropy)
        bonus = m if gates.entropy_mask is None else m * gates.entropy_mask
        metrics["bonus_tokens"] = bonus.sum().detach()
        metrics["bonus_entropy"] = (entropies * bonus).sum().detach() / metrics["bonus_tokens"].clamp(min=1.0)
    if params.entropy_coef != 0.0:
        bonus, g_ent = entropy_bonus(entropies, mask, gates.entropy_mask, params.entropy_coef)
        value = value + bonus.detach()
    return value, grad, g_ent, metrics


class AttachGrad(torch.autograd.Function):
    """`value` as a function of `inputs` whose gradients are already known: `grads` times the upstream.

    The precomputed gradients are handed to autograd in place (no second weight-sized buffer), so the
    backward runs once: retain_graph is not supported."""

    @staticmethod
    def forward(ctx, value, grads, *inputs):
        ctx.grads = grads  # computed in the forward, not inputs: kept as attributes, freed with the graph
        return value.clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.grads is None:
            raise RuntimeError(
                "the fused GRPO loss's backward can run only once (retain_graph is not supported)"
            )
        grads, ctx.grads = ctx.grads, None
        scaled = []
        for t in grads:
            if t is not None and not bool(g == 1):
                t = t.mul_(g.to(t.dtype))
            scaled.append(t)
        return (None, None, *scaled)


def attach_grads(value, inputs, grads):
    """Make `value` differentiable w.r.t. the `inputs` that need it, with the precomputed `grads`."""
    if not torch.is_grad_enabled() or not any(x is not None and x.requires_grad for x in inputs):
        return value
    return AttachGrad.apply(value, tuple(grads), *inputs)


def grpo_loss(
    logps,
    advantages,
    mask,
    *,
    old_logps=None,
    ref_logps=None,
    beta=0.0,
    epsilon_low=0.2,
    epsilon_high=None,
    loss_type="dapo",
    importance_sampling_level="token",
    max_completion_length=None,
    num_items_in_batch=None,
    use_bias_correction_kl=False,
    delta=None,
    sampling_logps=None,
    sampling_correction=None,
    sampling_clip_max=3.0,
    sampling_clip_min=None,
    off_policy_mask_threshold=None,
    sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05,
    vespo_k_pos=2.0,
    vespo_lambda_pos=3.0,
    vespo_k_neg=3.0,
    vespo_lambda_neg=2.0,
    impl="auto",
):
    """The GRPO loss family with TRL 1.16 GRPOTrainer semantics (its option names and defaults).

    Args:
        logps: (B, T) float per-token log-probs of the policy (differentiable).
        advantages: (B,) float advantages, one per sequence.
        mask: (B, T) bool/int/float completion mask (1 = token counts).
        old_logps: optional (B, T) log-probs of the policy that sampled (num_iterations > 1); None = the
            current log-probs, detached (ratio 1).
        ref_logps: (B, T) reference-model log-probs, required when beta != 0.
        beta: weight of the k3 KL penalty exp(ref - logp) - (ref - logp) - 1.
        epsilon_low, epsilon_high: clip range [1 - epsilon_low, 1 + epsilon_high]; epsilon_high defaults to
            epsilon_low. For "cispo" epsilon_high is the ratio's cap itself (TRL).
        loss_type: "grpo" (mean of per-sequence means), "bnpo" (mean over active tokens), "dr_grpo" (sum over
            B * max_completion_length), "dapo" (sum over num_items_in_batch), "cispo" (clipped-IS-weight
            policy gradient, dapo's normalizer), "sapo" (soft sigmoid gate, grpo's normalizer), "luspo" (clip
            family, per-sequence sums averaged), "vespo" (gamma-weighted sequence ratio, dapo's normalizer).
        importance_sampling_level: "token", or "sequence" (GSPO: one ratio per sequence, from the masked
            mean log-ratio).
        max_completion_length: int, required by "dr_grpo".
        num_items_in_batch: dapo/cispo/vespo normalizer (active tokens across the whole batch); default
            mask.sum().
        use_bias_correction_kl: multiply the KL by the importance ratio (TRL's option of that name).
        delta: two-sided clipping: the unclipped ratio is capped at delta (clip family).
        sampling_logps: (B, T) the rollout engine's log-probs of the sampled tokens (NaN = not scored: ratio
            1); needed by sampling_correction, and used by the off-policy mask when given.
        sampling_correction: None, or the rollout-mismatch correction (TRL's
            vllm_importance_sampling_mode): "token_truncate" | "token_mask" | "sequence_truncate" |
            "sequence_mask"; the ratio is exp(old - sampling) (old: old_logps, else the detached logps),
            per token or summed over the sequence, clamped to [sampling_clip_min, sampling_clip_max]
            (truncate) or zeroed outside it (mask); it multiplies each token's policy loss (VESPO: its
            weight).
        sampling_clip_max, sampling_clip_min: the correction's bounds (None = unbounded on that side).
        off_policy_mask_threshold: DeepSeek-V3.2's off-policy sequence mask: a sequence with a negative
            advantage whose mean log(sampling / current) exceeds this is dropped.
        sapo_temperature_pos, sapo_temperature_neg: SAPO's gate temperatures for A > 0 and A <= 0.
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO's gamma shape and rate.
        impl: "auto" (Triton for CUDA tensors, else the twin), "triton" or "torch".

    Returns:
        (loss, metrics): fp32 scalar loss, and a dict of detached scalars: the clip ratios of the loss type
        (`clip_ratio_low`, `clip_ratio_high`, `clip_ratio`, or `cispo_clip_ratio`: masked token means, or
        sequence means at sequence level), `kl` (beta != 0), `vespo_phi_mean`; with sampling_logps the
        mismatch `sampling_k3` (mean k3 estimate of KL(sampler || trainer)), `sampling_logp_diff_mean` /
        `_max`; with a correction `is_ratio_min` / `_mean` / `_max` and `is_masked_fraction` or
        `is_truncated_fraction`; with the off-policy mask `off_policy_masked_fraction`.
    """
    check_tensor("logps", logps, (2,))
    params, ref_logps = loss_options(
        logps.shape,
        advantages,
        mask,
        old_logps,
        ref_logps,
        num_items_in_batch,
        sampling_logps,
        beta=beta,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        loss_type=loss_type,
        importance_sampling_level=importance_sampling_level,
        max_completion_length=max_completion_length,
        use_bias_correction_kl=use_bias_correction_kl,
        delta=delta,
        sampling_correction=sampling_correction,
        sampling_clip_max=sampling_clip_max,
        sampling_clip_min=sampling_clip_min,
        off_policy_mask_threshold=off_policy_mask_threshold,
        sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg,
        vespo_k_pos=vespo_k_pos,
        vespo_lambda_pos=vespo_lambda_pos,
        vespo_k_neg=vespo_k_neg,
        vespo_lambda_neg=vespo_lambda_neg,
    )
    impl = resolve_impl(impl, logps, advantages, mask, old_logps, ref_logps, sampling_logps)
    return grpo_loss_from_params(
        logps, None, advantages, mask, old_logps, sampling_logps, ref_logps, params, num_items_in_batch, impl
    )


def grpo_loss_from_params(
    logps, entropies, advantages, mask, old_logps, sampling_logps, ref_logps, params, n_items, impl
):
    """`grpo_loss` on already validated inputs (see `loss_options`) with a resolved impl; `entropies` (B, T)
    differentiable when the options need them (fused path), else None."""
    ent = None if entropies is None else entropies.detach().float()
    value, grad, g_ent, metrics = loss_and_grads(
        logps.detach().float().contiguous(), ent, advantages, mask, old_logps, sampling_logps, ref_logps,
        params, n_items, impl,
    )  # fmt: skip
    # the gradient is known as soon as the loss is: both paths produce d loss / d logp in the forward
    grads = (grad.to(logps.dtype),) if g_ent is None else (grad.to(logps.dtype), g_ent.to(entropies.dtype))
    inputs = (logps,) if g_ent is None else (logps, entropies)
    return attach_grads(value, inputs, grads), metrics


# grpo_loss's non-tensor options and their defaults (fused_linear_grpo_loss takes the same)
LOSS_DEFAULTS = {
    k: v.default
    for k, v in inspect.signature(grpo_loss).parameters.items()
    if v.kind is v.KEYWORD_ONLY
    and k not in ("old_logps", "ref_logps", "sampling_logps", "num_items_in_batch", "impl")
}

__all__ = ["grpo_loss"]
