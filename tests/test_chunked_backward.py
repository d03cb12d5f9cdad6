"""The Triton path's backwards: "chunked" (GEMMs + row kernels, one writer per output, the default) and
"atomic" (tile kernels with atomics), each against fp64 math written here, through the Triton interpreter."""

import grpo_fast.kernels.logprobs as lp_mod
import grpo_fast.kernels.rows as rows_mod
import pytest
import torch
from conftest import INTERPRET
from grpo_fast.kernels import fused_linear_grpo_loss, fused_linear_logprobs
from oracle import assert_within, naive_entropy, naive_grpo_loss, naive_logprobs
from test_fused_loss import _problem

pytestmark = pytest.mark.skipif(
    not (INTERPRET or torch.cuda.is_available()), reason="impl='triton' on CPU needs TRITON_INTERPRET=1"
)


def _leaves(*ts):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in ts]


def test_row_kernels_match_fp64(monkeypatch):
    monkeypatch.setattr(rows_mod, "ROW_BLOCK_V", 512)  # several steps per row, the last one partial
    g = torch.Generator().manual_seed(3)
    C, V, inv_t = 5, 1300, 1 / 0.7
    z = torch.randn(C, V, generator=g) * 4
    tgt = torch.randint(0, V, (C,), generator=g)
    zd = z.double()
    lse_ref = torch.logsumexp(zd, 1)
    logp, lse = rows_mod.row_lse(z, tgt)
    assert (lse.double() - lse_ref).abs().max() < 1e-5
    assert (logp.double() - (zd.gather(1, tgt[:, None]).squeeze(1) - lse_ref)).abs().max() < 1e-5
    gl, ge = torch.randn(C, generator=g), torch.randn(C, generator=g)
    p = torch.softmax(zd, 1)
    ez = (p * zd).sum(1)
    onehot = torch.nn.functional.one_hot(tgt, V).double()
    want = (gl.double()[:, None] * (onehot - p) + ge.double()[:, None] * p * (ez[:, None] - zd)) * inv_t
    dz = rows_mod.row_grad(z.clone(), lse, tgt, gl, inv_t, ge, ez.float())
    assert (dz.double() - want).abs().max() < 1e-5 * want.abs().max()


@pytest.mark.parametrize("path", ["chunked", "atomic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprob_backward_paths_match_fp64(monkeypatch, path, dtype):
    monkeypatch.setattr(lp_mod, "TRITON_BACKWARD", path)
    monkeypatch.setattr(rows_mod, "CHUNK_BYTES", 4 * 1001 * 16)  # 16 tokens per chunk: d weight over 7
    hidden, weight, b, targets, mask, *_ = _problem(B=3, T=37, dtype=dtype, bias=True)
    gl = torch.randn(3, 37, generator=torch.Generator().manual_seed(1))
    ge = torch.randn(3, 37, generator=torch.Generator().manual_seed(2))

    def run(fn, ts):
        ts = _leaves(*ts)
        logp, ent = fn(*ts)
        ((logp.double() * gl).sum() + (ent.double() * ge).sum()).backward()
        return [logp.detach(), ent.detach()] + [t.grad for t in ts]

    ours = run(
        lambda h, w, bb: fused_linear_logprobs(
            h, w, targets, bias=bb, temperature=0.7, return_entropy=True, impl="triton"
        ),
        (hidden, weight, b),
    )

    def naive(dt):
        return lambda h, w, bb: (
            naive_logprobs(h, w, targets, bb, 0.7, dtype=dt),
            naive_entropy(h, w, bb, 0.7, dtype=dt),
        )

    exact = run(naive(torch.float64), (hidden.double(), weight.double(), b.double()))
    lowp = run(naive(dtype), (hidden, weight, b))
    for name, o, e, lo in zip(["logp", "entropy", "d hidden", "d weight", "d bias"], ours, exact, lowp):
        assert_within(name, o, e, lo, dtype)


@pytest.mark.parametrize("path", ["chunked", "atomic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "kw,chunk",
    [
        (dict(loss_type="dapo", beta=0.04), 16),
        (dict(loss_type="dr_grpo", max_completion_length=40, beta=0.04, use_bias_correction_kl=True), 16),
        (dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04), 40),
        (dict(loss_type="bnpo", importance_sampling_level="sequence"), 16),
    ],
    ids=["token", "token-kl", "sequence-rows", "sequence-scoring-pass"],
)
def test_loss_backward_paths_match_fp64(monkeypatch, path, dtype, kw, chunk):
    """Token-level options in flat chunks; a sequence-level ratio in chunks of whole rows (40 tokens: the
    rows of 37 and 12), or after a scoring pass where a row (37) is longer than a chunk (16); d weight
    summed over the chunks."""
    monkeypatch.setattr(lp_mod, "TRITON_BACKWARD", path)
    monkeypatch.setattr(rows_mod, "CHUNK_BYTES", 4 * 1001 * chunk)
    hidden, weight, b, targets, mask, adv, old, ref = _problem(B=3, T=37, dtype=dtype, bias=True)
    kw = dict(kw, old_logps=old, ref_logps=ref, epsilon_high=0.28)

    def grads(fn, ts):
        ts = _leaves(*ts)
        loss, _ = fn(*ts)
        (loss * 1.3).backward()
        return [loss.detach()] + [t.grad for t in ts]

    ours = grads(
        lambda h, w, bb: fused_linear_grpo_loss(
            h, w, targets, mask, adv, bias=bb, temperature=0.7, impl="triton", **kw
        ),
        (hidden, weight, b),
    )

    def naive(dt):
        return lambda h, w, bb: naive_grpo_loss(
            naive_logprobs(h, w, targets, bb, 0.7, dtype=dt), adv, mask, **kw
        )

    exact = grads(naive(torch.float64), (hidden.double(), weight.double(), b.double()))
    lowp = grads(naive(dtype), (hidden, weight, b))
    for name, o, e, lo in zip(["loss", "d hidden", "d weight", "d bias"], ours, exact, lowp):
        assert_within(name, o, e, lo, dtype)


def test_chunked_path_never_runs_the_atomic_kernel(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the atomic backward ran")

    monkeypatch.setattr(lp_mod, "_logprob_bwd", refuse)
    hidden, weight, _, targets, mask, adv, old, _ = _problem(B=3, T=37)
    h, w = _leaves(hidden, weight)
    loss, _ = fused_linear_grpo_loss(h, w, targets, mask, adv, old_logps=old, impl="triton")
    logp = fused_linear_logprobs(h, w, targets, impl="triton")
    (loss + logp.sum()).backward()
    assert torch.isfinite(h.grad).all() and w.grad.abs().sum() > 0
