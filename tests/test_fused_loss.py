import itertools

import pytest
import torch
from grpo_fast.kernels import fused_linear_grpo_loss
from oracle import assert_within, naive_entropy, naive_grpo_loss, naive_logprobs

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]


def _problem(B=3, T=37, H=32, V=1001, dtype=torch.float32, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.5 * 3).to(dtype)
    b = torch.randn(V, generator=g).to(dtype) if bias else None
    targets = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.tensor([T, T // 3, 0, 7, 1][:B])  # ragged, a fully masked sequence
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    adv = torch.randn(B, generator=g)
    with torch.no_grad():
        base = naive_logprobs(hidden, weight, targets, b, 0.7).float()
    # log-ratios on both sides of the clip ranges used here ([log 0.8, log 1.2] and [log 0.8, log 1.28]) and
    # inside them, each >= 0.06 from every edge, per token and as each sequence's mean (GSPO): a bf16
    # log-prob's rounding (~0.03), or another CPU's, must not move a token across an edge, where the gradient
    # jumps. Each row cycles through the four values in its own order, so every prefix's mean stays small.
    values = torch.tensor([-0.6, -0.1, 0.05, 0.6])
    order = torch.stack([torch.randperm(4, generator=g) for _ in range(B)])
    log_ratio = values[order.gather(1, (torch.arange(T) % 4).expand(B, T))]
    edges = torch.tensor([0.8, 1.2, 1.28]).log()
    seq = (log_ratio * mask).sum(1) / mask.sum(1).clamp_min(1)
    assert (seq[mask.any(1)][:, None] - edges).abs().min() >= 0.06, "pick another seed"
    old = base - log_ratio
    ref = base + 0.2 * torch.randn(B, T, generator=g)
    return hidden, weight, b, targets, mask, adv, old, ref


def _grads(fn, tensors):
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]
    loss, metrics = fn(*leaves)
    (loss * 1.3).backward()
    return loss.detach(), metrics, [None if x is None else x.grad for x in leaves]


def _naive(targets, mask, adv, temperature, dtype, **kw):
    def f(h, w, b):
        lp = naive_logprobs(h, w, targets, b, temperature, dtype=dtype)
        return naive_grpo_loss(lp, adv, mask, **kw)

    return f


def _compare(impl, dtype, bias, kw, B=3, T=37, V=1001):
    hidden, weight, b, targets, mask, adv, old, ref = _problem(B=B, T=T, V=V, dtype=dtype, bias=bias)
    kw = dict(kw, old_logps=old, ref_logps=ref)
    ours = _grads(
        lambda h, w, bb: fused_linear_grpo_loss(
            h, w, targets, mask, adv, bias=bb, temperature=0.7, impl=impl, **kw
        ),
        (hidden, weight, b),
    )
    f64 = (hidden.double(), weight.double(), None if b is None else b.double())
    exact = _grads(_naive(targets, mask, adv, 0.7, torch.float64, **kw), f64)
    lowp = _grads(_naive(targets, mask, adv, 0.7, dtype, **kw), (hidden, weight, b))
    assert ours[0].dtype == torch.float32
    assert_within("loss", ours[0], exact[0], lowp[0], dtype)
    for k, v in exact[1].items():
        assert abs(ours[1][k].item() - v.item()) < (1e-5 if dtype == torch.float32 else 0.05), k
    for name, g, r, lg in zip(["d hidden", "d weight", "d bias"], ours[2], exact[2], lowp[2]):
        if r is not None:
            assert g.dtype == dtype
            assert_within(name, g, r, lg, dtype)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize(
    "loss_type,level,beta", list(itertools.product(LOSS_TYPES, ["token", "sequence"], [0.0, 0.04]))
)
def test_fused_loss_matches_naive(impl, loss_type, level, beta):
    _compare(
        impl,
        torch.float32,
        bias=False,
        kw=dict(
            beta=beta,
            loss_type=loss_type,
            importance_sampling_level=level,
            max_completion_length=40,
            epsilon_high=0.28,
        ),
    )


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_fused_loss_bias_and_dtypes(impl, dtype, level):
    _compare(
        impl,
        dtype,
        bias=True,
        kw=dict(beta=0.04, importance_sampling_level=level, use_bias_correction_kl=True),
    )


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_fused_loss_twin_real_vocabulary(level):
    _compare(
        "torch",
        torch.float32,
        bias=False,
        B=2,
        T=60,
        V=151936,
        kw=dict(beta=0.04, importance_sampling_level=level),
    )


def test_fused_loss_single_token():
    _compare("torch", torch.float32, bias=False, B=1, T=1, kw=dict(beta=0.0))
    _compare("triton", torch.float32, bias=False, B=1, T=1, kw=dict(beta=0.0))


def test_no_grad_forward_matches():
    hidden, weight, _, targets, mask, adv, old, _ = _problem()
    with torch.no_grad():
        a, _ = fused_linear_grpo_loss(hidden, weight, targets, mask, adv, old_logps=old, impl="torch")
    b, _ = fused_linear_grpo_loss(
        hidden.requires_grad_(), weight, targets, mask, adv, old_logps=old, impl="torch"
    )
    assert abs(a.item() - b.item()) < 1e-6


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("quantile", [1.0, 0.5])
def test_entropy_metrics_for_an_adaptive_coefficient(impl, quantile):
    """compute_entropy: the entropies without a bonus (an adaptive coefficient measured at 0): the loss and
    gradients are those without it; `entropy` is the mean over the active tokens, `bonus_entropy` and
    `bonus_tokens` the mean and count over the tokens the bonus would act on (under top_entropy_quantile the
    top-entropy ones), against fp64 entropies and a quantile taken here."""
    hidden, weight, _, targets, mask, adv, old, _ = _problem()
    kw = dict(old_logps=old, temperature=0.7, impl=impl, top_entropy_quantile=quantile)
    fn = lambda h, w, b: fused_linear_grpo_loss(h, w, targets, mask, adv, **kw)  # noqa: E731
    plain = _grads(fn, (hidden, weight, None))
    kw["compute_entropy"] = True
    measured = _grads(fn, (hidden, weight, None))
    ent = naive_entropy(hidden, weight, temperature=0.7)
    active = mask.bool()
    kept = active & (ent >= torch.quantile(ent[active], 1.0 - quantile)) if quantile < 1 else active
    metrics = measured[1]
    assert abs(metrics["entropy"].item() - ent[active].mean().item()) < 1e-5
    assert metrics["bonus_tokens"].item() == kept.sum().item()
    assert kept.sum() < active.sum() if quantile < 1 else kept.equal(active)
    assert abs(metrics["bonus_entropy"].item() - ent[kept].mean().item()) < 1e-5
    assert (measured[0] - plain[0]).abs().item() < 1e-6
    for a, b in zip(measured[2][:2], plain[2][:2]):
        assert (a - b).abs().max().item() < 1e-6
    if quantile == 1.0:  # nothing asked for the entropies: none computed
        assert "entropy" not in plain[1] and "bonus_entropy" not in plain[1]


# ---- against Liger-Kernel's LigerFusedLinearGRPOLoss, an independent implementation ----
@pytest.mark.parametrize(
    "loss_type,level,beta", list(itertools.product(LOSS_TYPES, ["token", "sequence"], [0.0, 0.04]))
)
def test_fused_loss_matches_liger(loss_type, level, beta):
    liger = pytest.importorskip("liger_kernel.chunked_loss")
    hidden, weight, b, targets, mask, adv, old, ref = _problem(bias=True, seed=3)
    lg = liger.LigerFusedLinearGRPOLoss(
        beta=beta,
        compiled=False,
        use_ref_model=beta != 0.0,
        epsilon_low=0.2,
        epsilon_high=0.28,
        loss_type=loss_type,
        max_completion_length=40,
        importance_sampling_level=level,
        temperature=0.7,
    )
    theirs = _grads(
        lambda h, w, bb: lg(
            h, w, targets, mask, adv, bias=bb, ref_per_token_logps=ref, old_per_token_logps=old
        ),
        (hidden, weight, b),
    )
    kw = dict(
        beta=beta,
        epsilon_low=0.2,
        epsilon_high=0.28,
        loss_type=loss_type,
        importance_sampling_level=level,
        max_completion_length=40,
        old_logps=old,
        ref_logps=ref,
    )
    for impl in ("torch", "triton"):
        ours = _grads(
            lambda h, w, bb: fused_linear_grpo_loss(
                h, w, targets, mask, adv, bias=bb, temperature=0.7, impl=impl, **kw
            ),
            (hidden, weight, b),
        )
        assert abs(ours[0].item() - theirs[0].item()) < 1e-5, (impl, ours[0].item(), theirs[0].item())
        for name, g, r in zip(["d hidden", "d weight", "d bias"], ours[2], theirs[2]):
            err = (g - r).abs().max().item()
            assert err < 1e-5 * max(1.0, r.abs().max().item()), f"{impl} {name}: max err {err:.3g}"


def test_trainer_steps_agree_triton_vs_torch():
    """A few AdamW steps of a small model on one fixed GRPO batch, old log-probs one update back: at every
    step impl="triton" and impl="torch" give the same loss and every parameter's gradient at the same weights.

    Gradients, not weights after the step, are what is compared: AdamW moves an element by ~lr whatever the
    size of its gradient, so a gradient at rounding level whose sign differs between two summation orders (the
    interpreter's numpy matmul vs torch's, each with kernels chosen per CPU) moves it by up to 2 lr."""
    from transformers import AutoModelForCausalLM

    from grpo_fast.models.model_parts import lm_head_of
    from grpo_fast.tasks import default_task
    from grpo_fast.trainer.modeling import completion_hidden_states

    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(5, 100, (2, 6), generator=g)
    prompt_mask = torch.ones(2, 6, dtype=torch.long)
    completion_ids = torch.randint(5, 100, (8, 5), generator=g)
    completion_mask = (torch.arange(5)[None, :] < torch.tensor([5, 3, 5, 1, 4, 5, 2, 5])[:, None]).long()
    adv = torch.randn(8, generator=g)
    batch = (prompt_ids, prompt_mask, completion_ids, completion_mask)
    model = AutoModelForCausalLM.from_pretrained(default_task.ASSET_DIR)
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(params.values(), lr=1e-3)
    old = None  # old log-probs: the policy one update back, so ratios move off 1 (and clip)
    for step in range(3):
        head = lm_head_of(model).weight
        with torch.no_grad():
            current = naive_logprobs(
                completion_hidden_states(model, *batch), head, completion_ids, temperature=0.9
            ).float()
        seen = {}
        for impl in ("triton", "torch"):  # torch last: its gradients take the step
            opt.zero_grad()
            loss, _ = fused_linear_grpo_loss(
                completion_hidden_states(model, *batch), head, completion_ids, completion_mask, adv,
                temperature=0.9, old_logps=old, impl=impl,
            )  # fmt: skip
            loss.backward()
            seen[impl] = loss.item(), {k: p.grad.clone() for k, p in params.items() if p.grad is not None}
        (lt, gt), (lr_, gr) = seen["triton"], seen["torch"]
        assert lt == pytest.approx(lr_, abs=1e-5 * max(1.0, abs(lr_))), step
        assert gt.keys() == gr.keys() and len(gr) == len(params)
        for k, want in gr.items():  # one fp32 backward each: rounding, relative to the tensor's scale
            err = (gt[k] - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
            assert err < 1e-4, f"step {step} {k}: gradient differs by {err:.3g} of its largest entry"
        opt.step()
        old = current
    assert old is not None and seen["torch"][0] != 0


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_frozen_head_gives_d_hidden_only(impl, level):
    """A head that does not need a gradient (LoRA's frozen LM head): the kernels skip d weight, and d hidden
    is still the naive fp64 one."""
    hidden, weight, b, targets, mask, adv, old, ref = _problem()
    kw = dict(old_logps=old, beta=0.04, ref_logps=ref, importance_sampling_level=level)
    h = hidden.clone().requires_grad_(True)
    loss, _ = fused_linear_grpo_loss(h, weight, targets, mask, adv, temperature=0.7, impl=impl, **kw)
    (loss * 1.3).backward()
    assert weight.grad is None
    f64 = (hidden.double(), weight.double(), None)
    exact = _grads(_naive(targets, mask, adv, 0.7, torch.float64, **kw), f64)
    lowp = _grads(_naive(targets, mask, adv, 0.7, torch.float32, **kw), (hidden, weight, None))
    assert_within("d hidden", h.grad, exact[2][0], lowp[2][0], torch.float32)
