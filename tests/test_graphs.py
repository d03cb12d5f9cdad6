"""The native engine's bucketed, fixed-address decode step (grpo_fast.rollout.graphs: CUDA graphs on a GPU,
the same buckets run eagerly on a CPU) against the unbucketed eager step: the real rows of a padded bucket
sample bit for bit what the eager step samples (fp32, through the CPU decode kernels, whose rows never
depend on the batch), no buffer moves inside a call or between calls of one shape, an optimizer step between
two calls is seen by the second, and multi-turn rows (parked while their tool runs) keep working."""

import threading
from concurrent import futures

import pytest
import torch
from oracle import assert_greedy_equal
from tiny_models import eos_likely_lm

import grpo_fast.rollout.native as native
from grpo_fast.rollout import cpu_decode, generate_groups, graphs
from grpo_fast.rollout.dtypes import Packed

pytestmark = pytest.mark.transformers_range
V, EOS = 97, 1


def _prompts(lengths=(7, 4, 1, 5, 3), P=7):
    """Left-padded prompts of these lengths, ids in [2, V)."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor(lengths)
    mask = (torch.arange(P)[None, :] >= P - lengths[:, None]).long()
    return torch.randint(2, V, (len(lengths), P), generator=g) * mask, mask


def _kernels_or_skip():
    """The bitwise comparisons need the CPU decode kernels (fp32 linears and attention row by row); elsewhere
    a row's sums depend on the batch it runs in (oneDNN's blocking), and the tests compare greedy tokens."""
    if cpu_decode.kernels() is None or cpu_decode.linear_for(torch.float32) is None:
        pytest.skip(f"no CPU decode linear kernel: {cpu_decode.unavailable_reason() or 'no AVX-512'}")


@pytest.fixture(autouse=True)
def short_windows(monkeypatch):
    """Windows of 4 tokens (16 on CUDA): several compactions within 60 tokens."""
    monkeypatch.setattr(native, "SYNC_EVERY", 4)


@pytest.fixture
def seen_buckets(monkeypatch):
    """Every (bucket, views) a Static steps on, and each view's tensors' addresses at that step."""
    seen = []
    real = graphs.Static.step

    def spy(self, bucket, b, step, args):
        seen.append((bucket, int(b.done.numel() - (~b.done).sum()), _addresses(self, b, args)))
        return real(self, bucket, b, step, args)

    monkeypatch.setattr(graphs.Static, "step", spy)
    return seen


def _where(t) -> int:
    """A tensor's address (oneDNN's packed weights, used where cpu_decode's linear kernel is not built, are
    opaque: their object)."""
    return id(t) if t.is_mkldnn else t.data_ptr()


def _addresses(st, b, args) -> dict:
    """Where each tensor the step reads or writes lives (the weight copies included)."""
    out = {}
    for name, value in vars(b).items():
        for i, x in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(x, torch.Tensor):
                out[f"{name}{i}"] = x.data_ptr()
    out["eos"] = args[3].data_ptr()  # made per call, kept by the Static: a graph reads it
    layers, head = args[0], args[1]
    for i, ly in enumerate(layers):
        for f in native._LINEARS:
            lin = getattr(ly, f)
            if isinstance(lin, Packed):
                out.update({f"{f}{i}.{j}": _where(t) for j, t in enumerate(lin.tensors) if t is not None})
    if isinstance(head, Packed):
        out.update({f"head.{j}": _where(t) for j, t in enumerate(head.tensors) if t is not None})
    return out


def _run(model, compile, G=6, C=60, seed=0, **kw):
    ids, mask = _prompts()
    opts = dict(
        temperature=1.0,
        top_k=30,
        top_p=0.95,
        min_p=0.02,
        eos_token_id=EOS,
        engine="native",
        return_logprobs=True,
    )
    opts.update(kw)
    return generate_groups(
        model, ids, mask, G, C, compile=compile, generator=torch.Generator().manual_seed(seed), **opts
    )


def test_buckets():
    assert (
        graphs.buckets(1) == [1] and graphs.buckets(8) == [1, 2, 4, 8] and graphs.buckets(6) == [1, 2, 4, 6]
    )
    assert [graphs.bucket_for(k, 6) for k in range(1, 7)] == [1, 2, 4, 4, 6, 6]


@pytest.mark.parametrize("share_prefix", [True, False])
@pytest.mark.parametrize(
    "temperature,factor,penalty",
    [(1.0, 8.0, 1.0), (0.0, 2.0, 1.0), (1.0, 8.0, 1.3)],
    ids=["sampled", "greedy", "sampled under a repetition penalty"],
)
def test_padded_buckets_sample_bit_for_bit_what_the_eager_step_samples(
    share_prefix, temperature, factor, penalty, seen_buckets
):
    _kernels_or_skip()
    model = eos_likely_lm("llama", V, EOS, factor=factor)
    kw = dict(share_prefix=share_prefix, temperature=temperature, repetition_penalty=penalty)
    eager = _run(model, False, **kw)
    bucketed = _run(model, "graphs", **kw)
    for want, got in zip(eager, bucketed, strict=True):
        assert torch.equal(want, got)
    lengths = eager[1].sum(1)
    assert len(set(lengths.tolist())) > 3 and int(lengths.min()) < 60  # rows end at several points
    # it ran on buckets, shrank, and some smaller bucket was padded (filler rows beside the running ones)
    buckets = [s[0] for s in seen_buckets]
    assert buckets[0] == ((5, 6) if share_prefix else (30, 1)) and len(set(buckets)) >= 2
    assert any(done > 0 for bucket, done, _ in seen_buckets if bucket != buckets[0])
    eng = native.engine_for(model)
    assert eng.last_call["buckets"] and eng.last_call["graphs"] == 0 and eng.last_call["capture_s"] == 0
    assert eng.stats["graph_reason"].startswith("no CUDA device")


def test_greedy_buckets_equal_the_eager_step_through_pytorch_ops(monkeypatch):
    """Without the CPU decode kernels (PyTorch ops and oneDNN, whose sums may depend on the batch): greedy
    tokens equal up to near-ties."""
    monkeypatch.setattr(cpu_decode, "ENABLED", False)
    model = eos_likely_lm("qwen2", V, EOS, factor=8.0)
    ids, mask = _prompts()
    eager = _run(model, False, temperature=0.0, return_logprobs=False)
    bucketed = _run(model, "graphs", temperature=0.0, return_logprobs=False)
    assert_greedy_equal(model, ids, mask, 6, bucketed, eager)
    assert native.engine_for(model).last_call["kernel_steps"] == 0


def test_the_gpu_steps_path_of_a_bf16_rollout_on_buckets(monkeypatch):
    """What a CUDA device runs for a bf16 rollout of an fp32 policy, on a CPU: buckets, PyTorch ops, the
    attention as batched products (`_merge_attention_products`, the non-CPU path) over bf16 KV with fp32
    queries cast to it. Greedy tokens equal the fp32 eager engine's where bf16's margin allows."""
    monkeypatch.setattr(cpu_decode, "ENABLED", False)
    model = eos_likely_lm("qwen2", V, EOS, factor=8.0)
    ids, mask = _prompts()
    want = _run(model, False, temperature=0.0, return_logprobs=False)
    products = []
    real = native._merge_attention_products
    monkeypatch.setattr(native, "_merge_attention", lambda *a: products.append(a[1].dtype) or real(*a))
    got = _run(model, "graphs", temperature=0.0, return_logprobs=False, rollout_dtype="bf16")
    assert products and set(products) == {torch.bfloat16}
    st = native.engine_for(model)._static
    assert {x.dtype for x in (*st.full.comp_k, *st.full.prompt_v)} == {torch.bfloat16}
    assert_greedy_equal(model, ids, mask, 6, got, want, tie=0.03)


def test_no_buffer_moves_inside_a_call_or_between_calls(seen_buckets):
    model = eos_likely_lm("llama", V, EOS, factor=8.0)
    _run(model, "graphs")
    st = native.engine_for(model)._static
    _run(model, "graphs", seed=1)
    assert native.engine_for(model)._static is st  # one Static for the shape, refilled
    first = seen_buckets[0][2]
    assert {"comp_k0", "noise0", "qkv0.0", "down1.0", "head.0"} <= first.keys()  # buffers and weight copies
    for bucket, _, addresses in seen_buckets:
        assert addresses == first, bucket
    assert len({s[0] for s in seen_buckets}) >= 3  # across several compactions


def test_an_optimizer_step_between_calls_is_seen(monkeypatch):
    """An optimizer step (in place) between two calls: the second call samples from the new weights, through
    the same weight copies (rollout dtype bf16 here: the copies are refreshed in place), exactly what an
    eager call samples."""
    model = eos_likely_lm("qwen2", V, EOS, factor=8.0)
    before = _run(model, "graphs", rollout_dtype="bf16")
    st = native.engine_for(model)._static
    copies = [_where(t) for t in st.weights[1].tensors if t is not None]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ids, mask = _prompts()
    model(ids, attention_mask=mask).logits.float().pow(2).mean().backward()
    opt.step()
    after = _run(model, "graphs", rollout_dtype="bf16")
    assert native.engine_for(model)._static is st
    assert [_where(t) for t in st.weights[1].tensors if t is not None] == copies
    eager = _run(model, False, rollout_dtype="bf16")
    assert not torch.equal(after[0], before[0])
    if cpu_decode.linear_for(torch.bfloat16) is not None:
        for want, got in zip(eager, after, strict=True):
            assert torch.equal(want, got)
    else:
        torch.testing.assert_close(after[2], eager[2], atol=0.05, rtol=0)


class _Tools:
    """A turn hook (native.generate's multi-turn contract): a row that ends its first turn gets a tool turn
    of three fixed tokens, half of them at once and half after a delay (parked meanwhile); the second turn
    ends the row."""

    def __init__(self):
        self.pool = futures.ThreadPoolExecutor(2)
        self.turns = {}
        self.lock = threading.Lock()

    def start(self, s, tokens):
        with self.lock:
            self.turns[s] = self.turns.get(s, 0) + 1
            if self.turns[s] > 1:
                return None
        if s % 2:
            fut = futures.Future()
            fut.set_result([5, 6, 7])
            return fut
        return self.pool.submit(lambda: (threading.Event().wait(0.05), [5, 6, 7])[1])

    def finish(self, s, fut):
        return fut.result()


def test_a_linear_that_changes_format_between_calls_is_not_sampled_stale():
    """A projection swapped between two calls for one the fp32 copy does not take (a Linear subclass, as an
    adapter wrapper is): the buckets drop the copies (and graphs) made on the old module and sample from the
    new one, greedy as the reference engine does."""
    from grpo_fast.rollout.reference import generate_plain

    class Wrapped(torch.nn.Linear):
        pass

    model = eos_likely_lm("llama", V, EOS, factor=8.0)
    ids, mask = _prompts()
    kw = dict(temperature=0.0, eos_token_id=EOS, engine="native", compile="graphs")
    first = generate_groups(model, ids, mask, 2, 16, **kw)
    torch.manual_seed(0)
    for layer in model.model.layers:
        q = layer.self_attn.q_proj
        layer.self_attn.q_proj = Wrapped(q.in_features, q.out_features, bias=False)
        with torch.no_grad():
            layer.self_attn.q_proj.weight.copy_(torch.randn_like(q.weight) * 3)
    after = generate_groups(model, ids, mask, 2, 16, **kw)
    ref = generate_plain(model, ids, mask, 2, 16, temperature=0.0, eos_token_id=EOS)
    assert_greedy_equal(model, ids, mask, 2, after, ref)
    assert not torch.equal(after[0], first[0])


def test_multi_turn_rows_on_buckets_equal_the_eager_step(seen_buckets):
    model = eos_likely_lm("llama", V, EOS, factor=8.0)
    ids, mask = _prompts()
    eng = native.engine_for(model)
    out = {}
    for mode in (False, "graphs"):
        hook = _Tools()
        out[mode] = eng.generate(
            ids, mask, 4, 48, temperature=1.0, top_p=1.0, top_k=0, eos_token_id=EOS, share_prefix=True,
            generator=torch.Generator().manual_seed(2), all_done=None, return_logprobs=True, compile=mode,
            turn_hook=hook,
        )  # fmt: skip
        got = out[mode][0]
        with_tool = [any(r[i : i + 4].tolist() == [EOS, 5, 6, 7] for i in range(len(r) - 3)) for r in got]
        assert sum(with_tool) >= 4  # rows ended a turn, got the tool's, and went on
    if cpu_decode.kernels() is not None and cpu_decode.linear_for(torch.float32) is not None:
        for want, got in zip(out[False], out["graphs"], strict=True):
            assert torch.equal(want, got)
    else:
        assert torch.equal(out[False][1].sum(1) > 0, out["graphs"][1].sum(1) > 0)
    assert len({s[0] for s in seen_buckets}) >= 2


def test_compile_must_be_a_known_mode():
    model = eos_likely_lm("llama", V, EOS)
    ids, mask = _prompts()
    with pytest.raises(ValueError, match="compile must be one of"):
        generate_groups(model, ids, mask, 2, 4, compile="fast", engine="native")


def test_the_trainer_flag_reaches_the_engine():
    from grpo_fast.trainer.config import parse_config
    from grpo_fast.trainer.evaluate import eval_engine_options
    from grpo_fast.trainer.step import engine_options

    assert engine_options(parse_config(["--rollout-compile", "graphs"]))["compile"] == "graphs"
    assert engine_options(parse_config([]))["compile"] == "auto"
    assert engine_options(parse_config(["--rollout-compile", "on"]))["compile"] is True
    # held-out evaluation runs eager: its shapes would replace training's buffers and graphs
    assert eval_engine_options(parse_config(["--rollout-compile", "graphs"]))["compile"] is False
    assert eval_engine_options(parse_config(["--rollout-compile", "on"]))["compile"] is True


@pytest.mark.parametrize("rollout_dtype,penalty", [("model", 1.0), ("fp8", 1.0), ("model", 1.3)])
def test_the_step_cuda_captures_reads_nothing_back_on_the_host(monkeypatch, rollout_dtype, penalty):
    """The step exactly as CUDA runs it (no CPU kernels, the full KV capacity), top-k / top-p / min-p, the
    repetition penalty's mask and the draw included, makes no host read: a CUDA graph can capture it.
    Checked with the operators it runs."""
    monkeypatch.setattr(cpu_decode, "ENABLED", False)
    monkeypatch.setattr(native.NativeEngine, "_eager_cpu", lambda self, device: False)
    real, modes = graphs.Static.step, []

    def watched(self, bucket, b, step, args):
        with graphs.HostReads() as mode:
            real(self, bucket, b, step, args)
        modes.append(mode)

    monkeypatch.setattr(graphs.Static, "step", watched)
    model = eos_likely_lm("qwen2", V, EOS, factor=8.0)
    _run(model, "graphs", C=12, rollout_dtype=rollout_dtype, repetition_penalty=penalty)
    assert len(modes) >= 12 and all(m.seen == [] for m in modes), {s for m in modes for s in m.seen}
    with graphs.HostReads() as mode:  # the detector (the one the capture runs first) detects
        torch.ones(3).sum().item()
        bool((torch.arange(3) > 1).any())
        torch.arange(4).nonzero()
    assert mode.seen == ["_local_scalar_dense", "_local_scalar_dense", "nonzero"]
