"""The trainer's configuration: one dataclass, set from a YAML/JSON file and CLI flags (flags win).

Names and defaults follow TRL's GRPOConfig where they overlap. With neither --model nor --dataset the
embedded default task runs, with the preset below for the fields the user did not set.
"""

import argparse
import dataclasses
import json
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ..tasks import EMBEDDED


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


def chat_template_kwargs(text: str) -> dict:
    """--chat-template-kwargs: a JSON object (argparse reports a ValueError as the flag's invalid value)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


@dataclass
class GRPOConfig:
    # --- model and data ---
    model: str = _f("", "local directory or Hub id of a causal LM; empty = the embedded default base model")
    dtype: str = _f(
        "fp32",
        "the parameters' storage dtype (TRL: model_init_kwargs dtype): fp32 master weights, or bf16 for "
        "memory (the optimizer then keeps every update: --optim)",
        choices=("fp32", "bf16"),
    )
    bf16: bool = _f(
        None,
        "bf16 mixed precision: the training forward autocast to bf16 on the stored weights (TRL's name; "
        "unset: on where bf16 is faster, a GPU with bf16 tensor cores or a CPU where "
        "grpo_fast/trainer/calibrate.py measured it faster (first run, cached), said once with the ratio); "
        "rollouts and held-out evaluation then sample in bf16",
    )
    fp16: bool = _f(False, "fp16 mixed precision: autocast to fp16, the loss scaled (TRL's name)")
    cast_lm_head_to_fp32: bool = _f(
        False,
        "the LM head's GEMM in fp32 under --bf16 / --fp16, outside the autocast region (TRL's name, the "
        "ScaleRL recipe: the log-probs of the loss and of the old and reference policies from fp32 logits); "
        "needs fp32 weights (--dtype fp32)",
    )
    optim: str = _f(
        "adamw_torch_fused",
        "optimizer, HF's names: adamw_torch_fused (default) / adamw_torch; on bf16 weights both keep fp32 "
        "master weights (2+4+8 bytes a parameter); adamw_kahan (bf16 weights + a bf16 compensation, 2+2+8); "
        "adamw_stochastic (stochastic rounding, 2+8); adamw_8bit / paged_adamw_8bit (bitsandbytes, fp32 "
        "weights, 4+2)",
        choices=(
            "adamw_torch_fused",
            "adamw_torch",
            "adamw_kahan",
            "adamw_stochastic",
            "adamw_8bit",
            "paged_adamw_8bit",
        ),
    )
    gradient_checkpointing: bool = _f(False, "recompute activations in backward to save memory")
    lora_r: int = _f(0, "LoRA rank (0 = train all weights); the reference model is the base, adapters off")
    lora_alpha: int = _f(16, "LoRA alpha")
    lora_dropout: float = _f(0.0, "LoRA dropout")
    disable_dropout: bool = _f(
        False,
        "every nn.Dropout module of the policy and reference at p = 0, LoRA's included (TRL's name and "
        "default): the training forward then scores as the no-grad forwards (old and reference log-probs) do",
    )
    lora_target_modules: str = _f("all-linear", "LoRA target modules (comma-separated names or all-linear)")
    dataset: str = _f("", "local JSONL/JSON/CSV/Parquet file or Hub dataset name; empty = the embedded task")
    dataset_split: str = _f("train", "split of a Hub dataset")
    shuffle_dataset: bool = _f(
        True, "draw the prompts in a new random order each epoch (TRL's name and default); off: in file order"
    )
    eval_dataset: str = _f(
        "", "held-out prompts (file or Hub name); empty = none (embedded task: its eval split)"
    )
    eval_split: str = _f("test", "split of a Hub eval dataset")
    max_prompt_length: int = _f(512, "prompts are cut to their last N tokens")
    chat_template_kwargs: dict = _f(
        None,
        "extra keyword arguments of the chat template, a JSON object (TRL's name), e.g. "
        "'{\"enable_thinking\": false}' for Qwen3: every prompt, multi-turn conversations and held-out too",
        type=chat_template_kwargs,
    )
    # --- rewards ---
    reward: list = _f(
        None,
        "reward function (repeatable): a built-in (accuracy: math-verify; integer_answer: the stated "
        "integer, expressions and lists score 0; format; partial; overlong[:N]; code) or path/file.py:func",
        action="append",
    )
    reward_weights: list = _f(None, "one weight per reward function (default 1 each)", nargs="+", type=float)
    allow_unsandboxed_code: bool = _f(
        False, "run the code reward without its OS sandbox (bubblewrap) when that is missing: limits only"
    )
    on_reward_error: str = _f(
        "raise",
        "a failing reward function stops training, or its samples are dropped",
        choices=("raise", "skip"),
    )
    task: str = _f(
        "shop",
        "the embedded task, when --model and --dataset are empty: shop (make demo), shop-tools (make "
        "demo-tools: multi-turn, a calculator tool, its own base model), smollm2 (make demo-smollm2: "
        "SmolLM2-135M-Instruct, built offline, on additions and two-step word problems), or smollm2-two-step "
        "(the word problems alone, 128-token completions: docs/real-model.md)",
        choices=tuple(EMBEDDED),
    )
    # --- multi-turn: tools and environments (TRL's names) ---
    tools: list = _f(
        None,
        "a tool the model may call, path/file.py:function with type hints and a docstring (repeatable); "
        "rollouts become multi-turn",
        action="append",
    )
    environment: str = _f(
        "",
        "path/file.py:Class, TRL's environment_factory: one instance per rollout, reset(**row) before it, "
        "its public methods are tools, its optional get_reward() a reward",
    )
    max_tool_calling_iterations: int = _f(
        None, "tool rounds per rollout (default: until max_completion_length)", type=int
    )
    tool_timeout_s: float = _f(10.0, "seconds each tool call may run (then: an error message to the model)")
    # --- generation ---
    num_generations: int = _f(8, "completions per prompt (the group size G)")
    prompts_per_step: int = _f(8, "prompts per optimizer step (each yields num_generations completions)")
    max_completion_length: int = _f(256, "longest completion in tokens")
    temperature: float = _f(1.0, "sampling temperature (also divides the logits in the loss)")
    top_p: float = _f(1.0, "nucleus sampling threshold")
    top_k: int = _f(0, "top-k sampling (0 = off)")
    min_p: float = _f(
        None,
        "min-p sampling (TRL's): drop the tokens below min_p x the likeliest token's probability, after "
        "top-k and top-p (transformers' order; vLLM applies it first); typical 0.01-0.2, default off",
        type=float,
    )
    repetition_penalty: float = _f(
        1.0,
        "TRL's: before temperature and the filters, the logit of each token already in the sample's context "
        "(prompt, completion so far, tool turns) is divided by it where positive, multiplied where negative; "
        "> 1 discourages repeats, 1.0 off. It shapes sampling only: the loss scores the model's own "
        "log-probs (as TRL's transformers path); held-out evaluation decodes greedily without it",
    )
    share_prefix: bool = _f(
        True, "prefill and train each prompt once per group (exact; see shared_prefix.py)"
    )
    rollout: str = _f(
        "auto",
        "generation engine: native (static KV cache, fixed-shape decode step; Llama/Qwen2/Qwen3/Mistral), "
        "reference (the model's own forward, token by token), vllm (vLLM in this process, weights pushed "
        "each step; make setup-vllm), auto (native when it supports the model)",
        choices=("auto", "native", "reference", "vllm"),
    )
    rollout_compile: str = _f(
        "auto",
        "the native engine's decode step: auto (CUDA graphs on CUDA, eager on a CPU), graphs (one CUDA graph "
        "per batch bucket, captured when first needed; on a CPU the same buckets run eagerly), on (Inductor, "
        "torch.compile: a first compile takes minutes), off (eager)",
        choices=("auto", "graphs", "on", "off"),
    )
    rollout_dtype: str = _f(
        "model",
        "the precision rollouts sample in: the policy's own (model = fp32), or a copy made after each "
        "optimizer step: bf16 / fp16 (native and vllm), int8 (native, CPU: per-channel weights, per-token "
        "activations), fp8 (native: e4m3 via torch._scaled_mm, GPU-fast, CPU-emulated; vllm: GPU), or auto "
        "(on a CPU bf16 where its decode step measured faster, as --bf16 unset measures training; elsewhere "
        "bf16 where the machine multiplies bf16 natively); not the training forward, so the mismatch "
        "correction applies",
        choices=("model", "auto", "fp32", "bf16", "fp16", "int8", "fp8"),
    )
    vllm_gpu_memory_utilization: float = _f(
        0.3, "--rollout vllm on CUDA: the share of GPU memory vLLM takes for its weights and KV cache"
    )
    vllm_kv_cache_gb: float = _f(2.0, "--rollout vllm on CPU: vLLM's KV cache space in GiB (whole GiB)")
    vllm_mode: str = _f(
        "colocate",
        "--rollout vllm: colocate (vLLM in this process) or server (rollouts on vLLM servers, e.g. started "
        "with `grpo-fast serve MODEL`; the weights pushed after every optimizer step and verified)",
        choices=("colocate", "server"),
    )
    vllm_server_base_url: str = _f(
        None, "server mode: the server's URL, or several comma-separated (prompts routed across them); if "
        "given, vllm_server_host and vllm_server_port are ignored", type=str,
    )  # fmt: skip
    vllm_server_host: str = _f("0.0.0.0", "server mode: the server's host, without vllm_server_base_url")
    vllm_server_port: int = _f(8000, "server mode: the server's port, without vllm_server_base_url")
    vllm_server_timeout: float = _f(240.0, "server mode: seconds to wait for the server(s) to be up")
    vllm_request_timeout_s: float = _f(
        600.0, "server mode: seconds any request (a prompt's G samples, a weight push) may take before the "
        "run stops with an error naming the server (with several servers: retried on another)",
    )  # fmt: skip
    vllm_weight_dir: str = _f(
        None, "server mode: the directory weight pushes go through (safetensors, read by the server's worker "
        "extension); default /dev/shm (shared memory) when every server is on this host", type=str,
    )  # fmt: skip
    max_staleness: int = _f(
        0, "asynchronous GRPO: the next steps' rollouts are generated (on vLLM servers, or colocated on a "
        "thread of its own over a copy of the weights) while this one trains, from weights at most this many "
        "policy versions older than the policy they train (a version per rollout trained: its "
        "steps_per_generation / gradient_accumulation_steps x num_iterations optimizer steps); staler ones "
        "are dropped, counted and replaced (TRL's AsyncGRPO name); "
        "0 = synchronous",
    )  # fmt: skip
    # --- GRPO ---
    beta: float = _f(0.0, "KL coefficient (k3 estimator against the reference model)")
    use_bias_correction_kl: bool = _f(
        True,
        "multiply the k3 KL by the importance ratio (TRL's name and default, DeepSeek-V3.2): the KL's "
        "gradient is then the unbiased reverse-KL gradient; it changes the gradient whenever beta != 0, "
        "on-policy too (the ratio is differentiable where its value is 1)",
    )
    sync_ref_model: bool = _f(
        False,
        "TR-DPO's moving reference (TRL's name): every ref_model_sync_steps optimizer steps the reference "
        "becomes ref_model_mixup_alpha x policy + (1 - alpha) x reference; needs beta != 0, no LoRA. "
        "Checkpoints keep the reference (reference/model.safetensors), so --resume continues with it",
    )
    ref_model_mixup_alpha: float = _f(0.6, "sync_ref_model: the policy's share of the new reference (TRL's)")
    ref_model_sync_steps: int = _f(512, "sync_ref_model: optimizer steps between syncs (TRL's)")
    epsilon: float = _f(0.2, "lower clip epsilon")
    epsilon_high: float = _f(None, "upper clip epsilon (default: epsilon)", type=float)
    loss_type: str = _f(
        "dapo",
        "the loss (TRL's): grpo / bnpo / dr_grpo / dapo / luspo (clipped ratio, each its normalizer), cispo "
        "(clipped IS weight), sapo (soft gate), vespo (gamma-weighted sequence ratio)",
        choices=("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"),
    )
    delta: float = _f(None, "two-sided clipping: cap the unclipped ratio at delta (clip family)", type=float)
    sapo_temperature_pos: float = _f(1.0, "sapo: the gate's temperature for positive advantages")
    sapo_temperature_neg: float = _f(1.05, "sapo: the gate's temperature for other advantages")
    vespo_k_pos: float = _f(2.0, "vespo: gamma shape for non-negative advantages")
    vespo_lambda_pos: float = _f(3.0, "vespo: gamma rate for non-negative advantages")
    vespo_k_neg: float = _f(3.0, "vespo: gamma shape for negative advantages")
    vespo_lambda_neg: float = _f(2.0, "vespo: gamma rate for negative advantages")
    vllm_importance_sampling_correction: bool = _f(
        True,
        "correct the mismatch between the rollout engine's log-probs and the trainer's (TRL's name and "
        "default) whenever the engine is not the training forward: vllm (native and reference are exact)",
    )
    vllm_importance_sampling_mode: str = _f(
        "sequence_mask",
        "the correction: the ratio exp(trainer - engine) per token or per sequence, truncated to the clip "
        "bounds or zeroed outside them (TRL's)",
        choices=("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
    )
    vllm_importance_sampling_clip_max: float = _f(3.0, "the correction's upper bound", type=float)
    vllm_importance_sampling_clip_min: float = _f(
        None, "the correction's lower bound (default: none)", type=float
    )
    off_policy_mask_threshold: float = _f(
        None,
        "DeepSeek-V3.2's off-policy sequence mask: drop a negative-advantage sequence whose mean "
        "log(engine / policy) exceeds this (default: off)",
        type=float,
    )
    top_entropy_quantile: float = _f(
        1.0, "train only on each micro-batch's highest-entropy tokens, this fraction of them (1 = all)"
    )
    entropy_coef: float = _f(
        0.0,
        "entropy bonus: the loss minus this x the mean entropy of trained tokens (the initial coefficient "
        "under --use-adaptive-entropy)",
    )
    use_adaptive_entropy: bool = _f(
        False,
        "Skywork-OR1's adaptive entropy control (TRL's): after each optimizer step the coefficient rises by "
        "entropy_coef_delta when the step's mean entropy (its trained tokens, all ranks) is at or below "
        "entropy_target, else falls by it, within [entropy_coef_min, entropy_coef_max]; a step applies it "
        "only when the step before measured at or below the target (not the first step)",
    )
    entropy_coef_min: float = _f(0.0, "lower bound of the adaptive entropy coefficient")
    entropy_coef_max: float = _f(1.0, "upper bound of the adaptive entropy coefficient")
    entropy_coef_delta: float = _f(0.005, "the adaptive entropy coefficient's change per optimizer step")
    entropy_target: float = _f(
        0.2,
        "the mean per-token entropy (nats) the adaptive control holds: the bonus acts at or below it "
        "(TRL's default 0.2 acts on near collapse only; set it near the entropy seen early in training)",
    )
    skip_zero_advantage_groups: bool = _f(
        True,
        "leave out of the optimization the groups whose every sample has advantage 0 (equal rewards): "
        "their gradient is exactly 0 when beta = 0, entropy_coef = 0 (no adaptive entropy) and "
        "top_entropy_quantile = 1 "
        "(otherwise, and under torchrun, they train); the normalizers still count their tokens and rows. "
        "The step's per-token diagnostics (entropy, rollout mismatch) then cover the trained groups; clip "
        "ratios keep TRL's meaning",
    )
    scale_rewards: str = _f("group", "advantage scaling", choices=("group", "batch", "none"))
    multi_objective_aggregation: str = _f(
        "sum_then_normalize",
        "how several reward functions make one advantage (TRL's name and default): sum_then_normalize (the "
        "weighted sum, scaled as scale_rewards says) or normalize_then_sum (GDPO: each function's rewards "
        "normalized within their group, the weighted sum normalized over the batch; scale_rewards unused)",
        choices=("sum_then_normalize", "normalize_then_sum"),
    )
    importance_sampling_level: str = _f(
        "token", "importance ratio per token or per sequence (GSPO)", choices=("token", "sequence")
    )
    num_iterations: int = _f(1, "optimizer passes over each generated batch (mu)")
    mask_truncated_completions: bool = _f(False, "exclude completions that hit max_completion_length")
    # --- optimization ---
    learning_rate: float = _f(1e-6, "AdamW peak learning rate")
    adam_beta1: float = _f(0.9, "AdamW beta1")
    adam_beta2: float = _f(0.999, "AdamW beta2")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    max_grad_norm: float = _f(1.0, "gradient clipping norm")
    warmup_steps: float = _f(
        0.0, "linear warmup from 0 over this many steps (>= 1), or this fraction of max_steps (< 1), as TRL's"
    )
    lr_scheduler_type: str = _f(
        "linear",
        "transformers' schedule of that name: linear / cosine decay to 0 after the warmup, constant (no "
        "warmup), constant_with_warmup",
        choices=("linear", "cosine", "constant", "constant_with_warmup"),
    )
    gradient_accumulation_steps: int = _f(
        1, "micro-batches per optimizer step (prompts_per_step splits evenly)"
    )
    steps_per_generation: int = _f(
        None,
        "micro-batches each generation feeds (TRL's name and default: gradient_accumulation_steps, one "
        "optimizer step per rollout); a multiple k of gradient_accumulation_steps makes each rollout "
        "prompts_per_step x k prompts, trained as k optimizer steps of prompts_per_step prompts each (whole "
        "groups, in the sampler's order; the log-probs of the steps after the first taken before it, as "
        "num_iterations does); exclusive with generation_batch_size",
        type=int,
    )
    generation_batch_size: int = _f(
        None,
        "completions per generation, all ranks together (TRL's name): prompts_per_step x num_generations x "
        "k for k optimizer steps per rollout (see steps_per_generation, exclusive with it)",
        type=int,
    )
    group_split: int = _f(
        0,
        "completions per training sub-batch (0 = whole groups): a group's completions in sub-batches that "
        "each carry the prompt; gradients identical to the whole group's",
    )
    max_memory_gb: float = _f(
        0.0,
        "plan gradient checkpointing and pack each step's micro-batches from its real lengths (whole groups, "
        "or sub-batches of a group's completions each carrying the prompt) so that a step's estimated peak "
        "stays under this many GiB (grpo-fast estimate); replaces --group-split; 0 = use the flags as given",
    )
    max_steps: int = _f(100, "optimizer steps")
    seed: int = _f(42, "random seed")
    # --- output ---
    output_dir: str = _f("runs/grpo", "where metrics, plots and checkpoints go")
    logging_steps: int = _f(1, "write a metrics record every N steps")
    log_completions: bool = _f(
        False,
        "at each logged step, append its prompts, completions, each reward function's score and the "
        "advantages to <output_dir>/completions.jsonl and print them (TRL's name): what the rewards pay for",
    )
    num_completions_to_print: int = _f(
        None, "--log-completions: how many of a step's completions to print (TRL's; default all)", type=int
    )
    eval_steps: int = _f(0, "evaluate held-out greedy accuracy every N steps (0 = only before and after)")
    eval_max_samples: int = _f(256, "held-out prompts per evaluation")
    num_generations_eval: int = _f(
        None,
        "TRL's name: also sample N completions per held-out prompt as training samples them and log "
        "eval_sampled_accuracy (the share paid in full: pass@1 at the training temperature) and "
        "eval_pass_at_n (prompts with one or more); default off (TRL's None means num_generations: here "
        "held-out evaluation stays greedy-only unless asked, the sampled pass costing N times the greedy)",
        type=int,
    )
    save_steps: int = _f(0, "checkpoint every N steps (0 = only at the end)")
    save_total_limit: int = _f(2, "checkpoints kept")
    resume: bool = _f(False, "continue from the latest checkpoint in output_dir")
    overwrite_output_dir: bool = _f(
        False, "start afresh in an output_dir that holds checkpoints (deletes them)"
    )
    report_to: str = _f("none", "also log to tensorboard or wandb", choices=("none", "tensorboard", "wandb"))
    time_budget_s: float = _f(0.0, "stop after this many seconds of training (0 = no limit)")
    # --- devices and kernels ---
    distributed: str = _f(
        "ddp",
        "under torchrun: DDP (a replica per rank) or FSDP2 (params, grads, optimizer state sharded)",
        choices=("ddp", "fsdp"),
    )
    dist_timeout_s: float = _f(600.0, "a collective that waits longer (e.g. a rank died) is an error")
    liger_kernels: bool = _f(
        False, "on CUDA, patch the model with Liger's RMSNorm / RoPE / SwiGLU kernels (needs liger-kernel)"
    )


# The embedded default task: a tiny base model learns in minutes on a CPU with these.
DEFAULT_TASK_PRESET = dict(
    reward=["shop_answer"],
    num_generations=8,
    prompts_per_step=16,
    max_completion_length=20,
    max_prompt_length=32,
    learning_rate=1e-4,
    warmup_steps=0.02,
    lr_scheduler_type="constant_with_warmup",
    max_steps=400,
    eval_steps=25,
    eval_max_samples=128,
    save_steps=100,
    time_budget_s=280.0,
)

# make demo-tools: the same problems, the calculator tool (grpo_fast/tasks/tools_task.py), longer
# completions
TOOLS_TASK_PRESET = dict(
    DEFAULT_TASK_PRESET,
    tools=[f"{Path(__file__).resolve().parents[1] / 'tasks' / 'tools_task.py'}:calculator"],
    max_completion_length=32,
    max_prompt_length=40,
    max_tool_calling_iterations=2,
)
# make demo-smollm2: a real pretrained model (grpo_fast/tasks/smollm2.py) on grpo_fast/tasks/arithmetic.py,
# the integer it states the reward; held-out greedy accuracy rises by >= 0.15 within 12 minutes on 2 cores
SMOLLM2_TASK_PRESET = dict(
    reward=["integer_answer"],
    num_generations=8,
    prompts_per_step=4,
    max_completion_length=32,
    max_prompt_length=96,
    learning_rate=2e-5,
    lr_scheduler_type="constant",
    max_steps=80,
    eval_steps=10,
    eval_max_samples=128,
    save_steps=30,
    time_budget_s=600.0,
)
# --task smollm2-two-step: the two-step word problems alone, room to work both steps (128 tokens) and 17
# minutes of steps; SmolLM2-135M does not lift on them in that time (docs/real-model.md)
SMOLLM2_TWO_STEP_PRESET = dict(
    SMOLLM2_TASK_PRESET,
    max_completion_length=128,
    max_steps=400,
    eval_steps=0,
    save_steps=10,
    time_budget_s=1020.0,
)
TASK_PRESETS = {
    "shop": DEFAULT_TASK_PRESET, "shop-tools": TOOLS_TASK_PRESET, "smollm2": SMOLLM2_TASK_PRESET,
    "smollm2-two-step": SMOLLM2_TWO_STEP_PRESET,
}  # fmt: skip


def _field_type(f):
    t = f.type if not isinstance(f.type, str) else eval(f.type, vars(typing))  # noqa: S307 - our own annotations
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        t = next(a for a in typing.get_args(t) if a is not type(None))
    return t


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="grpo-fast train",
        description="GRPO training on fused kernels.",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--config", help="YAML or JSON file of config fields (flags override it)")
    for f in dataclasses.fields(GRPOConfig):
        meta = dict(f.metadata)
        flag = "--" + f.name.replace("_", "-")
        kw = {"help": f"{meta.pop('help')} (default: {f.default})", "dest": f.name}
        t = _field_type(f)
        if t is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            continue
        if "action" in meta or "nargs" in meta:
            kw.update(meta)
        else:
            kw.update(type=meta.pop("type", t), **meta)
        p.add_argument(flag, **kw)
    return p


# TRL / transformers config fields a TRL user's file may hold that are not fields here: what says the same
TRL_EQUIVALENTS = {
    "per_device_train_batch_size": "--prompts-per-step, prompts per optimizer step over all ranks (TRL's "
    "per_device_train_batch_size x processes x gradient_accumulation_steps / num_generations)",
    "num_train_epochs": "--max-steps (optimizer steps)",
    "use_vllm": "--rollout vllm (--vllm-mode colocate or server)",
    "model_init_kwargs": "--dtype (fp32 or bf16)",
    "resume_from_checkpoint": "--resume (the latest checkpoint in --output-dir)",
    "save_strategy": "--save-steps N (0: at the end only)",
    "eval_strategy": "--eval-steps N (0: before and after training)",
    "generation_kwargs": "--temperature, --top-p, --top-k, --min-p, --repetition-penalty",
    "per_device_eval_batch_size": "none: held-out evaluation runs in chunks of 64 prompts",
    "use_liger_kernel": "--liger-kernels",
    "gradient_checkpointing_kwargs": "--gradient-checkpointing",
    "use_cpu": "none: the device is CUDA where there is one, else the CPU",
    "pad_to_multiple_of": "none: sequences are not padded to a multiple (TRL's default 'auto' pads on Neuron "
    "only)",
    "cache_implementation": "none: the native engine keeps its own static KV cache (--rollout native)",
    "use_transformers_paged": "--rollout native (static KV cache, each prompt prefilled once per group)",
    "use_transformers_continuous_batching": "--rollout native or --rollout vllm",
    "vllm_max_model_length": "none: vLLM's context is --max-prompt-length + --max-completion-length",
}
# TRL 1.16's deprecated alias of vllm_importance_sampling_clip_max, taken with TRL's meaning (it replaces it)
TRL_DEPRECATED_CAP = "vllm_importance_sampling_cap"


def load_config_file(path: str) -> dict:
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of config fields, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    unknown = sorted(k for k in (k.replace("-", "_") for k in data) if k not in names)
    if "warmup_ratio" in unknown:  # transformers 5 folded it into warmup_steps, as we do
        raise ValueError(f"--config {path}: warmup_ratio is warmup_steps now (a value < 1 is a fraction)")
    data = {k.replace("-", "_"): v for k, v in data.items()}
    cap = data.pop(TRL_DEPRECATED_CAP, None) if TRL_DEPRECATED_CAP in unknown else None
    unknown = [k for k in unknown if k != TRL_DEPRECATED_CAP]
    if unknown:
        hints = [f"{k}: {TRL_EQUIVALENTS[k]}" for k in unknown if k in TRL_EQUIVALENTS]
        said = f"; TRL's fields here: {'; '.join(hints)}" if hints else ""
        raise ValueError(f"--config {path}: unknown fields {unknown}{said}")
    if cap is not None:  # TRL 1.16's meaning: the deprecated cap replaces clip_max, with a warning
        warnings.warn(
            f"--config {path}: {TRL_DEPRECATED_CAP} is TRL's deprecated name for "
            f"vllm_importance_sampling_clip_max; taken as it ({cap})",
            FutureWarning,
            stacklevel=2,
        )
        data["vllm_importance_sampling_clip_max"] = cap
    return data


def validate(cfg: GRPOConfig, require_reward: bool = True) -> GRPOConfig:
    """Every field's range, and a reward function unless `require_reward` is False (what only sizes a run,
    like `grpo-fast estimate`, needs none)."""
    for f in dataclasses.fields(GRPOConfig):
        choices = f.metadata.get("choices")
        if choices and getattr(cfg, f.name) not in choices:
            raise ValueError(f"{f.name} must be one of {choices}, got {getattr(cfg, f.name)!r}")
    positive = (
        "num_generations",
        "prompts_per_step",
        "max_completion_length",
        "max_prompt_length",
        "max_steps",
        "num_iterations",
        "gradient_accumulation_steps",
        "logging_steps",
    )
    for name in positive:
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.num_generations < 2:
        raise ValueError(
            f"num_generations must be >= 2, got {cfg.num_generations}: advantages are relative to the group, "
            "so with one completion per prompt every advantage is 0 and nothing is learned"
        )
    if cfg.prompts_per_step % cfg.gradient_accumulation_steps:
        raise ValueError(
            f"prompts_per_step ({cfg.prompts_per_step}) must be divisible by "
            f"gradient_accumulation_steps ({cfg.gradient_accumulation_steps})"
        )
    if cfg.group_split < 0 or (cfg.group_split and cfg.num_generations % cfg.group_split):
        raise ValueError(
            f"group_split must be 0 (whole groups) or divide num_generations ({cfg.num_generations}), "
            f"got {cfg.group_split}"
        )
    if cfg.max_memory_gb < 0:
        raise ValueError(f"max_memory_gb must be >= 0 (0 = no plan), got {cfg.max_memory_gb}")
    if cfg.warmup_steps < 0 or (cfg.warmup_steps >= 1 and cfg.warmup_steps != int(cfg.warmup_steps)):
        raise ValueError(
            f"warmup_steps must be a whole number of steps (>= 1) or a fraction of max_steps in [0, 1), got "
            f"{cfg.warmup_steps}"
        )
    if cfg.temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {cfg.temperature}")
    if not 0 < cfg.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {cfg.top_p}")
    if cfg.num_generations_eval is not None and cfg.num_generations_eval < 1:
        raise ValueError(
            f"num_generations_eval must be >= 1 (or unset: greedy only), got {cfg.num_generations_eval}"
        )
    if not cfg.repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0 (1.0: off), got {cfg.repetition_penalty}")
    if cfg.min_p is not None and not 0 <= cfg.min_p <= 1:
        raise ValueError(
            f"min_p must be in [0, 1] (a share of the likeliest token's probability), got {cfg.min_p}"
        )
    if cfg.learning_rate <= 0:
        raise ValueError(f"learning_rate must be > 0, got {cfg.learning_rate}")
    if cfg.reward_weights is not None and len(cfg.reward_weights) != len(cfg.reward or []):
        raise ValueError(
            f"reward_weights has {len(cfg.reward_weights)} values for {len(cfg.reward or [])} "
            "reward functions"
        )
    if not 0 < cfg.vllm_gpu_memory_utilization <= 1:
        raise ValueError(
            f"vllm_gpu_memory_utilization must be in (0, 1], got {cfg.vllm_gpu_memory_utilization}"
        )
    if cfg.vllm_kv_cache_gb < 1:
        raise ValueError(f"vllm_kv_cache_gb must be >= 1 (whole GiB), got {cfg.vllm_kv_cache_gb}")
    check_server_mode(cfg)
    if cfg.dist_timeout_s <= 0:
        raise ValueError(f"dist_timeout_s must be > 0, got {cfg.dist_timeout_s}")
    if cfg.delta is not None and not cfg.delta > 0:
        raise ValueError(
            f"delta must be > 0 (a cap on the ratio; TRL suggests > 1 + epsilon_high), got {cfg.delta}"
        )
    if cfg.sync_ref_model and (cfg.beta == 0 or cfg.lora_r):
        raise ValueError(
            "sync_ref_model needs a reference model of its own to move: "
            + ("beta is 0 (no KL term, no reference)" if cfg.beta == 0 else "with LoRA (lora_r > 0) the "
               "reference is the base with adapters off, which is not synced")
        )  # fmt: skip
    if isinstance(cfg.chat_template_kwargs, str):  # a JSON string (a --config file), as TRL takes it
        try:
            cfg.chat_template_kwargs = chat_template_kwargs(cfg.chat_template_kwargs)
        except ValueError as exc:
            raise ValueError(f"chat_template_kwargs: {exc}") from exc
    if cfg.chat_template_kwargs is not None and not isinstance(cfg.chat_template_kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be a mapping, got {cfg.chat_template_kwargs!r}")
    if not 0 <= cfg.ref_model_mixup_alpha <= 1:
        raise ValueError(f"ref_model_mixup_alpha must be in [0, 1], got {cfg.ref_model_mixup_alpha}")
    if cfg.ref_model_sync_steps < 1:
        raise ValueError(f"ref_model_sync_steps must be >= 1, got {cfg.ref_model_sync_steps}")
    if not 0 <= cfg.top_entropy_quantile <= 1:
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {cfg.top_entropy_quantile}")
    if cfg.cast_lm_head_to_fp32 and cfg.dtype != "fp32":
        raise ValueError(
            f"cast_lm_head_to_fp32 needs --dtype fp32, got --dtype {cfg.dtype}: the LM head would be the one "
            "fp32 module among 16-bit weights (and its tied embeddings with it), which the rollout engines "
            "do not run; with fp32 weights the head's GEMM runs in fp32 under --bf16"
        )
    if cfg.use_adaptive_entropy:
        if not cfg.entropy_coef_min <= cfg.entropy_coef_max:
            raise ValueError(
                f"entropy_coef_min ({cfg.entropy_coef_min}) must be <= entropy_coef_max "
                f"({cfg.entropy_coef_max})"
            )
        if not cfg.entropy_coef_delta >= 0:
            raise ValueError(f"entropy_coef_delta must be >= 0, got {cfg.entropy_coef_delta}")
    check_correction(cfg)
    generation_steps(cfg)
    correcting = cfg.vllm_importance_sampling_correction and cfg.rollout == "vllm"
    if correcting and (cfg.top_p < 1 or cfg.top_k or cfg.min_p) and cfg.temperature != 1:
        raise ValueError(
            f"--rollout vllm with top_p={cfg.top_p} / top_k={cfg.top_k} / min_p={cfg.min_p} at temperature "
            f"{cfg.temperature}: "
            "vLLM reports log-probs renormalized over the kept tokens, not softmax(logits / T) as the "
            "trainer scores them, which biases the rollout-mismatch correction; sample at temperature 1, or "
            "without top_p / top_k / min_p, or pass --no-vllm-importance-sampling-correction"
        )
    if correcting and cfg.repetition_penalty != 1 and cfg.temperature != 1:
        raise ValueError(
            f"--rollout vllm with repetition_penalty={cfg.repetition_penalty} at temperature "
            f"{cfg.temperature}: vLLM's log-probs at a temperature other than 1 are its processed ones, "
            "which include the penalty, not softmax(logits / T) as the trainer scores them; sample at "
            "temperature 1, or without the penalty, or pass --no-vllm-importance-sampling-correction"
        )
    if cfg.max_tool_calling_iterations is not None and cfg.max_tool_calling_iterations < 0:
        raise ValueError(
            f"max_tool_calling_iterations must be None or >= 0, got {cfg.max_tool_calling_iterations}"
        )
    if not cfg.tool_timeout_s > 0:
        raise ValueError(f"tool_timeout_s must be > 0 seconds, got {cfg.tool_timeout_s}")
    if require_reward and not cfg.reward and not cfg.environment:
        raise ValueError("no reward function: pass --reward NAME or --reward path/file.py:func")
    return cfg


def generation_steps(cfg: GRPOConfig) -> int:
    """Optimizer steps each rollout feeds (TRL's steps_per_generation / gradient_accumulation_steps, or its
    generation_batch_size over a step's completions); before num_iterations' repeats."""
    ga, per_step = cfg.gradient_accumulation_steps, cfg.prompts_per_step * cfg.num_generations
    if cfg.steps_per_generation is not None and cfg.generation_batch_size is not None:
        raise ValueError("steps_per_generation and generation_batch_size can not both be set (as in TRL)")
    if cfg.generation_batch_size is not None:
        if cfg.generation_batch_size < 1 or cfg.generation_batch_size % per_step:
            raise ValueError(
                f"generation_batch_size ({cfg.generation_batch_size}) must be a positive multiple of a "
                f"step's completions, prompts_per_step x num_generations = {per_step}"
            )
        return cfg.generation_batch_size // per_step
    if cfg.steps_per_generation is None:
        return 1
    if cfg.steps_per_generation < 1 or cfg.steps_per_generation % ga:
        raise ValueError(
            f"steps_per_generation ({cfg.steps_per_generation}) must be a positive multiple of "
            f"gradient_accumulation_steps ({ga}): each optimizer step trains whole micro-batches of one "
            "rollout"
        )
    return cfg.steps_per_generation // ga


def prompts_per_rollout(cfg: GRPOConfig) -> int:
    """Prompts each rollout generates for (all ranks): prompts_per_step x generation_steps."""
    return cfg.prompts_per_step * generation_steps(cfg)


def steps_per_rollout(cfg: GRPOConfig) -> int:
    """Optimizer steps each rollout trains: generation_steps x num_iterations."""
    return generation_steps(cfg) * cfg.num_iterations


def server_urls(cfg: GRPOConfig) -> list[str]:
    """The vLLM servers of --vllm-mode server: vllm_server_base_url split at commas, else host:port."""
    if cfg.vllm_server_base_url:
        return [u.strip() for u in cfg.vllm_server_base_url.split(",") if u.strip()]
    host = "127.0.0.1" if cfg.vllm_server_host in ("0.0.0.0", "") else cfg.vllm_server_host
    return [f"http://{host}:{cfg.vllm_server_port}"]


def collective_timeout_s(cfg: GRPOConfig) -> float:
    """How long a torchrun collective may wait: --dist-timeout-s, but in server mode at least as long as a
    rank may wait for another's server requests (vllm_request_timeout_s x (servers + 1): a generation retried
    on every server), so that a failing server ends the run with its own error, saved, not a timed-out
    collective."""
    if not (cfg.rollout == "vllm" and cfg.vllm_mode == "server"):
        return cfg.dist_timeout_s
    return max(cfg.dist_timeout_s, cfg.vllm_request_timeout_s * (len(server_urls(cfg)) + 1) + 60)


def check_server_mode(cfg: GRPOConfig) -> None:
    server = cfg.rollout == "vllm" and cfg.vllm_mode == "server"
    if cfg.max_staleness < 0:
        raise ValueError(
            f"max_staleness must be >= 0 optimizer steps (0 = synchronous), got {cfg.max_staleness}"
        )
    if cfg.max_staleness and cfg.rollout == "vllm" and not server:
        raise ValueError(
            f"max_staleness={cfg.max_staleness} (asynchronous GRPO) with vLLM needs --vllm-mode server (a "
            "vLLM engine in this process does not generate on a thread of its own); colocated, use "
            "--rollout native (or auto)"
        )
    if cfg.vllm_mode == "server" and cfg.rollout != "vllm":
        raise ValueError(f"vllm_mode='server' needs --rollout vllm, got --rollout {cfg.rollout}")
    if not server:
        return
    for name in ("vllm_server_timeout", "vllm_request_timeout_s"):
        if not getattr(cfg, name) > 0:
            raise ValueError(f"{name} must be > 0 seconds, got {getattr(cfg, name)}")
    for url in server_urls(cfg):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"vllm_server_base_url: expected http(s)://host:port, got {url!r}")
    if cfg.rollout_dtype not in ("model", "auto"):
        raise ValueError(
            f"--vllm-mode server: the server's dtype is its own (grpo-fast serve --dtype), got "
            "--rollout-dtype "
            f"{cfg.rollout_dtype}"
        )


def check_correction(cfg: GRPOConfig) -> None:
    """Options that conflict with the rollout-mismatch correction, when it will be on: the rollout is not the
    training forward (vLLM, a --rollout-dtype copy, 16-bit weights or compute). Run again once --bf16 unset
    is decided (grpo_fast.trainer.precision)."""
    inexact = (
        cfg.rollout == "vllm"
        or cfg.rollout_dtype not in ("model", "fp32", "auto")
        or cfg.dtype != "fp32"
        or bool(cfg.bf16 or cfg.fp16)
    )
    mode = cfg.vllm_importance_sampling_mode
    correcting = cfg.vllm_importance_sampling_correction and inexact
    if correcting and cfg.loss_type == "vespo" and mode.startswith("sequence"):
        raise ValueError(
            "loss_type vespo needs vllm_importance_sampling_mode token_truncate or token_mask (it folds the "
            f"correction into its sequence weight), got {mode}; the correction is on because the rollout is "
            "not the training forward (vLLM, a --rollout-dtype copy, or 16-bit training)"
        )


def parse_config(argv=None, require_reward: bool = True) -> GRPOConfig:
    """Config from (in increasing priority) defaults, the embedded-task preset, --config FILE, flags."""
    args = vars(build_parser().parse_args(argv))
    file_values = load_config_file(args.pop("config")) if "config" in args else {}
    values = {**file_values, **args}
    if not values.get("model") and not values.get("dataset"):
        values = {**TASK_PRESETS[values.get("task", "shop")], **values}
    return validate(GRPOConfig(**values), require_reward)


def to_dict(cfg: GRPOConfig) -> dict:
    return dataclasses.asdict(cfg)
