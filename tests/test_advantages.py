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


def _trl_advantages(per_func, weights, G, scale, aggregation, eps=1e-4):
    """TRL 1.16's advantages and is_std_zero, naive fp64 loops over Python floats (NaN = not scored): a
    group's mean and unbiased std over its scored values (no std below two), a NaN result 0."""
    nan = float("nan")

    def stats(xs):
        xs = [x for x in xs if x == x]
        mean = sum(xs) / len(xs) if xs else nan
        std = (sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else nan
        return mean, std

    def norm(xs, size, how):
        out, zero = [], []
        batch_std = stats(xs)[1] if len(xs) > 1 else 0.0
        for g in range(0, len(xs), size):
            part = xs[g : g + size]
            mean, std = stats(part)
            std = 0.0 if size == 1 else std
            std = batch_std if how == "batch" else std
            zero += [std == 0.0] * size
            out += [x - mean if how == "none" else (x - mean) / (std + eps) for x in part]
        return out, zero

    rows = per_func.double().tolist()
    scored = [any(v == v for v in r) for r in rows]
    total = [sum(w * v for w, v in zip(weights, r) if v == v) if s else nan for r, s in zip(rows, scored)]
    if aggregation == "normalize_then_sum":
        cols = [norm([r[j] for r in rows], G, "group")[0] for j in range(len(weights))]
        summed = [sum(w * c[i] for w, c in zip(weights, cols) if c[i] == c[i]) for i in range(len(rows))]
        summed = [x if s else nan for x, s in zip(summed, scored)]
        adv, zero = norm(summed, len(rows), "group")
    else:
        adv, zero = norm(total, G, scale)
    adv = [0.0 if a != a else a for a in adv]
    return (
        torch.tensor(total, dtype=torch.float64),
        torch.tensor(adv, dtype=torch.float64),
        torch.tensor(zero),
    )


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_trainer_advantages_are_trls_with_unscored_rows(aggregation, scale):
    """The trainer's advantages (grpo_fast.trainer.step.advantages_of) from two reward functions, some rows
    scored by one, some by none, against TRL's formulas written out: groups all unscored, with one scored
    row, equal scored rows, several different, and none unscored (the kernel's path)."""
    from grpo_fast.trainer.step import advantages_of

    nan = float("nan")
    a = [nan, nan, nan, nan, 1.0, nan, nan, nan, 0.3, 0.3, nan, 0.3, 1.0, 0.0, nan, 0.5, 0.2, 0.9, 0.4, 0.4]
    b = [nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, 1.0, nan, 3.0, 0.0, 1.0, 2.0, 0.5, 0.0]
    per_func = torch.tensor([a, b]).T.contiguous()
    weights, G = [1.0, 0.5], 4
    rewards, adv, zero = advantages_of(per_func, weights, G, scale, aggregation)
    want_r, want_adv, want_zero = _trl_advantages(per_func, weights, G, scale, aggregation)
    torch.testing.assert_close(rewards.double(), want_r, equal_nan=True, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(adv.double(), want_adv, atol=1e-5, rtol=1e-5)
    assert zero.tolist() == want_zero.tolist()
    assert adv[:4].eq(0).all()  # unscored: no advantage
    if aggregation == "sum_then_normalize":  # (normalize_then_sum: a row's sum is normalized over the batch)
        assert adv[4:8].eq(0).all()  # one scored row in its group: no std, no advantage
        assert adv[8:12].eq(0).all()  # the scored rows equal: exactly 0, as a finite group gives
    finite = torch.tensor([[0.2, 1.0], [0.9, 2.0], [0.4, 0.5], [0.4, 0.0]] * 2)
    rewards, adv, _ = advantages_of(finite, weights, G, scale, aggregation)
    torch.testing.assert_close(adv.double(), _trl_advantages(finite, weights, G, scale, aggregation)[1])
