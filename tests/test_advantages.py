import pytest
import torch
from grpo_fast.kernels import group_advantages
from oracle import naive_advantages


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_groups,G", [(1, 4), (5, 8), (3, 37)])
def test_advantages_match_naive(impl, scale, dtype, n_groups, G):
    rewards = torch.randn(n_groups * G).to(dtype)
    rewards[:G] = 1.0  # one constant group
    out = group_advantages(rewards, G, scale=scale, impl=impl)
    ref = naive_advantages(rewards, G, scale=scale)
    assert out.dtype == torch.float32
    assert (out.double() - ref).abs().max() < 1e-5 * max(1.0, ref.abs().max().item())
    assert torch.all(out[:G] == 0)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_worked_example_42(impl):
    # "6 boxes x 8 items, 6 sold": answers 42, 24, 42, 48 score 1, 0, 1, 0; mean 0.5, unbiased std 0.5774
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    out = group_advantages(rewards, 4, impl=impl)
    std = (sum((r - 0.5) ** 2 for r in [1, 0, 1, 0]) / 3) ** 0.5
    expected = torch.tensor([0.5, -0.5, 0.5, -0.5]) / (std + 1e-4)
    assert torch.allclose(out, expected, atol=1e-6)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_zero_variance_and_group_size_one_give_exact_zero(impl):
    # 0.1 three times: the fp32 mean is not exactly 0.1, the advantage must still be exactly 0
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7])
    assert torch.all(group_advantages(rewards, 3, impl=impl) == 0)
    assert torch.all(group_advantages(torch.randn(6), 1, impl=impl) == 0)
    assert torch.all(group_advantages(torch.randn(6), 1, scale="batch", impl=impl) == 0)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_large_group(impl):
    rewards = torch.rand(2 * 300)
    out = group_advantages(rewards, 300, impl=impl)
    assert (out.double() - naive_advantages(rewards, 300)).abs().max() < 1e-5
