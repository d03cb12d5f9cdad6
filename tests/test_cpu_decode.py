"""The native engine's CPU decode kernels (grpo_fast.rollout.cpu_decode) against fp64 math written here: the
residual add and RMSNorm, SiLU(gate) * up, RoPE + the KV write + one softmax over a row's group's real
prompt keys and its own keys up to its position (GQA, left padding, unwritten slots holding garbage), and the
decode's linear layers (every row-tile and column-block tail, bias, fp32 accumulation of bf16)."""

import pytest
import torch
from oracle import assert_draws_follow

from grpo_fast.rollout import cpu_decode

kern = cpu_decode.kernels()
pytestmark = pytest.mark.skipif(
    kern is None, reason=f"no CPU decode kernels: {cpu_decode.unavailable_reason()}"
)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _rotate(x, cos, sin):  # HF's rotate-half RoPE, in fp64
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(x_dtype, out_dtype, with_delta):
    torch.manual_seed(0)
    x, delta, w = torch.randn(5, 96).to(x_dtype), torch.randn(5, 96).to(torch.bfloat16), torch.randn(96)
    summed = (x.double() + delta.double()).to(x_dtype) if with_delta else x.clone()
    x_in = x.clone()
    out = kern.add_rms_norm(x_in, delta if with_delta else None, w, 1e-5, out_dtype)
    assert out.dtype == out_dtype
    torch.testing.assert_close(x_in, summed, atol=0, rtol=0)  # the residual stream, updated in place
    s = summed.double()
    want = (s / (s.square().mean(-1, keepdim=True) + 1e-5).sqrt()).to(x_dtype).double() * w.double()
    tol = TOL[torch.bfloat16 if torch.bfloat16 in (x_dtype, out_dtype) else torch.float32]
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype):
    torch.manual_seed(0)
    gu = (torch.randn(4, 2 * 40) * 3).to(dtype)
    g, u = gu.double().chunk(2, -1)
    want = g / (1 + torch.exp(-g)) * u
    torch.testing.assert_close(kern.silu_mul(gu).double(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("io_dtype", [torch.float32, torch.bfloat16])
# d: vector tails only, blocks of 32 (AVX2) and a tail, whole blocks; rep: the heads sharing a KV head, run
# three at a time (one group short, one exact, one and a remainder)
@pytest.mark.parametrize("d,rep", [(24, 3), (40, 2), (64, 3), (64, 4)])
def test_rope_attend(kv_dtype, io_dtype, d, rep):
    torch.manual_seed(0)
    n, G, kvh, P, cap = 3, 4, 2, 70, 128  # P, t past one 64-key block
    R, h = n * G, kvh * rep
    qkv = torch.randn(R, (h + 2 * kvh) * d).to(io_dtype)
    pos = torch.randint(0, 200, (R,)).double()
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).double() / d)
    ang = torch.cat([pos[:, None] * inv, pos[:, None] * inv], -1)
    cos, sin = ang.cos(), ang.sin()
    pk, pv = torch.randn(n, kvh, P, d).to(kv_dtype), torch.randn(n, kvh, P, d).to(kv_dtype)
    ck, cv = (torch.randn(R, kvh, cap, d) * 3).to(kv_dtype), torch.randn(R, kvh, cap, d).to(kv_dtype)
    pad = torch.tensor([0, 4, 69])  # left padding per prompt (the last has one real token)
    valid = (torch.arange(P)[None, :] >= pad[:, None]).to(torch.uint8)
    t = torch.randint(0, cap, (R,))
    t[0], t[1] = 0, cap - 1
    t[2:7] = torch.tensor([15, 16, 40, 63, 64])  # a last key block's 1, 2, 3, 4 registers, then a new block
    ck0, cv0 = ck.clone(), cv.clone()
    ckt, pkt = _blocked(ck), _blocked(pk)
    out = kern.rope_attend(qkv, cos.float(), sin.float(), ck, ckt, cv, pkt, pv, valid, t, h, 0.25, io_dtype)
    assert out.dtype == io_dtype and out.shape == (R, h * d)
    x = qkv.double()
    q = _rotate(x[:, : h * d].view(R, h, d), cos[:, None], sin[:, None])
    k_new = _rotate(x[:, h * d : (h + kvh) * d].view(R, kvh, d), cos[:, None], sin[:, None])
    v_new = x[:, (h + kvh) * d :].view(R, kvh, d)
    tol = TOL[torch.bfloat16 if torch.bfloat16 in (kv_dtype, io_dtype) else torch.float32]
    for r in range(R):
        g, s = r // G, int(t[r])
        torch.testing.assert_close(ck[r, :, s].double(), k_new[r].to(kv_dtype).double(), atol=tol, rtol=tol)
        torch.testing.assert_close(cv[r, :, s].double(), v_new[r].to(kv_dtype).double(), atol=0, rtol=0)
        others = torch.arange(cap) != s  # every other slot untouched
        assert torch.equal(ck[r, :, others], ck0[r, :, others]) and torch.equal(
            cv[r, :, others], cv0[r, :, others]
        )
        for j in range(h):
            keys = torch.cat([pk[g, j // rep][valid[g].bool()], ck[r, j // rep, : s + 1]]).double()
            vals = torch.cat([pv[g, j // rep][valid[g].bool()], cv[r, j // rep, : s + 1]]).double()
            want = torch.softmax(keys @ q[r, j] * 0.25, 0) @ vals
            torch.testing.assert_close(out[r, j * d : (j + 1) * d].double(), want, atol=tol, rtol=tol)
    assert torch.equal(ckt, _blocked(ck))  # the blocked copy written at each row's slot t, nothing else


def _blocked(k):
    """Keys (.., slots, d) as rope_attend reads them, written out key by key: key p's element j at [..,
    p // 64, j, p % 64], zeros past the last key."""
    *lead, slots, d = k.shape
    out = torch.zeros(*lead, -(-slots // 64), d, 64, dtype=k.dtype)
    for p in range(slots):
        out[..., p // 64, :, p % 64] = k[..., p, :]
    return out


def test_blocked_keys_lay_keys_out_as_rope_attend_reads_them():
    k = torch.randn(2, 3, 70, 5)
    assert torch.equal(cpu_decode.blocked_keys(k), _blocked(k))
    assert torch.equal(cpu_decode.blocked_zeros(k), _blocked(torch.zeros_like(k)))
    kt, new = _blocked(k[0]), torch.randn(4, 3, 5)  # one row: 4 keys written at slots 62..65, two blocks
    cpu_decode.write_blocked_keys(kt, torch.arange(62, 66), new)
    want = k[0].clone()
    want[:, 62:66] = new.transpose(0, 1)
    assert torch.equal(kt, _blocked(want))


LINEAR = [d for d in (torch.float32, torch.bfloat16) if cpu_decode.linear_for(d) is not None]


@pytest.mark.parametrize("dtype", LINEAR)
@pytest.mark.parametrize("M", [1, 5, 8, 9, 16, 19])
@pytest.mark.parametrize("N,K", [(960, 576), (50, 64), (17, 6), (3 * 16 + 1, 130)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear(dtype, M, N, K, with_bias):
    torch.manual_seed(M * 1000 + N + K)
    w, x = torch.randn(N, K).to(dtype), torch.randn(M, K).to(dtype)
    bias = torch.randn(N) if with_bias else None
    pack, linear = cpu_decode.linear_for(dtype)
    y = linear(x, pack([w], dtype), bias, N)
    assert y.dtype == dtype and y.shape == (M, N)
    want = x.double() @ w.double().t() + (bias.double() if with_bias else 0)
    # fp32: accumulation order; bf16: the output's rounding (8 bits) on top of fp32 accumulation
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(y.double(), want, atol=tol * (K**0.5), rtol=tol)


@pytest.mark.parametrize("dtype", LINEAR)
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_pack_linear_lays_out_and_rounds_as_torch(dtype, src):
    torch.manual_seed(1)
    N, K = 37, 10
    w = torch.randn(N, K).to(src)
    pack, _ = cpu_decode.linear_for(dtype)
    p = pack(
        [w], dtype
    )  # (N/16, K/per, 16, per): bf16 in pairs where the build multiplies pairs (AVX512-BF16)
    per = p.shape[-1]
    unpack = lambda p: p.permute(0, 2, 1, 3).reshape(-1, K)  # noqa: E731
    assert torch.equal(unpack(p)[:N], w.to(dtype))  # torch's cast: round to nearest even
    assert not unpack(p)[N:].any() and unpack(p).shape[0] == 48
    assert per in ((1, 2) if dtype == torch.bfloat16 else (1,))
    # several matrices stacked by rows (a fused q / k / v), repacked in place into the same storage
    parts = [torch.randn(n, K).to(src) for n in (20, 3, 14)]
    address = p.data_ptr()
    assert pack(parts, dtype, out=p) is p and p.data_ptr() == address
    assert torch.equal(unpack(p)[:N], torch.cat(parts).to(dtype)) and not unpack(p)[N:].any()
    with pytest.raises(RuntimeError, match="out packed for 49 outputs and 10 inputs"):
        pack([*parts, w[:12]], dtype, out=p)  # 4 blocks of 16 outputs, not 3


@pytest.mark.skipif(torch.bfloat16 not in LINEAR, reason="no bf16 linear kernel on this CPU")
def test_linear_accumulates_bf16_in_fp32():
    # 4096 products of 1 + 2^-7 summed: a bf16 accumulator stops growing at 256 (its spacing passes the
    # term); fp32 holds 4128 exactly, which bf16 rounds to 4128
    x = torch.ones(3, 4096, dtype=torch.bfloat16)
    w = torch.full((20, 4096), 1 + 2**-7, dtype=torch.bfloat16)
    pack, linear = cpu_decode.linear_for(torch.bfloat16)
    assert torch.equal(linear(x, pack([w], torch.bfloat16), None, 20).float(), torch.full((3, 20), 4128.0))


def test_loading_the_kernels_leaves_denormals_alone():
    """Built with -ffast-math, but not linked with it: no flush-to-zero for the rest of the process."""
    tiny = torch.tensor([1e-39])
    assert kern is not None and float(tiny * 0.5) > 0


def test_draw_samples_each_token_at_its_softmax_probability():
    """The one-pass draw (no top-k / top-p) over several blocks of 256 tokens and a partial last one, tokens
    of mass 0 among them (exp underflows) and a whole block without mass: token frequencies against fp64
    softmax(logits / T), never a token of mass 0 (also at u = 0 and u just below 1), log-probs against fp64
    log_softmax."""
    torch.manual_seed(0)
    V, N, T = 2 * 256 + 88, 100_000, 0.7
    logits = torch.randn(V, dtype=torch.float64) * 1.5
    logits[::7] = -1e4
    logits[256:512] = -1e4
    probs = torch.softmax(logits / T, 0)
    keep = probs > 0
    tok, logp = kern.draw(logits.float().expand(N, -1).contiguous(), torch.rand(N), T)
    assert tok.dtype == torch.int64 and logp.dtype == torch.float32
    assert_draws_follow(tok, probs)
    torch.testing.assert_close(logp.double(), torch.log_softmax(logits / T, 0)[tok], atol=2e-5, rtol=0)
    edges, _ = kern.draw(logits.float().expand(2, -1).contiguous(), torch.tensor([0.0, 1 - 2**-24]), T)
    assert keep[edges].all()
    assert edges[0] == keep.nonzero()[0, 0] and edges[1] == keep.nonzero()[-1, 0]  # the first, the last


def test_draw_reports_the_log_softmax_over_a_real_vocabulary():
    """At SmolLM2's vocabulary, rows of different scales: log-probs equal fp64 log_softmax for likely and
    for rare tokens (u at the edges picks the first tokens with mass)."""
    torch.manual_seed(0)
    logits = torch.randn(64, 49152) * torch.linspace(0.5, 8, 64)[:, None]
    u = torch.rand(64)
    u[-4:] = torch.tensor([0.0, 1e-7, 1 - 2**-24, 0.5])  # on the widest rows: the rarest tokens
    tok, logp = kern.draw(logits, u, 1.0)
    want = torch.log_softmax(logits.double(), -1).gather(-1, tok[:, None]).squeeze(-1)
    assert torch.isfinite(logp).all() and want.min() < -15
    torch.testing.assert_close(logp.double(), want, atol=2e-5, rtol=0)
    with pytest.raises(RuntimeError, match="temperature"):
        kern.draw(logits, u, 0.0)


def test_draw_under_a_repetition_penalty_samples_the_penalized_softmax_and_reports_the_model_log_prob():
    """With `seen` and a penalty, the one-pass draw samples softmax(penalized logits / T) (the penalty
    written out here in fp64: a seen token's positive logit divided, its negative one multiplied) and reports
    the unpenalized log_softmax(logits / T); seen tokens among the likeliest and the unlikeliest, a penalty
    above 1 and one below."""
    torch.manual_seed(0)
    V, N, T = 2 * 256 + 88, 100_000, 0.8
    logits = torch.randn(V, dtype=torch.float64) * 1.5
    seen = torch.zeros(V, dtype=torch.bool)
    seen[logits.argsort(descending=True)[:5]] = True
    seen[logits.argsort()[:5]] = True
    seen[::37] = True
    for penalty in (1.8, 0.7):
        z = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
        rows = logits.float().expand(N, -1).contiguous()
        tok, logp = kern.draw(rows, torch.rand(N), T, seen.expand(N, -1).contiguous(), penalty)
        assert_draws_follow(tok, torch.softmax(z / T, 0))
        want = torch.log_softmax(logits / T, 0)[tok]
        torch.testing.assert_close(logp.double(), want, atol=2e-5, rtol=0)
    # a real vocabulary, rows of different scales and a strong penalty: finite, the model's log-probs
    logits = torch.randn(16, 49152) * torch.linspace(0.5, 8, 16)[:, None]
    seen = torch.rand(16, 49152) < 0.01
    tok, logp = kern.draw(logits, torch.rand(16), 1.0, seen, 20.0)
    want = torch.log_softmax(logits.double(), -1).gather(-1, tok[:, None]).squeeze(-1)
    torch.testing.assert_close(logp.double(), want, atol=2e-5, rtol=0)
    with pytest.raises(RuntimeError, match="seen"):
        kern.draw(logits, torch.rand(16), 1.0, seen[:, :10], 2.0)


def test_kernels_release_the_gil():
    """A kernel call lets other Python threads run (colocated asynchronous GRPO trains on one while another
    decodes): with the interpreter's switch interval made huge, a thread that held the GIL through its call
    would let the main thread run only after the call had returned. `linear` of a 1024 x 2048 input through a
    2048 x 2048 packed weight (~9 GFLOP, tenths of a second) is still running when the main thread wakes."""
    import sys
    import threading

    if cpu_decode.linear_for(torch.float32) is None:
        pytest.skip("no linear kernel in this CPU's build (neither AVX-512 nor AVX2 + FMA)")
    pack, linear = cpu_decode.linear_for(torch.float32)
    w = pack([torch.randn(2048, 2048)], torch.float32)
    x = torch.randn(1024, 2048)
    calling, returned = threading.Event(), threading.Event()

    def call():
        calling.set()  # the main thread may run from here on only where this thread lets go of the GIL
        linear(x, w, None, 2048)
        returned.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        thread = threading.Thread(target=call)
        thread.start()
        calling.wait()
        during = not returned.is_set()
        thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert returned.is_set(), "the kernel call raised: nothing was measured"
    assert during, "the main thread ran only after the kernel call had returned: the kernel held the GIL"
