"""Bad input gets a ValueError/TypeError naming the argument and what was expected."""

import pytest
import torch
from grpo_fast.kernels import fused_linear_grpo_loss, fused_linear_logprobs, group_advantages, grpo_loss

H, V = 8, 50


def _lp_args():
    return torch.randn(2, 3, H), torch.randn(V, H), torch.randint(0, V, (2, 3))


@pytest.mark.parametrize(
    "mutate,exc,words",
    [
        (lambda h, w, t: (h[0, 0], w, t[0, 0]), ValueError, "hidden must have 2 or 3 dimensions"),
        (lambda h, w, t: (h, w[:, :4], t), ValueError, "weight.shape[1]"),
        (lambda h, w, t: (h, w, t.float()), TypeError, "targets must be an int64"),
        (lambda h, w, t: (h, w, t[:, :2]), ValueError, "targets must have hidden's leading shape"),
        (lambda h, w, t: (h, w, t + V), ValueError, "targets must lie in [0, 50)"),
        (lambda h, w, t: (h, w, t - V), ValueError, "targets must lie in [0, 50)"),
        (lambda h, w, t: (h, w.double(), t), TypeError, "hidden and weight must share a dtype"),
        (lambda h, w, t: (h.long(), w, t), TypeError, "hidden must be a floating-point tensor"),
        (lambda h, w, t: ([1.0], w, t), TypeError, "hidden must be a torch.Tensor"),
    ],
)
def test_logprobs_bad_input(mutate, exc, words):
    h, w, t = mutate(*_lp_args())
    with pytest.raises(exc) as e:
        fused_linear_logprobs(h, w, t)
    assert words in str(e.value)


@pytest.mark.parametrize(
    "kw,words",
    [
        (dict(temperature=0.0), "temperature must be a number > 0"),
        (dict(temperature=-1.0), "temperature must be a number > 0"),
        (dict(impl="cuda"), "impl must be one of"),
        (dict(bias=torch.randn(V + 1)), "bias must have shape (50,)"),
    ],
)
def test_logprobs_bad_options(kw, words):
    with pytest.raises(ValueError) as e:
        fused_linear_logprobs(*_lp_args(), **kw)
    assert words in str(e.value)


def test_mismatched_devices():
    h, w, t = _lp_args()
    with pytest.raises(ValueError, match="one device"):
        from grpo_fast.kernels._common import resolve_impl

        resolve_impl("auto", h, w.to("meta"))


@pytest.mark.parametrize(
    "rewards,G,kw,words",
    [
        (torch.randn(7), 2, {}, "must split into whole groups of group_size=2"),
        (torch.randn(0), 2, {}, "must split into whole groups"),
        (
            torch.tensor([1.0, float("nan")]),
            2,
            {},
            "rewards must be finite; non-finite values at indices [1]",
        ),
        (torch.tensor([1.0, float("inf")]), 2, {}, "rewards must be finite"),
        (torch.randn(4), 0, {}, "group_size must be an int >= 1"),
        (torch.randn(4), 2, dict(scale="std"), "scale must be one of"),
        (torch.randn(4), 2, dict(eps=-1.0), "eps must be a number >= 0"),
        (torch.randn(4), 2, dict(impl="jax"), "impl must be one of"),
        (torch.randn(2, 2), 2, {}, "rewards must have 1 dimensions"),
    ],
)
def test_advantages_bad_input(rewards, G, kw, words):
    with pytest.raises(ValueError) as e:
        group_advantages(rewards, G, **kw)
    assert words in str(e.value)


def _loss_args():
    return torch.randn(2, 3), torch.randn(2), torch.ones(2, 3, dtype=torch.long)


@pytest.mark.parametrize(
    "kw,words",
    [
        (dict(loss_type="ppo"), "loss_type must be one of"),
        (dict(importance_sampling_level="batch"), "importance_sampling_level must be one of"),
        (dict(epsilon_low=-0.1), "epsilon_low must be a number >= 0"),
        (dict(epsilon_high=-0.1), "epsilon_high must be a number >= 0"),
        (dict(beta=0.04), "beta != 0 needs ref_logps"),
        (dict(loss_type="dr_grpo"), "loss_type='dr_grpo' needs max_completion_length"),
        (dict(old_logps=torch.randn(2, 4)), "old_logps must have shape (2, 3)"),
        (dict(ref_logps=torch.randn(3, 3), beta=0.1), "ref_logps must have shape (2, 3)"),
        (dict(num_items_in_batch=0), "num_items_in_batch must be > 0"),
        (dict(impl="fast"), "impl must be one of"),
    ],
)
def test_loss_bad_options(kw, words):
    with pytest.raises(ValueError) as e:
        grpo_loss(*_loss_args(), **kw)
    assert words in str(e.value)


def test_loss_bad_shapes():
    logps, adv, mask = _loss_args()
    with pytest.raises(ValueError, match="advantages must have shape"):
        grpo_loss(logps, torch.randn(3), mask)
    with pytest.raises(ValueError, match=r"mask must have shape \(2, 3\)"):
        grpo_loss(logps, adv, mask[:, :2])
    with pytest.raises(ValueError, match="logps must have 2 dimensions"):
        grpo_loss(logps[0], adv, mask)


def test_fused_loss_bad_input():
    h, w, t = _lp_args()
    mask, adv = torch.ones(2, 3), torch.randn(2)
    with pytest.raises(ValueError, match="hidden must have 3 dimensions"):
        fused_linear_grpo_loss(h.reshape(6, H), w, t.reshape(6), mask, adv)
    with pytest.raises(ValueError, match="targets must lie in"):
        fused_linear_grpo_loss(h, w, t + V, mask, adv)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        fused_linear_grpo_loss(h, w, t, mask, adv, loss_type="ppo")
    with pytest.raises(ValueError, match="beta != 0 needs ref_logps"):
        fused_linear_grpo_loss(h, w, t, mask, adv, beta=0.1)
    with pytest.raises(ValueError, match="temperature must be"):
        fused_linear_grpo_loss(h, w, t, mask, adv, temperature=0)
