import pytest
import torch
from grpo_fast.kernels import fused_linear_logprobs
from oracle import assert_within, naive_entropy, naive_logprobs

DTYPES = [torch.float32, torch.bfloat16]


def _run(fn, tensors, upstream):
    """Value and the gradient of every tensor input under a fixed random upstream gradient."""
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward([o for o in outs], [u.to(o.dtype) for o, u in zip(outs, upstream)])
    return [o.detach() for o in outs], [None if x is None else x.grad for x in leaves]


def _inputs(lead, H, V, dtype, bias):
    hidden = torch.randn(*lead, H).to(dtype)
    weight = (torch.randn(V, H) / H**0.5 * 3).to(dtype)  # logits of O(3): a peaked but not one-hot softmax
    b = torch.randn(V).to(dtype) if bias else None
    targets = torch.randint(0, V, lead)
    return hidden, weight, b, targets


def _check(impl, dtype, lead, H, V, bias, temperature, entropy):
    hidden, weight, b, targets = _inputs(lead, H, V, dtype, bias)
    n_out = 2 if entropy else 1
    up = [torch.randn(lead, dtype=torch.float64) for _ in range(n_out)]

    def ours(h, w, bb):
        return fused_linear_logprobs(
            h, w, targets, bias=bb, temperature=temperature, return_entropy=entropy, impl=impl
        )

    def naive(dt):
        def f(h, w, bb):
            lp = naive_logprobs(h, w, targets, bb, temperature, dtype=dt)
            return (lp, naive_entropy(h, w, bb, temperature, dtype=dt)) if entropy else lp

        return f

    out, grads = _run(ours, (hidden, weight, b), up)
    ref, ref_grads = _run(
        naive(torch.float64), (hidden.double(), weight.double(), None if b is None else b.double()), up
    )
    low, low_grads = _run(naive(dtype), (hidden, weight, b), up)
    for o in out:
        assert o.dtype == torch.float32 and o.shape == lead
    names = ["logp", "entropy"]
    for i in range(n_out):
        assert_within(names[i], out[i], ref[i], low[i], dtype)
    for name, g, r, lg in zip(["d hidden", "d weight", "d bias"], grads, ref_grads, low_grads):
        if r is None:
            continue
        assert g.dtype == dtype
        assert_within(name, g, r, lg, dtype)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,H,V", [((1,), 16, 64), ((3, 37), 32, 1001)])
@pytest.mark.parametrize("bias", [False, True])
def test_logprobs_match_naive(impl, dtype, lead, H, V, bias):
    _check(impl, dtype, lead, H, V, bias, temperature=0.7, entropy=False)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_entropy_and_its_gradient(impl, dtype):
    _check(impl, dtype, (3, 37), 32, 1001, bias=True, temperature=0.7, entropy=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_twin_real_vocabulary(dtype):
    # Qwen's 151,936-token vocabulary: several twin chunks over tokens, a ragged last one
    _check("torch", dtype, (2, 150), 8, 151936, bias=False, temperature=1.0, entropy=False)


def test_temperature_one_equals_log_softmax_default():
    hidden, weight, _, targets = _inputs((4, 5), 16, 300, torch.float32, False)
    a = fused_linear_logprobs(hidden, weight, targets, impl="torch")
    b = fused_linear_logprobs(hidden, weight, targets, temperature=1.0, impl="triton")
    ref = naive_logprobs(hidden, weight, targets)
    assert (a.double() - ref).abs().max() < 1e-5 and (b.double() - ref).abs().max() < 1e-5


def test_twin_chunks_bound_the_logits_tile(monkeypatch):
    # shrink the tile: ragged token blocks and vocabulary slices must not change values or gradients
    import grpo_fast.kernels.logprobs as lp_mod

    hidden, weight, b, targets = _inputs((50,), 16, 1000, torch.float32, True)
    up = [torch.randn(50), torch.randn(50)]

    def f(h, w, bb):
        return fused_linear_logprobs(h, w, targets, bias=bb, return_entropy=True, impl="torch")

    full, full_grads = _run(f, (hidden, weight, b), up)
    monkeypatch.setattr(lp_mod, "TWIN_TILE_ELEMS", 16 * 130)
    monkeypatch.setattr(lp_mod, "TWIN_MAX_ROWS", 16)
    assert lp_mod.twin_chunk_rows(1000) == 2
    chunked, chunked_grads = _run(f, (hidden, weight, b), up)
    for x, y in zip(full + full_grads, chunked + chunked_grads):
        assert torch.allclose(x, y, atol=1e-5)
    ref = naive_logprobs(hidden, weight, targets, b)
    assert (chunked[0].double() - ref).abs().max() < 1e-5


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_on_cuda_matches_naive(dtype):
    hidden, weight, b, targets = (
        x.cuda() if x is not None else None for x in _inputs((4, 129), 256, 5003, dtype, True)
    )
    out = fused_linear_logprobs(hidden, weight, targets, bias=b, impl="triton")
    ref = naive_logprobs(hidden, weight, targets, b).float()
    low = naive_logprobs(hidden, weight, targets, b, dtype=dtype).float()
    assert_within("logp (cuda)", out, ref, low, dtype)


@pytest.mark.parametrize("group_n", [0, 4])
def test_triton_backward_program_orders(monkeypatch, group_n):
    # the backward's tiles in either program order (token block fastest, or grouped with a ragged last group:
    # 18 token blocks in groups of 4, the last ragged) give the fp64 gradients
    import grpo_fast.kernels.logprobs as lp_mod

    monkeypatch.setattr(lp_mod, "BWD_GROUP_N", group_n)
    _check("triton", torch.float32, (18 * 64 - 5,), 16, 300, bias=True, temperature=0.7, entropy=False)


def test_triton_backward_default_group_spans_token_blocks():
    # N over one full group of BWD_GROUP_N token blocks plus a ragged one
    import grpo_fast.kernels.logprobs as lp_mod

    N = (lp_mod.BWD_GROUP_N + 2) * lp_mod.BWD_TILES[32]["BLOCK_N"] + 7
    _check("triton", torch.float32, (N,), 16, 300, bias=True, temperature=0.7, entropy=False)
