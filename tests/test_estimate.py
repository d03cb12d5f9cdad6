"""`grpo-fast estimate` against measured peaks, and the `--max-memory-gb` planner in the trainer."""

import json

import pytest

from bench.models import memory as bench_memory
from grpo_fast.tasks import default_task
from grpo_fast.trainer.config import parse_config
from grpo_fast.trainer.estimate import PLAN_MARGIN, Estimator, Plan, main, plan
from grpo_fast.trainer.train import train

TINY = ["--num-generations", "4", "--prompts-per-step", "2", "--max-completion-length", "16",
        "--eval-max-samples", "0", "--save-steps", "0", "--max-steps", "1"]  # fmt: skip


@pytest.mark.slow
def test_estimate_within_15_percent_of_measured_peak():
    """Real `grpo-fast train` steps in fresh processes (resident-set peak of the largest step after the
    first, per-step reset) on a 2-layer model of SmolLM2-135M's shape and vocabulary, over the axes that
    change the memory: full / LoRA, beta 0 / 0.04, gradient checkpointing off / on, prefix sharing on / off,
    colocated async (the generation thread's copy and rollout beside the training). The allocator is held as
    the trainer holds it under --max-memory-gb (glibc's default keeps freed blocks in the heap: LoRA's
    resident set then ran 20-25% over its tensors). And each precision recipe: bf16 weights with fp32
    masters / a Kahan compensation, bf16 autocast on fp32 weights, 8-bit AdamW states."""
    names = ["full", "full_beta_gc_unshared", "lora_beta", "lora_gc_unshared"]
    rows = bench_memory.run(names, layers=2, steps=2, map_large=True)["rows"]
    # every precision recipe (grpo_fast.trainer.precision), shorter completions: 16-bit GEMMs are slow on
    # some CPUs
    recipes = [n for n in bench_memory.RECIPES if n != "full"]
    rows += bench_memory.run(recipes, layers=2, steps=2, map_large=True, overrides=dict(C=32, G=4))["rows"]
    # colocated async: the thread's copy of the weights, and its rollout of the next batch through this step's
    # training (step 2 of 3: the last step has no next batch)
    rows += bench_memory.run(["full_async"], layers=2, steps=3, map_large=True)["rows"]
    assert [r["config"] for r in rows] == names + recipes + ["full_async"]
    for r in rows:
        assert "measured_mib" in r and "estimate_mib" in r, r.get("note")
        shown = (r["config"], r["measured_mib"], r["estimate_mib"])
        assert abs(r["error_pct"]) <= 15, shown


def test_estimate_parts_follow_the_flags():
    base = parse_config(TINY + ["--max-completion-length", "64"])
    e = Estimator(base).estimate()
    p = e["parts"]
    assert p["reference model"] == 0 and p["optimizer state"] == 2 * p["gradients"] > 0
    with_ref = Estimator(parse_config(TINY + ["--max-completion-length", "64", "--beta", "0.04"])).estimate()
    assert with_ref["parts"]["reference model"] == p["weights"]
    est = Estimator(base)
    longer = est.estimate(C=256)
    assert longer["parts"]["activations"] > 3 * p["activations"]
    assert longer["parts"]["rollout KV cache"] > p["rollout KV cache"]
    gc = est.estimate(plan=Plan(True), C=256)
    assert gc["parts"]["activations"] < 0.8 * longer["parts"]["activations"]
    split = est.estimate(plan=Plan(False, 0.0), C=256)  # packed to nothing: one completion per micro-batch
    assert split["micro_batches"] == 8 and split["parts"]["activations"] < longer["parts"]["activations"] / 4
    assert e["kv_cache_unshared"] > p["rollout KV cache"]  # prefix sharing keeps one prompt KV per group
    # a repetition penalty: each of the 2 x 4 rows' context mask (1 byte a vocabulary entry) and three fp32
    # temporaries of its penalized logits at the draw's peak
    vocab = json.loads((default_task.ASSET_DIR / "config.json").read_text())["vocab_size"]
    flags = TINY + ["--max-completion-length", "64", "--repetition-penalty", "1.1"]
    penalized = Estimator(parse_config(flags)).estimate()["parts"]["rollout working set"]
    assert penalized - p["rollout working set"] == 2 * 4 * vocab * (1 + 3 * 4)
    # fp32 log-probs held through a rollout's steps: 2 prompts x 4 completions x 64 tokens x 4 bytes a step's
    # worth, for the reference (beta) and for each step that trains off-policy (not the first of one pass)
    step_logps = 2 * 4 * 64 * 4
    for flags, held in [
        ([], 0), (["--beta", "0.04"], 1), (["--num-iterations", "2"], 1),
        (["--steps-per-generation", "2"], 1), (["--steps-per-generation", "3", "--beta", "0.04"], 2 + 3),
        (["--steps-per-generation", "2", "--num-iterations", "2"], 2),
    ]:  # fmt: skip
        cfg = parse_config(TINY + ["--max-completion-length", "64", *flags])
        assert Estimator(cfg).estimate()["parts"]["old / reference log-probs"] == held * step_logps, flags


def test_cuda_graphs_keep_the_rollout_buffers_through_training():
    """On CUDA the native engine's graphs (its default there) keep the KV and the rollout dtype's weight copy
    allocated between calls: the training peak holds them; eager (--rollout-compile off) frees them."""
    from grpo_fast.trainer.estimate import engine_copy_bytes

    flags = TINY + ["--max-completion-length", "64", "--rollout-dtype", "bf16"]
    est = Estimator(parse_config(flags), device="cuda")
    graphs = est.estimate()
    eager = Estimator(parse_config(flags + ["--rollout-compile", "off"]), device="cuda").estimate()
    kept = graphs["parts"]["rollout buffers kept (CUDA graphs)"]
    copy = engine_copy_bytes(est.params, est.cfg, "cuda")
    kv = graphs["parts"]["rollout KV cache"]
    assert copy > 0 and kv + copy < kept < kv + copy + graphs["parts"]["rollout working set"]
    assert graphs["train_peak"] - eager["train_peak"] == pytest.approx(kept, rel=1e-9)
    assert graphs["rollout_peak"] == eager["rollout_peak"]
    assert "rollout buffers kept (CUDA graphs)" not in Estimator(parse_config(flags)).estimate()["parts"]


def test_the_cpu_engine_keeps_its_weight_copy_through_training(monkeypatch):
    """On a CPU the native engine keeps its packed copy of the linear weights between calls (the next call
    rewrites it in place): the training peak holds it, written out from the config (every Linear's weight,
    fp32; bf16: half)."""
    flags = TINY + ["--max-completion-length", "64"]
    cfg = json.loads((default_task.ASSET_DIR / "config.json").read_text())
    H, inter, L, V = (cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
    d = cfg.get("head_dim", H // cfg["num_attention_heads"])
    per_layer = H * d * (cfg["num_attention_heads"] * 2 + cfg["num_key_value_heads"] * 2) + 3 * H * inter
    for extra, width in [([], 4), (["--rollout-dtype", "bf16"], 2)]:
        est = Estimator(parse_config(flags + extra), device="cpu").estimate()
        assert est["parts"]["rollout weight copy kept"] == (L * per_layer + V * H) * width, extra
        # Inductor's step (--rollout-compile on) reads the fp32 modules themselves (no copy: the engine's
        # test_compiled_step_matches_eager_and_sees_updated_weights); a bf16 copy turns it off, runs eager
        on = Estimator(parse_config(flags + extra + ["--rollout-compile", "on"]), device="cpu").estimate()
        want = 0 if width == 4 else est["parts"]["rollout weight copy kept"]
        assert on["parts"].get("rollout weight copy kept", 0) == want, extra
    import grpo_fast.trainer.estimate as estimate_mod

    held = estimate_mod._runtime_bytes("cpu", parse_config(flags))  # the process's resident set, held
    monkeypatch.setattr(estimate_mod, "_runtime_bytes", lambda device, cfg: held)
    kept = Estimator(parse_config(flags), device="cpu").estimate()
    monkeypatch.setattr(estimate_mod, "engine_copy_bytes", lambda *a: 0.0)  # the modules' own weights
    unkept = Estimator(parse_config(flags), device="cpu").estimate()
    copy = kept["parts"]["rollout weight copy kept"]
    assert kept["train_peak"] - unkept["train_peak"] == pytest.approx(copy, rel=1e-9)
    monkeypatch.undo()
    async_ = Estimator(parse_config(flags + ["--max-staleness", "1"]), device="cpu").estimate()
    assert "rollout weight copy kept" not in async_["parts"]  # the overlap holds a whole rollout already


@pytest.mark.parametrize("rollout_dtype,kv", [("fp32", "float32"), ("bf16", "bfloat16")])
@pytest.mark.parametrize("C", [64, 65])
def test_the_kv_cache_is_the_engines_buffers(rollout_dtype, kv, C, monkeypatch):
    """The estimate's rollout KV cache on a CPU is the bytes of the KV buffers the native engine allocates
    for that call (the prompts' and completions' keys and values, the decode kernels' blocked keys), in the
    rollout's KV dtype (bf16 for a bf16 rollout), at the engine's capacity (a 65-token completion takes two
    blocks of 64 slots)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_fast.rollout import cpu_decode, generate_groups, native

    if cpu_decode.kernels() is None:
        pytest.skip(f"no CPU decode kernels (their blocked keys): {cpu_decode.unavailable_reason()}")
    if rollout_dtype == "bf16" and cpu_decode.linear_for(torch.bfloat16) is None:
        pytest.skip("no bf16 linear kernel on this CPU")
    P = 24
    flags = TINY + ["--max-completion-length", str(C), "--max-prompt-length", str(P)]
    est = Estimator(parse_config(flags + ["--rollout-dtype", rollout_dtype]), device="cpu").estimate()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(default_task.ASSET_DIR)).eval()
    made, fresh = [], native._fresh_buffers
    monkeypatch.setattr(native, "_fresh_buffers", lambda *a: made.append(fresh(*a)) or made[-1])
    ids = torch.randint(3, 100, (2, P))
    generate_groups(
        model, ids, torch.ones_like(ids), 4, C, temperature=1.0, eos_token_id=None, engine="native",
        rollout_dtype=rollout_dtype, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    (b,) = made
    buffers = [*b.prompt_k, *b.prompt_v, *b.prompt_kt, *b.comp_k, *b.comp_v, *b.comp_kt]
    assert {str(x.dtype).removeprefix("torch.") for x in buffers} == {kv}
    assert est["parts"]["rollout KV cache"] == sum(x.numel() * x.element_size() for x in buffers)


def test_estimate_command_prints_the_table_and_what_fits(capsys):
    main(TINY + ["--max-memory-gb", "2"])
    out = capsys.readouterr().out
    for word in ("weights", "optimizer state", "rollout KV cache", "activations", "PEAK", "without prefix",
                 "with gradient checkpointing",
                 "largest --max-completion-length", "the trainer's plan"):  # fmt: skip
        assert word in out, out
    with pytest.raises(SystemExit) as exc:
        main(TINY + ["--device", "tpu"])
    assert exc.value.code == 2
    assert "--device must be cpu or cuda" in capsys.readouterr().err


def test_estimate_needs_no_reward_and_says_what_the_plan_fits_first(capsys, monkeypatch):
    """A model and a budget are enough (memory does not depend on the rewards). Where the whole step as one
    micro-batch does not fit but the trainer's plan does, the first line says what the plan reaches and the
    second, labelled as one micro-batch, says that nothing fits that way. The process's own resident set is
    held at a fixed value for the test and the command alike (it moves as a test session goes on: a budget
    between two estimates must be the command's too)."""
    import grpo_fast.trainer.estimate as estimate_mod

    held = 256 * 2**20  # the process's resident set, fixed: late in a test session it reaches GBs
    monkeypatch.setattr(estimate_mod, "_runtime_bytes", lambda device, cfg: held)
    argv = ["--model", str(default_task.ASSET_DIR), "--prompts-per-step", "16", "--num-generations", "16",
            "--max-completion-length", "256", "--max-prompt-length", "2048"]  # fmt: skip
    main(argv)  # no --reward: no error
    e = Estimator(parse_config(argv, require_reward=False))
    smallest = e.estimate(plan=Plan(True, 0.0))["peak"]
    whole_at_1 = e.estimate(C=1)["peak"]
    # ~370 vs ~1150 MiB over the resident set, which both include: the plan fits PLAN_MARGIN of the budget,
    # the whole step at C=1 does not fit the budget itself
    assert smallest / PLAN_MARGIN < whole_at_1, "the case needs a budget between the two"
    budget_gb = 0.5 * (smallest / PLAN_MARGIN + whole_at_1) / 2**30
    capsys.readouterr()
    main(argv + ["--max-memory-gb", f"{budget_gb:.4f}"])
    lines = capsys.readouterr().out.splitlines()
    planned = next(i for i, x in enumerate(lines) if "with the trainer's plan: largest" in x)
    whole = next(i for i, x in enumerate(lines) if "as one micro-batch" in x)
    assert planned < whole
    largest_c = int(lines[planned].split("--max-completion-length ")[1].split(",")[0])
    assert largest_c >= 256  # the configured length plans
    assert "nothing fits (at --max-completion-length 1 the step needs" in lines[whole]


def test_max_memory_gb_plans_splits_and_records(tmp_path):
    """A budget between the smallest plan and the configured one: the trainer packs its micro-batches under
    it, runs, and writes the plan into config.json; a budget below the smallest plan is refused, naming what
    would fit."""
    argv = TINY + [
        "--max-completion-length",
        "256",
        "--num-generations",
        "8",
        "--output-dir",
        str(tmp_path / "run"),
    ]
    cfg = parse_config(argv)
    est = Estimator(cfg)
    whole = est.estimate()["peak"]
    smallest = est.estimate(plan=Plan(True, 0.0))["peak"]
    assert smallest < whole
    # the trainer's own estimate sees its own resident set: room for it to have grown
    budget = (smallest + 0.5 * (whole - smallest)) / PLAN_MARGIN / 2**30
    p, e = plan(cfg, budget, "cpu", est)
    assert e["peak"] <= PLAN_MARGIN * budget * 2**30
    assert e["micro_batches"] > 1 or p.gradient_checkpointing
    train(parse_config(argv + ["--max-memory-gb", f"{budget:.4f}"]))
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    rec = saved["resolved"]["memory_plan"]
    assert rec["estimated_peak_mib"] <= budget * 1024
    assert saved["gradient_checkpointing"] == p.gradient_checkpointing == rec["gradient_checkpointing"]
    assert rec["micro_batch_budget_mib"] > 0 and rec["micro_batches_at_longest"] >= e["micro_batches"]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "peak_mem_train_mb" in r]
    assert len(steps) == 1 and steps[0]["micro_batches"] >= 1
    with pytest.raises(ValueError, match=r"--max-memory-gb 0.01: no plan fits.*--max-completion-length"):
        train(parse_config(argv + ["--max-memory-gb", "0.01", "--overwrite-output-dir"]))
