"""The native rollout engine against independent references: HF `generate` and the reference engine (greedy,
token for token), the softmax (sampling, statistically), the training forward (log-probs of its samples)."""

import copy
import math

import pytest
import torch
from grpo_fast.kernels import fused_linear_logprobs
from oracle import assert_draws_follow, assert_greedy_equal, assert_greedy_row_equal, hf_greedy
from tiny_models import eos_likely_lm, ragged_prompts
from transformers import GPT2Config, GPT2LMHeadModel

import grpo_fast.rollout.native as native
from grpo_fast.models.model_parts import lm_head_of
from grpo_fast.models.shared_prefix import shared_prefix_forward
from grpo_fast.rollout import cpu_decode, generate_groups
from grpo_fast.rollout.reference import generate_plain
from grpo_fast.rollout.sampling import BLOCK, draw, filtered, inverse_cdf

pytestmark = pytest.mark.transformers_range
V, EOS = 97, 1


def _model(kind, seed=0):
    return eos_likely_lm(kind, V, EOS, seed)


def _prompts(n=3, P=7):
    return ragged_prompts(V, n, P)


@pytest.fixture(params=[True, False], ids=["cpu-kernels", "torch-ops"])
def cpu_kernels(request, monkeypatch):
    """The eager CPU step through cpu_decode's C++ kernels (where they build), or through PyTorch ops."""
    if request.param and cpu_decode.kernels() is None:
        pytest.skip(f"no CPU decode kernels: {cpu_decode.unavailable_reason()}")
    monkeypatch.setattr(cpu_decode, "ENABLED", request.param)
    return request.param


def _kernel_steps_as_asked(model, cpu_kernels, kind):
    """The last call ran its decode steps through the kernels exactly when asked (never for qwen3: its q / k
    norms)."""
    last = native.engine_for(model).last_call
    if cpu_kernels and kind != "qwen3":
        assert last["kernel_steps"] == last["decode_steps"] > 0, last
    else:
        assert last["kernel_steps"] == 0, last


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("share_prefix", [True, False])
def test_greedy_equals_hf_generate_and_the_reference_engine(kind, share_prefix, monkeypatch, cpu_kernels):
    for name in ("SYNC_EVERY", "SYNC_EVERY_CPU"):  # windows of several tokens, compaction within 30 tokens
        monkeypatch.setattr(native, name, 3)
    model = _model(kind)
    ids, mask = _prompts()
    G, C = 4, 30
    got = generate_groups(
        model, ids, mask, G, C, temperature=0.0, eos_token_id=EOS, share_prefix=share_prefix, engine="native"
    )
    _kernel_steps_as_asked(model, cpu_kernels, kind)
    ref = generate_plain(model, ids, mask, G, C, temperature=0.0, eos_token_id=EOS)
    assert_greedy_equal(model, ids, mask, G, got, ref)
    lengths = got[1].sum(1)
    assert len(set(lengths.tolist())) > 1 and int(lengths.min()) < C  # EOS at different points
    for i in range(ids.shape[0]):
        p = ids[i][mask[i].bool()]
        assert_greedy_row_equal(model, p, got[0][i * G][got[1][i * G].bool()], hf_greedy(model, p, C, EOS))


def test_the_near_tie_comparison_fails_on_a_real_difference():
    """The greedy comparison forgives only a near-tie: a token changed where the margin is clear fails."""
    model = _model("llama")
    ids, mask = _prompts(1)
    prompt = ids[0][mask[0].bool()]
    got = generate_plain(model, ids, mask, 1, 8, temperature=0.0)[0][0]
    assert_greedy_row_equal(model, prompt, got, got.clone())
    wrong = got.clone()
    wrong[3] = (wrong[3] + 1) % V
    with pytest.raises(AssertionError, match="greedy tokens differ at position 3"):
        assert_greedy_row_equal(model, prompt, got, wrong)


def test_sampled_tokens_follow_the_softmax():
    # one draw per row from known logits: frequencies against softmax(logits / T) restricted to top-k / top-p
    torch.manual_seed(0)
    logits = torch.randn(1, 40) * 2
    N = 100_000
    for T, k, p, m in ((1.0, 0, 1.0, 0.0), (0.7, 10, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.05)):
        tok, logp = draw(logits.expand(N, -1), torch.rand(N), T, k, p, m)
        z = logits[0].double() / T
        keep = torch.ones_like(z, dtype=torch.bool)
        if k:
            keep &= z >= torch.topk(z, k).values[-1]
        if m:  # min-p: at least m x the likeliest token's probability
            keep &= torch.softmax(z, 0) >= m * torch.softmax(z, 0).max()
        if p < 1.0:
            order = torch.argsort(z, descending=True)
            probs = torch.softmax(z[order], 0)
            drop = probs.cumsum(0) - probs > p
            keep[order[drop]] = False
        expected = torch.softmax(z.masked_fill(~keep, -math.inf), 0)
        freq = torch.bincount(tok, minlength=40).double() / N
        assert freq[~keep].sum() == 0
        # 5 standard errors per token, plus a chi-square over the kept tokens (40 dof: p ~ 1e-4 at 80)
        se = (expected * (1 - expected) / N).sqrt()
        assert ((freq - expected).abs() <= 5 * se + 1e-9).all()
        chi2 = (N * (freq - expected)[keep] ** 2 / expected[keep]).sum()
        assert chi2 < 80, chi2
        # the reported log-prob is the unfiltered softmax(logits / T)
        assert torch.allclose(logp, torch.log_softmax(logits[0] / T, 0)[tok], atol=1e-6)


@pytest.mark.parametrize(
    "top_k,top_p,min_p", [(0, 1.0, 0.1), (20, 1.0, 0.05), (0, 0.9, 0.2), (30, 0.95, 0.02)]
)
def test_filters_keep_what_transformers_warpers_keep(top_k, top_p, min_p):
    """top-k, top-p and min-p together keep the tokens transformers' own warpers keep, applied in its order
    (TopK, TopP, MinP: what TRL's generation and HF `generate` run)."""
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    scaled = torch.randn(64, 500) * 3
    hf = scaled.clone()
    for warper in (TopKLogitsWarper(top_k) if top_k else None, TopPLogitsWarper(top_p) if top_p < 1 else None,
                   MinPLogitsWarper(min_p)):  # fmt: skip
        hf = warper(None, hf) if warper is not None else hf
    ours = filtered(scaled, top_k, top_p, min_p)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(hf))
    assert (
        torch.isfinite(ours).sum(1).min() >= 1 and (~torch.isfinite(ours)).any(1).all()
    )  # each row filtered
    torch.testing.assert_close(ours[torch.isfinite(ours)], scaled[torch.isfinite(ours)])


def test_the_two_level_inverse_cdf_draws_each_token_with_its_probability():
    """Over a vocabulary of several blocks and a partial last one, tokens of mass 0 among them (what top-k /
    top-p leave), `inverse_cdf` draws each token at its probability and never one of mass 0, also at u = 0
    and u just below 1."""
    torch.manual_seed(0)
    V, N = 2 * BLOCK + 88, 200_000
    probs = torch.softmax(torch.randn(V, dtype=torch.float64) * 2, 0)
    probs[::7] = 0
    probs[BLOCK : 2 * BLOCK] = 0  # a whole block without mass
    probs /= probs.sum()
    tok = inverse_cdf(probs.float().expand(N, -1).contiguous(), torch.rand(N))
    assert_draws_follow(tok, probs)
    edges = inverse_cdf(probs.float().expand(2, -1).contiguous(), torch.tensor([0.0, 1 - 2**-24]))
    assert (probs[edges] > 0).all()


def test_the_one_pass_draw_reports_the_log_softmax_over_a_real_vocabulary():
    """At T=1 with nothing filtered, the draw takes its log-probs from the softmax it samples from (one pass
    over the vocabulary's exponentials): they equal fp64 log_softmax for likely and for rare tokens."""
    torch.manual_seed(0)
    logits = torch.randn(64, 49152) * 6
    u = torch.rand(64)
    u[:4] = torch.tensor([0.0, 1e-7, 1 - 2**-24, 0.5])  # the first tokens with mass: rare ones
    tok, logp = draw(logits, u, 1.0, 0, 1.0)
    want = torch.log_softmax(logits.double(), -1).gather(-1, tok[:, None]).squeeze(-1)
    assert torch.isfinite(logp).all() and want.min() < -15
    torch.testing.assert_close(logp.double(), want, atol=2e-5, rtol=0)


def test_the_engine_times_its_phases_and_decodes_every_step_without_eos():
    """`last_call`: prefill, weight packing and decode seconds, and C - 1 decode steps when no row ends (the
    first token comes from the prefill's logits): what profile_decode holds against the floor."""
    model = _model("llama")
    ids, mask = _prompts()
    G, C = 3, 17
    out = generate_groups(
        model, ids, mask, G, C, temperature=1.0, eos_token_id=None, engine="native",
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert out[1].sum() == ids.shape[0] * G * C
    last = native.engine_for(model).last_call
    assert last["decode_steps"] == C - 1 and last["rows"] == ids.shape[0] * G
    assert last["prompt_tokens"] == int(mask.sum())
    assert min(last["prefill_s"], last["pack_s"]) >= 0 and last["decode_s"] > 0


F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("q_dtype,dtype,tol", [(F32, F32, 1e-5), (BF16, BF16, 2e-2), (F32, BF16, 2e-2)])
@pytest.mark.parametrize("products", [False, True])
def test_decode_attention_equals_one_softmax_over_prompt_and_own_keys(q_dtype, dtype, tol, products):
    """A decoding row's attention (the CPU's two flash calls merged by log-sum-exp, and the products other
    devices run) equals fp64 attention written here over [its group's real prompt keys; its own keys up to
    its position], with GQA heads, left padding and unwritten slots holding garbage; fp32 queries over a bf16
    rollout's bf16 KV give an fp32 output."""
    torch.manual_seed(0)
    n, G, kvh, rep, d, P, cap = 3, 4, 2, 3, 16, 9, 8
    R, h = n * G, kvh * rep
    q = torch.randn(R, h, d)
    pk, pv = torch.randn(n, kvh, P, d), torch.randn(n, kvh, P, d)
    ck, cv = torch.randn(R, kvh, cap, d) * 3, torch.randn(R, kvh, cap, d)
    pad = torch.tensor([0, 4, 8])  # left padding per prompt (the last has one real token)
    t = torch.randint(0, cap, (R,))
    prompt_real = torch.arange(P)[None, :] >= pad[:, None]
    own_real = torch.arange(cap)[None, :] <= t[:, None]
    bias = lambda real: torch.where(real, 0.0, float("-inf"))  # noqa: E731
    attention = native._merge_attention_products if products else native._merge_attention
    out = attention(
        q.to(q_dtype), *(x.to(dtype) for x in (pk, pv, ck, cv)),
        bias(prompt_real).to(dtype).view(n, 1, 1, P),
        bias(own_real).to(dtype).view(R, 1, 1, cap),
        0.25,
    )  # fmt: skip
    assert out.dtype == q_dtype
    out = out.double()
    for r in range(R):
        g = r // G
        for j in range(h):
            keys = torch.cat([pk[g, j // rep][prompt_real[g]], ck[r, j // rep][own_real[r]]]).double()
            vals = torch.cat([pv[g, j // rep][prompt_real[g]], cv[r, j // rep][own_real[r]]]).double()
            want = torch.softmax(keys @ q[r, j].double() * 0.25, 0) @ vals
            torch.testing.assert_close(out[r, j * d : (j + 1) * d], want, atol=tol, rtol=tol)


@pytest.mark.parametrize("rollout_dtype", ["model", "bf16"])
def test_the_layer_stack_in_one_call_samples_what_the_kernels_layer_by_layer_do(rollout_dtype, monkeypatch):
    """cpu_decode.decode_layers (a step's layers in one C++ call) against the same kernels called layer by
    layer from Python: the same tokens and log-probs, bit for bit, through EOS and compaction."""
    if cpu_decode.kernels() is None:
        pytest.skip(f"no CPU decode kernels: {cpu_decode.unavailable_reason()}")
    if cpu_decode.linear_for(BF16 if rollout_dtype == "bf16" else F32) is None:  # (a baseline x86-64 build)
        pytest.skip(f"no {rollout_dtype} linear kernel in this CPU's build: the stack runs layer by layer")
    monkeypatch.setattr(native, "SYNC_EVERY_CPU", 3)
    model = _model("llama")
    ids, mask = _prompts()

    def run():
        return generate_groups(
            model, ids, mask, 4, 30, temperature=1.0, top_k=40, eos_token_id=EOS, engine="native",
            rollout_dtype=rollout_dtype, generator=torch.Generator().manual_seed(3), return_logprobs=True,
        )  # fmt: skip

    stacks, real = [], native._stack_args
    monkeypatch.setattr(native, "_stack_args", lambda *a: stacks.append(real(*a)) or stacks[-1])
    in_one = run()
    assert stacks and all(s is not None for s in stacks)
    _kernel_steps_as_asked(model, True, "llama")
    monkeypatch.setattr(native, "_stack_args", lambda *a: None)
    by_layer = run()
    _kernel_steps_as_asked(model, True, "llama")
    lengths = in_one[1].sum(1)
    assert len(set(lengths.tolist())) > 1  # EOS at different points
    for a, b in zip(in_one, by_layer, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "engine,share_prefix,top_p,top_k,min_p",
    [
        ("native", True, 1.0, 0, 0.0),
        ("native", False, 1.0, 0, 0.0),
        ("native", True, 0.9, 20, 0.0),
        ("native", True, 1.0, 0, 0.5),
        ("reference", True, 0.9, 20, 0.0),
        ("reference", False, 1.0, 0, 0.5),
    ],
)
def test_sampled_completions_logprobs_equal_the_training_forward(
    engine, share_prefix, top_p, top_k, min_p, cpu_kernels
):
    """The engine's log-probs are the trainer's (the rollout-mismatch ratio exp(trainer - engine) is 1), also
    under top-p / top-k / min-p truncation: both score softmax(logits / T) over the whole vocabulary."""
    model = _model("qwen2")
    ids, mask = _prompts()
    G, T = 4, 0.8
    c_ids, c_mask, logp = generate_groups(
        model, ids, mask, G, 20, temperature=T, eos_token_id=EOS, share_prefix=share_prefix, top_p=top_p,
        top_k=top_k, min_p=min_p, generator=torch.Generator().manual_seed(0), engine=engine,
        return_logprobs=True,
    )  # fmt: skip
    if engine == "native":
        _kernel_steps_as_asked(model, cpu_kernels, "qwen2")
    assert len({tuple(r.tolist()) for r in c_ids[:G]}) > 1  # the samples of a group differ
    with torch.no_grad():
        hidden = shared_prefix_forward(model, ids, mask, c_ids, c_mask)
        ref = fused_linear_logprobs(hidden, lm_head_of(model).weight, c_ids, temperature=T)
    assert torch.allclose(logp, ref * c_mask, atol=1e-5), (logp - ref * c_mask).abs().max()
    ratio = torch.exp(ref - logp)[c_mask.bool()]
    assert (ratio - 1).abs().max() < 1e-4, ratio
    if (
        top_p < 1 or min_p
    ):  # the truncation is real: renormalized (vLLM's processed) log-probs would be biased
        scaled = (hidden @ lm_head_of(model).weight.T / T).reshape(-1, model.config.vocab_size)
        kept = torch.log_softmax(filtered(scaled, top_k, top_p, min_p), -1).gather(-1, c_ids.reshape(-1, 1))
        bias = (kept.view_as(ref) - ref)[c_mask.bool()]
        assert (bias >= -1e-6).all() and bias.max() > 1e-2, bias.max()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("share_prefix", [True, False])
@pytest.mark.parametrize("compile", ["auto", "graphs"])
def test_repetition_penalty_greedy_equals_hf_generate(kind, share_prefix, compile, monkeypatch, cpu_kernels):
    """Under transformers' repetition penalty (prompt and completion tokens), greedy native (eager, and on
    the buckets CUDA graphs replay) and reference completions are HF `generate`'s, token for token; the
    penalty is real: without it the completions differ."""
    for name in ("SYNC_EVERY", "SYNC_EVERY_CPU"):  # windows of several tokens, compaction within 30 tokens
        monkeypatch.setattr(native, name, 3)
    model = eos_likely_lm(kind, V, EOS, 0, factor=1.5)
    ids, mask = _prompts(4)
    G, C, penalty = 2, 30, 1.3
    opts = dict(temperature=0.0, eos_token_id=EOS, share_prefix=share_prefix)
    native_opts = dict(engine="native", compile=compile, **opts)
    got = generate_groups(model, ids, mask, G, C, repetition_penalty=penalty, **native_opts)
    plain = generate_groups(model, ids, mask, G, C, **native_opts)
    ref = generate_groups(model, ids, mask, G, C, engine="reference", repetition_penalty=penalty, **opts)
    assert_greedy_equal(model, ids, mask, G, got, ref, repetition_penalty=penalty)
    lengths = got[1].sum(1)
    assert len(set(lengths.tolist())) > 1 and int(lengths.min()) < C  # EOS at different points: compaction
    changed = 0
    for i in range(ids.shape[0]):
        p = ids[i][mask[i].bool()]
        hf = hf_greedy(model, p, C, EOS, repetition_penalty=penalty)
        row = got[0][i * G][got[1][i * G].bool()]
        assert_greedy_row_equal(model, p, row, hf, repetition_penalty=penalty)
        changed += row.tolist() != plain[0][i * G][plain[1][i * G].bool()].tolist()
    assert changed >= 2, changed


@pytest.mark.parametrize("share_prefix", [True, False])
@pytest.mark.parametrize("compile", ["auto", "graphs"])
def test_repetition_penalty_samples_replayed_row_by_row(share_prefix, compile, monkeypatch, cpu_kernels):
    """Sampled under a repetition penalty, with rows ending apart (compaction moves them, with the tokens each
    has seen): every token of every row is the one an fp64 replay of that row alone draws, written here
    from the model's plain forward (penalized logits / T, the inverse CDF at the row's uniform: the engine
    takes (C + 1, rows) uniforms from the generator, token j of row s at [j, s]); its log-prob is the
    unpenalized softmax(logits / T) (the trainer's)."""
    monkeypatch.setattr(native, "SYNC_EVERY", 3)
    model = eos_likely_lm("llama", V, EOS, 0, factor=1.5)
    ids, mask = _prompts(3)
    G, C, T, penalty, seed = 4, 24, 0.8, 1.3, 7
    c_ids, c_mask, logp = generate_groups(
        model, ids, mask, G, C, temperature=T, eos_token_id=EOS, share_prefix=share_prefix, engine="native",
        compile=compile, repetition_penalty=penalty, generator=torch.Generator().manual_seed(seed),
        return_logprobs=True,
    )  # fmt: skip
    lengths = c_mask.sum(1)
    assert len(set(lengths.tolist())) > 2, lengths
    u = torch.rand(C + 1, ids.shape[0] * G, generator=torch.Generator().manual_seed(seed)).double()
    oracle = copy.deepcopy(model).double()
    for s in range(c_ids.shape[0]):
        context = ids[s // G][mask[s // G].bool()].tolist()
        for j in range(int(lengths[s])):
            with torch.no_grad():
                z = oracle(torch.tensor([context])).logits[0, -1]
            shaped = z.clone()
            for tok in set(context):
                shaped[tok] = shaped[tok] / penalty if shaped[tok] > 0 else shaped[tok] * penalty
            cdf = torch.softmax(shaped / T, 0).cumsum(0)
            want = int((cdf <= u[j, s] * cdf[-1]).sum())
            assert int(c_ids[s, j]) == want, (s, j, int(c_ids[s, j]), want)
            assert abs(float(logp[s, j]) - float(torch.log_softmax(z / T, 0)[want])) < 1e-5
            context.append(want)
        assert int(lengths[s]) == C or context[-1] == EOS


def test_a_penalized_draw_follows_the_penalized_softmax_and_reports_the_model_log_prob():
    """`draw` under a repetition penalty: frequencies against softmax(penalized logits / T) (the penalty
    written out here: divide a seen token's positive logit, multiply its negative one); the log-prob it
    reports is the unpenalized softmax(logits / T)."""
    torch.manual_seed(0)
    logits = torch.randn(1, 40) * 2
    seen = torch.zeros(1, 40, dtype=torch.bool)
    seen[0, logits[0].argsort(descending=True)[:3]] = True  # the three likeliest (positive logits)
    seen[0, logits[0].argsort()[:3]] = True  # and three unlikely ones (negative)
    N, T, penalty = 100_000, 0.9, 1.5
    tok, logp = draw(logits.expand(N, -1), torch.rand(N), T, 0, 1.0, 0.0, seen.expand(N, -1), penalty)
    z = logits[0].double()
    z = torch.where(seen[0], torch.where(z > 0, z / penalty, z * penalty), z)
    assert_draws_follow(tok, torch.softmax(z / T, 0))
    assert torch.allclose(logp, torch.log_softmax(logits[0] / T, 0)[tok], atol=1e-6)


def test_sampling_is_reproducible_with_a_generator():
    model = _model("llama")
    ids, mask = _prompts()
    runs = [
        generate_groups(
            model,
            ids,
            mask,
            4,
            16,
            temperature=1.0,
            top_p=0.9,
            top_k=20,
            eos_token_id=EOS,
            generator=torch.Generator().manual_seed(5),
            engine="native",
        )  # fmt: skip
        for _ in range(2)
    ]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def _kept_copies(model) -> list:
    """Where each of the engine's kept weight copies lives: a tensor's address (oneDNN's packed weights are
    opaque: their object)."""
    from grpo_fast.rollout.dtypes import Packed

    _, weights = native.engine_for(model)._kept
    tensors = [
        t for p in native._linears(weights) if isinstance(p, Packed) for t in p.tensors if t is not None
    ]
    return [id(t) if t.is_mkldnn else t.data_ptr() for t in tensors]


@pytest.mark.parametrize("rollout_dtype", ["model", "bf16"])
def test_eager_cpu_calls_rewrite_one_kept_weight_copy(rollout_dtype, cpu_kernels):
    """Eager on a CPU the engine keeps its copy of the linear weights (fp32 packed, or bf16) between calls and
    rewrites it in place: an optimizer step between two calls is seen by the second (greedy, against the
    reference engine on the updated model) through the same copies; a call in another rollout dtype
    replaces the copy (one at a time), and a call of another row count where the packing depends on it
    (oneDNN's) packs afresh. The first call runs under inference mode (an evaluation loop's), the next ones
    outside it: the copies stay writable (qwen2: its q / k / v biases are copied too)."""
    model = _model("qwen2")
    ids, mask = _prompts()
    kw = dict(temperature=0.0, eos_token_id=EOS, engine="native", compile=False, rollout_dtype=rollout_dtype)
    with torch.inference_mode():
        before = generate_groups(model, ids, mask, 4, 20, **kw)
    where = _kept_copies(model)
    assert len(where) >= 2 * 4 + 1  # every layer's linears and the LM head
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(ids, attention_mask=mask).logits.float().pow(2).mean().backward()
    opt.step()
    after = generate_groups(model, ids, mask, 4, 20, **kw)
    assert _kept_copies(model) == where
    ref = generate_plain(model, ids, mask, 4, 20, temperature=0.0, eos_token_id=EOS)
    assert_greedy_equal(model, ids, mask, 4, after, ref)
    assert not torch.equal(after[0], before[0])
    other = "bf16" if rollout_dtype == "model" else "fp32"
    generate_groups(model, ids, mask, 4, 20, **{**kw, "rollout_dtype": other})
    assert native.engine_for(model)._kept[0][0] == other
    generate_groups(model, ids, mask, 4, 20, **kw)
    where = _kept_copies(model)
    fewer = generate_groups(model, ids[:2], mask[:2], 4, 20, **kw)  # 8 rows, not 12
    dtype = torch.bfloat16 if rollout_dtype == "bf16" else torch.float32
    repacked = False  # cpu_decode's packing serves any row count
    if not cpu_kernels or cpu_decode.linear_for(dtype) is None:  # oneDNN's (its reorder is for a row count)
        repacked = dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()  # else F.linear
    assert (_kept_copies(model) != where) == repacked
    assert_greedy_equal(model, ids[:2], mask[:2], 4, fewer, [t[:8] for t in after])


def test_a_model_is_freed_with_its_engine_and_weight_copy():
    """The engine (and its kept weight copy) lives as long as its model, not longer: it holds the model
    weakly, the engines' table is keyed by it weakly."""
    import gc
    import weakref

    model = _model("llama")
    ids, mask = _prompts()
    generate_groups(model, ids, mask, 2, 8, engine="native", eos_token_id=EOS)
    engine = weakref.ref(native.engine_for(model))
    model_ref = weakref.ref(model)
    del model
    gc.collect()
    assert model_ref() is None and engine() is None


@pytest.mark.slow
def test_compiled_step_matches_eager_and_sees_updated_weights():
    # one compile of a 2-layer step (tens of seconds on 2 CPU cores), then an in-place weight update
    model = _model("qwen2")
    ids, mask = _prompts()
    kw = dict(temperature=0.0, eos_token_id=EOS, engine="native")
    compiled = generate_groups(model, ids, mask, 4, 20, compile=True, **kw)
    assert native.engine_for(model)._kept is None  # the step reads the modules: no copy (the planner's too)
    eager = generate_groups(model, ids, mask, 4, 20, compile=False, **kw)
    assert_greedy_equal(model, ids, mask, 4, compiled, eager)
    eng = native.engine_for(model)
    assert eng.stats["compiled"] and eng.stats["compile_s"] > 0
    with torch.no_grad():  # what an optimizer step does: the same tensors, new values
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    after = generate_groups(model, ids, mask, 4, 20, compile=True, **kw)
    ref = generate_plain(model, ids, mask, 4, 20, temperature=0.0, eos_token_id=EOS)
    assert_greedy_equal(model, ids, mask, 4, after, ref)
    assert not torch.equal(after[0], compiled[0])


def test_lora_model_generates_through_its_adapters():
    peft = pytest.importorskip("peft")  # not in the bare environment
    LoraConfig, get_peft_model = peft.LoraConfig, peft.get_peft_model

    model = get_peft_model(_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # adapters that change the outputs
    ids, mask = _prompts()
    got = generate_groups(model, ids, mask, 2, 12, temperature=0.0, eos_token_id=EOS, engine="native")
    ref = generate_plain(model, ids, mask, 2, 12, temperature=0.0, eos_token_id=EOS)
    assert_greedy_equal(model, ids, mask, 2, got, ref)
    with model.disable_adapter():
        base = generate_plain(model, ids, mask, 2, 12, temperature=0.0, eos_token_id=EOS)
    assert not torch.equal(got[0], base[0])


def test_other_models_fall_back_with_a_reason(capsys):
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    ids, mask = _prompts()
    out = generate_groups(gpt2, ids, mask, 2, 5, temperature=0.0, eos_token_id=EOS)
    assert out[0].shape[0] == 6 and "reference engine (model type 'gpt2'" in capsys.readouterr().out
    with pytest.raises(ValueError, match="engine='native' cannot run this model: model type 'gpt2'"):
        generate_groups(gpt2, ids, mask, 2, 5, engine="native")
    with pytest.raises(ValueError, match="engine must be one of"):
        generate_groups(gpt2, ids, mask, 2, 5, engine="vllm-ish")
