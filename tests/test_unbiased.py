"""Samples from another distribution, with `sampling_correction`, give the on-policy gradient in expectation.

The trainer's policy is p = softmax(logits) of a tiny causal LM (vocabulary 16) after a fixed prompt; the
sampler is q = softmax(logits / 1.6), the same model at another temperature, as a vLLM sampler that differs
from the trainer. Rewards are a fixed table over completions and advantages A = reward - 0.5 (no group
normalization, so that each sample's term depends on that sample alone). With old_logps = None the policy
ratio is 1, the clip is inactive, and the dapo loss with num_items_in_batch = n L has the gradient
-(1 / nL) sum_b IS_b A_b grad log p(y_b), IS the detached correction weight. Its expectation over y ~ q is
the on-policy gradient -(1 / L) E_p[A grad log p(y)] = -(1 / L) sum_y A(y) grad p(y) exactly when IS = p(y) /
q(y), which every completion can be enumerated to compute (V**L of them) and to check:
  * L = 1: the token ratio is the sequence ratio, so `token_truncate` is exact (its cap never reached);
  * L = 3: only the sequence ratio is, so `sequence_truncate` (the per-position distributions depend on the
    earlier tokens through the model).
Two checks of each: the expectation itself, with every completion as one batch weighted by q(y) (exact to
float rounding), and sampled batches from q, whose mean gradient must match within its standard error
(z-scores along the exact gradient and a few random directions) while the uncorrected one must not.
"""

import pytest
import torch
from grpo_fast.kernels import fused_linear_grpo_loss, grpo_loss
from tiny_models import tiny_lm

V = 16
PROMPT = torch.tensor([[2, 5, 7, 3]])
SAMPLER_TEMPERATURE = 1.6
BASELINE = 0.5
CAP = 1e6  # far above any p(y) / q(y) here (asserted): truncation never acts, the correction is exact
CASES = [(1, "token_truncate"), (3, "sequence_truncate")]  # (completion length L, correction)
# at a cap never reached, masking is the same as truncating
EXACT_CASES = CASES + [(1, "token_mask"), (3, "sequence_mask")]


def _model():
    model = tiny_lm("llama", vocab=V, head_dim=4)  # hidden 16, 2 layers
    with torch.no_grad():
        # at init the logits are ~0.1: sharpen them (std ~2) so that the two temperatures differ markedly
        model.get_output_embeddings().weight.mul_(25.0)
    return model


def _hidden(model, ys):
    """(n, L, H) hidden states at the positions predicting each completion token."""
    ids = torch.cat([PROMPT.expand(len(ys), -1), ys], 1)
    return model.model(input_ids=ids).last_hidden_state[:, PROMPT.shape[1] - 1 : -1]


def _token_logps(hidden, weight, ys, temperature=1.0):
    z = (hidden.float() @ weight.float().T) / temperature
    return torch.log_softmax(z, -1).gather(-1, ys[..., None]).squeeze(-1)


def _flat_grad(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])


def _exact(model, L):
    """Every completion (V**L, L), its sampler log-probs (V**L, L), advantages (V**L,) and the exact
    on-policy gradient of -(1 / L) E_p[A log p(y)] (flat, over all parameters)."""
    ys = torch.cartesian_prod(*[torch.arange(V)] * L).reshape(-1, L)
    weight = model.get_output_embeddings().weight
    h = _hidden(model, ys)
    logp = _token_logps(h, weight, ys)
    logq = _token_logps(h, weight, ys, SAMPLER_TEMPERATURE).detach()
    reward = (torch.rand(len(ys), generator=torch.Generator().manual_seed(3)) < 0.5).float()
    adv = reward - BASELINE
    # grad of sum_y A p(y) is sum_y A p(y) grad log p(y): the on-policy expectation, no sampling
    ref = _flat_grad(model, -(adv * logp.sum(1).exp()).sum() / L)
    max_ratio = (logp.sum(1).detach() - logq.sum(1)).exp().max().item()
    assert max_ratio < CAP, f"p/q reaches {max_ratio:.3g}: the cap would truncate"
    return ys, logq, adv, ref


def _loss(model, ys, logq, adv, n_items, correction, entry="fused"):
    """The trainer's loss on completions `ys` (rows) drawn with sampler log-probs `logq`."""
    weight = model.get_output_embeddings().weight
    h = _hidden(model, ys)
    mask = torch.ones_like(ys)
    opts = dict(
        loss_type="dapo",
        num_items_in_batch=n_items,
        sampling_logps=logq,
        sampling_correction=correction,
        sampling_clip_max=CAP,
        impl="torch",
    )
    if entry == "fused":
        return fused_linear_grpo_loss(h, weight, ys, mask, adv, **opts)[0]
    return grpo_loss(_token_logps(h, weight, ys), adv, mask, **opts)[0]


def _fmt(z):
    return "[" + ", ".join(f"{v:+.2f}" for v in z.tolist()) + "]"


@pytest.mark.parametrize("entry", ["fused", "logps"])
@pytest.mark.parametrize("L, correction", EXACT_CASES)
def test_expectation_is_the_on_policy_gradient(L, correction, entry):
    """All V**L completions in one batch, each with weight q(y) folded into its advantage: the corrected
    loss's gradient is -E_q[IS A grad log p] / L, the on-policy gradient to rounding; uncorrected, not."""
    model = _model()
    ys, logq, adv, ref = _exact(model, L)
    q = logq.sum(1).exp()
    got = _flat_grad(model, _loss(model, ys, logq, adv * q, L, correction, entry))
    off = _flat_grad(model, _loss(model, ys, logq, adv * q, L, None, entry))
    err = ((got - ref).norm() / ref.norm()).item()
    err_off = ((off - ref).norm() / ref.norm()).item()
    assert err < 1e-4, f"corrected: relative error {err:.2e} (uncorrected {err_off:.3f})"
    assert err_off > 0.1, f"uncorrected: relative error only {err_off:.3f}: the test cannot tell"


@pytest.mark.parametrize("entry", ["fused", "logps"])
def test_token_correction_on_longer_completions(entry):
    """Why the sequence modes exist: on L = 3 `token_truncate` weights each token by its own ratio, so its
    expectation is -(1 / L) E_q[A sum_t r_t grad log p_t] (checked exactly), not the on-policy gradient."""
    L = 3
    model = _model()
    ys, logq, adv, ref = _exact(model, L)
    q = logq.sum(1).exp()
    got = _flat_grad(model, _loss(model, ys, logq, adv * q, L, "token_truncate", entry))
    logp = _token_logps(_hidden(model, ys), model.get_output_embeddings().weight, ys)
    r = (logp - logq).exp().detach()
    want = _flat_grad(model, -(q * adv * (r * logp).sum(1)).sum() / L)
    err = ((got - want).norm() / want.norm()).item()
    bias = ((want - ref).norm() / ref.norm()).item()
    assert err < 1e-4, f"token_truncate on L=3: relative error {err:.2e} against E_q[A sum_t r_t grad logp_t]"
    assert bias > 0.05, f"token-level correction off the on-policy gradient by only {bias:.3f}"


@pytest.mark.parametrize("L, correction", CASES)
def test_sampled_gradient_is_unbiased(L, correction):
    """K batches of completions drawn from q: the mean corrected gradient is the exact on-policy one within
    its standard error; the uncorrected mean (same samples) is many standard errors away."""
    K, n = 40, 250
    model = _model()
    ys, logq, adv, ref = _exact(model, L)
    g = torch.Generator().manual_seed(7)
    # drawing whole completions from q(y) = prod_t q_t(y_t | y_<t) is drawing them token by token
    draws = torch.multinomial(logq.sum(1).exp(), K * n, replacement=True, generator=g).view(K, n)
    # the exact gradient's direction and four random ones
    dirs = torch.cat([ref[None] / ref.norm(), torch.randn(4, ref.numel(), generator=g)])
    dirs = dirs / dirs.norm(dim=1, keepdim=True)

    def z_scores(mode):
        proj = torch.stack(
            [dirs @ _flat_grad(model, _loss(model, ys[i], logq[i], adv[i], n * L, mode)) for i in draws]
        )  # (K, directions)
        return (proj.mean(0) - dirs @ ref) / (proj.std(0) / K**0.5)

    z_on, z_off = z_scores(correction), z_scores(None)
    report = f"z corrected {_fmt(z_on)}, uncorrected {_fmt(z_off)} (the first along the exact gradient)"
    assert z_on.abs().max() < 4.5, report
    assert z_off[0].abs() > 8, report
