"""End to end: GRPO steps on identical work, grpo-fast vs TRL 1.16's GRPOTrainer, each in its own process.

    python -m bench.models.e2e [--quick] [--providers a,b] [--warmup 1] [--steps 2]

Work: a random-init ~50M Qwen2-shaped model (bench_prefix.make_model) saved to a local directory with a
word-level tokenizer, prompts of exactly P tokens, G completions of up to C tokens sampled at temperature 1,
`prompts_per_step` prompts per optimizer step, beta 0, loss dapo, fp32, no gradient checkpointing, AdamW
lr 1e-6. The first `warmup` steps are not counted. Tokens/s counts the tokens actually processed as if
unshared (prompt tokens x G + completion tokens), so a completion that stops early at EOS is not a gain.

Providers:
  trl                 trl.GRPOTrainer (HF generate, its chunked fused LM head), bf16=False: fp32 as ours
  trl_bf16            the same at TRL's default bf16=True: autocast bf16 on fp32 master weights
  trl_liger           the same with use_liger_kernel=True (TRL 1.16 applies only Liger's layer kernels;
                      they are Triton, CUDA only, so this is skipped on CPU)
  trl_grpo_fast       grpo_fast.integrations.trl.GRPOTrainer (same arguments, our kernels)
  grpo_fast_unshared  grpo-fast's trainer, share_prefix off
  grpo_fast           grpo-fast's trainer, share_prefix on (the default), fp32 (--no-bf16)
  grpo_fast_mp        the same with --bf16: bf16 autocast on fp32 master weights, rollouts in bf16 (corrected)
  grpo_fast_bf16      the same with --rollout-dtype bf16 (a bf16 copy of the policy decodes; the loss corrects
                      the mismatch, TRL's sequence_mask)
  grpo_fast_vllm      the same with --rollout vllm (vLLM in the trainer's process, weights pushed every step;
                      run in the vLLM environment, `make setup-vllm`: transformers 5.19 there)
  grpo_fast_vllm_bf16 the same with --rollout-dtype bf16 (vLLM's weights in bf16; the loss corrects)
  grpo_fast_server    --rollout vllm --vllm-mode server: rollouts on a vLLM server (fp32) started for the run
                      by grpo-fast serve's launcher on its own core(s), the trainer pinned to the others;
                      weights pushed and verified after every step (sync s); synchronous
  grpo_fast_server_async  the same with --max-staleness 1: the next step's rollout generated while this one
                      trains; the model `async step = max(generate, train) + sync` is checked against it
  grpo_fast_async     grpo_fast with --max-staleness 1 colocated: the native engine samples a copy of the
                      weights on a thread of its own while the trainer trains (both share the cores)
  grpo_fast_async_bf16  the same with --rollout-dtype bf16 (the thread decodes a bf16 copy; corrected)
  grpo_fast_async_mp  grpo_fast_async with --bf16 (grpo_fast_mp's precision)

`our_default` in the results names our provider at our default precision on this machine (grpo_fast_mp
where --bf16 unset means on: grpo_fast/trainer/precision.py), compared with TRL at its default (trl_bf16).

Step time is split into generation / scoring (rewards and advantages) / training (log-probs, loss,
backward, optimizer); peak memory is the process's resident-set high-water mark (CPU) or
max_memory_allocated (CUDA) above what the process held once its libraries were imported.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench._utils import (
    NO_VLLM,
    baseline_mib,
    cpu_line,
    machine_info,
    markdown_table,
    run_worker,
    vllm_python,
    worker_main,
    write_results,
)
from grpo_fast.trainer.memory import peak_mib
from grpo_fast.trainer.plotting import pyplot

PROVIDERS = ["trl", "trl_liger", "trl_grpo_fast", "grpo_fast_unshared", "grpo_fast", "grpo_fast_vllm"]
REAL_PROVIDERS = [
    "trl", "trl_bf16", "trl_static_cache", "trl_grpo_fast", "trl_grpo_fast_native", "grpo_fast",
    "grpo_fast_mp", "grpo_fast_bf16", "grpo_fast_vllm", "grpo_fast_vllm_bf16", "grpo_fast_server",
    "grpo_fast_server_async",
]  # fmt: skip
LABELS = {
    "trl": "TRL GRPOTrainer",
    "trl_bf16": "TRL GRPOTrainer, bf16=True (its default)",
    "grpo_fast_mp": "grpo-fast, --bf16 (autocast, fp32 masters, bf16 rollout, corrected)",
    "trl_liger": "TRL + use_liger_kernel",
    "trl_static_cache": "TRL + cache_implementation='static'",
    "trl_continuous_batching": "TRL + use_transformers_continuous_batching",
    "trl_grpo_fast": "TRL + grpo_fast subclass",
    "trl_grpo_fast_native": "TRL + grpo_fast subclass, rollout='native'",
    "grpo_fast_unshared": "grpo-fast, sharing off",
    "grpo_fast": "grpo-fast, sharing on",
    "grpo_fast_vllm": "grpo-fast, --rollout vllm",
    "grpo_fast_bf16": "grpo-fast, --rollout-dtype bf16 (corrected)",
    "grpo_fast_vllm_bf16": "grpo-fast, --rollout vllm --rollout-dtype bf16 (corrected)",
    "grpo_fast_server": "grpo-fast, vLLM server (own core), synchronous",
    "grpo_fast_server_async": "grpo-fast, vLLM server (own core), async --max-staleness 1",
    "grpo_fast_async": "grpo-fast, colocated async --max-staleness 1 (a thread samples a weight copy)",
    "grpo_fast_async_bf16": "grpo-fast, colocated async --max-staleness 1, --rollout-dtype bf16 (corrected)",
    "grpo_fast_async_mp": "grpo-fast, colocated async --max-staleness 1, --bf16 (autocast, corrected)",
    "grpo_fast_default": "grpo-fast at its defaults (--bf16 and --rollout-dtype unset: this machine decides)",
    "grpo_fast_default_async": "grpo-fast at its defaults, colocated async --max-staleness 1",
    "grpo_fast_default_all_groups": "grpo-fast at its defaults, every group trained as TRL does "
    "(--no-skip-zero-advantage-groups)",
}
STEADY_STEPS = 4  # an async row's measured steps after its first (the head start), for a steady-state figure
# the training settings both trainers get, under the names both use
SAME_FOR_BOTH = dict(temperature=1.0, beta=0.0, loss_type="dapo", learning_rate=1e-6)
MIN_WORKER_S = 20  # a provider is not started with less time than this before --deadline
SHAPES = {
    "full": dict(P=512, C=128, G=8, prompts_per_step=2),
    "quick": dict(P=24, C=8, G=4, prompts_per_step=2),
    "real": dict(P=128, C=256, G=8, prompts_per_step=2),  # P: the longest chat prompt allowed
}


def real_reward(completions, answer, **kwargs):
    """Accuracy: 1 when the completion states the answer as a number, else 0 (chat or plain completions)."""
    import re

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(str(a) in re.findall(r"-?\d+", t)) for t, a in zip(texts, answer)]


def build_real_work(out: Path, n_prompts: int) -> tuple[Path, Path, int]:
    """SmolLM2-135M-Instruct (grpo_fast.tasks.smollm2) and chat prompts with answers: small arithmetic
    questions, phrased a few ways so that prompt lengths differ."""
    from grpo_fast.tasks.smollm2 import build

    model_dir = build()
    g = torch.Generator().manual_seed(0)
    forms = [
        "What is {a} + {b}?",
        "Compute {a} plus {b}. Explain briefly, then give the result.",
        "A shop had {a} apples and received {b} more. How many apples does it have now? Think step by step.",
    ]
    data = out / "real_prompts.jsonl"
    with data.open("w") as f:
        for i in range(n_prompts):
            a, b = torch.randint(10, 99, (2,), generator=g).tolist()
            q = forms[i % len(forms)].format(a=a, b=b)
            f.write(json.dumps({"prompt": [{"role": "user", "content": q}], "answer": a + b}) + "\n")
    return model_dir, data, 134_515_008


def bench_reward(completions, **kwargs):
    """Share of distinct words: cheap, and it spreads the rewards within a group."""
    return [len(set(c.split())) / max(1, len(c.split())) for c in completions]


# ---------------------------------------------------------------------------------------------------------
# The shared work: model directory and prompts
# ---------------------------------------------------------------------------------------------------------
def build_work(out: Path, quick: bool, P: int, n_prompts: int) -> tuple[Path, Path, int]:
    """A random-init model + word-level tokenizer in out/model and n_prompts prompts of exactly P tokens;
    returns the two paths and the model's parameter count."""
    from bench.models.prefix import make_model

    model = make_model("tiny" if quick else "50m")
    model_dir = save_word_level(model, out / "model")
    data = word_prompts(out / "prompts.jsonl", n_prompts, P, model.config.vocab_size)
    return model_dir, data, sum(p.numel() for p in model.parameters())


def save_word_level(model, model_dir: Path) -> Path:
    """Save `model` with a word-level tokenizer of its vocabulary ("w2", "w3", ...; 0 pad, 1 EOS): any prompt
    of k words is exactly k tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    V = model.config.vocab_size
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, V)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    model.config.pad_token_id, model.config.eos_token_id, model.config.bos_token_id = 0, 1, None
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    model.generation_config.bos_token_id = None
    model.save_pretrained(model_dir)
    fast.save_pretrained(model_dir)
    return model_dir


def word_prompts(path: Path, n_prompts: int, P: int, V: int) -> Path:
    """n_prompts prompts of exactly P tokens of `save_word_level`'s tokenizer."""
    g = torch.Generator().manual_seed(0)
    with path.open("w") as f:
        for _ in range(n_prompts):
            words = torch.randint(2, V, (P,), generator=g).tolist()
            f.write(json.dumps({"prompt": " ".join(f"w{w}" for w in words)}) + "\n")
    return path


# ---------------------------------------------------------------------------------------------------------
# Workers
# ---------------------------------------------------------------------------------------------------------
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_trl(a: dict) -> dict:
    import warnings

    try:
        import trl
        from datasets import Dataset
    except ImportError as exc:
        return {"skipped": f"trl is not importable here ({exc})"}
    from transformers import AutoModelForCausalLM, TrainerCallback

    from grpo_fast.integrations.trl import GRPOTrainer as OurTRL
    from grpo_fast.trainer.modeling import load_tokenizer

    warnings.simplefilter("ignore", FutureWarning)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a["provider"] == "trl_liger":
        if device.type != "cuda":
            return {"skipped": "Liger's layer kernels are Triton kernels for CUDA; no GPU here"}
        try:
            import liger_kernel  # noqa: F401
        except ImportError:
            return {"skipped": "liger-kernel is not installed"}
    base = OurTRL if a["provider"].startswith("trl_grpo_fast") else trl.GRPOTrainer
    timings = {"gen": 0.0, "score": 0.0, "tokens": 0}

    class Timed(base):
        def _generate(self, prompts):
            _sync(device)
            t = time.perf_counter()
            out = super()._generate(prompts)
            _sync(device)
            timings["gen"] += time.perf_counter() - t
            return out

        def _calculate_rewards(self, *args, **kwargs):
            t = time.perf_counter()
            out = super()._calculate_rewards(*args, **kwargs)
            timings["score"] += time.perf_counter() - t
            return out

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            timings["tokens"] += int(out["prompt_mask"].sum() + out["completion_mask"].sum())
            return out

    steps = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            _sync(device)
            timings.update(gen=0.0, score=0.0, tokens=0, t0=time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            _sync(device)
            total = time.perf_counter() - timings["t0"]
            steps.append(
                dict(
                    step_s=total,
                    generate_s=timings["gen"],
                    score_s=timings["score"],
                    train_s=total - timings["gen"] - timings["score"],
                    tokens=timings["tokens"],
                )
            )

    base_mib = baseline_mib(device)
    tok = load_tokenizer(a["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(a["model_dir"], dtype=torch.float32).to(device)
    rows = [json.loads(line) for line in Path(a["data"]).read_text().splitlines()]
    config = trl.GRPOConfig(
        output_dir=a["out"],
        # its memory options (bench_frontier): micro-batches of `trl_micro_batch` completions, checkpointing
        per_device_train_batch_size=a.get("trl_micro_batch") or a["G"] * a["prompts_per_step"],
        gradient_accumulation_steps=a["G"]
        * a["prompts_per_step"]
        // (a.get("trl_micro_batch") or a["G"] * a["prompts_per_step"]),
        num_generations=a["G"],
        max_completion_length=a["C"],
        max_steps=a["warmup"] + a["steps"],
        **SAME_FOR_BOTH,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=a["provider"] == "trl_bf16",
        use_cpu=device.type == "cpu",
        gradient_checkpointing=a.get("gradient_checkpointing", False),
        use_liger_kernel=a["provider"] == "trl_liger",
        use_transformers_continuous_batching=a["provider"] == "trl_continuous_batching",
        cache_implementation="static" if a["provider"] == "trl_static_cache" else None,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Timed(
        model=model,
        reward_funcs=real_reward if a.get("workload") == "real" else bench_reward,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        callbacks=[StepClock()],
        **({"rollout": "native"} if a["provider"] == "trl_grpo_fast_native" else {}),
    )
    trainer.train()
    return {"steps": steps[a["warmup"] :], "peak_mem_mb": peak_mib(device) - base_mib}


def run_grpo_fast(a: dict) -> dict:
    import grpo_fast.trainer.train as train_mod
    from grpo_fast.trainer.config import GRPOConfig

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak_at_end = {}

    def no_checkpoint(*args, **kwargs):  # checkpoints are not part of the measured work (TRL: save "no")
        peak_at_end["mb"] = peak_mib(device)
        return Path(a["out"]) / "no-checkpoint"

    train_mod.ckpt_mod.save_checkpoint = no_checkpoint
    if a["provider"].startswith("grpo_fast_server") and "server_url" not in a:
        return with_server(a, lambda url: run_grpo_fast(dict(a, server_url=url)))
    base_mib = baseline_mib(device)
    above = a.get("budget_above_baseline_gb")  # bench_frontier: --max-memory-gb is the whole process's
    cfg = GRPOConfig(
        model=a["model_dir"],
        dataset=a["data"],
        reward=[
            f"{Path(__file__).resolve()}:{'real_reward' if a.get('workload') == 'real' else 'bench_reward'}"
        ],
        num_generations=a["G"],
        prompts_per_step=a["prompts_per_step"],
        max_prompt_length=a["P"],
        max_completion_length=a["C"],
        max_steps=a["warmup"] + a["steps"],
        **SAME_FOR_BOTH,
        share_prefix=a["provider"] != "grpo_fast_unshared",
        rollout="vllm" if a["provider"].startswith(("grpo_fast_vllm", "grpo_fast_server")) else "auto",
        **server_options(a),
        rollout_dtype="bf16" if a["provider"].endswith("_bf16") else "model",
        # the default rows leave bf16 unset, as `grpo-fast train` does (the calibration decides); the others
        # fp32, as TRL's bf16=False row
        bf16=None if a["provider"].startswith("grpo_fast_default") else a["provider"].endswith("_mp"),
        output_dir=a["out"],
        overwrite_output_dir=True,
        skip_zero_advantage_groups=not a["provider"].endswith("_all_groups"),
        max_memory_gb=(base_mib / 1024 + above) if above else 0.0,
    )
    train_mod.train(cfg)
    records = [json.loads(line) for line in (Path(a["out"]) / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "time_train_s" in r][a["warmup"] :]
    steps = []
    for r in records:
        step_s = r["time_generate_s"] + r["time_reward_s"] + r["time_train_s"] + r.get("time_sync_s", 0.0)
        steps.append(dict(step_s=step_s, generate_s=r["time_generate_s"], score_s=r["time_reward_s"],
                          train_s=r["time_train_s"], sync_s=r.get("time_sync_s", 0.0),
                          push_s=r.get("sync/seconds", 0.0), gen_busy_s=r.get("async/generate_busy_s", 0.0),
                          gen_idle_s=r.get("async/generate_idle_s", 0.0),
                          trainer_wait_s=r.get("async/trainer_wait_s", 0.0),
                          groups_skipped=r.get("zero_advantage_groups_skipped", 0),
                          tokens=round(r["tokens_per_s"] * step_s)))  # fmt: skip
    resolved = json.loads((Path(a["out"]) / "config.json").read_text())  # what the run decided
    train = "bf16" if resolved.get("bf16") else "fp32"
    sample = resolved.get("rollout_dtype") if resolved.get("rollout_dtype") != "model" else train
    return {"steps": steps, "peak_mem_mb": peak_at_end.get("mb", peak_mib(device)) - base_mib,
            "max_staleness": cfg.max_staleness, "precision": f"{train} / {sample}"}  # fmt: skip


def server_options(a: dict) -> dict:
    if a["provider"].startswith("grpo_fast_async") or a["provider"] == "grpo_fast_default_async":
        return dict(max_staleness=1)
    if "server_url" not in a:
        return {}
    staleness = 1 if a["provider"].endswith("_async") else 0
    return dict(vllm_mode="server", vllm_server_base_url=a["server_url"], max_staleness=staleness)


def with_server(a: dict, fn):
    """fn(url) with a vLLM server for a["model_dir"] on its own core(s) (this process pinned to the others),
    stopped after: the server's start is not part of the measured steps."""
    import os
    import socket

    from grpo_fast.rollout.server import serve

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server_cores, trainer_cores = serve.split_cores()
    gpus = None
    if torch.cuda.is_available():  # one GPU for the server (the last), the trainer on cuda:0
        if torch.cuda.device_count() < 2:
            return {"skipped": "needs two GPUs: one for the server, one for the trainer"}
        server_cores, trainer_cores, gpus = None, None, str(torch.cuda.device_count() - 1)
    if trainer_cores:
        lo, _, hi = trainer_cores.partition("-")
        mine = set(range(int(lo), int(hi or lo) + 1))
        os.sched_setaffinity(0, mine)
        torch.set_num_threads(len(mine))
    python = vllm_python()
    if python is None:
        return {"skipped": NO_VLLM}
    with open(Path(a["out"]) / "server.log", "w") as log, serve.launch(
        a["model_dir"], port=port, python=python, cores=server_cores, gpus=gpus,
        max_model_len=a["P"] + a["C"] + 8, log=log,
    ) as url:  # fmt: skip
        return fn(url)


def _import_libraries() -> None:
    """Every provider's process imports the same libraries before its baseline is taken, so that peak memory
    compares the work, not import footprints (our trainer imports some of these lazily, later)."""
    import importlib

    for name in ("transformers", "grpo_fast.rewards", "grpo_fast.trainer.train"):
        importlib.import_module(name)
    for name in (
        "matplotlib.pyplot",
        "datasets",
        "trl",
        "grpo_fast.integrations.trl",
    ):  # absent on a bare box
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def measure_one(a: dict) -> dict:
    torch.manual_seed(0)
    _import_libraries()
    with tempfile.TemporaryDirectory() as tmp:
        a = dict(a, out=tmp)
        res = run_grpo_fast(a) if a["provider"].startswith("grpo_fast") else run_trl(a)
    if "steps" in res:
        steps = res["steps"]
        pipelined = res.get("max_staleness", 0) > 0
        if pipelined and len(steps) > 1:  # the first measured step had a head start (rollouts made early)
            steps = steps[1:]
        total = {
            k: sum(s.get(k, 0.0) for s in steps)
            for k in ("step_s", "generate_s", "score_s", "train_s", "tokens", *SERVER_KEYS)
        }
        n = len(steps)
        res.update(
            step_s=total["step_s"] / n,
            generate_s=total["generate_s"] / n,
            score_s=total["score_s"] / n,
            train_s=total["train_s"] / n,
            tokens_per_step=total["tokens"] / n,
            tokens_per_s=total["tokens"] / total["step_s"],
            **{k: total[k] / n for k in SERVER_KEYS},
        )
        if pipelined:
            steady_figure(res, n)
        if a["provider"].startswith("grpo_fast"):  # groups whose advantages were all 0 (TRL trains them)
            res["groups_skipped"] = (
                f"{sum(s.get('groups_skipped', 0) for s in steps)} of {n * a['prompts_per_step']}"
            )
    return res


def steady_figure(res: dict, n: int) -> None:
    """A pipelined row's headline at steady state: its measured steps after the head start when there are
    STEADY_STEPS of them, else the step model's max(generate, train) + sync from its own parts."""
    model_s = modeled_step_s(res["gen_busy_s"], res["score_s"] + res["train_s"], res["push_s"], True)
    res["tokens_per_s_step_model"] = res["tokens_per_step"] / model_s
    if n >= STEADY_STEPS:
        res["steady"] = f"measured: {n} steps after the head start"
        return
    res["tokens_per_s_measured"] = res["tokens_per_s"]
    res["tokens_per_s"], res["step_s"] = res["tokens_per_s_step_model"], model_s
    res["steady"] = f"step model: {n} step(s) after the head start, < {STEADY_STEPS}"


SERVER_KEYS = ("sync_s", "push_s", "gen_busy_s", "gen_idle_s", "trainer_wait_s")


# ---------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------
COLUMNS = [
    ("label", "provider"),
    ("step_s", "step s"),
    ("generate_s", "generation s"),
    ("score_s", "scoring s"),
    ("train_s", "training s"),
    ("sync_s", "sync s (push + wait)"),
    ("tokens_per_s", "tokens/s"),
    ("speedup_vs_trl", "tokens/s vs TRL"),
    ("speedup_vs_trl_default", "vs TRL bf16=True (its default)"),
    ("generation_share", "generation / step"),
    ("peak_mem_mb", "peak MiB"),
    ("mem_vs_trl", "peak vs TRL"),
    ("precision", "precision (bf16 autocast / rollout)"),
    ("steady", "pipelined figure from"),
    ("groups_skipped", "groups not trained (advantages all 0)"),
    ("skipped", "note"),
]


def plot_e2e(rows: list[dict], path: Path, title: str) -> None:
    plt = pyplot(str(path))
    if plt is None:
        return

    done = [r for r in rows if "step_s" in r]
    labels = [r["label"].replace(", ", ",\n").replace(" + ", " +\n") for r in done]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    bottom = [0.0] * len(done)
    for key, name, color in (
        ("generate_s", "generation", "#4c72b0"),
        ("score_s", "scoring", "#dd8452"),
        ("train_s", "training", "#55a868"),
    ):
        vals = [r[key] for r in done]
        ax1.bar(labels, vals, bottom=bottom, label=name, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for x, r in enumerate(done):
        ax1.text(x, r["step_s"], f"{r['tokens_per_s']:.0f} tok/s", ha="center", va="bottom", fontsize=8)
    ax1.set(title="time per step (stacked)", ylabel="seconds", ylim=(0, 1.3 * max(bottom, default=1.0)))
    ax1.legend(loc="upper right", ncol=3, fontsize=8)
    ax2.bar(labels, [r["peak_mem_mb"] for r in done], color="#8172b2")
    for x, r in enumerate(done):
        ax2.text(x, r["peak_mem_mb"], f"{r['peak_mem_mb']:.0f}", ha="center", va="bottom", fontsize=8)
    peaks = [r["peak_mem_mb"] for r in done]
    ax2.set(
        title="peak memory above the imported libraries",
        ylabel="MiB",
        ylim=(0, 1.15 * max(peaks, default=1.0)),
    )
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def modeled_step_s(generate: float, train: float, sync: float, asynchronous: bool) -> float:
    """The step model: `max(generate, train) + sync` when the rollout runs beside training, else the sum."""
    return (max(generate, train) if asynchronous else generate + train) + sync


def step_model(rows: list[dict]) -> dict | None:
    """The server and async rows against the model `sync step = generate + train + sync`, `async step =
    max(generate, train) + sync`, each from the parts its own run measured (generate: the generation's busy
    seconds; train: scoring + training; sync: the push itself)."""
    got = {
        r["provider"]: r
        for r in rows
        if "step_s" in r and r["provider"].startswith(("grpo_fast_server", "grpo_fast_async"))
    }
    if not got:
        return None
    out, lines = {}, []
    for p, r in got.items():
        gen, train, sync = r["gen_busy_s"], r["score_s"] + r["train_s"], r["push_s"]
        asynchronous = r.get("max_staleness", 0) > 0
        predicted = modeled_step_s(gen, train, sync, asynchronous)
        out[p] = dict(generate_s=gen, train_s=train, sync_s=sync, predicted_step_s=predicted,
                      measured_step_s=r["step_s"], measured_over_model=r["step_s"] / predicted)  # fmt: skip
        form = "max(generate, train) + sync" if asynchronous else "generate + train + sync"
        lines.append(
            f"- {p}: {form} = {predicted:.2f} s (generate {gen:.2f}, train {train:.2f}, sync {sync:.2f}); "
            f"measured {r['step_s']:.2f} s ({r['step_s'] / predicted:.2f}x the model); the trainer waited "
            f"{r['trainer_wait_s']:.2f} s/step for rollouts, the generation thread {r['gen_idle_s']:.2f} "
            "s/step for the version gate"
        )
    out["text"] = "Step-time model (server and async rows):\n\n" + "\n".join(lines)
    return out


def render(payload: dict) -> str:
    """The markdown of a results payload (main's; also to re-render a saved json), its step model under it."""
    rows, cfg, info = payload["rows"], payload["config"], payload["machine"]
    real = payload["workload"] == "real"
    what = (
        "SmolLM2-135M-Instruct, chat prompts (arithmetic questions) with answers, an accuracy reward"
        if real
        else "Random-init Qwen2-shaped model"
    )
    md = (
        f"# End-to-end GRPO step vs TRL ({'' if real else 'P=' + str(cfg['P']) + ', '}C={cfg['C']}, "
        f"G={cfg['G']}, {cfg['prompts_per_step']} prompts/step)\n\n"
        f"{what}, {cfg['model_params'] / 1e6:.1f}M parameters, fp32 (rows saying bf16: mixed precision), "
        f"beta 0, loss dapo; "
        f"{cfg['warmup']} warm-up step(s), then the mean of {cfg['steps']}. Machine: {cpu_line(info)}"
        f"{', ' + info['gpu'] if 'gpu' in info else ''}, "
        f"torch {info['versions']['torch']}, "
        f"trl {info['versions']['trl']}, commit {info['git_commit']}.\n\n"
        + markdown_table(rows, COLUMNS)
        + "\n"
    )
    model = step_model(rows)
    return md + ("\n" + model["text"] + "\n" if model else "")


def main(argv=None, on_row=None) -> None:
    """The command line; `on_row(row)` is called with each provider's row as it ends (the GPU suite keeps
    rows that a time-out would otherwise lose)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model and shapes (a smoke run)")
    ap.add_argument("--workload", default="synthetic", choices=("synthetic", "real"))
    ap.add_argument("--providers", default=None, help="comma-separated (default: the workload's list)")
    ap.add_argument("--max-completion-length", type=int, default=None, help="C in place of the workload's")
    ap.add_argument("--warmup", type=int, default=1, help="steps not counted")
    ap.add_argument("--steps", type=int, default=2, help="steps measured")
    ap.add_argument("--out-dir", default=None, help="results folder (default bench/results/<machine>)")
    ap.add_argument("--worker-timeout", type=float, default=3600, help="seconds per provider process")
    ap.add_argument(
        "--deadline", type=float, default=None, help="epoch seconds by which every provider must be done"
    )
    args = ap.parse_args(argv)
    real = args.workload == "real"
    shape = dict(SHAPES["real" if real else "quick" if args.quick else "full"])
    if args.max_completion_length is not None:
        shape["C"] = args.max_completion_length
    providers = args.providers or ",".join(REAL_PROVIDERS if real else PROVIDERS)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        n_prompts = shape["prompts_per_step"] * (args.warmup + args.steps)
        if real:
            model_dir, data, model_params = build_real_work(Path(tmp), n_prompts)
        else:
            model_dir, data, model_params = build_work(Path(tmp), args.quick, shape["P"], n_prompts)
        base = dict(
            shape,
            model_dir=str(model_dir),
            data=str(data),
            warmup=args.warmup,
            steps=args.steps,
            quick=args.quick,
            workload=args.workload,
        )
        print(f"bench_e2e: {json.dumps(shape)}, warmup {args.warmup}, measured {args.steps}", flush=True)
        for p in providers.split(","):
            t0 = time.time()
            timeout = args.worker_timeout
            if args.deadline is not None:
                timeout = min(timeout, args.deadline - t0)
            python = vllm_python() if p.startswith("grpo_fast_vllm") else None  # a server runs in its own
            if timeout < MIN_WORKER_S:
                res = {"skipped": f"out of time ({max(timeout, 0):.0f} s left before the deadline)"}
            elif p.startswith("grpo_fast_vllm") and python is None:
                res = {"skipped": NO_VLLM}
            else:
                try:
                    res = run_worker("models.e2e", dict(base, provider=p), timeout=timeout, python=python)
                except subprocess.TimeoutExpired:
                    res = {"error": f"did not finish within {timeout:.0f}s"}
            row = dict(provider=p, label=LABELS[p], **res)
            rows.append(row)
            if on_row is not None:
                on_row(row)
            shown = res.get("error") or res.get("skipped")
            if not shown:
                shown = (
                    f"{res['step_s']:.2f} s/step (gen {res['generate_s']:.2f}, score {res['score_s']:.3f}, "
                    f"train {res['train_s']:.2f}), {res['tokens_per_s']:.0f} tok/s, "
                    f"peak {res['peak_mem_mb']:.0f} MiB"
                )
            print(f"  {p:<20} {shown}   ({time.time() - t0:.0f}s)", flush=True)
    trl_row = next((r for r in rows if r["provider"] == "trl" and "step_s" in r), None)
    trl_default = next((r for r in rows if r["provider"] == "trl_bf16" and "step_s" in r), None)
    for r in rows:
        if trl_row and "step_s" in r:
            r["speedup_vs_trl"] = r["tokens_per_s"] / trl_row["tokens_per_s"]
            r["mem_vs_trl"] = r["peak_mem_mb"] / trl_row["peak_mem_mb"]
        if trl_default and "step_s" in r:  # TRL at its own default, bf16=True
            r["speedup_vs_trl_default"] = r["tokens_per_s"] / trl_default["tokens_per_s"]
        if "step_s" in r and "generate_s" in r:
            r["generation_share"] = r["generate_s"] / r["step_s"]  # async: the trainer's wait for it
        if "error" in r:
            r["skipped"] = "error: " + r["error"]
    name = "bench_e2e" + ("_real" if real else "_quick" if args.quick else "")
    out_dir = Path(args.out_dir) if args.out_dir else None
    from grpo_fast.trainer.precision import auto_bf16

    info = machine_info()
    payload = {"machine": info, "config": dict(shape, warmup=args.warmup, steps=args.steps), "rows": rows}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if any(r["provider"] == "grpo_fast_default" and "step_s" in r for r in rows):
        payload["our_default"] = "grpo_fast_default"  # what `grpo-fast train` picked for this workload
    else:  # the hand table's pick (no calibration: this process has no run config)
        payload["our_default"] = "grpo_fast_mp" if auto_bf16(device)[0] else "grpo_fast"
    payload["config"]["model_params"] = model_params
    payload["workload"] = args.workload
    md = render(payload)
    model = step_model(rows)
    if model:
        payload["step_model"] = {p: v for p, v in model.items() if p != "text"}
    out = write_results(name, payload, md, out_dir)
    plot_e2e(rows, out / f"{name}.png", f"GRPO step, P={shape['P']} C={shape['C']} G={shape['G']}")
    print(md)
    print(f"wrote {out}/{name}.{{json,md,png}}")


if __name__ == "__main__":
    if not worker_main(measure_one):
        main(sys.argv[1:])
