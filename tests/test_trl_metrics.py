"""grpo_fast.integrations.trl.GRPOTrainer logs what TRL 1.16's GRPOTrainer logs: keys and values.

Each case trains an identical copy of the tiny shop model for three optimizer steps of two micro-batches (so
that `entropy_coef`, logged once per optimizer step, is seen at its timing) with TRL's class and with ours, on
the same completions and rewards. Generation is replaced in both by one fixed function of the prompts (a
frozen copy of the base model samples them with a seeded generator), so the batches do not depend on how each
trainer's weights drifted by rounding. Where a case's sampler is "logprobs", the fixed rollout also returns
sampling log-probs, as a rollout_func may without vLLM (TRL's off-policy mask reads them, no metric names
them); where it is "vllm", it stands in for TRL's vLLM path: `use_vllm` is switched on after construction (no
engine is built; TRL's own code computes the IS ratio and its metrics at generation, both losses apply it).

Then every record of `log_history` holds the same keys, but for the metrics the fused path does not compute
(`fused_gaps`, each with its reason), and the same values within fp32 rounding (`_tol`). SGD, not AdamW:
Adam's first step is about lr * sign(grad), which turns a rounding-level difference in a near-zero gradient
element into a whole step; under SGD the two runs' weights stay as close as their gradients.
"""

import copy
import warnings
import zlib

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpo_fast.integrations.trl as integ
from grpo_fast.tasks import default_task

trl = pytest.importorskip("trl")

G, C = 4, 16  # completions per prompt, max completion tokens
# the stand-in sampler: temperature 2, or the near-greedy model's groups repeat whole completions (whose
# tokens tie their entropies, see _spy_ties); its log-probs: the model's at temperature 1 plus NOISE
SAMPLE_T, NOISE = 2.0, 0.05
LR = 0.1  # SGD: enough for the ratios of num_iterations=2 to reach the clip range
CLIP_FAMILY = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# wall-clock metrics: present in both, values cannot match
TIMING = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}
TIMING |= {f"eval_{k}" for k in ("runtime", "samples_per_second", "steps_per_second")}


def _reward(completions, **kwargs):
    """A fixed pseudo-random score of the text: groups have spread, and both trainers get the same rewards."""
    return [zlib.crc32(c.encode()) % 1000 / 1000 for c in completions]


class FixedRollout:
    """Stands in for `_generate_single_turn`: each run of equal prompts (TRL repeats a prompt for its samples)
    gets completions sampled from `model`, seeded by the prompt and the call's index."""

    def __init__(self, model, eos: int, logprobs: bool):
        self.model, self.eos, self.logprobs, self.calls = model, eos, logprobs, 0

    @torch.no_grad()
    def __call__(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        self.calls += 1
        completions, logprobs = [], []
        for start in range(0, len(prompt_ids), num_generations):
            prompt = prompt_ids[start]
            g = torch.Generator().manual_seed(zlib.crc32(repr((self.calls, prompt)).encode()))
            ids, lps = torch.tensor([prompt] * num_generations), []
            for _ in range(C):
                logits = self.model(input_ids=ids).logits[:, -1].float()
                tok = torch.multinomial(torch.softmax(logits / SAMPLE_T, -1), 1, generator=g)
                lps.append(torch.log_softmax(logits, -1).gather(1, tok))
                ids = torch.cat([ids, tok], 1)
            for row, lp in zip(ids[:, len(prompt) :], torch.cat(lps, 1)):
                ends = (row == self.eos).nonzero()
                n = int(ends[0]) + 1 if len(ends) else C  # up to and with the first EOS, as TRL keeps it
                completions.append(row[:n].tolist())
                logprobs.append((lp[:n] + NOISE * torch.randn(n, generator=g)).tolist())
        return completions, logprobs if self.logprobs else None


def fused_gaps(opts: dict) -> dict:
    """TRL's metrics that the fused path does not log, and why (docs/trl.md's table)."""
    gaps = {}
    computed = opts.get("entropy_coef", 0.0) != 0.0 or opts.get("use_adaptive_entropy", False)
    if not computed and opts.get("top_entropy_quantile", 1.0) == 1.0:
        gaps["entropy"] = "per-token entropies are computed only when an option needs them"
    if opts["loss_type"] in CLIP_FAMILY:
        why = "per-sequence clip fractions: the fused kernel returns batch sums only"
        gaps.update({"clip_ratio/low_min": why, "clip_ratio/high_max": why})
    return gaps


def _tol(key):
    """Relative tolerance: two fp32 code paths (the fused kernels, TRL's logits) over three SGD steps. A
    log-prob agrees to about an ulp at |logp| ~ 10-20 (1e-6); a sequence-level ratio, exp of a sum of 16 of
    them, to about 16 ulp (measured: 7e-6 at most, the IS ratio's max), so 3e-5. The KL term multiplies a
    log-prob's error by exp(ref - logp) - 1, tens once the policy has moved (kl ~ 1.6 per token): 1e-4
    (measured: 1e-5)."""
    return 1e-4 if key.removeprefix("eval_") == "kl" else 3e-5


def _spy_ties(trainer) -> list:
    """Spies on TRL's top-entropy mask. The two code paths round a token's entropy differently (~1e-7), so a
    quantile threshold on a value several tokens share (samples of one context) can keep a tie on one side
    and drop it on the other: the loss changes by whole tokens. The cases' quantiles put every threshold clear
    of ties in these batches; the returned counts of tokens at each threshold check that they still do."""
    orig, counts = trainer.get_high_entropy_mask, []

    def spy(entropies, mask, threshold):
        active = entropies[mask.bool()].float()
        q = torch.quantile(active, threshold)
        counts.append(int(((active - q).abs() <= 1e-4 * q.abs()).sum()))
        return orig(entropies, mask, threshold)

    trainer.get_high_entropy_mask = spy
    return counts


def _train(cls, base_model, tmp_path, opts, sampler, evaluate):
    rows = [{"prompt": r["prompt"]} for r in default_task.dataset_rows("train")[:18]]
    tok = AutoTokenizer.from_pretrained(default_task.ASSET_DIR)
    args = dict(
        output_dir=str(tmp_path / cls.__module__),
        per_device_train_batch_size=2 * G,
        gradient_accumulation_steps=2,
        num_generations=G,
        max_completion_length=C,
        optim="sgd",
        max_steps=3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        use_cpu=not torch.cuda.is_available(),
        seed=0,
    )
    args.update({"learning_rate": LR, **opts})
    if evaluate:
        args.update(eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=2 * G)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(
            model=copy.deepcopy(base_model),
            reward_funcs=_reward,
            args=trl.GRPOConfig(**args),
            train_dataset=Dataset.from_list(rows[:16]),
            eval_dataset=Dataset.from_list(rows[16:]) if evaluate else None,
            processing_class=tok,
        )
    if sampler == "vllm":
        trainer.use_vllm = True  # TRL's vLLM branches (ratio, metrics, loss factor); generation is ours below
    frozen = copy.deepcopy(base_model).eval()
    trainer._generate_single_turn = FixedRollout(frozen, tok.eos_token_id, logprobs=sampler is not None)
    ties = _spy_ties(trainer) if cls is trl.GRPOTrainer else []
    trainer.train()
    assert all(n <= 1 for n in ties), f"top-entropy thresholds on tied entropies {ties}: change the quantile"
    if cls is integ.GRPOTrainer:
        assert trainer.fused_fallback_reason is None and not trainer._fallback_warned
    return trainer.state.log_history


@pytest.fixture(scope="module")
def base_model():
    return AutoModelForCausalLM.from_pretrained(default_task.ASSET_DIR, dtype=torch.float32)


ADAPTIVE = dict(use_adaptive_entropy=True, entropy_coef=0.05, entropy_coef_delta=0.1)
CASES = {  # name: (GRPOConfig options, sampler: None, "logprobs" or "vllm", held-out evaluation)
    # the entropy bonus: policy_loss and entropy_coef (issue 48), with KL, iterations, the entropy mask
    "grpo-bonus-beta-eval": (dict(loss_type="grpo", entropy_coef=0.05, beta=0.04), None, True),
    "dapo-bonus-iterations": (dict(loss_type="dapo", entropy_coef=0.05, num_iterations=2), None, False),
    "grpo-bonus-entropy_mask": (
        dict(loss_type="grpo", entropy_coef=0.05, top_entropy_quantile=0.2),
        None,
        False,
    ),
    # the adaptive entropy control (Skywork-OR1): no bonus at the first step, the coefficient rising by 0.1 at
    # each step to 0.35 (a target of 100 nats: the entropy is below it), with held-out evaluation (its loss
    # applies the bonus, its entropy is measured and does not move the coefficient) and with the entropy mask
    # (measured and applied on the kept tokens); falling by 0.1 to 0 at TRL's default target of 0.2 nats
    "grpo-adaptive_bonus-eval": (dict(loss_type="grpo", entropy_target=100.0, **ADAPTIVE), None, True),
    "dapo-adaptive_bonus-entropy_mask": (
        dict(loss_type="dapo", entropy_target=100.0, top_entropy_quantile=0.2, **ADAPTIVE),
        None,
        False,
    ),
    "bnpo-adaptive_falling": (dict(loss_type="bnpo", **{**ADAPTIVE, "entropy_coef": 0.15}), None, False),
    # every other loss type, the IS correction's modes and the other options, without the bonus
    "bnpo-entropy_mask-beta-iterations": (
        dict(loss_type="bnpo", top_entropy_quantile=0.2, beta=0.04, num_iterations=2),
        None,
        False,
    ),
    "dr_grpo-delta-is_token_truncate": (
        dict(loss_type="dr_grpo", delta=1.5, vllm_importance_sampling_mode="token_truncate"),
        "vllm",
        False,
    ),
    "cispo-is_sequence_mask-iterations": (
        dict(loss_type="cispo", epsilon_high=1.3, num_iterations=2),
        "vllm",
        False,
    ),
    "sapo-beta": (dict(loss_type="sapo", beta=0.04), None, False),
    "luspo-sequence-off_policy-logprobs": (
        dict(loss_type="luspo", importance_sampling_level="sequence", off_policy_mask_threshold=0.2),
        "logprobs",
        False,
    ),
    "vespo-is_token_mask": (
        dict(loss_type="vespo", vllm_importance_sampling_mode="token_mask"),
        "vllm",
        False,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_log_history_equals_trl(base_model, tmp_path, case):
    opts, sampler, evaluate = CASES[case]
    theirs = _train(trl.GRPOTrainer, base_model, tmp_path, opts, sampler, evaluate)
    ours = _train(integ.GRPOTrainer, base_model, tmp_path, opts, sampler, evaluate)
    gaps = fused_gaps(opts)
    assert len(ours) == len(theirs), ([sorted(r) for r in ours], [sorted(r) for r in theirs])
    for i, (mine, ref) in enumerate(zip(ours, theirs)):
        missing = {k for k in ref if k.removeprefix("eval_") in gaps}
        assert set(mine) == set(ref) - missing, (
            f"record {i}: only TRL's {sorted(set(ref) - set(mine) - missing)}, "
            f"only ours {sorted(set(mine) - set(ref))}"
        )
        for key in sorted(set(mine) - TIMING):
            a, b = mine[key], ref[key]
            assert abs(a - b) <= _tol(key) * max(1.0, abs(b)), f"record {i} {key}: ours {a!r}, TRL {b!r}"
    logged = set().union(*theirs)
    if opts.get("entropy_coef"):  # each case exercises what it is named after
        assert {"policy_loss", "entropy_coef", "eval_policy_loss" if evaluate else "policy_loss"} <= logged
        assert "eval_entropy_coef" not in logged  # TRL: at optimizer steps only
    if opts.get("use_adaptive_entropy"):
        coef = [r["entropy_coef"] for r in theirs if "entropy_coef" in r]
        rising = opts.get("entropy_target", 0.2) > 1
        assert coef == pytest.approx([0.15, 0.25, 0.35] if rising else [0.05, 0.0, 0.0])
    if sampler == "vllm":
        assert "sampling/importance_sampling_ratio/mean" in logged
    if opts.get("num_iterations", 1) > 1 and opts["loss_type"] in CLIP_FAMILY + ("cispo",):
        key = "cispo_clip_ratio" if opts["loss_type"] == "cispo" else "clip_ratio/region_mean"
        assert any(r.get(key, 0) > 0 for r in theirs)  # the second iteration's ratios reach the clip range
