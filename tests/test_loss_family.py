"""Every option of grpo_loss and fused_linear_grpo_loss against TRL 1.16's own code, run rather than retyped.

The oracle:
- the loss is `GRPOTrainer._compute_loss`, called unbound on `_TrlTrainer`, a stand-in that holds exactly the
  attributes it reads (a missing one is an AttributeError); its `_get_per_token_logps_and_entropies` hands
  back the test's differentiable fp64 log-probs and entropies, so autograd through TRL's loss gives the
  reference gradients;
- the rollout-vs-trainer importance-sampling ratio (TRL's `vllm_importance_sampling_*` options, our
  `sampling_correction`) and its logged min/mean/max are the two blocks of
  `GRPOTrainer._generate_and_score_completions` that compute them, cut out of TRL's source and executed
  (`_trl_block` fails loudly when a TRL upgrade moves them);
- the fused path goes through naive fp64 logits (full log_softmax, entropies from it) into the same TRL
  loss, and is also compared with Liger-Kernel 0.8.5's LigerFusedLinearGRPOLoss on the options it implements
  as TRL does.
The data put every token's log-ratio, every sequence's mean log-ratio, every importance-sampling ratio (token
and sequence) and every off-policy KL clearly on one side of each edge used here (`_check_margins`).
"""

import inspect
import math
import sys
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import grpo_fast.kernels.logprobs as lp_mod
import pytest
import torch
from grpo_fast.kernels import fused_linear_grpo_loss, grpo_loss
from oracle import TOL, max_err, naive_logits

trl_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
GRPOTrainer = trl_trainer.GRPOTrainer
nanmin, nanmax = trl_trainer.nanmin, trl_trainer.nanmax

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
LEVELS = ["token", "sequence"]
CORRECTIONS = [None, "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
UP = 1.37  # upstream gradient of the loss

# grpo_loss's keywords and their defaults (the API under test), all of which the TRL oracle understands
API_DEFAULTS = dict(
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
    top_entropy_quantile=1.0,  # fused_linear_grpo_loss only
    entropy_coef=0.0,  # fused_linear_grpo_loss only
)

# TRL's logged name -> ours; TRL's per-sequence extremes (clip_ratio/low_min, ...) are not compared
METRIC_NAMES = {
    "clip_ratio/low_mean": "clip_ratio_low",
    "clip_ratio/high_mean": "clip_ratio_high",
    "clip_ratio/region_mean": "clip_ratio",
    "kl": "kl",
    "cispo_clip_ratio": "cispo_clip_ratio",
    "vespo/phi_seq_mean": "vespo_phi_mean",
    "sampling/importance_sampling_ratio/min": "is_ratio_min",
    "sampling/importance_sampling_ratio/mean": "is_ratio_mean",
    "sampling/importance_sampling_ratio/max": "is_ratio_max",
    "entropy": "entropy",
}


# --------------------------------------------------------------------------------------------------------
# The TRL oracle
# --------------------------------------------------------------------------------------------------------
def _trl_block(first_statement):
    """The `if self.use_vllm and self.vllm_importance_sampling_correction:` block of TRL's generation step
    whose first statement starts with `first_statement`, dedented and compiled."""
    lines = inspect.getsource(GRPOTrainer._generate_and_score_completions).splitlines()
    header = "if self.use_vllm and self.vllm_importance_sampling_correction:"
    found = [
        i
        for i in range(len(lines) - 1)
        if lines[i].strip() == header and lines[i + 1].strip().startswith(first_statement)
    ]
    assert len(found) == 1, f"TRL's generation step has no single block starting {first_statement!r}"
    i = found[0]
    indent = len(lines[i]) - len(lines[i].lstrip())
    j = i + 1
    while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
        j += 1
    return compile(textwrap.dedent("\n".join(lines[i:j])), f"<trl: {first_statement}>", "exec")


_IS_RATIO_BLOCK = _trl_block("mask = completion_mask if tool_mask is None")
_IS_METRICS_BLOCK = _trl_block("delta = torch.abs(old_per_token_logps - sampling_per_token_logps)")


class _Accelerator:
    """One process: gather and reduce are identities."""

    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


class _TrlTrainer:
    """The attributes GRPOTrainer._compute_loss (and the generation step's IS-ratio blocks) read, set as
    GRPOTrainer.__init__ sets them from a GRPOConfig with grpo_loss's options."""

    get_off_policy_mask = staticmethod(GRPOTrainer.get_off_policy_mask)
    get_gamma_weights = staticmethod(GRPOTrainer.get_gamma_weights)
    get_high_entropy_mask = GRPOTrainer.get_high_entropy_mask

    def __init__(self, o, logps=None, entropies=None):
        self._given = (logps, entropies, None)  # per-token logps, entropies, MoE aux loss
        self.loss_type = o["loss_type"]
        self.importance_sampling_level = o["importance_sampling_level"]
        self.epsilon_low = o["epsilon_low"]
        self.epsilon_high = o["epsilon_low"] if o["epsilon_high"] is None else o["epsilon_high"]
        self.beta = o["beta"]
        self.max_completion_length = o["max_completion_length"]
        self.top_entropy_quantile = o["top_entropy_quantile"]
        self.entropy_coef = o["entropy_coef"]
        self.use_adaptive_entropy = False
        self._entropy_bonus_enabled = o["entropy_coef"] != 0.0
        self.off_policy_mask_threshold = o["off_policy_mask_threshold"]
        self.use_vllm = True
        self.vllm_importance_sampling_correction = o["sampling_correction"] is not None
        self.vllm_importance_sampling_mode = o["sampling_correction"]
        self.vllm_importance_sampling_clip_max = o["sampling_clip_max"]
        self.vllm_importance_sampling_clip_min = o["sampling_clip_min"]
        self.aux_loss_enabled = False
        self.current_gradient_accumulation_steps = 1
        self.args = SimpleNamespace(
            delta=o["delta"],
            use_bias_correction_kl=o["use_bias_correction_kl"],
            sapo_temperature_pos=o["sapo_temperature_pos"],
            sapo_temperature_neg=o["sapo_temperature_neg"],
            vespo_k_pos=o["vespo_k_pos"],
            vespo_lambda_pos=o["vespo_lambda_pos"],
            vespo_k_neg=o["vespo_k_neg"],
            vespo_lambda_neg=o["vespo_lambda_neg"],
            steps_per_generation=1,
        )
        self.accelerator = _Accelerator()
        self.model = SimpleNamespace(training=True)
        self._metrics = defaultdict(lambda: defaultdict(list))

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        return self._given


def trl_sampling_ratio(trainer, old, sampling, mask):
    """TRL's generation-step importance-sampling ratio ((B, T) or (B, 1)); logs its min/mean/max."""
    ns = dict(
        self=trainer,
        torch=torch,
        math=math,
        nanmin=nanmin,
        nanmax=nanmax,
        old_per_token_logps=old.detach(),
        sampling_per_token_logps=sampling,
        completion_mask=mask,
        tool_mask=None,
        device=mask.device,
        mode="train",
    )
    exec(_IS_RATIO_BLOCK, ns)
    exec(_IS_METRICS_BLOCK, ns)
    return ns["vllm_importance_sampling_ratio"]


def trl_grpo_loss(logps, advantages, mask, entropies=None, **options):
    """TRL 1.16's loss for grpo_loss's keyword `options`, and what it logs (in our metric names)."""
    o = {**API_DEFAULTS, **options}
    B, T = logps.shape
    trainer = _TrlTrainer(o, logps, torch.zeros_like(logps) if entropies is None else entropies)
    n = mask.sum() if o["num_items_in_batch"] is None else o["num_items_in_batch"]
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "num_items_in_batch": torch.tensor(float(n)),
    }
    for ours, theirs in [
        ("old_logps", "old_per_token_logps"),
        ("ref_logps", "ref_per_token_logps"),
        ("sampling_logps", "sampling_per_token_logps"),
    ]:
        if o[ours] is not None:
            inputs[theirs] = o[ours]
    if o["sampling_correction"] is not None:
        old = logps.detach() if o["old_logps"] is None else o["old_logps"]  # TRL scores old at generation
        inputs["importance_sampling_ratio"] = trl_sampling_ratio(trainer, old, o["sampling_logps"], mask)
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    logged = trainer._metrics["train"]
    if entropies is None:  # TRL logs the entropy of what its model returned: here nothing
        del logged["entropy"]
    return loss, {ours: logged[theirs][-1] for theirs, ours in METRIC_NAMES.items() if theirs in logged}


# --------------------------------------------------------------------------------------------------------
# Data: every quantity that decides a branch sits clearly on one side of its edge
# --------------------------------------------------------------------------------------------------------
LENGTHS = (37, 18, 0, 5, 30, 12)  # ragged, one fully masked row; 102 tokens (a top-50% entropy split between)
ADVANTAGES = (0.9, -1.2, 0.4, -0.7, 1.1, -0.5)
# log(pi / pi_old), each row cycling its four values: sequence means ~0, 0.62, -, -0.37, 0.61, ~0, so at
# sequence level rows 1 and 4 lie above every upper edge (A < 0 and A > 0), row 3 below the lower one
LOG_RATIO = (
    (-0.6, 0.6, -0.1, 0.05),
    (0.6, 0.9, 0.32, 0.6),
    (0.05, -0.1, 0.6, -0.6),
    (-0.6, -0.1, -0.6, 0.05),
    (0.9, 0.32, 0.6, 0.6),
    (0.05, -0.6, 0.6, -0.1),
)
# log(pi_old / pi_sampling), cycled: token values on both sides of [log 0.5, log 3]; sequence sums 1.9, -1.2,
# -, 0, 4.1, 0.45 (after the NaNs): above, below, inside, above, inside. Rows 0, 3 and 5 keep vespo's weight
# phi away from 0 (their log-ratio sums are small), so its IS bounds and the off-policy mask move the loss.
LOG_IS = (
    (0.9, -1.0, 0.2, -0.1),
    (-0.2, -0.1, 0.15, -0.1),
    (0.0, 0.0, 0.0, 0.0),
    (0.3, -1.2, 0.4, 0.2),
    (-0.1, 1.4, 0.1, -1.0),
    (1.4, -1.2, 0.05, -0.1),
)
NAN_AT = ((0, 1), (1, 3), (2, 0), (5, 20))  # tokens the rollout engine did not score (in and out of the mask)
OFF_POLICY = 0.2  # row 3 (A < 0, mean KL 0.37) dropped unless only sampling is off; 1 and 5 (KL <= 0.07) kept
# log-space edges: clip 1 - 0.2, 1 + 0.2, 1 + 0.28, delta and cispo's cap 1.5, cispo's default cap 0.2
RATIO_EDGES = [math.log(x) for x in (0.8, 1.2, 1.28, 1.5, 0.2)]
IS_EDGES = [math.log(0.5), math.log(3.0)]
MARGIN = 0.05  # > a bf16 log-prob's error: its rounding (<= 0.016 for a difference), bf16 logits' (~0.04)


def _cycled(rows, T):
    return torch.tensor(rows, dtype=torch.float64)[:, torch.arange(T) % 4]


def _mask(T=37):
    return (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).long()


def _others(base, with_old, g):
    """old, ref, sampling log-probs (fp64) around the policy's `base` log-probs."""
    B, T = base.shape
    old = base - _cycled(LOG_RATIO, T)
    sampling = (old if with_old else base) - _cycled(LOG_IS, T)
    for i, t in NAN_AT:
        sampling[i, t] = float("nan")
    ref = base + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    return (old if with_old else None), ref, sampling


def _check_margins(logps, old, sampling, mask):
    """No branch is decided within MARGIN of its edge, on the tensors as given (after any rounding)."""
    logps = logps.detach().double()
    m = mask.bool()
    rows = m.any(1)
    ref_old = logps if old is None else old.double()
    log_ratio = logps - ref_old
    seq_ratio = (log_ratio * m).sum(1) / m.sum(1).clamp(min=1)
    log_is = torch.nan_to_num((ref_old - sampling.double()) * m, nan=0.0)
    kls = [torch.nan_to_num(sampling.double() - logps, nan=0.0), -log_ratio]  # sampling given / not
    checks = [
        (log_ratio[m], RATIO_EDGES),
        (seq_ratio[rows], RATIO_EDGES),
        (log_is[m], IS_EDGES),
        (log_is.sum(1), IS_EDGES),
    ]
    checks += [(((kl * m).sum(1) / m.sum(1).clamp(min=1))[rows], [OFF_POLICY]) for kl in kls]
    for k, (values, edges) in enumerate(checks):
        gap = (values[:, None] - torch.tensor(edges, dtype=torch.float64)).abs().min().item()
        assert gap >= MARGIN, f"check {k}: a value {gap:.3g} from an edge; pick other data"


def _batch(dtype=torch.float32, with_old=True, T=37, seed=0):
    """Inputs of grpo_loss in `dtype`: logps, advantages, mask and the keyword tensors."""
    g = torch.Generator().manual_seed(seed)
    base = -(0.2 + 2.5 * torch.rand(len(LENGTHS), T, generator=g, dtype=torch.float64))
    old, ref, sampling = _others(base, with_old, g)
    logps, ref, sampling = (x.to(dtype) for x in (base, ref, sampling))
    old = None if old is None else old.to(dtype)
    mask = _mask(T)
    _check_margins(logps, old, sampling, mask)
    adv = torch.tensor(ADVANTAGES)
    return logps, adv, mask, dict(old_logps=old, ref_logps=ref, sampling_logps=sampling)


# --------------------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------------------
def _grads(fn, tensors):
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]
    loss, metrics = fn(*leaves)
    (loss * UP).backward()
    return loss.detach(), metrics, [None if x is None else x.grad for x in leaves]


def _assert_close(name, got, want, lowp, dtype, floor=0.0):
    """fp32: within 1e-5 of the reference's size (plus twice `lowp`'s error when given: the reference's own
    code in fp32 against it in fp64); low precision: flash-attention's rule, at most twice plain PyTorch's
    error in that dtype plus TOL of the reference's own size (not of 1: gradients are ~1e-2)."""
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    scale = max(want.abs().max().item() if want.numel() else 0.0, floor, 1e-30)
    err = max_err(got, want)
    mean = (got - want).abs().mean().item() if want.numel() else 0.0
    bound = 1e-5 * scale
    if dtype == torch.float32 and lowp is not None:  # an fp64 reference: also twice fp32's own error
        bound += 2 * max_err(torch.as_tensor(lowp).double(), want)
    if dtype != torch.float32:
        bound = 2 * max_err(torch.as_tensor(lowp).double(), want) + TOL[dtype] * scale
    assert err <= bound, (
        f"{name}: max err {err:.3g} (mean {mean:.3g}) > {bound:.3g}; reference size {scale:.3g}"
    )


def _assert_metrics(ours, exact, lowp, dtype):
    missing = sorted(set(exact) - set(ours))
    assert not missing, f"metrics missing: {missing} (have {sorted(ours)})"
    for k, v in exact.items():
        assert not torch.as_tensor(ours[k]).requires_grad, k
        got = float(ours[k])
        bound = 1e-5 * max(1.0, abs(v))
        if dtype != torch.float32:  # a mean's error can cancel in plain PyTorch and not in ours: TOL too
            bound = 2 * abs(lowp[k] - v) + TOL[dtype] * max(1.0, abs(v))
        assert abs(got - v) <= bound, f"metric {k}: ours {got:.7g}, TRL {v:.7g}"


def _for(loss_type, opts):
    """`opts` for `loss_type`: epsilon_high 0.28 (cispo: its absolute cap, 1.5) unless given; vespo, which TRL
    refuses with a sequence-level sampling correction, gets the token one of the same kind."""
    corr = opts.get("sampling_correction")
    if loss_type == "vespo" and corr is not None and corr.startswith("sequence"):
        opts = dict(opts, sampling_correction=corr.replace("sequence", "token"))
    eps_high = 1.5 if loss_type == "cispo" else 0.28  # cispo: an absolute cap on the ratio
    return dict(dict(loss_type=loss_type, epsilon_high=eps_high, max_completion_length=40), **opts)


def _compare_grpo_loss(impl, dtype, with_old, opts, with_sampling=True):
    logps, adv, mask, tensors = _batch(dtype, with_old)
    if not with_sampling:
        tensors["sampling_logps"] = None
    kw = {**tensors, **opts}
    ours = _grads(lambda lp: grpo_loss(lp, adv, mask, impl=impl, **kw), [logps])
    up64 = {k: (v.double() if torch.is_tensor(v) else v) for k, v in kw.items()}
    exact = _grads(lambda lp: trl_grpo_loss(lp, adv, mask, **up64), [logps.double()])
    lowp = exact if dtype == torch.float32 else _grads(lambda lp: trl_grpo_loss(lp, adv, mask, **kw), [logps])
    assert ours[0].dtype == torch.float32 and ours[0].dim() == 0
    _assert_close("loss", ours[0], exact[0], lowp[0], dtype, floor=0.1)
    assert ours[2][0].dtype == dtype
    _assert_close("d logps", ours[2][0], exact[2][0], lowp[2][0], dtype)
    _assert_metrics(ours[1], exact[1], lowp[1], dtype)


# --------------------------------------------------------------------------------------------------------
# grpo_loss
# --------------------------------------------------------------------------------------------------------
TWIN_CASES = [
    (lt, level, corr, beta, with_old)
    for lt in LOSS_TYPES
    for level in LEVELS
    for corr in CORRECTIONS
    for beta in (0.0, 0.04)
    for with_old in (True, False)
    if not (lt == "vespo" and corr is not None and corr.startswith("sequence"))
]


@pytest.mark.parametrize("loss_type,level,correction,beta,with_old", TWIN_CASES)
def test_twin_matches_trl(loss_type, level, correction, beta, with_old):
    """Full product on the PyTorch twin: loss type x level x sampling correction x beta x old given."""
    opts = dict(importance_sampling_level=level, sampling_correction=correction, beta=beta)
    _compare_grpo_loss(
        "torch", torch.float32, with_old, _for(loss_type, opts), with_sampling=bool(correction)
    )


# Each set applies to every loss type; together they give each loss type every value of delta, the
# off-policy mask (from sampling log-probs and from old ones), the IS bounds (clip_min, no clip_max), the
# normalizer, the bias-corrected KL, the sapo/vespo shape parameters, bf16, and old_logps None.
OPTION_SETS = {
    "delta-token_truncate-min": dict(
        dtype=torch.float32, with_old=True, importance_sampling_level="token",
        sampling_correction="token_truncate", sampling_clip_min=0.5, delta=1.5, beta=0.04,
    ),
    "bf16-delta-opm-sequence_mask": dict(
        dtype=torch.bfloat16, with_old=True, importance_sampling_level="sequence",
        sampling_correction="sequence_mask", off_policy_mask_threshold=OFF_POLICY, delta=1.5,
    ),
    "opm-sampling-no-correction-no-old": dict(
        dtype=torch.float32, with_old=False, importance_sampling_level="token",
        off_policy_mask_threshold=OFF_POLICY, beta=0.04, use_bias_correction_kl=True,
    ),
    "opm-from-old-sequence-num_items-shapes": dict(
        dtype=torch.float32, with_old=True, with_sampling=False, importance_sampling_level="sequence",
        off_policy_mask_threshold=OFF_POLICY, num_items_in_batch=123, beta=0.04, use_bias_correction_kl=True,
        sapo_temperature_pos=0.7, sapo_temperature_neg=1.3,
        vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.5, vespo_lambda_neg=1.5,
    ),
    "bf16-token_mask-min-shapes-num_items": dict(
        dtype=torch.bfloat16, with_old=True, importance_sampling_level="token",
        sampling_correction="token_mask", sampling_clip_min=0.5, beta=0.04, num_items_in_batch=123,
        sapo_temperature_pos=0.7, sapo_temperature_neg=1.3, vespo_k_neg=2.5,
    ),
    "bf16-delta-sequence_truncate-no-max-no-old": dict(
        dtype=torch.bfloat16, with_old=False, importance_sampling_level="sequence",
        sampling_correction="sequence_truncate", sampling_clip_min=0.5, sampling_clip_max=None, delta=1.5,
    ),
    "opm-token_mask-no-max-default-eps-high": dict(
        dtype=torch.float32, with_old=True, importance_sampling_level="token",
        sampling_correction="token_mask", sampling_clip_min=0.5, sampling_clip_max=None,
        off_policy_mask_threshold=OFF_POLICY, epsilon_high=None,
    ),
}  # fmt: skip


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("options", list(OPTION_SETS))
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_options_match_trl(impl, options, loss_type):
    opts = dict(OPTION_SETS[options])
    dtype, with_old, with_sampling = opts.pop("dtype"), opts.pop("with_old"), opts.pop("with_sampling", True)
    _compare_grpo_loss(impl, dtype, with_old, _for(loss_type, opts), with_sampling=with_sampling)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("mode", ["sequence_truncate", "sequence_mask"])
def test_vespo_refuses_sequence_level_sampling_correction(impl, mode):
    assert "VESPO loss requires `vllm_importance_sampling_mode`" in inspect.getsource(GRPOTrainer.__init__)
    logps, adv, mask, tensors = _batch()
    kw = dict(tensors, loss_type="vespo", sampling_correction=mode)
    with pytest.raises(ValueError):
        grpo_loss(logps, adv, mask, impl=impl, **kw)
    hidden, weight, _, targets = _head(seed=1)
    with pytest.raises(ValueError):
        fused_linear_grpo_loss(hidden, weight, targets, mask, adv, impl=impl, **kw)


# --------------------------------------------------------------------------------------------------------
# fused_linear_grpo_loss
# --------------------------------------------------------------------------------------------------------
TEMPERATURE = 0.7
ENTROPY_EDGE = 1e-4  # a token's entropy this close to the top-quantile threshold could go either way


def _head(dtype=torch.float32, bias=False, T=37, H=16, V=131, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(len(LENGTHS), T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.5 * 3).to(dtype)
    b = torch.randn(V, generator=g).to(dtype) if bias else None
    targets = torch.randint(0, V, (len(LENGTHS), T), generator=g)
    return hidden, weight, b, targets


def _naive(h, w, b, targets, dtype):
    """Per-token log-probs and entropies from the full logits (matmul in `dtype`, the rest fp64)."""
    logp = torch.log_softmax(naive_logits(h, w, b, TEMPERATURE, dtype), dim=-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _fused_problem(dtype, bias, with_old, quantile, seed=0):
    hidden, weight, b, targets = _head(dtype, bias, seed=seed)
    mask = _mask()
    with torch.no_grad():
        base, ent = _naive(hidden, weight, b, targets, torch.float64)
    old, ref, sampling = _others(base, with_old, torch.Generator().manual_seed(seed + 1))
    tensors = dict(
        old_logps=None if old is None else old.float(), ref_logps=ref.float(), sampling_logps=sampling.float()
    )
    _check_margins(base, tensors["old_logps"], tensors["sampling_logps"], mask)
    if quantile < 1.0:  # as TRL's get_high_entropy_mask
        active = ent[mask.bool()]
        thr = torch.quantile(active.float(), 1 - quantile).double()
        gap = (active - thr).abs().min().item()
        assert gap >= ENTROPY_EDGE, f"an entropy {gap:.3g} from the top-{quantile} threshold; pick a seed"
    return hidden, weight, b, targets, mask, torch.tensor(ADVANTAGES), tensors


def _trl_fused(targets, mask, adv, dtype, kw):
    def f(h, w, b):
        logps, ent = _naive(h, w, b, targets, dtype)
        return trl_grpo_loss(logps, adv, mask, entropies=ent, **kw)

    return f


FUSED_SETS = {
    "delta-opm-token_truncate-top-entropy-bonus-bias": dict(
        dtype=torch.float32, bias=True, with_old=True, importance_sampling_level="token",
        sampling_correction="token_truncate", sampling_clip_min=0.5, delta=1.5, beta=0.04,
        off_policy_mask_threshold=OFF_POLICY, top_entropy_quantile=0.5, entropy_coef=0.01,
    ),
    "bf16-opm-sequence_mask-bonus-bias": dict(
        dtype=torch.bfloat16, bias=True, with_old=True, importance_sampling_level="sequence",
        sampling_correction="sequence_mask", off_policy_mask_threshold=OFF_POLICY, entropy_coef=0.01,
    ),
    "top-entropy-no-correction-no-old-kl": dict(
        dtype=torch.float32, bias=False, with_old=False, importance_sampling_level="token", beta=0.04,
        use_bias_correction_kl=True, top_entropy_quantile=0.5,
    ),
    "bf16-sequence-token_mask-top-entropy-bonus-num_items": dict(
        dtype=torch.bfloat16, bias=False, with_old=True, importance_sampling_level="sequence",
        sampling_correction="token_mask", top_entropy_quantile=0.5, entropy_coef=0.01,
        num_items_in_batch=123, sapo_temperature_pos=0.7, vespo_lambda_neg=1.5,
    ),
}  # fmt: skip


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("options", list(FUSED_SETS))
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_fused_matches_trl(impl, options, loss_type):
    _check_fused(impl, FUSED_SETS[options], loss_type)


# Options that need whole rows but no entropy: the twin's single pass over chunks of whole rows. Tiles of
# 40 tokens split the rows (37 | 18 0 5 | 30 | 12) over four chunks; 16 is shorter than a row, so the twin
# scores everything first instead.
ROW_SETS = {
    "sequence-opm-sequence_mask-kl": dict(
        dtype=torch.float32, bias=True, with_old=True, importance_sampling_level="sequence", beta=0.04,
        sampling_correction="sequence_mask", off_policy_mask_threshold=OFF_POLICY,
    ),
    "token-sequence_truncate-num_items": dict(
        dtype=torch.float32, bias=False, with_old=False, importance_sampling_level="token",
        sampling_correction="sequence_truncate", sampling_clip_min=0.5, num_items_in_batch=123,
    ),
}  # fmt: skip


@pytest.mark.parametrize("tile_tokens", [40, 16])
@pytest.mark.parametrize("options", list(ROW_SETS))
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_fused_row_chunks_match_trl(monkeypatch, tile_tokens, options, loss_type):
    fused_mod = sys.modules[fused_linear_grpo_loss.__module__]
    scoring_passes = []
    two_pass = fused_mod._two_pass
    monkeypatch.setattr(lp_mod, "twin_chunk_rows", lambda V: tile_tokens)
    monkeypatch.setattr(fused_mod, "_two_pass", lambda *a: scoring_passes.append(1) or two_pass(*a))
    _check_fused("torch", ROW_SETS[options], loss_type)
    assert len(scoring_passes) == (0 if tile_tokens >= max(LENGTHS) else 1)


def _check_fused(impl, options, loss_type):
    opts = dict(options)
    dtype, bias, with_old = opts.pop("dtype"), opts.pop("bias"), opts.pop("with_old")
    hidden, weight, b, targets, mask, adv, tensors = _fused_problem(
        dtype, bias, with_old, opts.get("top_entropy_quantile", 1.0)
    )
    kw = {**tensors, **_for(loss_type, opts)}
    ours = _grads(
        lambda h, w, bb: fused_linear_grpo_loss(
            h, w, targets, mask, adv, bias=bb, temperature=TEMPERATURE, impl=impl, **kw
        ),
        (hidden, weight, b),
    )
    f64 = (hidden.double(), weight.double(), None if b is None else b.double())
    exact = _grads(_trl_fused(targets, mask, adv, torch.float64, kw), f64)
    lowp = (
        exact
        if dtype == torch.float32
        else _grads(_trl_fused(targets, mask, adv, dtype, kw), (hidden, weight, b))
    )
    assert ours[0].dtype == torch.float32 and ours[0].dim() == 0
    _assert_close("loss", ours[0], exact[0], lowp[0], dtype, floor=0.1)
    for name, g, r, lg, x in zip(["d hidden", "d weight", "d bias"], ours[2], exact[2], lowp[2], f64):
        if x is not None:
            assert g is not None and g.dtype == dtype, name
            _assert_close(name, g, r, lg, dtype)
    if opts.get("top_entropy_quantile", 1.0) == 1.0 and not opts.get("entropy_coef"):
        for m in (exact[1], lowp[1]):  # entropy is computed (and reported) only when the options need it
            m.pop("entropy", None)
    _assert_metrics(ours[1], exact[1], lowp[1], dtype)


# ---- against Liger-Kernel's LigerFusedLinearGRPOLoss on what it implements as TRL does ----
# Liger 0.8.5 has every loss type, delta, use_bias_correction_kl, sapo/vespo parameters, num_items_in_batch
# and a given IS ratio (vllm_is_ratio, TRL's, computed here); it has no off-policy mask, entropy mask or
# entropy bonus, refuses sequence level for cispo/sapo/vespo, and its luspo equals TRL's only when the
# per-token loss stays (B, 1): sequence level, beta 0, no token-level IS ratio.
LIGER_SETS = {
    "kl-delta-token_truncate-num_items": dict(
        beta=0.04, use_bias_correction_kl=True, delta=1.5, sampling_correction="token_truncate",
        sampling_clip_min=0.5, num_items_in_batch=123, sapo_temperature_neg=1.3, vespo_k_pos=1.5,
    ),
    "sequence_mask": dict(sampling_correction="sequence_mask", delta=1.5),
    "no-correction": dict(beta=0.04),
}  # fmt: skip
LIGER_CASES = [
    (lt, level, s)
    for lt in LOSS_TYPES
    for level in LEVELS
    for s in LIGER_SETS
    if not (level == "sequence" and lt in ("cispo", "sapo", "vespo"))
    and not (lt == "luspo" and (level == "token" or s != "sequence_mask"))
]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("loss_type,level,options", LIGER_CASES)
def test_fused_matches_liger(impl, loss_type, level, options):
    liger = pytest.importorskip("liger_kernel.chunked_loss")
    hidden, weight, b, targets, mask, adv, tensors = _fused_problem(torch.float32, True, True, 1.0, seed=3)
    kw = {**tensors, **_for(loss_type, dict(LIGER_SETS[options], importance_sampling_level=level))}
    o = {**API_DEFAULTS, **kw}
    is_ratio = None
    if o["sampling_correction"] is not None:
        is_ratio = trl_sampling_ratio(_TrlTrainer(o), o["old_logps"], o["sampling_logps"], mask)
    lg = liger.LigerFusedLinearGRPOLoss(
        beta=o["beta"],
        compiled=False,
        use_ref_model=o["beta"] != 0.0,
        epsilon_low=o["epsilon_low"],
        epsilon_high=o["epsilon_high"],
        loss_type=loss_type,
        max_completion_length=o["max_completion_length"],
        importance_sampling_level=level,
        temperature=TEMPERATURE,
        delta=o["delta"],
        use_bias_correction_kl=o["use_bias_correction_kl"],
        **{k: o[k] for k in o if k.startswith(("sapo_", "vespo_"))},
    )

    def liger_in(dtype):
        c = lambda x: None if x is None else x.to(dtype)  # noqa: E731
        return _grads(
            lambda h, w, bb: lg(
                h, w, targets, mask, adv, bias=bb, ref_per_token_logps=c(o["ref_logps"]),
                old_per_token_logps=c(o["old_logps"]), vllm_is_ratio=c(is_ratio),
                num_items_in_batch=o["num_items_in_batch"],
            ),
            tuple(c(x) for x in (hidden, weight, b)),
        )  # fmt: skip

    # Liger's own code in fp64 is the reference; ours in fp32 may err up to twice Liger's fp32 run (plus 1e-5
    # of the reference's size): VESPO's gamma weights put both fp32 runs ~1e-5 relative from fp64
    exact, theirs = liger_in(torch.float64), liger_in(torch.float32)
    ours = _grads(
        lambda h, w, bb: fused_linear_grpo_loss(
            h, w, targets, mask, adv, bias=bb, temperature=TEMPERATURE, impl=impl, **kw
        ),
        (hidden, weight, b),
    )
    _assert_close("loss vs Liger", ours[0], exact[0], theirs[0], torch.float32, floor=0.1)
    for name, g, r, r32 in zip(["d hidden", "d weight", "d bias"], ours[2], exact[2], theirs[2]):
        _assert_close(f"{name} vs Liger", g, r, r32, torch.float32)
