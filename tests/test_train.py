"""The trainer end to end on the embedded tiny base model (seconds per test)."""

import json
import math
import shutil

import pytest
import torch
from oracle import naive_advantages, naive_grpo_loss
from replay import first_step_batch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import grpo_fast.trainer.setup as setup_mod
from grpo_fast.rewards import RewardError
from grpo_fast.tasks import default_task
from grpo_fast.trainer.batching import Packer
from grpo_fast.trainer.config import GRPOConfig, generation_steps, parse_config, prompts_per_rollout
from grpo_fast.trainer.data import PromptSampler
from grpo_fast.trainer.step import sampling_correction
from grpo_fast.trainer.train import train

ASSET = default_task.ASSET_DIR
QUICK = [
    "--num-generations",
    "4",
    "--prompts-per-step",
    "2",
    "--max-completion-length",
    "16",
    "--eval-max-samples",
    "0",
    "--save-steps",
    "0",
    "--warmup-steps",
    "0",
    "--lr-scheduler-type",
    "constant",
]


def _cfg(tmp_path, *extra):
    return parse_config(["--output-dir", str(tmp_path / "run"), *QUICK, *extra])


def _records(tmp_path):
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


def _sgd(params, optim, lr, *args, **kwargs):
    """build_optimizer's signature, plain SGD's update: params after - before = -lr * grad, grads readable
    back."""
    return torch.optim.SGD(params, lr=lr)


SPLITS = ["--group-split", "2"]  # each group of 4 in sub-batches of 2 completions, each carrying its prompt


@pytest.mark.parametrize(
    "loss_type,beta,extra,pack",
    [
        ("dapo", 0.0, [], None),
        ("grpo", 0.04, [], None),
        ("dr_grpo", 0.0, [], None),
        ("bnpo", 0.04, [], None),
        ("dapo", 0.04, SPLITS, None),
        ("bnpo", 0.0, SPLITS, None),
        ("grpo", 0.0, [*SPLITS, "--gradient-accumulation-steps", "2", "--no-share-prefix"], None),
        ("dr_grpo", 0.04, ["--group-split", "1"], None),
        # packed as --max-memory-gb packs (grpo_fast.trainer.batching), a micro-batch's cost here its
        # completions:
        ("bnpo", 0.04, [], 3),  # rows 0-2 | 3 with 4-5 (a ragged micro-batch) | 6-7
        ("grpo", 0.0, ["--no-share-prefix"], 3),
        ("dapo", 0.0, [], 8),  # both groups in one micro-batch
        ("bnpo", 0.0, ["--gradient-accumulation-steps", "2"], 3),  # per chunk: 3 + 1
    ],
)
def test_one_step_equals_naive_grpo(tmp_path, monkeypatch, loss_type, beta, extra, pack):
    """One step's update against full logits and plain formulas over the whole batch at once, also when the
    groups are trained in sub-batches (--group-split), micro-batches, or packed to a budget: the same
    gradients."""
    lr, seed, T = 1e-2, 7, 0.9
    monkeypatch.setattr(setup_mod, "build_optimizer", _sgd)
    if pack is not None:
        packer = Packer(lambda groups, P, C: sum(len(lens) for _, lens in groups), pack)
        monkeypatch.setattr(setup_mod, "plan_memory", lambda cfg, dist, device: (cfg, None, packer))
    cfg = _cfg(
        tmp_path,
        "--max-steps",
        "1",
        "--learning-rate",
        str(lr),
        "--max-grad-norm",
        "1e9",
        "--seed",
        str(seed),
        "--temperature",
        str(T),
        "--loss-type",
        loss_type,
        "--beta",
        str(beta),
        *extra,
    )
    train(cfg)
    after = load_file(tmp_path / "run" / "checkpoint-1" / "model.safetensors")

    # the same step, naively: same prompts, same sampled completions, full logits and plain formulas
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(ASSET)
    ref_model = AutoModelForCausalLM.from_pretrained(ASSET)
    b = first_step_batch(cfg, model, seed, temperature=T)
    c_ids, c_mask, adv, P = b.completion_ids, b.completion_mask, b.advantages, b.P

    def logps(m):
        logits = m(input_ids=b.full_ids, attention_mask=b.full_mask, position_ids=b.position_ids).logits
        logits = logits[:, P - 1 : -1].double() / T
        return torch.log_softmax(logits, -1).gather(-1, c_ids[..., None]).squeeze(-1)

    with torch.no_grad():
        ref = logps(ref_model)
    loss, _ = naive_grpo_loss(
        logps(model), adv, c_mask, ref_logps=ref, beta=beta, loss_type=loss_type, max_completion_length=16
    )
    loss.backward()
    before = dict(model.named_parameters())
    checked = 0
    for name, p in before.items():
        if name not in after:
            continue  # tied lm_head: its gradient is on embed_tokens
        got = (p.detach() - after[name]) / lr
        err = (got - p.grad).abs().max().item()
        assert err <= 1e-4 * max(1.0, p.grad.abs().max().item()), f"{name}: max grad err {err:.3g}"
        checked += 1
    assert checked == len(after)
    assert any(p.grad.abs().max() > 0 for p in before.values())


def test_engine_logprobs_reach_the_loss_with_every_option(tmp_path):
    """The native engine's log-probs travel to the loss: its mismatch to the trainer is rounding, the
    off-policy mask keeps everything, and VESPO's weight is phi(1) = 1 on-policy; TRL's correction is on only
    for an engine that is not the training forward (vLLM). The engine on batch buckets (`graphs`: CUDA
    graphs' path, run eagerly on a CPU), its graph metrics logged."""
    cfg = _cfg(
        tmp_path, "--max-steps", "2", "--loss-type", "vespo", "--off-policy-mask-threshold", "0.1",
        "--top-entropy-quantile", "0.5", "--entropy-coef", "0.01", "--beta", "0.04",
        "--rollout-compile", "graphs",
    )  # fmt: skip
    train(cfg)
    rec = [r for r in _records(tmp_path) if "loss" in r][-1]
    assert rec["rollout/cuda_graphs"] == 0 and rec["rollout/capture_s"] == 0  # no CUDA here
    assert abs(rec["loss/sampling_k3"]) < 1e-6 and rec["loss/sampling_logp_diff_max"] < 1e-3
    assert rec["loss/off_policy_masked_fraction"] == 0.0
    assert abs(rec["loss/vespo_phi_mean"] - 1.0) < 1e-4
    assert rec["loss/entropy"] > 0 and "loss/is_ratio_mean" not in rec  # exact engine: no correction
    assert sampling_correction(cfg, "native") is None and sampling_correction(cfg, "reference") is None
    assert sampling_correction(cfg, "vllm") == "sequence_mask"
    off = parse_config(["--no-vllm-importance-sampling-correction"])
    assert sampling_correction(off, "vllm") is None


# sync_ref_model: the reference moves every step, so a resumed run must restore it (not rebuild the base)
SYNCED = ["--beta", "0.04", "--sync-ref-model", "--ref-model-sync-steps", "1"]
# adaptive entropy control: the coefficient and the last step's entropy, which gates the next step's bonus
ADAPTIVE = ["--use-adaptive-entropy", "--entropy-coef", "0.01", "--entropy-coef-delta", "0.05",
            "--entropy-target", "100"]  # fmt: skip


@pytest.mark.parametrize(
    "extra",
    [[], SYNCED, ["--steps-per-generation", "2"], ADAPTIVE],
    ids=["fixed reference", "synced reference", "a rollout for two steps", "adaptive entropy"],
)
def test_resume_reproduces_uninterrupted_run(tmp_path, extra):
    full_dir, part_dir = tmp_path / "full", tmp_path / "part"
    full_dir.mkdir()
    part_dir.mkdir()
    train(_cfg(full_dir, "--max-steps", "4", "--learning-rate", "1e-4", *extra))
    train(_cfg(part_dir, "--max-steps", "2", "--learning-rate", "1e-4", *extra))
    # as if killed during step 3: its metrics record written, its save torn before the rename
    with open(part_dir / "run" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "loss": 99.0}) + "\n")
    (part_dir / "run" / ".checkpoint-3-torn").mkdir()
    train(_cfg(part_dir, "--max-steps", "4", "--learning-rate", "1e-4", "--resume", *extra))
    assert not (part_dir / "run" / ".checkpoint-3-torn").exists()
    keys = ("reward_mean", "loss", "completion_len_mean", "grad_norm", "clip_ratio", "kl")
    if extra == ADAPTIVE:  # the bonus from the second step on, its coefficient rising by the delta
        keys += ("entropy_coef",)
        assert [r["entropy_coef"] for r in _records(full_dir) if "loss" in r] == pytest.approx(
            [0.06, 0.11, 0.16, 0.21]
        )
    a = [r for r in _records(full_dir) if "loss" in r]
    b = [r for r in _records(part_dir) if "loss" in r]
    assert [r["step"] for r in b] == ([2, 4] if "--steps-per-generation" in extra else [1, 2, 3, 4])
    for ra, rb in zip(a, b):
        for k in keys:
            assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-7), (ra["step"], k)


def test_demo_defaults_log_metrics_plot_and_checkpoint(tmp_path):
    summary = train(
        parse_config(
            [
                "--output-dir",
                str(tmp_path / "run"),
                "--max-steps",
                "3",
                "--eval-steps",
                "3",
                "--eval-max-samples",
                "16",
            ]
        )
    )
    recs = _records(tmp_path)
    steps = [r for r in recs if "reward_mean" in r]
    evals = [r for r in recs if "eval_accuracy" in r]
    assert len(steps) == 3 and [e["step"] for e in evals] == [0, 3]
    for k in (
        "step",
        "reward_mean",
        "reward_std",
        "rewards/shop_answer_reward_mean",
        "kl",
        "clip_ratio",
        "completion_len_mean",
        "tokens_per_s",
        "peak_mem_mb",
        "lr",
    ):
        assert k in steps[0], k
    run = tmp_path / "run"
    assert (run / "curves.png").stat().st_size > 1000
    resolved = json.loads((run / "config.json").read_text())
    assert resolved["learning_rate"] == 1e-4
    # the model-level kernels in use are on record (none here: no CUDA, flag off)
    assert resolved["liger_kernels"] is False and resolved["resolved"]["liger_kernels"] is False
    assert "flash_attn" in resolved["resolved"] and resolved["resolved"]["world_size"] == 1
    ckpt = run / "checkpoint-3"
    reloaded = AutoModelForCausalLM.from_pretrained(ckpt)  # loadable by transformers
    assert sum(p.numel() for p in reloaded.parameters()) > 0
    assert summary["checkpoint"] == str(ckpt)


def test_log_completions_writes_and_prints_what_was_scored(tmp_path, capsys):
    """--log-completions: each logged step's prompts, completions, scores and advantages in completions.jsonl
    (the advantages those scores give by the group formula; the rewards those of metrics.jsonl), the first
    --num-completions-to-print of them printed; a resumed run drops the samples of the steps it redoes."""
    log = ["--log-completions", "--num-completions-to-print", "3", "--logging-steps", "2"]
    train(_cfg(tmp_path, "--max-steps", "3", "--save-steps", "2", *log))
    samples = [json.loads(x) for x in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert [x["step"] for x in samples] == [2] * 8 + [3] * 8  # logged steps: every 2nd, and the last
    records = {r["step"]: r for r in _records(tmp_path) if "reward_mean" in r}
    for step in (2, 3):
        rows = [x for x in samples if x["step"] == step]
        rewards = torch.tensor([x["rewards"]["shop_answer_reward"] for x in rows])
        assert float(rewards.mean()) == pytest.approx(records[step]["reward_mean"], abs=1e-6)
        want = naive_advantages(rewards, 4)
        assert [x["advantage"] for x in rows] == pytest.approx(want.tolist(), abs=1e-5)
        assert all(isinstance(x["completion"], str) and x["prompt"] for x in rows)
    printed = capsys.readouterr().out
    assert printed.count("[completion]") == 6 and printed.count("--- step 2") == 3
    shutil.rmtree(tmp_path / "run" / "checkpoint-3")  # as if killed before its save: step 3 is redone
    train(_cfg(tmp_path, "--max-steps", "3", "--resume", *log))  # from checkpoint-2
    again = [json.loads(x) for x in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert [x["step"] for x in again] == [2] * 8 + [3] * 8 and again[:8] == samples[:8]


def test_no_shuffle_dataset_trains_the_prompts_in_file_order(tmp_path):
    """--no-shuffle-dataset (TRL's shuffle_dataset=False): step k trains rows 2k, 2k+1 of the file, through
    the epoch's end into the next (the same order again); shuffled, the first steps are not the file's."""
    rows = [{"prompt": f"What is {i} + 1 ?", "answer": str(i + 1)} for i in range(5)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["--dataset", str(data), "--reward", "integer_answer", "--max-steps", "4", "--log-completions",
              "--num-completions-to-print", "0"]  # fmt: skip
    order = {}
    for name, flags in (("ordered", ["--no-shuffle-dataset"]), ("shuffled", [])):
        train(parse_config(["--output-dir", str(tmp_path / name), *QUICK, *common, *flags]))
        samples = (tmp_path / name / "completions.jsonl").read_text().splitlines()
        order[name] = [json.loads(x)["prompt"] for x in samples][::4]  # one per group of 4
    want = [rows[i % 5]["prompt"] for i in range(8)]  # 5 rows: the 2nd epoch starts at step 3's second
    assert order["ordered"] == want
    assert sorted(order["shuffled"][:5]) == sorted(want[:5]) and order["shuffled"] != want


def test_chat_template_kwargs_reach_the_prompts(tmp_path):
    """--chat-template-kwargs (TRL's chat_template_kwargs, e.g. '{"enable_thinking": false}' for Qwen3): the
    prompts the model is given are rendered with them (a template that writes a marker when `mark` is set)."""
    model_dir = tmp_path / "marked"
    shutil.copytree(ASSET, model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = (
        "{% if mark %}MARKED {% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %} ={% endif %}"
    )
    tok.save_pretrained(model_dir)
    data = tmp_path / "rows.jsonl"
    row = {"prompt": [{"role": "user", "content": "What is 2 + 1 ?"}], "answer": "3"}
    data.write_text((json.dumps(row) + "\n") * 2)
    prompts = {}
    for name, flags in (("plain", []), ("marked", ["--chat-template-kwargs", '{"mark": true}'])):
        argv = ["--model", str(model_dir), "--dataset", str(data), "--reward", "integer_answer",
                "--max-steps", "1", "--log-completions", "--num-completions-to-print", "0",
                *flags]  # fmt: skip
        train(parse_config(["--output-dir", str(tmp_path / name), *QUICK, *argv]))
        prompts[name] = json.loads((tmp_path / name / "completions.jsonl").read_text().splitlines()[0])[
            "prompt"
        ]
    assert prompts == {"plain": "What is 2 + 1 ? =", "marked": "MARKED What is 2 + 1 ? ="}


def test_min_p_and_repetition_penalty_reach_the_rollout(tmp_path, monkeypatch):
    """--min-p and --repetition-penalty (TRL's names; the penalty's default TRL's 1.0, off) are the
    rollout's: every generate_groups call of a run samples with them."""
    import grpo_fast.trainer.step as step_mod

    trl = pytest.importorskip("trl")
    trl_default = trl.GRPOConfig.__dataclass_fields__["repetition_penalty"].default
    assert GRPOConfig().repetition_penalty == trl_default == 1.0
    seen, real = [], step_mod.generate_groups
    pick = lambda k: (k["min_p"], k["repetition_penalty"])  # noqa: E731
    monkeypatch.setattr(step_mod, "generate_groups", lambda *a, **k: seen.append(pick(k)) or real(*a, **k))
    train(_cfg(tmp_path, "--max-steps", "2", "--min-p", "0.3", "--repetition-penalty", "1.2"))
    assert seen == [(0.3, 1.2), (0.3, 1.2)]


def test_num_generations_eval_scores_sampled_held_out_completions(tmp_path, monkeypatch):
    """--num-generations-eval N (TRL's name): beside greedy accuracy, N completions a held-out prompt sampled
    as training samples them; eval_sampled_accuracy and eval_pass_at_n are counted here by hand from those
    completions (the first reward function called directly, prompt by prompt); every evaluation draws alike
    (the same numbers twice) and leaves the training generator where it was; near-greedy sampling scores what
    greedy decoding scores."""
    import grpo_fast.trainer.evaluate as eval_mod

    N, calls, real = 4, [], eval_mod.generate_groups

    def spy(*a, **k):
        out = real(*a, **k)
        calls.append((a, k, out))
        return out

    monkeypatch.setattr(eval_mod, "generate_groups", spy)
    run = setup_mod.setup(_cfg(tmp_path, "--eval-max-samples", "10", "--num-generations-eval", str(N)))
    state = run.generator.get_state()
    ev = eval_mod.evaluate(run.policy, run.tokenizer, run.eval_rows, run.reward_funcs, run.cfg, run.device)
    assert torch.equal(run.generator.get_state(), state)
    sampled = [(a, k, out) for a, k, out in calls if a[3] == N]
    assert len(sampled) == 1 and sampled[0][1]["temperature"] == run.cfg.temperature
    assert sampled[0][1]["generator"] is not run.generator
    (_, ids, mask, *_), _, (comp, cmask) = sampled[0]
    texts = run.tokenizer.batch_decode(comp * cmask, skip_special_tokens=True)
    func, rows = run.reward_funcs[0], run.eval_rows
    hits = []
    for p, row in enumerate(rows):
        prompt = run.tokenizer.decode(ids[p][mask[p].bool()], skip_special_tokens=False)
        columns = {k: [row[k]] * N for k in row if k != "prompt"}
        columns["completion_ids"] = [c[m.bool()].tolist() for c, m in zip(comp[p * N : (p + 1) * N], cmask)]
        paid = func([prompt] * N, texts[p * N : (p + 1) * N], **columns)
        hits.append([v is not None and v >= 1.0 - 1e-6 for v in paid])
    assert ev["eval_sampled_accuracy"] == pytest.approx(sum(map(sum, hits)) / (N * len(rows)))
    assert ev["eval_pass_at_n"] == pytest.approx(sum(map(any, hits)) / len(rows))
    assert 0 < ev["eval_sampled_accuracy"] < ev["eval_pass_at_n"]  # the samples differ
    again = eval_mod.evaluate(run.policy, run.tokenizer, run.eval_rows, run.reward_funcs, run.cfg, run.device)
    assert again == ev
    run.cfg.temperature = 1e-4  # a one-hot softmax: every sample is the greedy completion
    cold = eval_mod.evaluate(run.policy, run.tokenizer, run.eval_rows, run.reward_funcs, run.cfg, run.device)
    assert cold["eval_sampled_accuracy"] == cold["eval_pass_at_n"] == cold["eval_accuracy"]


def test_a_rollout_cut_by_max_steps_trains_its_untrained_prompts_on_resume(tmp_path):
    """Two steps a rollout, --max-steps 3: the second rollout trains its first step only; its checkpoint's
    sampler sits before the second step's prompts, so a --resume to step 4 trains the prompts the
    uninterrupted 4-step run trains at step 4 (not the next ones)."""
    every = ["--steps-per-generation", "2", "--log-completions", "--num-completions-to-print", "0"]
    G = int(QUICK[QUICK.index("--num-generations") + 1])

    def rollouts(root):  # each logged rollout's prompts, a group's once, in the sampler's order
        lines = (root / "run" / "completions.jsonl").read_text().splitlines()
        recs = [json.loads(x) for x in lines][::G]
        return {s: [r["prompt"] for r in recs if r["step"] == s] for s in sorted({r["step"] for r in recs})}

    full, part = tmp_path / "full", tmp_path / "part"
    train(_cfg(full, "--max-steps", "4", *every))
    train(_cfg(part, "--max-steps", "3", *every))
    state = json.loads((part / "run" / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["sampler"] == {"epoch": 0, "pos": 2 * 4 - 2}  # two rollouts of 4 prompts, 2 untrained
    train(_cfg(part, "--max-steps", "4", "--resume", *every))
    want, got = rollouts(full), rollouts(part)
    assert len(want[4]) == len(got[4]) == 4 and want[2] == got[2]
    assert got[3] == want[4]  # the cut rollout drew what the uninterrupted one did for steps 3 and 4
    assert got[4][:2] == want[4][2:]  # step 4's prompts, drawn again after the resume


def test_the_sampler_rewinds_across_epochs():
    """`rewound(state, n)`: a sampler loaded with it draws the n prompts before `state` again, also back
    across an epoch's end (each epoch shuffled by its own seed)."""
    rows = [{"prompt": str(i)} for i in range(5)]
    s = PromptSampler(rows, 3, seed=7)
    drawn = [r["prompt"] for _ in range(4) for r in s.next()]  # 12 prompts: into the third epoch
    again = PromptSampler(rows, 3, seed=7)
    again.load_state_dict(s.rewound(s.state_dict(), 6))
    assert [r["prompt"] for _ in range(2) for r in again.next()] == drawn[-6:]
    with pytest.raises(ValueError, match="before the first"):
        s.rewound({"epoch": 0, "pos": 2}, 3)


def test_output_dir_with_checkpoints_needs_resume_or_overwrite(tmp_path):
    train(_cfg(tmp_path, "--max-steps", "2"))
    with pytest.raises(ValueError, match="already holds checkpoints .*--resume.*--overwrite-output-dir"):
        train(_cfg(tmp_path, "--max-steps", "1"))
    train(_cfg(tmp_path, "--max-steps", "1", "--overwrite-output-dir"))
    assert [p.name for p in (tmp_path / "run").glob("checkpoint-*")] == ["checkpoint-1"]


def test_user_reward_file_receives_columns_and_local_model(tmp_path):
    # a saved local model directory (random weights, the embedded tokenizer) and a JSONL dataset
    model_dir = tmp_path / "tiny"
    tok = AutoTokenizer.from_pretrained(ASSET)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            pad_token_id=0,
            eos_token_id=1,
        )
    ).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = tmp_path / "data.jsonl"
    data.write_text(
        "\n".join(
            json.dumps({"prompt": f"A shop has {i} boxes", "answer": str(i), "level": i % 3})
            for i in range(2, 8)
        )
    )
    log = tmp_path / "calls.jsonl"
    reward = tmp_path / "my_reward.py"
    reward.write_text(f"""
import json
def my_reward(prompts, completions, answer, level, completion_ids, **kw):
    with open({str(log)!r}, "a") as f:
        f.write(json.dumps({{"n": len(completions), "answer": answer, "level": level,
                            "ids": [len(x) for x in completion_ids]}}) + "\\n")
    return [float(len(c) % 2) for c in completions]
""")
    train(
        _cfg(
            tmp_path,
            "--model",
            str(model_dir),
            "--dataset",
            str(data),
            "--reward",
            f"{reward}:my_reward",
            "--max-steps",
            "2",
            "--learning-rate",
            "1e-3",
        )
    )
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(calls) == 2 and all(c["n"] == 8 for c in calls)
    assert all(isinstance(v, int) for c in calls for v in c["level"])
    assert all(a in {str(i) for i in range(2, 8)} for c in calls for a in c["answer"])
    assert (tmp_path / "run" / "checkpoint-2" / "model.safetensors").is_file()


def test_lora_run_keeps_base_and_uses_it_as_reference(tmp_path):
    train(_cfg(tmp_path, "--lora-r", "4", "--beta", "0.04", "--max-steps", "2", "--learning-rate", "1e-2"))
    ckpt = tmp_path / "run" / "checkpoint-2"
    adapter = load_file(ckpt / "adapter_model.safetensors")
    assert adapter and all("lora" in k for k in adapter)
    steps = [r for r in _records(tmp_path) if "loss" in r]
    assert steps[-1]["kl"] > 0  # the policy moved away from the base (adapters on vs off)


# ---- bad input ----
def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    "make,words",
    [
        (lambda t: _write(t, "d.jsonl", '{"question": "x", "answer": "1"}\n'), "no 'prompt' column"),
        (lambda t: _write(t, "d.jsonl", ""), "the dataset is empty"),
        (lambda t: _write(t, "d.csv", "prompt,answer\n"), "the dataset is empty"),
        (lambda t: t / "missing.jsonl", "no such file"),
        (lambda t: _write(t, "d.jsonl", '{"prompt": "a"}\n{"prompt": \n'), "line 2 is not valid JSON"),
        (lambda t: _write(t, "d.jsonl", '["prompt"]\n'), "line 1 is not a JSON object"),
    ],
)
def test_bad_dataset(tmp_path, make, words):
    cfg = _cfg(tmp_path, "--dataset", str(make(tmp_path)), "--reward", "format")
    with pytest.raises(ValueError, match=words):
        train(cfg)


def _rows(*rows):
    return "".join(json.dumps(r) + "\n" for r in rows)


@pytest.mark.parametrize(
    "data,reward,extra,words",
    [
        # a column of row 0 missing later: the reward functions would get a KeyError after the rollout
        (
            _rows({"prompt": "a", "answer": "1"}, {"prompt": "b"}),
            "format",
            (),
            r"row 1 lacks the column\(s\) \['answer'\] that row 0 has",
        ),
        (_rows({"prompt": "a"}, {"prompt": 5}), "format", (), r"row 1: 'prompt' must be text .*got int '5'"),
        (
            _rows({"prompt": [{"role": "user"}]}, {"prompt": "b"}),
            "format",
            (),
            r"row 0: 'prompt' must be text or a list of chat messages; message 0 is not",
        ),
        (_rows({"prompt": []}, {"prompt": "b"}), "format", (), "row 0: 'prompt' .*empty list of messages"),
        # accuracy_reward(prompts, completions, answer, **_) needs an `answer` column
        (
            _rows({"prompt": "a", "solution": "1"}, {"prompt": "b", "solution": "2"}),
            "accuracy",
            (),
            r"reward function 'accuracy_reward' needs the column\(s\) \['answer'\]; the dataset has",
        ),
        (
            _rows({"prompt": "a"}, {"prompt": "b"}),
            "format",
            ("--prompts-per-step", "4"),
            r"prompts_per_step \(4\) is larger than the dataset \(2 prompts\)",
        ),
    ],
)
def test_dataset_checked_row_by_row_before_the_model_loads(tmp_path, monkeypatch, data, reward, extra, words):
    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the dataset was checked")

    monkeypatch.setattr(setup_mod, "load_model_and_tokenizer", no_model)
    path = _write(tmp_path, "d.jsonl", data)
    with pytest.raises(ValueError, match=words):
        train(_cfg(tmp_path, "--dataset", str(path), "--reward", reward, *extra))


def test_missing_files_reported_before_the_model_loads(tmp_path, monkeypatch):
    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the files were checked")

    monkeypatch.setattr(setup_mod, "load_model_and_tokenizer", no_model)
    good = _write(tmp_path, "d.jsonl", _rows({"prompt": "a"}, {"prompt": "b"}))
    answered = _rows({"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"})
    answered = _write(tmp_path, "a.jsonl", answered)
    cases = [
        (("--dataset", str(tmp_path / "missing.jsonl"), "--reward", "format"), "--dataset .*no such file"),
        (("--dataset", str(good), "--eval-dataset", str(tmp_path / "no.jsonl"), "--reward", "format"),
         "--eval-dataset .*no such file"),
        (("--dataset", str(good), "--reward", str(tmp_path / "r.py") + ":f"), "--reward .*no such file"),
        # the eval rows meet the first reward function
        (("--dataset", str(answered), "--eval-dataset", str(good), "--reward", "accuracy"),
         "--eval-dataset .*needs the column"),
    ]  # fmt: skip
    for argv, words in cases:
        with pytest.raises(ValueError, match=words):
            train(_cfg(tmp_path, *argv))


def test_unreadable_model_path(tmp_path):
    (tmp_path / "empty_dir").mkdir()
    for path in (str(tmp_path / "nope"), str(tmp_path / "empty_dir")):
        with pytest.raises(ValueError, match="--model .*not a model directory"):
            train(_cfg(tmp_path, "--model", path, "--dataset", "x.jsonl", "--reward", "format"))
    # a model path is checked before the dataset is read (both before anything loads)


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--loss-type", "ppo"], "argument --loss-type: invalid choice: 'ppo'"),
        (["--num-generations", "two"], "argument --num-generations: invalid int value"),
        (["--scale-rewards", "global"], "argument --scale-rewards: invalid choice"),
        (["--rollout", "vllm-ish"], "argument --rollout: invalid choice: 'vllm-ish'"),
        (["--no-such-flag", "1"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_unknown_flag_values(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(argv)
    assert e.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--temperature", "0"], "temperature must be > 0"),
        (["--prompts-per-step", "3", "--gradient-accumulation-steps", "2"], "must be divisible by"),
        (["--reward", "format", "--reward-weights", "1", "2"], "reward_weights has 2 values for 1"),
        (["--reward", "nonsense"], "--reward 'nonsense': expected a built-in"),
        (["--dist-timeout-s", "0"], "dist_timeout_s must be > 0"),
        (["--num-generations", "1"], "num_generations must be >= 2, got 1: .*every advantage is 0"),
        (["--delta", "0"], "delta must be > 0"),
        (["--min-p", "1.5"], r"min_p must be in \[0, 1\]"),
        (["--repetition-penalty", "0"], r"repetition_penalty must be > 0 \(1.0: off\), got 0.0"),
        (["--num-generations-eval", "0"], r"num_generations_eval must be >= 1 \(or unset: greedy only\)"),
        (
            ["--rollout", "vllm", "--repetition-penalty", "1.2", "--temperature", "0.8"],
            "processed ones, which include the penalty",
        ),
        (
            ["--rollout", "vllm", "--min-p", "0.1", "--temperature", "0.8"],
            "renormalized over the kept tokens",
        ),
        (["--sync-ref-model"], "sync_ref_model needs a reference .*beta is 0"),
        (["--sync-ref-model", "--beta", "0.04", "--lora-r", "4"], "sync_ref_model needs .*LoRA"),
        (
            ["--sync-ref-model", "--beta", "0.04", "--ref-model-sync-steps", "0"],
            "ref_model_sync_steps must be",
        ),
        (["--beta", "0.04", "--ref-model-mixup-alpha", "1.5"], r"ref_model_mixup_alpha must be in \[0, 1\]"),
        (["--top-entropy-quantile", "1.5"], r"top_entropy_quantile must be in \[0, 1\]"),
        (
            ["--use-adaptive-entropy", "--entropy-coef-min", "0.5", "--entropy-coef-max", "0.1"],
            r"entropy_coef_min \(0.5\) must be <= entropy_coef_max \(0.1\)",
        ),
        (["--use-adaptive-entropy", "--entropy-coef-delta", "-0.1"], "entropy_coef_delta must be >= 0"),
        (
            ["--prompts-per-step", "2", "--gradient-accumulation-steps", "2", "--steps-per-generation", "3"],
            r"steps_per_generation \(3\) must be a positive multiple of gradient_accumulation_steps \(2\)",
        ),
        (["--steps-per-generation", "2", "--generation-batch-size", "128"], "can not both be set"),
        (
            ["--prompts-per-step", "2", "--num-generations", "4", "--generation-batch-size", "12"],
            r"generation_batch_size \(12\) must be a positive multiple of .* = 8",
        ),
        (["--rollout", "vllm", "--loss-type", "vespo"], "vespo needs vllm_importance_sampling_mode token_"),
        (["--bf16", "--loss-type", "vespo"], "vespo needs .*16-bit training"),
        (["--dtype", "bf16", "--loss-type", "vespo"], "vespo needs vllm_importance_sampling_mode token_"),
        (
            ["--rollout", "vllm", "--top-p", "0.9", "--temperature", "0.8"],
            "renormalized over the kept tokens",
        ),
    ]
    + ([] if torch.cuda.is_available() else [(["--liger-kernels"], "--liger-kernels: .* need a CUDA")]),
)
def test_bad_config_values(tmp_path, argv, words):
    with pytest.raises(ValueError, match=words):
        train(parse_config(["--output-dir", str(tmp_path), *argv]))


def test_generation_batch_size_and_steps_per_generation_name_the_same_rollout():
    """TRL's two names for one setting: 2 optimizer steps of 2 prompts x 4 completions per rollout (with 2
    micro-batches a step: steps_per_generation 4), and the rollout's prompts."""
    base = ["--prompts-per-step", "2", "--num-generations", "4", "--gradient-accumulation-steps", "2"]
    by_rows = parse_config([*base, "--generation-batch-size", "16"])
    by_steps = parse_config([*base, "--steps-per-generation", "4"])
    assert generation_steps(by_rows) == generation_steps(by_steps) == 2
    assert prompts_per_rollout(by_rows) == prompts_per_rollout(by_steps) == 4
    assert generation_steps(parse_config(base)) == 1  # TRL's default: gradient_accumulation_steps


BAD_REWARDS = {
    "count": (
        "def f(prompts, completions, **kw):\n    return [0.0]\n",
        r"reward function 'f': returned 1 values, expected 8",
    ),
    "nan": (
        "def f(prompts, completions, **kw):\n"
        "    return [float('nan') if i == 3 else 1.0 for i in range(len(completions))]\n",
        r"reward function 'f' on sample 3: returned nan",
    ),
    "type": (
        "def f(prompts, completions, **kw):\n    return ['high'] * len(completions)\n",
        r"reward function 'f' on sample 0: returned 'high', expected a float or None",
    ),
}


@pytest.mark.parametrize("kind", list(BAD_REWARDS))
def test_bad_reward_function_stops_before_any_update(tmp_path, kind):
    code, words = BAD_REWARDS[kind]
    path = _write(tmp_path, "r.py", code)
    with pytest.raises(RewardError, match=words):
        train(_cfg(tmp_path, "--reward", f"{path}:f", "--max-steps", "2"))
    run = tmp_path / "run"
    assert not list(run.glob("checkpoint-*"))
    assert not [r for r in _records(tmp_path) if "loss" in r]  # no optimizer step on garbage


def _poisoned_dataset(tmp_path):
    rows = [
        {"prompt": default_task.prompt_text((6, 8, 6)), "answer": "42", "bad": 0},
        {"prompt": default_task.prompt_text((3, 7, 2)), "answer": "19", "bad": 1},
    ]
    data = _write(tmp_path, "d.jsonl", "\n".join(json.dumps(r) for r in rows))
    reward = _write(
        tmp_path,
        "r.py",
        "def f(prompts, completions, bad, **kw):\n    return [1 / 0 if b else 1.0 for b in bad]\n",
    )
    return rows, data, reward


def test_raising_reward_names_the_sample(tmp_path):
    rows, data, reward = _poisoned_dataset(tmp_path)
    first = PromptSampler(rows, 2, 42).next()
    expected = 4 * [r["bad"] for r in first].index(1)  # the first completion of the poisoned prompt
    with pytest.raises(RewardError, match=rf"'f' on sample {expected}: raised ZeroDivisionError"):
        train(_cfg(tmp_path, "--model", str(ASSET), "--dataset", str(data), "--reward", f"{reward}:f"))
    assert not [r for r in _records(tmp_path) if "loss" in r]


def test_on_reward_error_skip_drops_samples(tmp_path):
    _, data, reward = _poisoned_dataset(tmp_path)
    train(
        _cfg(
            tmp_path,
            "--model",
            str(ASSET),
            "--dataset",
            str(data),
            "--reward",
            f"{reward}:f",
            "--on-reward-error",
            "skip",
            "--max-steps",
            "2",
        )
    )
    steps = [r for r in _records(tmp_path) if "loss" in r]
    assert len(steps) == 2
    assert all(r["rewards/f_mean"] == 1.0 for r in steps)  # the poisoned prompt's samples were dropped


def test_cli_entry_points(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "grpo_fast.train", "--loss-type", "nope"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "invalid choice: 'nope'" in out.stderr
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo_fast.cli",
            "train",
            "--model",
            str(tmp_path / "x"),
            "--reward",
            "format",
            "--dataset",
            "d.jsonl",
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "not a model directory" in out.stderr


def test_config_file_with_flags_winning(tmp_path):
    cfg_file = _write(tmp_path, "c.yaml", "learning_rate: 0.003\nnum_generations: 6\nbeta: 0.1\n")
    cfg = parse_config(["--config", str(cfg_file), "--num-generations", "4"])
    assert (cfg.learning_rate, cfg.num_generations, cfg.beta) == (0.003, 4, 0.1)
    bad = _write(tmp_path, "bad.json", '{"learning_rat": 1}')
    with pytest.raises(ValueError, match=r"unknown fields \['learning_rat'\]$"):
        parse_config(["--config", str(bad)])
    # a TRL user's fields that are named otherwise here: the error says what to write instead
    trl_file = _write(tmp_path, "trl.yaml", "use_vllm: true\nper_device_train_batch_size: 8\nbeta: 0.1\n")
    with pytest.raises(ValueError) as err:
        parse_config(["--config", str(trl_file)])
    said = str(err.value)
    assert "unknown fields ['per_device_train_batch_size', 'use_vllm']" in said
    assert "use_vllm: --rollout vllm" in said and "per_device_train_batch_size: --prompts-per-step" in said
    # TRL's deprecated vllm_importance_sampling_cap, with TRL's meaning: it replaces clip_max, with a warning
    fields = "vllm_importance_sampling_cap: 2.5\nvllm_importance_sampling_clip_max: 9.0\n"
    cap_file = _write(tmp_path, "cap.yaml", fields)
    with pytest.warns(FutureWarning, match="deprecated name for vllm_importance_sampling_clip_max"):
        cfg = parse_config(["--config", str(cap_file)])
    trl, yaml = pytest.importorskip("trl"), pytest.importorskip("yaml")
    with pytest.warns(FutureWarning):  # TRL's own deprecation warning
        theirs = trl.GRPOConfig(
            output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, **yaml.safe_load(fields)
        )
    assert cfg.vllm_importance_sampling_clip_max == theirs.vllm_importance_sampling_clip_max == 2.5
    shutil.rmtree(tmp_path / "run", ignore_errors=True)


def test_gradient_checkpointing_bf16_and_no_shared_prefix(tmp_path):
    train(
        _cfg(
            tmp_path,
            "--gradient-checkpointing",
            "--dtype",
            "bf16",
            "--no-share-prefix",
            "--max-steps",
            "4",
            "--num-iterations",
            "2",
            "--gradient-accumulation-steps",
            "2",
            "--learning-rate",
            "1e-3",
        )
    )
    steps = [r for r in _records(tmp_path) if "loss" in r]
    assert [r["step"] for r in steps] == [2, 4]  # one generation batch, two optimizer updates each
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in steps)
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["resolved"]["dtype"] == "bf16" and cfg["gradient_checkpointing"] is True


@pytest.mark.parametrize("disable", [False, True])
def test_disable_dropout_zeroes_the_dropouts_trl_does(disable):
    """--disable-dropout (TRL's name, default off): the model as training gets it has every nn.Dropout at
    p = 0, LoRA's included; the modules zeroed are those TRL's own disable_dropout_in_model zeroes."""
    from trl.trainer.utils import disable_dropout_in_model

    from grpo_fast.trainer.modeling import load_model_and_tokenizer

    argv = ["--lora-r", "4", "--lora-dropout", "0.3", *(["--disable-dropout"] if disable else [])]
    model, _, _ = load_model_and_tokenizer(parse_config(argv), torch.device("cpu"))
    dropouts = {n: m.p for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout)}
    assert dropouts and any("lora_dropout" in n for n in dropouts)
    plain, _, _ = load_model_and_tokenizer(parse_config(argv[:4]), torch.device("cpu"))
    if disable:
        disable_dropout_in_model(plain)
    assert dropouts == {n: m.p for n, m in plain.named_modules() if isinstance(m, torch.nn.Dropout)}
    assert set(dropouts.values()) == ({0.0} if disable else {0.3})


@pytest.mark.parametrize("cast", [False, True])
def test_cast_lm_head_to_fp32_scores_from_fp32_logits(cast):
    """--cast-lm-head-to-fp32 (TRL's, the ScaleRL recipe) under --bf16: the body runs in bf16 autocast, the
    LM head's GEMM in fp32. The old / reference log-probs and the loss then equal fp64 arithmetic on the
    body's hidden states to fp32 rounding; without it the bf16 GEMM is ~1e-2 off (which shows the test
    can tell them apart). --dtype bf16 is refused (the head would be fp32 among bf16 weights)."""
    from grpo_fast.trainer.modeling import completion_hidden_states
    from grpo_fast.trainer.step import loss_options, policy_loss, sequence_logps

    cfg = parse_config(["--bf16", "--temperature", "0.8", *(["--cast-lm-head-to-fp32"] if cast else [])])
    model = AutoModelForCausalLM.from_pretrained(default_task.ASSET_DIR, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    n, G, P, C, V = 2, 3, 6, 8, model.config.vocab_size
    batch = (
        torch.randint(3, V, (n, P), generator=g), torch.ones(n, P, dtype=torch.long),
        torch.randint(3, V, (n * G, C), generator=g), torch.ones(n * G, C, dtype=torch.long), None,
    )  # fmt: skip
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = completion_hidden_states(model, *batch[:4], share_prefix=cfg.share_prefix)
    logits = hidden.double() @ model.lm_head.weight.double().T / 0.8
    want = torch.log_softmax(logits, -1).gather(-1, batch[2][..., None]).squeeze(-1)
    with torch.no_grad():
        got = sequence_logps(model, batch, cfg)
    err = (got.double() - want).abs().max().item()
    assert err < 1e-4 if cast else err > 1e-3, err
    adv, mask = torch.randn(n * G, generator=g), batch[3]
    old = want.float() + 0.1 * torch.randn(n * G, C, generator=g)
    options = {**loss_options(cfg, "native"), "sampling_correction": None}  # no engine's log-probs here
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = policy_loss(model, batch, mask, adv, old, None, None, mask.sum(), cfg, options)
    ref, _ = naive_grpo_loss(want, adv, mask, old_logps=old, num_items_in_batch=mask.sum())
    assert abs(loss.item() - ref.item()) < (1e-5 if cast else 1.0)
    if cast:
        with pytest.raises(ValueError, match="cast_lm_head_to_fp32 needs --dtype fp32"):
            train(parse_config(["--cast-lm-head-to-fp32", "--dtype", "bf16"]))
