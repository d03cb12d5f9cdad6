"""What each GRPO loss variant is, in one table: its per-token policy term, its normalizer, and the
detached gates that multiply it, with TRL 1.16 `GRPOTrainer` semantics. The PyTorch twin differentiates these
functions; the Triton kernel (loss.py) follows the same table with hand-written gradients.

r = exp(logp - old) per token, or exp(masked mean of logp - old) per sequence (GSPO); A the advantage.
  clip family (grpo, bnpo, dr_grpo, dapo, luspo): -min(min(r, delta) A, clip(r, 1 - eps_low, 1 + eps_high) A)
  cispo: -sg(min(r, eps_high)) A logp     sapo: -sigmoid(tau (r - 1)) 4 / tau A, tau by the sign of A
  vespo: -sg(phi(w)) A logp, phi(w) = exp(lambda + k log w - lambda w), w the sequence ratio (times IS ratios)
Gates (all detached): the rollout-mismatch ratio exp(old - sampling) (truncated or masked, per token or per
sequence), DeepSeek-V3.2's off-policy sequence mask, the top-entropy token mask.
"""

import math
from dataclasses import dataclass

import torch

from ._common import check_nonnegative

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
LEVELS = ("token", "sequence")
CORRECTIONS = (None, "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# the Triton kernel's policy term, by loss type (constexpr KIND)
KINDS = {"cispo": 1, "sapo": 2, "vespo": 3}  # every other type: 0, the clip family


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
    delta: float | None
    correction: str | None
    clip_min: float | None
    clip_max: float | None
    off_policy_threshold: float | None
    sapo_temperature_pos: float
    sapo_temperature_neg: float
    vespo: tuple  # k_pos, lambda_pos, k_neg, lambda_neg
    top_entropy_quantile: float
    entropy_coef: float
    compute_entropy: bool = False  # every token's entropy though no option needs it (its metrics only)

    @property
    def kind(self) -> int:
        return KINDS.get(self.loss_type, 0)

    @property
    def needs_entropy(self) -> bool:
        return self.top_entropy_quantile < 1.0 or self.entropy_coef != 0.0 or self.compute_entropy

    @property
    def token_local(self) -> bool:
        """Every factor of a token's loss known from that token alone (the twin's one-pass path)."""
        return not (
            self.sequence_level
            or (self.correction or "").startswith("sequence")
            or self.off_policy_threshold is not None
            or self.loss_type == "vespo"
            or self.needs_entropy
        )


def _number(name, value, *, optional=False, positive=False):
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise TypeError(f"{name} must be a number{' or None' if optional else ''}, got {value!r}")
    if positive and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return float(value)


def make_loss_params(
    *,
    beta,
    epsilon_low,
    epsilon_high,
    loss_type,
    importance_sampling_level,
    max_completion_length,
    use_bias_correction_kl,
    delta,
    sampling_correction,
    sampling_clip_max,
    sampling_clip_min,
    off_policy_mask_threshold,
    sapo_temperature_pos,
    sapo_temperature_neg,
    vespo_k_pos,
    vespo_lambda_pos,
    vespo_k_neg,
    vespo_lambda_neg,
    top_entropy_quantile=1.0,  # the fused path's only; grpo_loss's defaults are in its signature
    entropy_coef=0.0,
    compute_entropy=False,
) -> LossParams:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if importance_sampling_level not in LEVELS:
        raise ValueError(
            f"importance_sampling_level must be one of {LEVELS}, got {importance_sampling_level!r}"
        )
    if sampling_correction not in CORRECTIONS:
        raise ValueError(f"sampling_correction must be one of {CORRECTIONS}, got {sampling_correction!r}")
    if loss_type == "vespo" and (sampling_correction or "").startswith("sequence"):
        raise ValueError(
            "loss_type='vespo' folds the sampling correction into its sequence weight: sampling_correction "
            f"must be None, 'token_truncate' or 'token_mask', got {sampling_correction!r}"
        )
    check_nonnegative("epsilon_low", epsilon_low)
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    check_nonnegative("epsilon_high", epsilon_high)
    if loss_type == "dr_grpo" and (not isinstance(max_completion_length, int) or max_completion_length < 1):
        raise ValueError(
            f"loss_type='dr_grpo' needs max_completion_length as an int >= 1, got {max_completion_length!r}"
        )
    q = _number("top_entropy_quantile", top_entropy_quantile)
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {top_entropy_quantile!r}")
    clip_min = _number("sampling_clip_min", sampling_clip_min, optional=True)
    clip_max = _number("sampling_clip_max", sampling_clip_max, optional=True)
    if clip_min is not None and clip_max is not None and clip_min > clip_max:
        raise ValueError(f"sampling_clip_min ({clip_min}) must be <= sampling_clip_max ({clip_max})")
    return LossParams(
        beta=_number("beta", beta),
        epsilon_low=float(epsilon_low),
        epsilon_high=float(epsilon_high),
        loss_type=loss_type,
        sequence_level=importance_sampling_level == "sequence",
        max_completion_length=max_completion_length,
        use_bias_correction_kl=bool(use_bias_correction_kl),
        delta=_number("delta", delta, optional=True, positive=True),
        correction=sampling_correction,
        clip_min=clip_min,
        clip_max=clip_max,
        off_policy_threshold=_number("off_policy_mask_threshold", off_policy_mask_threshold, optional=True),
        sapo_temperature_pos=_number("sapo_temperature_pos", sapo_temperature_pos, positive=True),
        sapo_temperature_neg=_number("sapo_temperature_neg", sapo_temperature_neg, positive=True),
        vespo=tuple(
            _number(n, v)
            for n, v in (
                ("vespo_k_pos", vespo_k_pos),
                ("vespo_lambda_pos", vespo_lambda_pos),
                ("vespo_k_neg", vespo_k_neg),
                ("vespo_lambda_neg", vespo_lambda_neg),
            )
        ),
        top_entropy_quantile=q,
        entropy_coef=_number("entropy_coef", entropy_coef),
        compute_entropy=bool(compute_entropy),
    )


# --------------------------------------------------------------------------------------------------------
# Per-token policy terms: (logp, coef_1 = r, advantage, params, phi) -> the per-token loss before gates
# --------------------------------------------------------------------------------------------------------
def _clipped(logp, r, adv, p: LossParams, phi):
    coef_2 = torch.clamp(r, 1 - p.epsilon_low, 1 + p.epsilon_high)
    coef_1 = r if p.delta is None else torch.clamp(r, max=p.delta)  # two-sided clipping
    return -torch.min(coef_1 * adv, coef_2 * adv)


def _cispo(logp, r, adv, p: LossParams, phi):
    return -torch.clamp(r, max=p.epsilon_high).detach() * adv * logp


def _sapo(logp, r, adv, p: LossParams, phi):
    tau = torch.where(adv > 0, p.sapo_temperature_pos, p.sapo_temperature_neg)
    return -torch.sigmoid(tau * (r - 1)) * 4 / tau * adv


def _vespo(logp, r, adv, p: LossParams, phi):
    return -phi * adv * logp


POLICY_TERMS = {t: _clipped for t in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")}
POLICY_TERMS.update(cispo=_cispo, sapo=_sapo, vespo=_vespo)


# --------------------------------------------------------------------------------------------------------
# Normalizers: w (B, T) such that loss = sum(w * per_token_loss)
# --------------------------------------------------------------------------------------------------------
def _per_sequence_mean(m, p, n_items):  # mean over sequences of each one's token mean
    return m / (m.sum(-1, keepdim=True).clamp(min=1.0) * m.shape[0])


def _token_mean(m, p, n_items):
    return m / m.sum().clamp(min=1.0)


def _fixed_length(m, p, n_items):
    return m / (m.shape[0] * p.max_completion_length)


def _per_sequence_sum(m, p, n_items):  # luspo: each sequence's token sum, averaged over sequences
    return m / m.shape[0]


def _items(m, p, n_items):  # dapo's normalizer: active tokens across the whole (generation) batch
    n = m.sum() if n_items is None else torch.as_tensor(n_items, dtype=torch.float32)
    return m / n.to(m.device).clamp(min=1.0)


NORMALIZERS = {
    "grpo": _per_sequence_mean,
    "sapo": _per_sequence_mean,
    "bnpo": _token_mean,
    "dr_grpo": _fixed_length,
    "luspo": _per_sequence_sum,
    "dapo": _items,
    "cispo": _items,
    "vespo": _items,
}


def token_weights(mask, params: LossParams, num_items_in_batch=None):
    """w (B, T) fp32 such that loss = sum(w * per_token_loss) for the loss type (TRL's normalizers)."""
    return NORMALIZERS[params.loss_type](mask.float(), params, num_items_in_batch)


# --------------------------------------------------------------------------------------------------------
# Clip flags (for the metrics): (low, high) boolean tensors, by loss type
# --------------------------------------------------------------------------------------------------------
def clip_flags(r, adv, p: LossParams):
    if p.kind == 0:
        coef_1 = r if p.delta is None else torch.clamp(r, max=p.delta)
        return (coef_1 < 1 - p.epsilon_low) & (adv < 0), (coef_1 > 1 + p.epsilon_high) & (adv > 0)
    if p.kind == 1:  # cispo: the ratio capped at epsilon_high
        return torch.zeros_like(r, dtype=torch.bool), (r > p.epsilon_high) & (adv > 0)
    return None, None  # sapo, vespo: no hard clip


CLIP_METRICS = {0: ("clip_ratio_low", "clip_ratio_high", "clip_ratio"), 1: (None, "cispo_clip_ratio", None)}


# --------------------------------------------------------------------------------------------------------
# Gates: detached factors of the per-token policy loss, computed once the trainer's log-probs are known
# --------------------------------------------------------------------------------------------------------
def sampling_ratio(trainer_logps, sampling_logps, mask, p: LossParams):
    """TRL's rollout-mismatch importance ratio: (B, T) for token modes, (B, 1) for sequence modes, or (N,)
    for flat tokens. Tokens the engine could not score (NaN) get ratio 1."""
    diff = torch.nan_to_num((trainer_logps - sampling_logps) * mask, nan=0.0)
    if p.correction.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if p.correction.endswith("truncate"):
        return torch.clamp(ratio, min=p.clip_min, max=p.clip_max)
    lo = -math.inf if p.clip_min is None else p.clip_min
    hi = math.inf if p.clip_max is None else p.clip_max
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


def off_policy_keep(adv, logps, behaviour_logps, mask, threshold):
    """DeepSeek-V3.2's off-policy sequence mask (B, 1): keep a sequence whose advantage is >= 0 or whose mean
    KL(behaviour || policy) estimate is <= threshold; unscored (NaN) tokens give no evidence."""
    kl = torch.nan_to_num(behaviour_logps - logps, nan=0.0)
    mean_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return ((adv >= 0) | (mean_kl <= threshold)).float()


def vespo_phi(adv, log_ratio, mask, is_ratio, p: LossParams):
    """VESPO's gamma weight phi(w) (B, 1), w the sequence's summed log-ratio (plus the token IS ratios)."""
    floor = math.log(1e-8)
    log_w = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
    if is_ratio is not None:
        log_w = log_w + torch.clamp(torch.log(is_ratio), floor, 20.0).sum(-1, keepdim=True)
    log_w = torch.clamp(log_w, floor, 20.0)
    k_pos, lam_pos, k_neg, lam_neg = p.vespo
    nonneg = adv >= 0
    k = torch.where(nonneg, k_pos, k_neg)
    lam = torch.where(nonneg, lam_pos, lam_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def top_entropy_mask(entropies, mask, quantile):
    """1 for the active tokens whose entropy is at or above the batch's (1 - quantile) quantile."""
    m = mask.bool()
    active = entropies[m].float()
    if active.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.float32)
    threshold = torch.quantile(active, 1.0 - quantile)
    # Tokens with one context (a group's first completion position: its samples share the prompt) have equal
    # entropies in exact arithmetic, but fp32 can part them by a few ulp with the token's row in the GEMM and
    # vector loops (issue 44: an Intel AVX-512 CPU split such a tie at the threshold, dropping one of them).
    # 2^-16 of the threshold (128-256 ulp) keeps a tie on the side exact arithmetic puts it, far below any gap
    # between distinct entropies that matters.
    slack = 2.0**-16 * threshold.abs().clamp(min=1.0)
    return ((entropies * mask >= threshold - slack) & m).float()


@dataclass
class Gates:
    gate: torch.Tensor | None  # the detached factor of each token's policy loss (None = 1)
    phi: torch.Tensor | None  # VESPO's sequence weight (B, 1)
    entropy_mask: torch.Tensor | None  # the top-entropy tokens (the entropy bonus acts on them too)
    metrics: dict


def loss_gates(logps, old_logps, sampling_logps, entropies, adv, mask, p: LossParams) -> Gates:
    """Every detached factor of the policy loss, from the trainer's detached log-probs `logps` (B, T) (or
    flat active tokens when `p.token_local`), with the metrics of the mismatch and of each mask."""
    m = mask.float()
    trainer = logps if old_logps is None else old_logps  # the policy that TRL scores the samples with
    gate, phi, ent_mask, metrics = None, None, None, {}
    is_ratio = None
    if p.correction is not None:
        is_ratio = sampling_ratio(trainer, sampling_logps, m, p)
        metrics.update(ratio_metrics(is_ratio, m, p))
    if sampling_logps is not None:
        metrics.update(mismatch_metrics(trainer, sampling_logps, m))
    if p.loss_type == "vespo":
        phi = vespo_phi(adv, logps - trainer, m, is_ratio, p)
        metrics["vespo_phi_mean"] = phi.mean() if phi.numel() else phi.new_zeros(())
    elif is_ratio is not None:
        gate = is_ratio
    if p.off_policy_threshold is not None:
        behaviour = trainer if sampling_logps is None else sampling_logps
        keep = off_policy_keep(adv, logps, behaviour, m, p.off_policy_threshold)
        metrics["off_policy_masked_fraction"] = 1.0 - keep.mean() if keep.numel() else keep.new_zeros(())
        gate = keep if gate is None else gate * keep
    if p.top_entropy_quantile < 1.0:
        ent_mask = top_entropy_mask(entropies, m, p.top_entropy_quantile)
        gate = ent_mask if gate is None else gate * ent_mask
    return Gates(gate, phi, ent_mask, metrics)


def ratio_metrics(is_ratio, m, p: LossParams):
    """TRL's sampling/importance_sampling_ratio/{min,mean,max} (over active tokens, or over sequences), and
    the fraction the correction changed (masked to 0, or truncated)."""
    values = is_ratio.reshape(-1) if p.correction.startswith("sequence") else is_ratio[m.bool()]
    if values.numel() == 0:
        values = is_ratio.new_zeros(1)
    if p.correction.endswith("mask"):
        changed = ("is_masked_fraction", (values == 0).float().mean())
    else:
        bounded = [b for b in (p.clip_min, p.clip_max) if b is not None]
        hit = sum(((values == b).float() for b in bounded), torch.zeros_like(values))
        changed = ("is_truncated_fraction", hit.clamp(max=1.0).mean())
    return {
        "is_ratio_min": values.min(),
        "is_ratio_mean": values.mean(),
        "is_ratio_max": values.max(),
        changed[0]: changed[1],
    }


def mismatch_metrics(trainer_logps, sampling_logps, m):
    """Mismatch between the engine's and the trainer's log-probs over scored active tokens: mean k3 estimate
    of KL(sampler || trainer) and TRL's |logp difference| mean / max."""
    d = trainer_logps - sampling_logps
    ok = m.bool() & ~torch.isnan(d)
    d = d[ok]
    if d.numel() == 0:
        z = trainer_logps.new_zeros(())
        return {"sampling_k3": z, "sampling_logp_diff_mean": z, "sampling_logp_diff_max": z}
    return {
        "sampling_k3": (torch.exp(d) - d - 1).mean(),
        "sampling_logp_diff_mean": d.abs().mean(),
        "sampling_logp_diff_max": d.abs().max(),
    }


def adaptive_entropy_coef(coef, entropy, *, target, delta, coef_min, coef_max) -> float:
    """Skywork-OR1's adaptive entropy control, one optimizer step of it (TRL's use_adaptive_entropy): the
    coefficient for the next step, raised by `delta` (to at most `coef_max`) where the step's mean entropy,
    over the tokens the bonus acts on, is at or below `target`, else lowered by it (to at least `coef_min`).
    The next step applies it only where this step's entropy is at or below the target."""
    if entropy <= target:
        return min(coef + delta, coef_max)
    return max(coef - delta, coef_min)


def entropy_bonus(entropies, mask, gate_mask, coef):
    """(value, d value / d entropy) of -coef * mean entropy over the tokens the policy loss acts on."""
    eff = mask.float() if gate_mask is None else mask.float() * gate_mask
    w = eff / eff.sum().clamp(min=1.0)
    return -coef * (entropies * w).sum(), -coef * w
