"""Low-precision rollouts of the native engine (`rollout_dtype`): a bf16 / fp16 / int8 / fp8 copy of the
policy's linear weights made per call. Oracles: each format's layer against its quantization written here in
fp64, the fp32 engine's greedy tokens where the logits margin allows, the fp32 training forward's log-probs
within a stated bound, the policy after an optimizer step and under LoRA."""

import json
from pathlib import Path

import pytest
import torch
from grpo_fast.kernels import fused_linear_logprobs
from oracle import assert_greedy_equal
from tiny_models import eos_likely_lm, ragged_prompts

from grpo_fast.models.model_parts import lm_head_of
from grpo_fast.models.shared_prefix import shared_prefix_forward
from grpo_fast.rollout import dtypes, generate_groups, is_exact

pytestmark = pytest.mark.transformers_range
V, EOS = 97, 1
ROOT = Path(__file__).resolve().parents[1]
# bf16 rounds weights and activations to 8 bits of mantissa, fp16 to 11, int8 to 1/254 of a row's largest
# value, fp8 (e4m3) to 4 bits: logits move by ~1e-2 of their size (fp16 less, fp8 more), so a greedy token may
# flip only where the best two are that close; log-probs stay within LOGP_BOUND
# int8 where this CPU multiplies it exactly (oneDNN without VNNI saturates: the engine refuses int8 there)
INT8 = pytest.param(
    "int8", marks=pytest.mark.skipif(not dtypes.int8_exact(), reason="int8 products saturate on this CPU")
)
DTYPES = ["bf16", "fp16", INT8, "fp8"]
TIE = {"bf16": 0.03, "fp16": 0.01, "int8": 0.05, "fp8": 0.1}
LOGP_BOUND = {"bf16": 0.05, "fp16": 0.01, "int8": 0.05, "fp8": 0.1}


def _model(kind="qwen2", seed=0):
    return eos_likely_lm(kind, V, EOS, seed)


def _greedy(model, ids, mask, dtype, G=2, C=24):
    return generate_groups(
        model, ids, mask, G, C, temperature=0.0, eos_token_id=EOS, engine="native", rollout_dtype=dtype
    )


def _fp64_reference(fmt, w, x):
    """What a layer of format `fmt` computes, written out in fp64: the inputs rounded as the format
    stores them (bf16 / fp16 casts; 8-bit: symmetric scales per output channel and per input row), then
    exact products and sums."""
    w, x = w.double(), x.double()
    if fmt in ("bf16", "fp16"):
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[fmt]
        return x.to(dt).double() @ w.to(dt).double().T
    qmax = 127.0 if fmt == "int8" else 448.0
    ws = w.abs().amax(1, keepdim=True) / qmax
    xs = x.abs().amax(1, keepdim=True) / qmax
    if fmt == "int8":
        wq, xq = torch.round(w / ws), torch.round(x / xs)
    else:  # e4m3: torch's cast rounds to the nearest representable value
        wq = (w / ws).float().to(torch.float8_e4m3fn).double()
        xq = (x / xs).float().to(torch.float8_e4m3fn).double()
    return (xq @ wq.T) * xs * ws.T


@pytest.mark.parametrize("fmt", DTYPES)
def test_each_format_computes_its_quantization(fmt):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g) * 0.05
    x = torch.randn(5, 64, generator=g) * 3
    w[3, 7] = 0.9  # an outlier weight: its row's scale, not the others'
    bias = torch.randn(96, generator=g)
    got = dtypes.LINEAR_FORMATS[fmt]([w], bias, 5)(x)
    want = _fp64_reference(fmt, w, x) + bias.double()
    # 16-bit outputs stay in their dtype (the step casts where it needs fp32); 8-bit products come out fp32
    out_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(fmt, torch.float32)
    assert got.dtype == out_dtype and got.shape == (5, 96)
    # the products summed in fp32 (8-bit) or the output rounded once to the format (16-bit: oneDNN / F.linear)
    tol = {"bf16": 1e-2, "fp16": 2e-3, "int8": 1e-4, "fp8": 1e-4}[fmt]
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err <= tol, err
    naive = x.double() @ w.double().T + bias.double()
    assert (got.double() - naive).abs().max() > 1e-6  # not the fp32 layer: the format's rounding ran


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_greedy_tokens_equal_the_fp32_engine_where_the_margin_allows(kind, dtype):
    model = _model(kind)
    ids, mask = ragged_prompts(V, 3, 7)
    want = _greedy(model, ids, mask, "model")
    got = _greedy(model, ids, mask, dtype)
    assert_greedy_equal(model, ids, mask, 2, got, want, tie=TIE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_sampled_logprobs_within_a_bound_of_the_training_forward(dtype):
    model = _model("qwen2")
    ids, mask = ragged_prompts(V, 3, 7)
    c_ids, c_mask, logp = generate_groups(
        model, ids, mask, 4, 20, temperature=0.8, eos_token_id=EOS, engine="native", rollout_dtype=dtype,
        generator=torch.Generator().manual_seed(0), return_logprobs=True,
    )  # fmt: skip
    with torch.no_grad():
        hidden = shared_prefix_forward(model, ids, mask, c_ids, c_mask)
        train = fused_linear_logprobs(hidden, lm_head_of(model).weight, c_ids, temperature=0.8)
    d = (train - logp)[c_mask.bool()]
    assert d.abs().max() <= LOGP_BOUND[dtype], d.abs().max()
    assert d.abs().max() > 1e-6  # a copy in another precision: not the training forward
    assert not is_exact("native", dtype) and is_exact("native", "model")


@pytest.mark.parametrize("dtype", ["bf16", INT8])
def test_the_copy_follows_optimizer_steps(dtype):
    model = _model("llama")
    ids, mask = ragged_prompts(V, 3, 7)
    before = _greedy(model, ids, mask, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    with torch.no_grad():
        for p in model.parameters():
            p.grad = torch.randn_like(p)
    opt.step()
    after = _greedy(model, ids, mask, dtype)
    assert not torch.equal(before[0], after[0])  # the update matters to what is compared
    assert_greedy_equal(model, ids, mask, 2, after, _greedy(model, ids, mask, "model"), tie=TIE[dtype])


def test_lora_adapters_are_merged_into_the_copy():
    peft = pytest.importorskip("peft")  # not in the bare environment
    model = peft.get_peft_model(
        _model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    ids, mask = ragged_prompts(V, 3, 7)
    got = _greedy(model, ids, mask, "bf16")
    assert_greedy_equal(model, ids, mask, 2, got, _greedy(model, ids, mask, "model"), tie=TIE["bf16"])
    with model.disable_adapter():
        base = _greedy(model, ids, mask, "bf16")
    assert not torch.equal(got[0], base[0])  # the adapters reached the bf16 copy


def test_auto_reads_the_cpu_flags(monkeypatch):
    dev = torch.device("cpu")
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    assert dtypes.auto_rollout_dtype(dev, torch.float32)[0] == "bf16"
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: {"avx2", "amx_bf16", "amx_tile"})
    assert dtypes.auto_rollout_dtype(dev, torch.float32)[0] == "bf16"
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: {"avx2", "fma"})
    pick, why = dtypes.auto_rollout_dtype(dev, torch.float32)
    assert pick == "model" and "no native bf16" in why
    assert dtypes.auto_rollout_dtype(dev, torch.bfloat16)[0] == "model"  # already low precision
    # a GPU: bf16 from compute capability 8.0 (Ampere) on, fp8 never unasked
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for cap, want in (((7, 5), "model"), ((8, 0), "bf16"), ((9, 0), "bf16")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, cap=cap: cap)
        assert dtypes.auto_rollout_dtype(torch.device("cuda"), torch.float32)[0] == want, cap
    assert dtypes.auto_rollout_dtype(torch.device("cuda"), torch.bfloat16)[0] == "model"


def test_auto_picks_the_fastest_choice_under_the_mismatch_bound_of_the_measured_table(monkeypatch):
    """The committed bench_generate table (real model, every rollout dtype, one run on one machine): with
    that machine's CPU flags, auto's pick is the fastest row whose mismatch is within the bound."""
    table = json.loads((ROOT / "bench/results/zen4/bench_generate_rollout_dtype.json").read_text())
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: set(table["machine"]["cpu_flags"]))
    rows = {r["provider"].removeprefix("native").lstrip("_") or "model": r for r in table["rows"]}
    rows = {k: r for k, r in rows.items() if k in dtypes.ROLLOUT_DTYPES}
    assert {"model", "bf16", "int8", "fp16", "fp8"} <= set(rows), sorted(rows)
    fine = {k: r["tokens_per_s"] for k, r in rows.items() if r["mismatch_k3"] <= dtypes.AUTO_MISMATCH_K3}
    pick = dtypes.auto_rollout_dtype(torch.device("cpu"), torch.float32)[0]
    assert pick == max(fine, key=fine.get), (pick, fine)
    assert set(rows) - set(fine)  # the bound excludes something measured: it decides


def test_bad_rollout_dtypes_are_named(monkeypatch):
    model = _model("llama")
    ids, mask = ragged_prompts(V, 2, 5)
    with pytest.raises(ValueError, match="rollout_dtype must be one of"):
        _greedy(model, ids, mask, "fp4")
    with pytest.raises(ValueError, match="rollout_dtype='bf16' needs the native or vllm engine"):
        generate_groups(model, ids, mask, 2, 4, engine="reference", rollout_dtype="bf16")
    with pytest.raises(ValueError, match="copy of an fp32 policy"):
        _greedy(_model("llama").bfloat16(), ids, mask, "fp16")
    cuda = torch.device("cuda")  # checked before anything runs there
    with pytest.raises(ValueError, match="'int8' runs on the CPU"):
        dtypes.check_rollout_dtype("int8", cuda, torch.float32)
    with monkeypatch.context() as m, pytest.raises(ValueError, match="'int8' needs exact int8 products"):
        m.setattr(dtypes, "int8_exact", lambda: False)  # a CPU whose int8 products saturate
        dtypes.check_rollout_dtype("int8", torch.device("cpu"), torch.float32)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    with pytest.raises(ValueError, match=r"fp8 tensor cores \(compute capability >= 8.9\)"):
        dtypes.check_rollout_dtype("fp8", cuda, torch.bfloat16)
    assert dtypes.check_rollout_dtype("bf16", cuda, torch.bfloat16) == "model"  # the policy's own


@pytest.mark.parametrize("dtype", [INT8, "fp8"])
def test_a_bf16_policy_samples_in_8_bits(dtype):
    """A 16-bit policy's 8-bit rollout: the layers quantized from bf16 weights, activations kept bf16
    between them; greedy tokens equal the bf16 engine's where the margin allows."""
    model = _model("qwen2").bfloat16()
    ids, mask = ragged_prompts(V, 3, 7)
    got = _greedy(model, ids, mask, dtype)
    assert_greedy_equal(model, ids, mask, 2, got, _greedy(model, ids, mask, "model"), tie=TIE[dtype] + 0.05)


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "torch-ops"])
def test_a_bf16_rollout_keeps_its_kv_cache_in_bf16(kernels, monkeypatch):
    """A bf16 rollout of an fp32 policy holds its keys and values in bf16 (half the bytes its attention
    reads), through the CPU decode kernels and through PyTorch ops (fp32 queries cast to the KV's dtype),
    with compaction between tokens: greedy tokens equal the fp32 engine's where bf16's margin allows, sampled
    log-probs stay within bf16's bound of the training forward; the fp32 rollout's KV stays fp32."""
    from grpo_fast.rollout import cpu_decode, native

    if kernels and cpu_decode.kernels() is None:
        pytest.skip(f"no CPU decode kernels: {cpu_decode.unavailable_reason()}")
    monkeypatch.setattr(cpu_decode, "ENABLED", kernels)
    made, fresh = [], native._fresh_buffers
    monkeypatch.setattr(native, "_fresh_buffers", lambda *a: made.append(fresh(*a)) or made[-1])
    model = _model("llama")
    ids, mask = ragged_prompts(V, 3, 7)
    want = _greedy(model, ids, mask, "model", G=4, C=30)
    assert {x.dtype for b in made for x in (*b.prompt_k, *b.comp_v)} == {torch.float32}
    made.clear()
    got = _greedy(model, ids, mask, "bf16", G=4, C=30)
    assert {x.dtype for b in made for x in (*b.prompt_k, *b.prompt_v, *b.comp_k, *b.comp_v)} == {
        torch.bfloat16
    }
    last = native.engine_for(model).last_call
    assert (last["kernel_steps"] > 0) == kernels, last
    assert_greedy_equal(model, ids, mask, 4, got, want, tie=TIE["bf16"])
    lengths = got[1].sum(1)
    assert len(set(lengths.tolist())) > 1  # rows ended at different points: compaction ran
    c_ids, c_mask, logp = generate_groups(
        model, ids, mask, 4, 20, temperature=0.8, eos_token_id=EOS, engine="native", rollout_dtype="bf16",
        generator=torch.Generator().manual_seed(0), return_logprobs=True,
    )  # fmt: skip
    with torch.no_grad():
        hidden = shared_prefix_forward(model, ids, mask, c_ids, c_mask)
        train = fused_linear_logprobs(hidden, lm_head_of(model).weight, c_ids, temperature=0.8)
    assert (train - logp)[c_mask.bool()].abs().max() <= LOGP_BOUND["bf16"]
