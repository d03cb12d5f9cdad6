import itertools

import pytest
import torch
from grpo_fast.kernels import grpo_loss
from oracle import naive_grpo_loss

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]


def _batch(B=4, T=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=g) * 3
    old = logps + 0.3 * torch.randn(B, T, generator=g)  # ratios well outside [0.8, 1.2]: clipping happens
    ref = logps + 0.2 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    lengths = torch.tensor([T, T // 2, 0, 5])[:B]  # ragged, one fully masked sequence
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    return logps, old, ref, adv, mask


CASES = list(itertools.product(LOSS_TYPES, ["token", "sequence"], [0.0, 0.04], [False, True]))


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("loss_type,level,beta,with_old", CASES)
def test_loss_and_grad_match_trl_formulas(impl, loss_type, level, beta, with_old):
    logps, old, ref, adv, mask = _batch()
    kw = dict(
        beta=beta,
        epsilon_low=0.2,
        epsilon_high=0.28,
        loss_type=loss_type,
        importance_sampling_level=level,
        max_completion_length=40,
    )
    lp = logps.clone().requires_grad_(True)
    loss, metrics = grpo_loss(
        lp, adv, mask, old_logps=old if with_old else None, ref_logps=ref, impl=impl, **kw
    )
    up = 1.7
    (loss * up).backward()
    lp64 = logps.double().requires_grad_(True)
    ref_loss, ref_metrics = naive_grpo_loss(
        lp64, adv, mask, old_logps=old if with_old else None, ref_logps=ref, **kw
    )
    (ref_loss * up).backward()
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * max(1.0, abs(ref_loss.item()))
    err = (lp.grad.double() - lp64.grad).abs().max().item()
    assert err <= 1e-5 * max(1.0, lp64.grad.abs().max().item()), f"d logps max err {err:.3g}"
    assert set(ref_metrics) <= set(metrics)
    for k, v in ref_metrics.items():
        assert abs(metrics[k].item() - v.item()) < 1e-5, k
        assert not metrics[k].requires_grad


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_bias_corrected_kl_and_num_items(impl, level):
    logps, old, ref, adv, mask = _batch(seed=1)
    kw = dict(
        beta=0.1,
        loss_type="dapo",
        importance_sampling_level=level,
        use_bias_correction_kl=True,
        num_items_in_batch=123,
    )
    lp = logps.clone().requires_grad_(True)
    loss, metrics = grpo_loss(lp, adv, mask, old_logps=old, ref_logps=ref, impl=impl, **kw)
    loss.backward()
    lp64 = logps.double().requires_grad_(True)
    ref_loss, ref_metrics = naive_grpo_loss(lp64, adv, mask, old_logps=old, ref_logps=ref, **kw)
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-6
    assert (lp.grad.double() - lp64.grad).abs().max() < 1e-6
    assert abs(metrics["kl"].item() - ref_metrics["kl"].item()) < 1e-6


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_on_policy_gradient_is_minus_advantage_over_tokens(impl):
    # old_logps=None: ratio 1, d loss / d logp = -A * w (dapo: w = 1 / active tokens); no clipping
    logps, _, _, adv, mask = _batch()
    lp = logps.clone().requires_grad_(True)
    loss, metrics = grpo_loss(lp, adv, mask, impl=impl)
    loss.backward()
    expected = -adv[:, None] * mask / mask.sum()
    assert torch.allclose(lp.grad, expected.float(), atol=1e-7)
    assert abs(loss.item() - (-(adv[:, None] * mask).sum() / mask.sum()).item()) < 1e-6
    assert metrics["clip_ratio"].item() == 0.0


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_bf16_logps_upcast(impl):
    logps, old, _, adv, mask = _batch()
    lp = logps.bfloat16().requires_grad_(True)
    loss, _ = grpo_loss(lp, adv, mask, old_logps=old, impl=impl)
    loss.backward()
    ref_loss, _ = naive_grpo_loss(lp.detach().double(), adv, mask, old_logps=old)
    assert loss.dtype == torch.float32 and abs(loss.item() - ref_loss.item()) < 1e-6
    assert lp.grad.dtype == torch.bfloat16
