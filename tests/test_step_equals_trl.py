"""Two `grpo-fast train` steps move the weights as two steps of TRL 1.16's GRPOTrainer do, on the same
completions: the prompts' encoding (the chat template), the completions' decoding for the reward,
math-verify's accuracy reward, group advantages, the loss over the step's tokens, gradient clipping, AdamW
and the learning-rate schedule.

The model is SmolLM2-135M-Instruct cut to its first two layers (its tokenizer, chat template and embeddings;
seconds a step). Generation is one fixed function of the prompt's token ids in both trainers (TRL's
`_generate_single_turn`, our `generate_groups`), so a prompt encoded differently finds no completions and
fails the test. The completions per prompt: the answer then EOS (reward 1), a wrong sentence then EOS, a
sample of the model cut at C tokens, and the answer followed by text cut at C (math-verify's reading of a
truncated completion). fp32 in both (TRL `bf16=False`, ours `--no-bf16`): any difference in what is trained
on shows at the size of the update, rounding at ~1e-6 of it.
"""

import copy
import json
import warnings
import zlib

import pytest
import torch
from datasets import Dataset
from torch.optim.optimizer import register_optimizer_step_pre_hook
from transformers import AutoModelForCausalLM

import grpo_fast.trainer.setup as setup_mod
import grpo_fast.trainer.step as step_mod
import grpo_fast.trainer.train as train_mod
from grpo_fast.rewards import load_reward
from grpo_fast.tasks import arithmetic
from grpo_fast.trainer.config import parse_config
from grpo_fast.trainer.modeling import load_tokenizer

trl = pytest.importorskip("trl")

G, C, N_PROMPTS, STEPS, LR = 4, 16, 4, 2, 1e-4


@pytest.fixture(scope="module")
def two_layer_dir(smollm2, tmp_path_factory):
    """SmolLM2-135M-Instruct's first two decoder layers, with its tokenizer, saved as a model directory."""
    model, tok = smollm2
    small = copy.deepcopy(model)
    small.model.layers = small.model.layers[:2]
    small.config.num_hidden_layers = 2
    if getattr(small.config, "layer_types", None):
        small.config.layer_types = small.config.layer_types[:2]
    out = tmp_path_factory.mktemp("smollm2-2l")
    small.save_pretrained(out)
    tok.save_pretrained(out)
    return out


class Completions:
    """The fixed rollout: for each prompt (its token ids) and call, G completions as token-id lists."""

    def __init__(self, model_dir, rows, still=()):
        self.still = set(still)  # (prompt number, call) whose completions are all wrong: advantages all 0
        self.tok = load_tokenizer(str(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.eos = self.tok.eos_token_id
        self.answer, self.number = {}, {}
        for r in rows:  # the prompt's ids as TRL tokenizes them (apply_chat_template, tokenize=True)
            ids = self.tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # a BatchEncoding in transformers 5
            self.answer[tuple(ids)] = r["answer"]
            self.number[tuple(ids)] = len(self.number)
        self.calls, self.made = {}, {}

    def _text(self, s):
        return self.tok(s, add_special_tokens=False)["input_ids"]

    def of(self, prompt_ids: tuple, call: int) -> list[list[int]]:
        """The same lists for both trainers: sampled once per (prompt, call)."""
        answer = self.answer[prompt_ids]  # KeyError: this trainer encoded the prompt differently
        if (prompt_ids, call) not in self.made:
            made = self._make(prompt_ids, call, answer)
            if (self.number[prompt_ids], call) in self.still:
                made = [self._text(f"The answer is {int(answer) + k + 1}.") + [self.eos] for k in range(G)]
            self.made[prompt_ids, call] = made
        return self.made[prompt_ids, call]

    @torch.no_grad()
    def _make(self, prompt_ids: tuple, call: int, answer: str) -> list[list[int]]:
        g = torch.Generator().manual_seed(zlib.crc32(repr((call, prompt_ids)).encode()))
        ids = torch.tensor([prompt_ids])
        for _ in range(C):
            logits = self.model(input_ids=ids).logits[:, -1].float()
            ids = torch.cat([ids, torch.multinomial(torch.softmax(logits, -1), 1, generator=g)], 1)
        sample = ids[0, len(prompt_ids) :].tolist()
        if self.eos in sample:
            sample = sample[: sample.index(self.eos) + 1]
        wrong = str(int(answer) + 1 + call)
        return [
            self._text(answer) + [self.eos],
            self._text(f"The answer is {wrong}.") + [self.eos],
            sample,
            self._text(f"{answer}, since adding the tens and then the units gives it")[:C],
        ]


def _trl_rollout(completions):
    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        call = completions.calls["trl"] = completions.calls.get("trl", 0) + 1
        out = []
        for start in range(0, len(prompt_ids), num_generations):
            out += completions.of(tuple(prompt_ids[start]), call)[:num_generations]
        return out, None

    return generate


def _our_rollout(completions, pad):
    def generate_groups(model, prompt_ids, prompt_mask, num_generations, max_new_tokens, **kw):
        call = completions.calls["ours"] = completions.calls.get("ours", 0) + 1
        rows = []
        for ids, mask in zip(prompt_ids, prompt_mask):
            rows += completions.of(tuple(ids[mask.bool()].tolist()), call)[:num_generations]
        c_ids = torch.full((len(rows), max_new_tokens), pad, dtype=torch.long)
        c_mask = torch.zeros_like(c_ids)
        for i, r in enumerate(rows):
            c_ids[i, : len(r)], c_mask[i, : len(r)] = torch.tensor(r), 1
        logps = torch.zeros(c_ids.shape)  # unread: fp32 on the policy's own forward is exact, uncorrected
        return c_ids, c_mask, logps if kw.get("return_logprobs") else None

    return generate_groups


class StepSpy:
    """Every optimizer step's gradients (as the step sees them: after clipping) and hyperparameters."""

    def __init__(self):
        self.steps = []

    def __enter__(self):
        def hook(opt, args, kwargs):
            groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            grads = {id(p): p.grad.detach().clone() for g in opt.param_groups for p in g["params"]
                     if p.grad is not None}  # fmt: skip
            self.steps.append((groups, grads))

        self.handle = register_optimizer_step_pre_hook(hook)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


# A reward of the completion's text alone that leaves some completions unscored (None), loaded by both
# trainers from one file. Alone: every group at both steps holds unscored rows beside two or more different
# scores (TRL leaves the unscored out of the group's mean and std and gives them advantage 0; filling them
# with the group's mean shrank the std: 14% off TRL's gradient). Beside accuracy, under normalize_then_sum:
# a function that scores some rows only (without the aggregation, 18% off).
REWARD_SOURCE = """
def shape(completions, **kwargs):
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [None if len(t) % 4 == 2 else (len(t) % 5) / 4 for t in texts]
"""
REWARDS = {
    "accuracy": dict(funcs=["accuracy"], weights=None, aggregation="sum_then_normalize"),
    "accuracy + shape, normalize_then_sum": dict(
        funcs=["accuracy", "shape"], weights=[1.0, 0.5], aggregation="normalize_then_sum"
    ),
    "shape alone, rows unscored": dict(funcs=["shape"], weights=None, aggregation="sum_then_normalize"),
}


def _reward_spec(model_dir, name):
    """--reward's spec of a REWARDS function: a built-in's name, or the shared file's function."""
    if name == "accuracy":
        return name
    path = model_dir / "rewards.py"
    if not path.exists():
        path.write_text(REWARD_SOURCE)
    return f"{path}:{name}"


def _train_trl(model_dir, rows, completions, loss_type="dapo", clip=1.0, kl=None, rewards=None, spg=1, ga=1):
    rewards, kl = rewards or REWARDS["accuracy"], kl or KL["none"]
    tok = load_tokenizer(str(model_dir))
    args = trl.GRPOConfig(
        output_dir=str(model_dir / "trl"), per_device_train_batch_size=N_PROMPTS * G // spg,
        gradient_accumulation_steps=ga, steps_per_generation=spg, shuffle_dataset=False, num_generations=G,
        max_completion_length=C, learning_rate=LR,
        lr_scheduler_type="linear", max_grad_norm=clip, loss_type=loss_type, max_steps=STEPS, **kl,
        logging_steps=1, save_strategy="no", report_to="none", bf16=False, use_cpu=True, seed=0,
        disable_tqdm=True, reward_weights=rewards["weights"],
        multi_objective_aggregation=rewards["aggregation"],
    )  # fmt: skip
    funcs = [load_reward(_reward_spec(model_dir, f)) for f in rewards["funcs"]]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.GRPOTrainer(model=model, reward_funcs=funcs, args=args,
                                  train_dataset=Dataset.from_list(rows), processing_class=tok)  # fmt: skip
    trainer._generate_single_turn = _trl_rollout(completions)
    with StepSpy() as spy:
        trainer.train()
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    logs = [r for r in trainer.state.log_history if "reward" in r]
    return spy, names, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, logs


def _train_ours(
    model_dir, rows, completions, tmp_path, monkeypatch, loss_type="dapo", clip=1.0, kl=None, rewards=None,
    spg=1, ga=1,
):  # fmt: skip
    rewards, kl = rewards or REWARDS["accuracy"], kl or KL["none"]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = parse_config([
        "--model", str(model_dir), "--dataset", str(data), "--output-dir",
        str(tmp_path / "ours"), "--num-generations", str(G), "--prompts-per-step", str(N_PROMPTS * ga // spg),
        "--steps-per-generation", str(spg), "--gradient-accumulation-steps", str(ga), "--no-shuffle-dataset",
        "--max-completion-length", str(C), "--learning-rate", str(LR), "--lr-scheduler-type", "linear",
        "--max-grad-norm", str(clip), "--loss-type", loss_type, "--max-steps",
        str(STEPS), "--no-bf16", "--rollout", "native", "--eval-max-samples", "0", "--save-steps", "0",
        "--seed", "0", "--multi-objective-aggregation", rewards["aggregation"],
        *[a for f in rewards["funcs"] for a in ("--reward", _reward_spec(model_dir, f))],
        *(["--reward-weights", *map(str, rewards["weights"])] if rewards["weights"] else []),
        *[a for k, v in kl.items() for a in ((f"--{k}".replace("_", "-"), str(v)) if v is not True
                                               else (f"--{k}".replace("_", "-"),))],
    ])  # fmt: skip
    tok = load_tokenizer(str(model_dir))
    monkeypatch.setattr(step_mod, "generate_groups", _our_rollout(completions, tok.pad_token_id))
    models, setup = [], train_mod.setup

    def spied_setup(cfg):
        run = setup(cfg)
        models.append(run.model)  # the run releases it when it ends
        return run

    monkeypatch.setattr(train_mod, "setup", spied_setup)
    with StepSpy() as spy:
        train_mod.train(cfg)
    model = models[0]
    names = {id(p): n for n, p in model.named_parameters()}
    records = [json.loads(x) for x in (tmp_path / "ours" / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "loss" in r]
    return spy, names, {n: p.detach().clone() for n, p in model.named_parameters()}, records


def _by_name(grads, names):
    return {names[i]: g for i, g in grads.items()}


# Groups whose completions are all wrong (advantages all 0) leave our optimization
# (skip_zero_advantage_groups, on by default) and stay in TRL's: one group at both steps under each
# normalizer (dapo: the step's tokens, grpo: rows, bnpo: the micro-batch's tokens), and every group at the
# first step (our optimizer still steps, on zero gradients, so that AdamW's step count and the schedule match
# TRL's at the second). Gradients are clipped at 1.0 in the mixed case; with still groups not at all (1e9),
# so that a loss of the wrong scale (a normalizer that lost the rows or tokens left out) shows in the
# gradient rather than being clipped away.
# With beta != 0 both trainers keep a frozen reference (the initial weights) and add TRL 1.16's default KL:
# k3 times the importance ratio (use_bias_correction_kl). The reference equals the policy at the first step
# (KL and its gradient 0), not at the second: there, the KL without the ratio (this trainer before it had
# the option) puts the gradient 3.3% off TRL's, against the tolerance of 0.01%.
BETA = 0.04
# sync_ref_model (TR-DPO, TRL's callback): after step 1 the reference is 0.6 x policy + 0.4 x base, which the
# KL of step 2 reads (without the sync, its gradient is 2.5% off TRL's)
KL = {
    "none": dict(beta=0.0),
    "k3": dict(beta=BETA),
    "k3, reference synced": dict(
        beta=BETA, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.6
    ),
    # Skywork-OR1's adaptive entropy control (TRL's use_adaptive_entropy), beside the KL options: no bonus at
    # the first step (no entropy measured before it; a bonus of 0.02 there puts the gradient off TRL's), the
    # step's entropy (a few nats) under the target raises the coefficient to 0.02 + 0.05 for the second;
    # the bonus trains the still groups too (none is skipped)
    "adaptive entropy": dict(
        beta=0.0, use_adaptive_entropy=True, entropy_coef=0.02, entropy_coef_delta=0.05, entropy_target=100.0
    ),
}
STILL = {
    "mixed": (),
    "one still group": ((1, 1), (1, 2)),
    "all still at step 1": tuple((k, 1) for k in range(N_PROMPTS)),
}


# steps_per_generation 2 (spg, micro-batches per generation; ga: per optimizer step): with ga 1, one rollout
# of the four prompts feeds both optimizer steps, two prompts each (TRL: per_device_train_batch_size of two
# groups). The second step is off-policy: its ratio is to the log-probs taken before the first (TRL takes
# them at generation), and dapo divides each step by half the generation's tokens (TRL's num_items_in_batch
# x gradient_accumulation_steps / steps_per_generation). TRL shuffles the generation's rows before cutting it
# into steps, ours cuts it by whole groups in the sampler's order: the test holds TRL's shuffle to the
# identity, and both samplers to the file's order (shuffle_dataset off). With ga 2 each step is two micro-
# batches of two groups: cispo, normalized like dapo over the step's tokens, took each micro-batch at half
# its weight before (the gradient half of TRL's). Cases whose normalizer is in question run unclipped (a
# still group), where a factor on the gradient shows.
CASES = [
    ("dapo", "mixed", "none", "accuracy", 1, 1),
    ("dapo", "one still group", "none", "accuracy", 1, 1),
    ("grpo", "one still group", "none", "accuracy", 1, 1),
    ("bnpo", "one still group", "none", "accuracy", 1, 1),
    ("dapo", "all still at step 1", "none", "accuracy", 1, 1),
    ("dapo", "mixed", "k3", "accuracy", 1, 1),
    ("dapo", "mixed", "k3, reference synced", "accuracy", 1, 1),
    ("dapo", "mixed", "none", "accuracy + shape, normalize_then_sum", 1, 1),
    ("dapo", "mixed", "none", "shape alone, rows unscored", 1, 1),
    ("dapo", "one still group", "none", "accuracy", 2, 1),
    ("bnpo", "one still group", "none", "accuracy", 2, 1),
    ("dapo", "mixed", "k3, reference synced", "accuracy", 2, 1),
    ("cispo", "one still group", "none", "accuracy", 2, 2),
    ("dapo", "one still group", "adaptive entropy", "accuracy", 1, 1),
    ("grpo", "one still group", "adaptive entropy", "accuracy", 2, 1),
]


@pytest.mark.slow
@pytest.mark.parametrize("loss_type, still, kl, rewards, spg, ga", CASES)
def test_two_steps_move_the_weights_as_trl(
    two_layer_dir, tmp_path, monkeypatch, loss_type, still, kl, rewards, spg, ga
):
    rows = [{k: r[k] for k in ("prompt", "answer")} for r in arithmetic.dataset_rows("train")[:N_PROMPTS]]
    completions = Completions(two_layer_dir, rows, STILL[still])
    base = {n: p.detach().clone() for n, p in completions.model.named_parameters()}
    clip = 1.0 if still == "mixed" else 1e9
    monkeypatch.setattr("trl.trainer.grpo_trainer.shuffle_sequence_dict", lambda batch: batch)
    t_spy, t_names, t_after, t_logs = _train_trl(
        two_layer_dir, rows, completions, loss_type, clip, KL[kl], REWARDS[rewards], spg, ga
    )
    o_spy, o_names, o_after, records = _train_ours(
        two_layer_dir, rows, completions, tmp_path, monkeypatch, loss_type, clip, KL[kl], REWARDS[rewards],
        spg, ga,
    )  # fmt: skip
    o_rewards, t_rewards = [r["reward_mean"] for r in records], [r["reward"] for r in t_logs]

    generations = STEPS * ga // spg
    assert completions.calls == {"trl": generations, "ours": generations}
    # each generation: the whole 4-row dataset, so both batches hold the same prompts and completions
    assert len(o_rewards) == generations
    assert o_rewards == pytest.approx(t_rewards, abs=1e-6), (o_rewards, t_rewards)
    zero_std = [r["frac_reward_zero_std"] for r in records]
    assert zero_std == pytest.approx([r["frac_reward_zero_std"] for r in t_logs], abs=1e-6)
    stills = [sum(1 for k, c in STILL[still] if c == call) for call in range(1, generations + 1)]
    bonus = "use_adaptive_entropy" in KL[kl]
    if rewards == "accuracy":  # right or wrong: a still group is one whose rewards are all equal
        assert 0 < t_rewards[-1] < 1
        skipped = [0 if bonus else n for n in stills]
        assert [r["zero_advantage_groups_skipped"] for r in records] == skipped
        assert zero_std == [s / N_PROMPTS for s in stills]
    if bonus:  # the coefficient after the rollout's steps; TRL logs it after each optimizer step
        assert records[-1]["entropy_coef"] == pytest.approx(0.02 + 0.05 * STEPS)
        if spg == 1:
            assert [r["entropy_coef"] for r in records] == pytest.approx([r["entropy_coef"] for r in t_logs])
    assert len(o_spy.steps) == len(t_spy.steps) == STEPS
    for k, ((t_groups, t_grads), (o_groups, o_grads)) in enumerate(zip(t_spy.steps, o_spy.steps)):
        for key in ("lr", "betas", "eps", "weight_decay"):  # the schedule's lr at this step, AdamW's settings
            assert {g[key] for g in o_groups} == {g[key] for g in t_groups}, (k, key, o_groups, t_groups)
        t, o = _by_name(t_grads, t_names), _by_name(o_grads, o_names)
        assert set(o) == set(t)
        diff = sum(float((o[n] - t[n]).double().square().sum()) for n in t) ** 0.5
        norm = sum(float(t[n].double().square().sum()) for n in t) ** 0.5
        if spg == ga and stills[k] == N_PROMPTS and not bonus:  # every advantage 0: zero gradients in both
            assert norm == 0 and diff == 0, (k, diff)
            continue
        assert norm > 0 and diff <= 1e-4 * norm, (k, diff, norm)
    moved = {n: t_after[n] - base[n] for n in base}
    diff = sum(float((o_after[n] - base[n] - moved[n]).double().square().sum()) for n in base) ** 0.5
    norm = sum(float(m.double().square().sum()) for m in moved.values()) ** 0.5
    assert norm > 0 and diff <= 1e-3 * norm, (diff, norm)


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant", "constant_with_warmup"])
@pytest.mark.parametrize("warmup", [0, 0.1, 0.25, 3])
def test_learning_rate_schedules_are_transformers_own(kind, warmup, tmp_path):
    """Our --lr-scheduler-type / --warmup-steps give the factors transformers' `get_scheduler` gives under
    TRL's Trainer (its warmup count from TrainingArguments.get_warmup_steps), at every step."""
    from transformers import TrainingArguments, get_scheduler

    for max_steps in (1, 7, 40):
        cfg = parse_config(["--output-dir", str(tmp_path), "--lr-scheduler-type", kind, "--warmup-steps",
                            str(warmup), "--max-steps", str(max_steps)], require_reward=False)  # fmt: skip
        ours = setup_mod.lr_lambda(cfg)
        args = TrainingArguments(output_dir=str(tmp_path), warmup_steps=warmup, lr_scheduler_type=kind)
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        theirs = get_scheduler(kind, opt, num_warmup_steps=args.get_warmup_steps(max_steps),
                               num_training_steps=max_steps)  # fmt: skip
        for step in range(max_steps):
            assert ours(step) == pytest.approx(theirs.get_last_lr()[0], abs=1e-12), (max_steps, step)
            opt.step()
            theirs.step()


def test_warmup_steps_refuses_what_transformers_would_not_mean(tmp_path):
    for bad in ("-1", "2.5"):
        with pytest.raises(ValueError, match="warmup_steps must be a whole number"):
            parse_config(["--output-dir", str(tmp_path), "--warmup-steps", bad], require_reward=False)
    config = tmp_path / "c.json"
    config.write_text('{"warmup_ratio": 0.1}')
    with pytest.raises(ValueError, match="warmup_ratio is warmup_steps now"):
        parse_config(["--config", str(config)], require_reward=False)
