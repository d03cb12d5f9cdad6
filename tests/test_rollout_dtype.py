"""Low-precision rollouts of the native engine (`rollout_dtype`): a bf16 / int8 copy of the policy's linear
weights made per call. Oracles: the fp32 engine's greedy tokens where the logits margin allows, the fp32
training forward's log-probs within a stated bound, the policy after an optimizer step and under LoRA."""

import pytest
import torch
from grpo_fast.kernels import fused_linear_logprobs
from oracle import assert_greedy_equal
from tiny_models import eos_likely_lm, ragged_prompts

import grpo_fast.rollout.native as native
from grpo_fast.model_parts import lm_head_of
from grpo_fast.rollout import generate_groups, is_exact
from grpo_fast.shared_prefix import shared_prefix_forward

pytestmark = pytest.mark.transformers_range
V, EOS = 97, 1
# bf16 weights round to 8 bits of mantissa, int8 to 1/254 of a row's largest weight: logits move by ~1e-2 of
# their size (int8 a few times more), so a greedy token may flip only where the best two are that close;
# log-probs stay within LOGP_BOUND
TIE = {"bf16": 0.03, "int8": 0.05}
LOGP_BOUND = {"bf16": 0.05, "int8": 0.05}


def _model(kind="qwen2", seed=0):
    return eos_likely_lm(kind, V, EOS, seed)


def _greedy(model, ids, mask, dtype, G=2, C=24):
    return generate_groups(
        model, ids, mask, G, C, temperature=0.0, eos_token_id=EOS, engine="native", rollout_dtype=dtype
    )


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_greedy_tokens_equal_the_fp32_engine_where_the_margin_allows(kind, dtype):
    model = _model(kind)
    ids, mask = ragged_prompts(V, 3, 7)
    want = _greedy(model, ids, mask, "model")
    got = _greedy(model, ids, mask, dtype)
    assert_greedy_equal(model, ids, mask, 2, got, want, tie=TIE[dtype])


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
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


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
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
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    assert native.auto_rollout_dtype(dev, torch.float32)[0] == "bf16"
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx2", "amx_bf16", "amx_tile"})
    assert native.auto_rollout_dtype(dev, torch.float32)[0] == "bf16"
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx2", "fma"})
    pick, why = native.auto_rollout_dtype(dev, torch.float32)
    assert pick == "model" and "no native bf16" in why
    assert native.auto_rollout_dtype(dev, torch.bfloat16)[0] == "model"  # already low precision


def test_bad_rollout_dtypes_are_named():
    model = _model("llama")
    ids, mask = ragged_prompts(V, 2, 5)
    with pytest.raises(ValueError, match="rollout_dtype must be one of"):
        _greedy(model, ids, mask, "fp4")
    with pytest.raises(ValueError, match="rollout_dtype='bf16' needs the native engine"):
        generate_groups(model, ids, mask, 2, 4, engine="reference", rollout_dtype="bf16")
    with pytest.raises(ValueError, match="copy of an fp32 policy"):
        _greedy(_model("llama").bfloat16(), ids, mask, "int8")
