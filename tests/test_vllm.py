"""The vLLM rollout engine against independent references: HF `generate` and the native engine (greedy, token
for token, after each of several optimizer steps, full fine-tuning and LoRA), the trainer's own log-probs of
its samples, and a short training run against the native engine's. Runs where vLLM is installed (`make
setup-vllm` builds .venv-vllm; `make test` runs this file there); elsewhere only the missing-vLLM error."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from grpo_fast.kernels import fused_linear_logprobs
from oracle import assert_greedy_equal, assert_greedy_row_equal, hf_greedy
from tiny_models import eos_likely_lm, ragged_prompts

from grpo_fast.models.model_parts import lm_head_of
from grpo_fast.models.shared_prefix import shared_prefix_forward
from grpo_fast.rollout import generate_groups, vllm_engine

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM not installed (make setup-vllm)")
V, EOS = 97, 1
ROOT = Path(__file__).resolve().parents[1]
OPTS = {"kv_cache_gb": 1, "max_model_len": 96}


def _model(kind="llama", seed=0, tie=False):  # head_dim 32: vLLM's CPU attention wants >= 32
    return eos_likely_lm(kind, V, EOS, seed, factor=8, head_dim=32, tie=tie)


def _prompts(n=3, P=7):
    return ragged_prompts(V, n, P)


def _hf_greedy(model, ids, mask, C, **generate_kwargs):
    """HF `generate`'s greedy continuation of each left-padded prompt."""
    return [hf_greedy(model, i[m.bool()], C, EOS, **generate_kwargs) for i, m in zip(ids, mask)]


def _optimizer_step(model, opt, seed):
    """One AdamW step on a next-token loss over random sequences: every trainable weight moves."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(2, V, (4, 12), generator=g)
    model.train()
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    model.eval()


def _check_greedy(model, ids, mask, G, C):
    """vLLM greedy == native engine == HF generate; returns vLLM's ids."""
    kw = dict(temperature=0.0, eos_token_id=EOS)
    got_ids, got_mask = generate_groups(model, ids, mask, G, C, engine="vllm", vllm_options=OPTS, **kw)
    nat_ids, nat_mask = generate_groups(model, ids, mask, G, C, engine="native", **kw)
    assert_greedy_equal(model, ids, mask, G, (got_ids, got_mask), (nat_ids, nat_mask))
    for i, hf in enumerate(_hf_greedy(model, ids, mask, C)):
        for s in range(i * G, (i + 1) * G):
            got = got_ids[s][got_mask[s].bool()]
            assert_greedy_row_equal(model, ids[i][mask[i].bool()], got, hf)
    return got_ids


@needs_vllm
@pytest.mark.parametrize("kind,tie", [("llama", True), ("qwen3", False)])
def test_greedy_equals_native_and_hf_after_each_optimizer_step(kind, tie):
    model = _model(kind, tie=tie)
    assert (lm_head_of(model).weight is model.get_input_embeddings().weight) == tie
    ids, mask = _prompts()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    outputs = [_check_greedy(model, ids, mask, 2, 24)]
    for step in range(3):
        _optimizer_step(model, opt, step)
        outputs.append(_check_greedy(model, ids, mask, 2, 24))
    # the steps changed what the model says, so equality above means the pushes reached vLLM
    assert any(not torch.equal(a, b) for a, b in zip(outputs, outputs[1:]))


@needs_vllm
def test_lora_pushes_merged_weights_of_the_adapted_layers_only():
    from peft import LoraConfig, get_peft_model

    from grpo_fast.rollout import vllm_engine

    # q_proj alone of q/k/v and up_proj alone of gate/up: the push must still carry whole fused layers
    model = get_peft_model(_model("qwen2", seed=1), LoraConfig(r=4, target_modules=["q_proj", "up_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    ids, mask = _prompts()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    outputs = [_check_greedy(model, ids, mask, 2, 20)]
    eng = vllm_engine.engine_for(model)
    n_all = len(vllm_engine.checkpoint_weights(model))
    for step in range(2):
        _optimizer_step(model, opt, 10 + step)
        before = eng.stats["pushed_tensors"]
        outputs.append(_check_greedy(model, ids, mask, 2, 20))
        # per layer q, k, v weights and biases (q's fused layer) and gate, up weights; nothing else moved
        pushed = eng.stats["pushed_tensors"] - before
        assert pushed == 8 * model.config.num_hidden_layers < n_all, (pushed, n_all)
    assert any(not torch.equal(a, b) for a, b in zip(outputs, outputs[1:]))
    with model.disable_adapter():
        base = generate_groups(model, ids, mask, 2, 20, temperature=0.0, eos_token_id=EOS, engine="native")
    assert not torch.equal(outputs[-1], base[0])  # the adapters matter to what was compared


@needs_vllm
def test_truncated_sampling_logprobs_are_the_full_softmax_at_temperature_one():
    """top-p / top-k / min-p at T = 1: vLLM's raw log-probs are softmax(logits) over the whole vocabulary,
    the trainer's distribution (ratio 1); at T != 1 only processed (renormalized) ones exist: refused."""
    model = _model("qwen2", seed=4)
    ids, mask = _prompts()
    kw = dict(eos_token_id=EOS, engine="vllm", vllm_options=OPTS, return_logprobs=True)
    c_ids, c_mask, logp = generate_groups(
        model, ids, mask, 4, 20, temperature=1.0, top_p=0.9, top_k=20, min_p=0.05,
        generator=torch.Generator().manual_seed(0), **kw,
    )  # fmt: skip
    with torch.no_grad():
        hidden = shared_prefix_forward(model, ids, mask, c_ids, c_mask)
        ref = fused_linear_logprobs(hidden, lm_head_of(model).weight, c_ids)
    ratio = torch.exp(ref - logp)[c_mask.bool()]
    assert (ratio - 1).abs().max() <= 1e-4, ratio
    with pytest.raises(ValueError, match="raw log-probs"):
        generate_groups(model, ids, mask, 4, 20, temperature=0.8, top_p=0.9, **kw)
    with pytest.raises(ValueError, match="min_p=0.1"):  # processed log-probs (an engine built for T != 1)
        vllm_engine.check_logprobs_mode("processed_logprobs", 0.8, 1.0, 0, 0.1)


@needs_vllm
def test_repetition_penalty_greedy_equals_native_and_hf_and_keeps_raw_logprobs():
    """repetition_penalty reaches vLLM: greedy under it vLLM == native == HF `generate` (and it changes the
    completions); sampled at T = 1 the raw log-probs stay the trainer's (the penalty shapes the draw, not
    what is scored); processed log-probs (an engine built for T != 1) include the penalty: refused."""
    model = eos_likely_lm("llama", V, EOS, 5, factor=2.0, head_dim=32)  # completions of 15 to 24 tokens
    ids, mask = _prompts()
    G, C, penalty = 2, 24, 1.5
    kw = dict(temperature=0.0, eos_token_id=EOS, repetition_penalty=penalty)
    got = generate_groups(model, ids, mask, G, C, engine="vllm", vllm_options=OPTS, **kw)
    nat = generate_groups(model, ids, mask, G, C, engine="native", **kw)
    assert_greedy_equal(model, ids, mask, G, got, nat, repetition_penalty=penalty)
    plain = generate_groups(model, ids, mask, G, C, temperature=0.0, eos_token_id=EOS, engine="native")
    assert not torch.equal(plain[0], nat[0])
    for i, hf in enumerate(_hf_greedy(model, ids, mask, C, repetition_penalty=penalty)):
        row = got[0][i * G][got[1][i * G].bool()]
        assert_greedy_row_equal(model, ids[i][mask[i].bool()], row, hf, repetition_penalty=penalty)
    c_ids, c_mask, logp = generate_groups(
        model, ids, mask, 4, 20, temperature=1.0, eos_token_id=EOS, repetition_penalty=penalty, engine="vllm",
        vllm_options=OPTS, generator=torch.Generator().manual_seed(0), return_logprobs=True,
    )  # fmt: skip
    with torch.no_grad():
        hidden = shared_prefix_forward(model, ids, mask, c_ids, c_mask)
        ref = fused_linear_logprobs(hidden, lm_head_of(model).weight, c_ids)
    assert (logp - ref * c_mask).abs().max() <= 1e-4
    with pytest.raises(ValueError, match="include the repetition_penalty=1.5"):
        vllm_engine.check_logprobs_mode("processed_logprobs", 0.8, 1.0, 0, 0.0, penalty)


@needs_vllm
def test_sampled_logprobs_equal_the_trainers_and_sampling_options_map():
    model = _model("qwen2", seed=2)
    ids, mask = _prompts()
    G, T = 4, 0.8
    kw = dict(temperature=T, eos_token_id=EOS, engine="vllm", vllm_options=OPTS)
    c_ids, c_mask, logp = generate_groups(
        model, ids, mask, G, 20, generator=torch.Generator().manual_seed(0), return_logprobs=True, **kw
    )
    assert len({tuple(r.tolist()) for r in c_ids[:G]}) > 1  # the samples of a group differ
    with torch.no_grad():
        hidden = shared_prefix_forward(model, ids, mask, c_ids, c_mask)
        ref = fused_linear_logprobs(hidden, lm_head_of(model).weight, c_ids, temperature=T)
    assert (logp - ref * c_mask).abs().max() <= 1e-4
    # layout: EOS kept with mask 1, EOS as padding after it, width = the longest completion
    lengths = c_mask.sum(1)
    assert c_ids.shape[1] == int(lengths.max()) and len(set(lengths.tolist())) > 1
    for row, m in zip(c_ids, c_mask):
        k = int(m.sum())
        assert m[:k].all() and not m[k:].any() and (row[k:] == EOS).all()
        assert EOS not in row[: k - 1].tolist() and (k == 20 or row[k - 1] == EOS)
    # seeds: the same generator seed gives the same samples, another seed other ones
    again = generate_groups(model, ids, mask, G, 20, generator=torch.Generator().manual_seed(0), **kw)
    other = generate_groups(model, ids, mask, G, 20, generator=torch.Generator().manual_seed(1), **kw)
    assert torch.equal(again[0], c_ids) and not torch.equal(other[0], c_ids)
    # top_k=1 is greedy; max tokens; no EOS asked for: all run to the limit
    greedy = generate_groups(model, ids, mask, 2, 9, temperature=0.0, eos_token_id=EOS, engine="native")
    top1 = generate_groups(model, ids, mask, 2, 9, temperature=1.3, top_k=1, eos_token_id=EOS, engine="vllm")
    assert_greedy_equal(model, ids, mask, 2, top1, greedy)
    no_eos = generate_groups(model, ids, mask, 2, 9, temperature=T, engine="vllm")
    assert no_eos[1].shape == (6, 9) and no_eos[1].all()


@needs_vllm
def test_torch_threads_are_the_trainers_after_generation():
    model = _model("llama", seed=3)
    ids, mask = _prompts()
    threads = torch.get_num_threads()
    generate_groups(
        model, ids, mask, 2, 8, temperature=0.0, eos_token_id=EOS, engine="vllm", vllm_options=OPTS
    )
    assert torch.get_num_threads() == threads


def _train(out: Path, rollout: str, steps: int, *extra):
    cmd = [
        sys.executable, "-m", "grpo_fast.trainer.train", "--output-dir", str(out), "--overwrite-output-dir",
        "--rollout", rollout, "--max-steps", str(steps), "--eval-steps", "0", "--save-steps", "20",
        "--time-budget-s", "0", "--vllm-kv-cache-gb", "1", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@needs_vllm
@pytest.mark.slow
def test_training_with_vllm_rollouts_learns_like_native_and_resumes(tmp_path):
    steps = 60
    runs = {r: _train(tmp_path / r, r, steps) for r in ("vllm", "native")}
    acc = {r: [m["eval_accuracy"] for m in recs if "eval_accuracy" in m] for r, recs in runs.items()}
    print("held-out accuracy (before, after):", acc)
    for r in acc:
        assert len(acc[r]) == 2 and acc[r][0] <= 0.35
    assert acc["vllm"][1] >= acc["vllm"][0] + 0.3
    assert acc["vllm"][1] >= acc["native"][1] - 0.15  # within noise of the native run
    assert len([m for m in runs["vllm"] if "loss" in m]) == steps
    # vLLM is not the training forward: TRL's sequence_mask correction ran, with its mismatch logged
    steps_vllm = [m for m in runs["vllm"] if "loss" in m]
    assert all("loss/is_ratio_mean" in m and m["loss/sampling_k3"] >= -1e-6 for m in steps_vllm)
    assert all(abs(m["loss/sampling_k3"]) < 1e-6 for m in runs["native"] if "loss" in m)
    print("vLLM mismatch (mean k3) per step:", [round(m["loss/sampling_k3"], 8) for m in steps_vllm][:10])
    assert json.loads((tmp_path / "vllm" / "config.json").read_text())["rollout"] == "vllm"
    # resume from the final checkpoint (step 60): the run goes on to 80 with vLLM rollouts
    resumed = _train(tmp_path / "vllm", "vllm", steps + 20, "--resume", "--no-overwrite-output-dir")
    assert [m["step"] for m in resumed if "loss" in m][-1] == steps + 20


def test_missing_vllm_is_a_clear_error(monkeypatch):
    if HAVE_VLLM:
        monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm now fails as if not installed
    from grpo_fast.rollout import vllm_engine

    ids, mask = _prompts()
    with pytest.raises(RuntimeError, match="make setup-vllm"):
        vllm_engine.VLLMEngine(_model(), **OPTS)
    with pytest.raises(ValueError, match="vllm engine options: unknown"):
        vllm_engine.VLLMEngine(_model(), gpu_memory=0.5)


@needs_vllm
@pytest.mark.slow
def test_multi_turn_trajectories_equal_the_plain_loop():
    """SmolLM2-135M-Instruct calling a tool (tests/test_tools.py's questions and loop): each turn after the
    first is a new request whose prefix vLLM's cache holds; token for token the re-render-and-generate
    loop."""
    from test_tools import QUESTIONS, assert_like_plain_loop, multiply
    from transformers import AutoModelForCausalLM

    from grpo_fast.rollout.trajectories import generate_trajectories
    from grpo_fast.tasks.smollm2 import build
    from grpo_fast.trainer.modeling import load_tokenizer

    tok = load_tokenizer(str(build()))
    model = AutoModelForCausalLM.from_pretrained(build(), dtype=torch.float32).eval()
    tr = generate_trajectories(
        model, tok, [[{"role": "user", "content": q}] for q in QUESTIONS], 1, 90, tools=[multiply],
        temperature=0.0, engine="vllm", max_tool_calling_iterations=2,
        vllm_options={"kv_cache_gb": 1, "max_model_len": 1024},
    )  # fmt: skip
    assert_like_plain_loop(model, tok, tr, QUESTIONS, [multiply], 90, 2, near_tie_ok=True)
    assert tr.tool_calls == [1, 1] and tr.turns == [2, 2]


@needs_vllm
def test_bf16_rollout_follows_the_policy_within_its_precision():
    """rollout_dtype="bf16": vLLM's weights in bf16, pushed from the fp32 policy after each optimizer step;
    greedy tokens equal the fp32 native engine's where the logits margin allows, sampled log-probs within
    a bound of the fp32 training forward's (and not equal to them: another precision ran)."""
    model = _model("qwen2", seed=5)
    ids, mask = _prompts()
    kw = dict(eos_token_id=EOS, vllm_options=OPTS, rollout_dtype="bf16")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    outputs = []
    for step in range(2):
        got = generate_groups(model, ids, mask, 2, 20, temperature=0.0, engine="vllm", **kw)
        want = generate_groups(model, ids, mask, 2, 20, temperature=0.0, eos_token_id=EOS, engine="native")
        assert_greedy_equal(model, ids, mask, 2, got, want, tie=0.03)
        outputs.append(got[0])
        _optimizer_step(model, opt, 20 + step)
    assert not torch.equal(outputs[0], outputs[1])  # the push reached the bf16 weights
    c_ids, c_mask, logp = generate_groups(
        model, ids, mask, 4, 20, temperature=1.0, engine="vllm", return_logprobs=True,
        generator=torch.Generator().manual_seed(0), **kw,
    )  # fmt: skip
    with torch.no_grad():
        hidden = shared_prefix_forward(model, ids, mask, c_ids, c_mask)
        ref = fused_linear_logprobs(hidden, lm_head_of(model).weight, c_ids)
    d = (ref - logp)[c_mask.bool()]
    assert 1e-5 < d.abs().max() <= 0.05, d.abs().max()
    with pytest.raises(ValueError, match="fixed when it starts"):
        generate_groups(model, ids, mask, 2, 4, engine="vllm", rollout_dtype="model", vllm_options=OPTS)
    for bad, match in (("int8", "native engine's"), ("fp8", "needs a GPU")):
        with pytest.raises(ValueError, match=match):
            generate_groups(_model("qwen2"), ids, mask, 2, 4, engine="vllm", rollout_dtype=bad)


@needs_vllm
def test_trainer_with_a_bf16_vllm_rollout_corrects_its_mismatch(tmp_path):
    """--rollout vllm --rollout-dtype bf16: every step ran with vLLM in bf16 (a mismatch to the fp32
    trainer above rounding, logged) and the correction on; what ran is recorded."""
    recs = [m for m in _train(tmp_path, "vllm", 3, "--rollout-dtype", "bf16") if "loss" in m]
    assert len(recs) == 3
    assert all(m["loss/sampling_k3"] > 1e-7 and "loss/is_ratio_mean" in m for m in recs), recs
    assert json.loads((tmp_path / "config.json").read_text())["rollout_dtype"] == "bf16"
