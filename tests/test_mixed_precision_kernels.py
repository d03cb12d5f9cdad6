"""The fused kernels under mixed precision: 16-bit activations on an fp32 master LM head, the reverse, and any
inputs under torch.autocast (HF models hand fp32 last hidden states over under autocast).

Ground truth is fp64 (oracle.py) on the unrounded inputs; the kernel may have about twice the error of plain
PyTorch in the compute dtype: F.linear on operands cast to it (what autocast does), then log-softmax in fp32.
"""

import contextlib
import sys

import grpo_fast.kernels.logprobs as lp_mod
import pytest
import torch
import torch.nn.functional as F
from grpo_fast.kernels import fused_linear_grpo_loss, fused_linear_logprobs
from oracle import TOL, max_err, naive_entropy, naive_grpo_loss, naive_logprobs
from test_fused_loss import _problem

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# (hidden dtype, weight dtype (and bias's), autocast dtype or None, the compute dtype the rule gives)
CASES = [
    pytest.param(BF16, FP32, None, BF16, id="bf16-hidden-fp32-weight"),
    pytest.param(FP32, BF16, None, BF16, id="fp32-hidden-bf16-weight"),
    pytest.param(FP16, FP32, None, FP16, id="fp16-hidden-fp32-weight"),
    pytest.param(FP32, FP32, BF16, BF16, id="fp32-under-autocast-bf16"),
]
TEMPERATURE = 0.7


def _autocast(dtype, device="cpu"):
    return torch.autocast(device, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _within(name, out, ref, lowp, cdtype):
    """flash-attention's rule: err(kernel) <= 2 err(plain torch in cdtype) + tol, both against fp64."""
    err, err_lp = max_err(out, ref), max_err(lowp, ref)
    scale = max(1.0, ref.double().abs().max().item()) if ref.numel() else 1.0
    mean = (out.double() - ref.double()).abs().mean().item() if out.numel() else 0.0
    mean_lp = (lowp.double() - ref.double()).abs().mean().item() if lowp.numel() else 0.0
    report = f"{name}: max err {err:.3g} (mean {mean:.3g}) vs plain {cdtype} {err_lp:.3g} ({mean_lp:.3g})"
    print(report)  # shown with -rP: the errors per case
    assert err <= 2 * err_lp + TOL[cdtype] * scale, report


def _lowp_logits(h, w, b, cdtype):
    """Plain PyTorch in the compute dtype: the operands cast to it, F.linear, fp32 logits."""
    z = F.linear(h.to(cdtype), w.to(cdtype), None if b is None else b.to(cdtype))
    return z.float() / TEMPERATURE


def _lowp_logprobs(h, w, b, targets, cdtype):
    return torch.log_softmax(_lowp_logits(h, w, b, cdtype), -1).gather(-1, targets[..., None]).squeeze(-1)


def _leaves(tensors):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]


def _grads(leaves):
    return [None if x is None else x.grad for x in leaves]


def _logprob_inputs(hdtype, wdtype, bias, lead=(3, 37), H=32, V=1001):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(*lead, H, generator=g).to(hdtype)
    weight = (torch.randn(V, H, generator=g) / H**0.5 * 3).to(wdtype)  # logits of O(3)
    b = torch.randn(V, generator=g).to(wdtype) if bias else None
    targets = torch.randint(0, V, lead, generator=g)
    return hidden, weight, b, targets


# --------------------------------------------------------------------------------------------------------
# fused_linear_logprobs
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("hdtype,wdtype,autocast,cdtype", CASES)
@pytest.mark.parametrize("bias,entropy", [(False, False), (True, True)])
def test_logprobs_mixed_precision(impl, hdtype, wdtype, autocast, cdtype, bias, entropy):
    hidden, weight, b, targets = _logprob_inputs(hdtype, wdtype, bias)
    lead = targets.shape
    n_out = 2 if entropy else 1
    up = [torch.randn(lead, dtype=torch.float64) for _ in range(n_out)]

    # ours: forward under the case's autocast, backward outside it (as a trainer does)
    leaves = _leaves((hidden, weight, b))
    with _autocast(autocast):
        out = fused_linear_logprobs(
            leaves[0], leaves[1], targets, bias=leaves[2], temperature=TEMPERATURE, return_entropy=entropy,
            impl=impl,
        )  # fmt: skip
    out = out if entropy else (out,)
    torch.autograd.backward(out, [u.float() for u in up])
    grads = _grads(leaves)

    # fp64 truth
    ref_leaves = _leaves((hidden.double(), weight.double(), None if b is None else b.double()))
    ref = [naive_logprobs(ref_leaves[0], ref_leaves[1], targets, ref_leaves[2], TEMPERATURE)]
    if entropy:
        ref.append(naive_entropy(ref_leaves[0], ref_leaves[1], ref_leaves[2], TEMPERATURE))
    torch.autograd.backward(ref, up)
    ref_grads = _grads(ref_leaves)

    # plain PyTorch in the compute dtype
    low_leaves = _leaves((hidden, weight, b))
    logp_all = torch.log_softmax(_lowp_logits(*low_leaves, cdtype), dim=-1)
    low = [logp_all.gather(-1, targets[..., None]).squeeze(-1)]
    if entropy:
        low.append(-(logp_all.exp() * logp_all).sum(-1))
    torch.autograd.backward(low, [u.float() for u in up])
    low_grads = _grads(low_leaves)

    for name, o, r, lo in zip(["logp", "entropy"], out, ref, low):
        assert o.dtype == FP32 and o.shape == lead
        _within(name, o, r, lo, cdtype)
    names = ["d hidden", "d weight", "d bias"]
    for name, x, g, r, lg in zip(names, (hidden, weight, b), grads, ref_grads, low_grads):
        if x is None:
            continue
        assert g.dtype == x.dtype, f"{name}: {g.dtype}, the input is {x.dtype}"
        _within(name, g, r, lg, cdtype)
    if wdtype == FP32:  # an fp32 master weight's gradient is accumulated in fp32, never rounded to cdtype
        rounded = grads[1] == grads[1].to(cdtype).float()
        assert rounded.float().mean() < 0.5, f"{rounded.float().mean():.2f} of d weight is {cdtype}-valued"


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_backward_keeps_the_forward_compute_dtype(impl):
    """Forward under bf16 autocast: the backward gives the same gradients outside autocast, inside it, and
    inside an fp16 autocast (ambient autocast re-casts nothing inside the kernels)."""
    hidden, weight, b, targets = _logprob_inputs(FP32, FP32, True, lead=(2, 9), V=300)
    up = torch.randn(2, 9)
    seen = []
    for during_backward in (None, BF16, FP16):
        leaves = _leaves((hidden, weight, b))
        with _autocast(BF16):
            out = fused_linear_logprobs(leaves[0], leaves[1], targets, bias=leaves[2], impl=impl)
        with _autocast(during_backward):
            out.backward(up)
        seen.append(_grads(leaves))
    for grads in seen[1:]:
        for g, want in zip(grads, seen[0]):
            assert g.dtype == FP32 and torch.equal(g, want)
    # and the forward did run in bf16: plain fp32 differs by bf16 rounding
    fp32 = fused_linear_logprobs(hidden, weight, targets, bias=b, impl=impl)
    with _autocast(BF16):
        bf = fused_linear_logprobs(hidden, weight, targets, bias=b, impl=impl)
    assert 1e-3 < (bf - fp32).abs().max().item() < 0.2


# --------------------------------------------------------------------------------------------------------
# fused_linear_grpo_loss
# --------------------------------------------------------------------------------------------------------
LOSSES = [
    pytest.param(dict(loss_type="dapo", beta=0.04), True, id="dapo-token-kl-bias"),
    pytest.param(dict(loss_type="grpo", importance_sampling_level="sequence"), False, id="grpo-sequence"),
]


def _loss_problem(hdtype, wdtype, bias):
    hidden, weight, b, targets, mask, adv, old, ref = _problem(bias=bias)  # fp32, ragged mask, an empty row
    b = None if b is None else b.to(wdtype)
    return hidden.to(hdtype), weight.to(wdtype), b, targets, mask, adv, old, ref


def _check_loss(impl, hdtype, wdtype, autocast, cdtype, kw, bias):
    hidden, weight, b, targets, mask, adv, old, ref = _loss_problem(hdtype, wdtype, bias)
    kw = dict(kw, old_logps=old, ref_logps=ref)

    leaves = _leaves((hidden, weight, b))
    with _autocast(autocast):
        loss, metrics = fused_linear_grpo_loss(
            leaves[0], leaves[1], targets, mask, adv, bias=leaves[2], temperature=TEMPERATURE, impl=impl, **kw
        )
    (loss * 1.3).backward()
    grads = _grads(leaves)

    def naive(h, w, bb, dtype):
        if dtype == torch.float64:
            lp = naive_logprobs(h, w, targets, bb, TEMPERATURE)
        else:
            lp = _lowp_logprobs(h, w, bb, targets, dtype)
        return naive_grpo_loss(lp, adv, mask, **kw)

    ref_leaves = _leaves((hidden.double(), weight.double(), None if b is None else b.double()))
    exact, exact_metrics = naive(*ref_leaves, torch.float64)
    (exact * 1.3).backward()
    low_leaves = _leaves((hidden, weight, b))
    lowp, _ = naive(*low_leaves, cdtype)
    (lowp * 1.3).backward()

    assert loss.dtype == FP32
    _within("loss", loss.detach(), exact.detach(), lowp.detach(), cdtype)
    for k, v in exact_metrics.items():
        assert metrics[k].dtype == FP32 and abs(metrics[k].item() - v.item()) < 0.05, k
    for name, x, g, r, lg in zip(
        ["d hidden", "d weight", "d bias"], (hidden, weight, b), grads, _grads(ref_leaves), _grads(low_leaves)
    ):
        if x is None:
            continue
        assert g.dtype == x.dtype, f"{name}: {g.dtype}, the input is {x.dtype}"
        _within(name, g, r, lg, cdtype)
    if wdtype == FP32:
        rounded = grads[1] == grads[1].to(cdtype).float()
        assert rounded.float().mean() < 0.5, f"{rounded.float().mean():.2f} of d weight is {cdtype}-valued"


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("hdtype,wdtype,autocast,cdtype", CASES)
@pytest.mark.parametrize("kw,bias", LOSSES)
def test_fused_loss_mixed_precision(impl, hdtype, wdtype, autocast, cdtype, kw, bias):
    _check_loss(impl, hdtype, wdtype, autocast, cdtype, kw, bias)


@pytest.mark.parametrize("hdtype,wdtype,autocast,cdtype", CASES)
def test_fused_loss_mixed_precision_scoring_pass(monkeypatch, hdtype, wdtype, autocast, cdtype):
    """The twin's other path: rows longer than a chunk (8 tokens here) are scored first, then differentiated
    (the path of the entropy options too)."""
    fused_mod = sys.modules[fused_linear_grpo_loss.__module__]
    scoring_passes = []
    two_pass = fused_mod._two_pass
    monkeypatch.setattr(lp_mod, "twin_chunk_rows", lambda V: 8)
    monkeypatch.setattr(fused_mod, "_two_pass", lambda *a: scoring_passes.append(1) or two_pass(*a))
    kw = dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04)
    _check_loss("torch", hdtype, wdtype, autocast, cdtype, kw, True)
    assert scoring_passes == [1]


def test_triton_tiles_for_wider_operands_keep_the_shared_memory_of_the_measured_ones():
    """Operands wider than the compute dtype (an fp32 master head on bf16 GEMMs) sit in shared memory at their
    own width: the 16-bit tiles keep their shape and launch options with a shorter K step, so that a K step's
    tiles take no more bytes than the measured configuration's; same-dtype calls keep the table's tiles."""
    lp = sys.modules[fused_linear_logprobs.__module__]

    def step_bytes(t, h_size, w_size):
        return (t["BLOCK_N"] * h_size + t["BLOCK_V"] * w_size) * t["BLOCK_H"]

    for table in (lp.FWD_TILES, lp.BWD_TILES):
        for c in (BF16, FP16, FP32):
            assert lp._tiles(table, c, c, c) == table[c.itemsize * 8]
        for c, h, w in ((BF16, BF16, FP32), (BF16, FP32, BF16), (BF16, FP32, FP32), (FP16, FP16, FP32)):
            t, measured = lp._tiles(table, c, h, w), table[16]
            assert {k: v for k, v in t.items() if k != "BLOCK_H"} == {
                k: v for k, v in measured.items() if k != "BLOCK_H"
            }
            assert 16 <= t["BLOCK_H"] < measured["BLOCK_H"]
            assert step_bytes(t, h.itemsize, w.itemsize) <= step_bytes(measured, 2, 2)


# --------------------------------------------------------------------------------------------------------
# the dtype rule's errors
# --------------------------------------------------------------------------------------------------------
def test_bf16_with_fp16_is_a_type_error():
    hidden, weight, b, targets = _logprob_inputs(BF16, FP16, False, lead=(2, 3), V=50)
    mask, adv = torch.ones(2, 3, dtype=torch.long), torch.randn(2)
    calls = [
        lambda h, w: fused_linear_logprobs(h, w, targets, impl="torch"),
        lambda h, w: fused_linear_grpo_loss(h, w, targets, mask, adv, impl="torch"),
    ]
    for call in calls:
        for h, w in ((hidden, weight), (hidden.half(), weight.bfloat16())):
            with pytest.raises(TypeError) as e:
                call(h, w)
            msg = str(e.value)
            assert all(s in msg for s in ("hidden", "weight", str(h.dtype), str(w.dtype))), msg
        with _autocast(BF16):  # autocast decides the compute dtype: any pair of float dtypes is fine
            call(hidden, weight)
    with pytest.raises(TypeError, match="hidden and weight must share a dtype"):  # two wide dtypes
        fused_linear_logprobs(hidden.float(), weight.double(), targets)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("hdtype,wdtype,autocast,cdtype", CASES)
def test_triton_on_cuda_mixed_precision(hdtype, wdtype, autocast, cdtype):
    """The compiled kernels cast tiles to the compute dtype as they load (the interpreter run above casts on
    the host): log-probs and the gradients of a (4 x 129) x 5003 problem."""
    hidden, weight, b, targets = (
        None if x is None else x.cuda() for x in _logprob_inputs(hdtype, wdtype, True, (4, 129), 256, 5003)
    )
    up = torch.randn(targets.shape, device="cuda", dtype=torch.float64)
    leaves = _leaves((hidden, weight, b))
    with _autocast(autocast, "cuda"):
        out = fused_linear_logprobs(
            leaves[0], leaves[1], targets, bias=leaves[2], temperature=TEMPERATURE, impl="triton"
        )
    out.backward(up.float())
    ref_leaves = _leaves((hidden.double(), weight.double(), b.double()))
    ref = naive_logprobs(ref_leaves[0], ref_leaves[1], targets, ref_leaves[2], TEMPERATURE)
    ref.backward(up)
    low_leaves = _leaves((hidden, weight, b))
    low = _lowp_logprobs(*low_leaves, targets, cdtype)
    low.backward(up.float())
    _within("logp (cuda)", out.detach(), ref.detach(), low.detach(), cdtype)
    for name, x, g, r, lg in zip(
        ["d hidden", "d weight", "d bias"], (hidden, weight, b), _grads(leaves), _grads(ref_leaves),
        _grads(low_leaves),
    ):  # fmt: skip
        assert g.dtype == x.dtype
        _within(f"{name} (cuda)", g, r, lg, cdtype)
