"""The clipped GRPO loss on per-token log-probs, with TRL 1.16's `GRPOTrainer._compute_loss` semantics.

logps, old_logps, ref_logps, mask: (B, T)   advantages: (B,)   ->  fp32 scalar loss, metrics
r = exp(logp - old)  (token level)  or  exp(masked mean over the sequence of logp - old)  (GSPO)
per_token = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) + beta * (exp(ref - logp) - (ref - logp) - 1)
loss = sum(w * per_token) with w from the loss type: grpo 1/(B len_b), bnpo 1/sum(mask),
       dr_grpo 1/(B max_completion_length), dapo 1/num_items_in_batch (all times mask).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import check_nonnegative, check_shape, check_tensor, resolve_impl

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class LossParams:
    """Non-tensor options of the loss, validated once."""

    beta: float
    epsilon_low: float
    epsilon_high: float
    loss_type: str
    sequence_level: bool
    max_completion_length: int | None
    use_bias_correction_kl: bool


def make_loss_params(
    *,
    beta,
    epsilon_low,
    epsilon_high,
    loss_type,
    importance_sampling_level,
    max_completion_length,
    use_bias_correction_kl,
) -> LossParams:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if importance_sampling_level not in LEVELS:
        raise ValueError(
            f"importance_sampling_level must be one of {LEVELS}, got {importance_sampling_level!r}"
        )
    check_nonnegative("epsilon_low", epsilon_low)
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    check_nonnegative("epsilon_high", epsilon_high)
    if not isinstance(beta, (int, float)):
        raise TypeError(f"beta must be a number, got {type(beta).__name__}")
    if loss_type == "dr_grpo" and (not isinstance(max_completion_length, int) or max_completion_length < 1):
        raise ValueError(
            f"loss_type='dr_grpo' needs max_completion_length as an int >= 1, got {max_completion_length!r}"
        )
    return LossParams(
        float(beta),
        float(epsilon_low),
        float(epsilon_high),
        loss_type,
        importance_sampling_level == "sequence",
        max_completion_length,
        bool(use_bias_correction_kl),
    )


def loss_options(logps_shape, advantages, mask, old_logps, ref_logps, num_items_in_batch, **options):
    """Validate tensors and options once; returns (LossParams, ref_logps, or None when beta == 0)."""
    params = make_loss_params(**options)
    check_loss_tensors(logps_shape, advantages, mask, old_logps, ref_logps, params.beta, num_items_in_batch)
    return params, (ref_logps if params.beta != 0.0 else None)


def check_loss_tensors(logps_shape, advantages, mask, old_logps, ref_logps, beta, num_items_in_batch):
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
    for name, t in (("old_logps", old_logps), ("ref_logps", ref_logps)):
        if t is not None:
            check_tensor(name, t, (2,))
            check_shape(name, t, (B, T))
    if beta != 0.0 and ref_logps is None:
        raise ValueError("beta != 0 needs ref_logps (the reference model's per-token log-probs), got None")
    if num_items_in_batch is not None:
        n = float(num_items_in_batch)
        if not n > 0:
            raise ValueError(f"num_items_in_batch must be > 0, got {num_items_in_batch!r}")
    return B, T


def token_weights(mask, params: LossParams, num_items_in_batch=None):
    """w (B, T) fp32 such that loss = sum(w * per_token_loss) for the loss type (TRL's normalizers)."""
    m = mask.float()
    B = m.shape[0]
    if params.loss_type == "grpo":
        return m / (m.sum(-1, keepdim=True).clamp(min=1.0) * B)
    if params.loss_type == "bnpo":
        return m / m.sum().clamp(min=1.0)
    if params.loss_type == "dr_grpo":
        return m / (B * params.max_completion_length)
    n = m.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, dtype=torch.float32)
    return m / n.to(m.device).clamp(min=1.0)


def per_token_terms(logps, old_logps, ref_logps, advantages, mask, params: LossParams):
    """TRL's per-token loss (differentiable in logps), the per-token KL, and the clip flags.

    At token level every tensor may be any shape broadcastable to logps; at sequence level they are (B, T)
    and the importance ratio is the masked mean over each row.
    """
    old = logps.detach() if old_logps is None else old_logps.float()
    log_ratio = logps - old
    if params.sequence_level:
        m = mask.float()
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - params.epsilon_low, 1 + params.epsilon_high)
    per_token = -torch.min(coef_1 * advantages, coef_2 * advantages)
    kl = None
    if params.beta != 0.0:
        delta = ref_logps.float() - logps
        kl = torch.exp(delta) - delta - 1
        if params.use_bias_correction_kl:
            kl = kl * coef_1
        per_token = per_token + params.beta * kl
    low = (coef_1 < 1 - params.epsilon_low) & (advantages < 0)
    high = (coef_1 > 1 + params.epsilon_high) & (advantages > 0)
    return per_token, kl, low, high


def clip_metric_sums(low, high, mask, sequence_level):
    """(sum, count) pairs behind TRL's clip ratios: over tokens, or over sequences at sequence level."""
    if sequence_level:
        n = torch.tensor(float(low.shape[0]), device=low.device)
        return low.float().sum(), high.float().sum(), (low | high).float().sum(), n
    m = mask.float()
    low, high = low.expand_as(m), high.expand_as(m)
    return (low * m).sum(), (high * m).sum(), ((low | high) * m).sum(), m.sum()


def finish_metrics(low_s, high_s, region_s, count, kl_s, token_count, with_kl):
    count = count.clamp(min=1.0)
    metrics = {
        "clip_ratio_low": low_s / count,
        "clip_ratio_high": high_s / count,
        "clip_ratio": region_s / count,
    }
    if with_kl:
        metrics["kl"] = kl_s / token_count.clamp(min=1.0)
    return {k: v.detach() for k, v in metrics.items()}


# --------------------------------------------------------------------------------------------------------
# Triton: one program per sequence computes the loss, the metrics' sums, and d loss / d logp
# --------------------------------------------------------------------------------------------------------
@triton.heuristics(
    {
        "HAS_OLD": lambda args: args["old_ptr"] is not None,
        "HAS_REF": lambda args: args["ref_ptr"] is not None,
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
    grad_ptr,
    row_ptr,
    T,
    beta,
    eps_low,
    eps_high,
    HAS_OLD: tl.constexpr,
    HAS_REF: tl.constexpr,
    SEQ_LEVEL: tl.constexpr,
    BIAS_KL: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * T
    a = tl.load(adv_ptr + row)
    lo = 1.0 - eps_low
    hi = 1.0 + eps_high
    a_neg = tl.where(a < 0, 1.0, 0.0)  # float flags: the interpreter cannot `&` a scalar with a block
    a_pos = tl.where(a > 0, 1.0, 0.0)
    zero = tl.zeros((BLOCK_T,), dtype=tl.float32)

    # 1. sequence level: the row's masked-mean log-ratio and summed weight come before any token's gradient
    if SEQ_LEVEL:
        log_v = zero
        n_v = zero
        w_v = zero
        for t0 in range(0, T, BLOCK_T):
            offs = t0 + tl.arange(0, BLOCK_T)
            tm = offs < T
            m = tl.load(mask_ptr + base + offs, mask=tm, other=0.0)
            if HAS_OLD:
                lp = tl.load(logp_ptr + base + offs, mask=tm, other=0.0)
                old = tl.load(old_ptr + base + offs, mask=tm, other=0.0)
                log_v += (lp - old) * m
            n_v += m
            w_v += tl.load(w_ptr + base + offs, mask=tm, other=0.0)
        inv_len = 1.0 / tl.maximum(tl.sum(n_v, axis=0), 1.0)
        r_seq = tl.exp(tl.sum(log_v, axis=0) * inv_len)
        u_seq = r_seq * a
        c_seq = tl.minimum(tl.maximum(r_seq, lo), hi) * a
        # d(-min(u, c)) / d log r: -u on the unclipped branch, or on the clipped one inside the clip range
        keep_seq = (u_seq <= c_seq) | ((r_seq >= lo) & (r_seq <= hi))
        d_pol_seq = tl.where(keep_seq, -u_seq, 0.0) * tl.sum(w_v, axis=0)
        pol_seq = -tl.minimum(u_seq, c_seq)

    # 2. per token: weighted loss, d loss / d logp, KL and clip sums (fp32 vector accumulators)
    loss_v = zero
    kl_v = zero
    klw_v = zero  # sum_t w_t * kl_t * r: how a bias-corrected KL reaches the sequence ratio
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
            loss_t = zero + pol_seq
            grad_t = zero  # the policy term's gradient flows through the sequence ratio (step 3)
        else:
            if HAS_OLD:
                r = tl.exp(lp - tl.load(old_ptr + base + offs, mask=tm, other=0.0))
            else:
                r = zero + 1.0
            u = r * a
            c = tl.minimum(tl.maximum(r, lo), hi) * a
            loss_t = -tl.minimum(u, c)
            grad_t = tl.where((u <= c) | ((r >= lo) & (r <= hi)), -u, 0.0)
            low = tl.where(r < lo, m, 0.0) * a_neg
            high = tl.where(r > hi, m, 0.0) * a_pos
            low_v += low
            high_v += high
            region_v += tl.maximum(low, high)
        if HAS_REF:
            ref = tl.load(ref_ptr + base + offs, mask=tm, other=0.0)
            e = tl.exp(ref - lp)
            kl = e - (ref - lp) - 1.0
            dkl = 1.0 - e
            if BIAS_KL:
                dkl = dkl * r
                if not SEQ_LEVEL:
                    dkl += kl * r  # d r / d logp = r at token level
                klw_v += w * kl * r
                kl = kl * r
            loss_t += beta * kl
            grad_t += beta * dkl
            kl_v += kl * m
        loss_v += w * loss_t
        tl.store(grad_ptr + base + offs, w * grad_t, mask=tm)

    # 3. sequence level: add the gradient through the mean log-ratio, m_t / len to every token
    if SEQ_LEVEL:
        g_seq = d_pol_seq
        if HAS_REF and BIAS_KL:
            g_seq += beta * tl.sum(klw_v, axis=0)
        for t0 in range(0, T, BLOCK_T):
            offs = t0 + tl.arange(0, BLOCK_T)
            tm = offs < T
            m = tl.load(mask_ptr + base + offs, mask=tm, other=0.0)
            g = tl.load(grad_ptr + base + offs, mask=tm, other=0.0)
            tl.store(grad_ptr + base + offs, g + g_seq * m * inv_len, mask=tm)
        low_s = tl.where(r_seq < lo, 1.0, 0.0) * a_neg
        high_s = tl.where(r_seq > hi, 1.0, 0.0) * a_pos
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


def _loss_triton(logps, old_logps, ref_logps, advantages, mask, w, params: LossParams):
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
        grad,
        rows,
        T,
        params.beta,
        params.epsilon_low,
        params.epsilon_high,
        SEQ_LEVEL=params.sequence_level,
        BIAS_KL=params.use_bias_correction_kl,
        BLOCK_T=min(1024, max(16, triton.next_power_of_2(T))),
    )
    sums = rows.sum(0)
    count = torch.tensor(float(B), device=logps.device) if params.sequence_level else mask_f.sum()
    metrics = finish_metrics(sums[2], sums[3], sums[4], count, sums[1], mask_f.sum(), ref_logps is not None)
    return sums[0], grad, metrics


def _loss_torch(logps, old_logps, ref_logps, advantages, mask, w, params: LossParams):
    with torch.enable_grad():
        lp = logps.detach().requires_grad_(True)
        per_token, kl, low, high = per_token_terms(
            lp, old_logps, ref_logps, advantages[:, None], mask, params
        )
        loss = (w * per_token).sum()
        (grad,) = torch.autograd.grad(loss, lp)
    low_s, high_s, region_s, count = clip_metric_sums(low, high, mask, params.sequence_level)
    kl_s = (kl.detach() * mask).sum() if kl is not None else None
    metrics = finish_metrics(low_s, high_s, region_s, count, kl_s, mask.float().sum(), kl is not None)
    return loss.detach(), grad, metrics


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
    impl="auto",
):
    """Clipped GRPO loss with TRL 1.16 GRPOTrainer semantics (loss types grpo, bnpo, dr_grpo, dapo).

    Args:
        logps: (B, T) float per-token log-probs of the policy (differentiable).
        advantages: (B,) float advantages, one per sequence.
        mask: (B, T) bool/int/float completion mask (1 = token counts).
        old_logps: optional (B, T) log-probs of the policy that sampled; None = on-policy (ratio 1).
        ref_logps: (B, T) reference-model log-probs, required when beta != 0.
        beta: weight of the k3 KL penalty exp(ref - logp) - (ref - logp) - 1.
        epsilon_low, epsilon_high: clip range [1 - epsilon_low, 1 + epsilon_high]; epsilon_high defaults to
            epsilon_low.
        loss_type: "grpo" (mean of per-sequence means), "bnpo" (mean over active tokens), "dr_grpo" (sum over
            B * max_completion_length), "dapo" (sum over num_items_in_batch).
        importance_sampling_level: "token", or "sequence" (GSPO: one ratio per sequence, from the masked
            mean log-ratio).
        max_completion_length: int, required by "dr_grpo".
        num_items_in_batch: dapo's normalizer (active tokens across the whole batch); default: mask.sum().
        use_bias_correction_kl: multiply the KL by the importance ratio (TRL's option of that name).
        impl: "auto" (Triton for CUDA tensors, else the twin), "triton" or "torch".

    Returns:
        (loss, metrics): fp32 scalar loss, and a dict of detached scalars `clip_ratio_low`,
        `clip_ratio_high`, `clip_ratio` (masked token means, or sequence means at sequence level) and `kl`
        (masked token mean, when beta != 0).
    """
    check_tensor("logps", logps, (2,))
    params, ref_logps = loss_options(
        logps.shape,
        advantages,
        mask,
        old_logps,
        ref_logps,
        num_items_in_batch,
        beta=beta,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        loss_type=loss_type,
        importance_sampling_level=importance_sampling_level,
        max_completion_length=max_completion_length,
        use_bias_correction_kl=use_bias_correction_kl,
    )
    impl = resolve_impl(impl, logps, advantages, mask, old_logps, ref_logps)
    return grpo_loss_from_params(
        logps, advantages, mask, old_logps, ref_logps, params, num_items_in_batch, impl
    )


def grpo_loss_from_params(logps, advantages, mask, old_logps, ref_logps, params, num_items_in_batch, impl):
    """`grpo_loss` on already validated inputs (see `loss_options`) with a resolved impl."""
    f32 = [None if t is None else t.float().contiguous() for t in (old_logps, ref_logps)]
    adv = advantages.reshape(-1).float().contiguous()
    w = token_weights(mask, params, num_items_in_batch).contiguous()
    fn = _loss_triton if impl == "triton" else _loss_torch
    value, grad, metrics = fn(
        logps.detach().float().contiguous(), f32[0], f32[1], adv, mask.contiguous(), w, params
    )
    # the gradient is known as soon as the loss is: both paths produce d loss / d logp in the forward
    return attach_grads(value, (logps,), (grad.to(logps.dtype),)), metrics


__all__ = ["grpo_loss"]
