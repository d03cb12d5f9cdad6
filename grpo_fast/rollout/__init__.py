"""Rollouts: G sampled completions per prompt, behind one interface, `generate_groups`, whatever engine runs
it.

Engines: "native" (grpo_fast.rollout.native: static KV cache, compiled fixed-shape decode step, no host sync
per token) for Llama / Qwen2 / Qwen3 / Mistral-style models; "reference" (grpo_fast.rollout.reference: the
model's own forward, eager, token by token), which is exact for any transformers causal LM and what the native
engine is tested against; "vllm" (grpo_fast.rollout.vllm_engine: vLLM in this process, the policy's weights
pushed whenever they changed; an optional install). "auto" takes the native engine when it supports the model,
else the reference one with a one-line reason. Prompts are left-padded; sample s belongs to prompt s // G;
sampling applies temperature, then top-k, then top-p; a sample stops at EOS (kept, mask 1) and later tokens
are padding (mask 0).

The package: the interface (here), the engines (`native`, `reference`, `vllm_engine`), sampling, decode-time
shared attention, and the multi-turn loop (`trajectories`) with its tools (`tools`). Imports: grpo_fast.models
and, for the python tool, grpo_fast.rewards' sandbox; never the trainer.
"""

import torch

from . import native, reference, server, vllm_engine
from .sampling import check_counts, check_repetition_penalty

ENGINES = ("auto", "native", "reference", "vllm")
# whether an engine's log-probs are the training forward's up to rounding (no mismatch to correct), when it
# runs the policy's own dtype (rollout_dtype "model"); a low-precision rollout never is
EXACT_ENGINES = {"native": True, "reference": True, "vllm": False}


def is_exact(engine: str, rollout_dtype: str = "model") -> bool:
    return EXACT_ENGINES.get(engine, False) and rollout_dtype in ("model", "fp32")


_said: set = set()  # fallback reasons already printed


def resolve_engine(model, engine: str) -> tuple[str, str | None]:
    """("native" | "reference" | "vllm", why not native or None)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "vllm":
        return "vllm", "asked for"
    if engine == "reference":
        return "reference", "asked for"
    reason = native.unsupported_reason(model)
    if reason and engine == "native":
        raise ValueError(f"engine='native' cannot run this model: {reason}")
    return ("reference", reason) if reason else ("native", None)


@torch.no_grad()
def generate_groups(
    model,
    prompt_ids,
    prompt_mask,
    num_generations,
    max_new_tokens,
    *,
    temperature=1.0,
    top_p=1.0,
    top_k=0,
    min_p=0.0,
    repetition_penalty=1.0,
    eos_token_id=None,
    share_prefix=True,
    generator=None,
    all_done=None,
    engine="auto",
    compile="auto",
    return_logprobs=False,
    vllm_options=None,
    rollout_dtype="model",
):
    """G sampled completions per prompt; sample s belongs to prompt s // G.

    Args:
        model: a Hugging Face causal LM (plain or PEFT-wrapped).
        prompt_ids, prompt_mask: (n_prompts, P) left-padded prompts and their attention mask.
        num_generations: G. max_new_tokens: C, the longest completion.
        temperature, top_p, top_k, min_p: sampling (temperature 0 = greedy; top_k 0 and min_p 0: off), the
            filters in transformers' order: top-k, top-p, then min-p (tokens below min_p x the likeliest's
            probability).
        repetition_penalty: transformers' and vLLM's (CTRL's): before temperature and the filters, the
            logit of every token already in the row's context (its prompt, its completion so far, a tool's
            turns) is divided by it where positive and multiplied where negative; 1.0: off. It shapes the
            draw only: the log-probs returned stay the model's (the trainer's).
        eos_token_id: int or list of ints ending a completion (kept, mask 1).
        share_prefix: prefill each prompt once and keep its KV once (True), or repeat it G times (False).
        generator: torch.Generator for reproducible sampling.
        all_done: optional `f(local_done) -> bool` deciding when decoding stops (distributed: every rank
            steps until all are done, so that a sharded model's collectives match).
        engine: "auto", "native", "reference" or "vllm" (see the module docstring).
        compile: native engine only: "auto" (CUDA graphs on CUDA, eager on a CPU), "graphs" (the decode step
            on padded batch buckets at fixed addresses, one CUDA graph per bucket; on a CPU run eagerly),
            True (Inductor, torch.compile; fails if compiling fails) or False (eager).
        vllm_options: vllm engine only, used when it is built (the first call for this model): max_model_len
            (default: the model's max_position_embeddings), gpu_memory_utilization, kv_cache_gb, threads,
            logprobs_mode (default: the one whose log-probs are the trainer's at this temperature); or
            mode="server" with urls (vLLM servers) and grpo_fast.rollout.server.ServerEngine's options
            (wait_s, timeout, weight_dir, auto_push): rollouts on those servers, the weights pushed there.
        rollout_dtype: the precision the rollout samples in; not the training forward's, so the mismatch
            correction applies. "model" / "fp32": the policy's own. Native engine: its decode step's linear
            layers run a copy of the policy's weights made per call: "bf16", "fp16" (CPU: oneDNN-packed
            where the CPU has native bf16 / fp16, else `F.linear`), "int8" (CPU: weights per output channel,
            activations per token, `torch._int_mm`), "fp8" (e4m3, the same scales, `torch._scaled_mm`:
            fp8 tensor cores on a GPU, emulated on a CPU); the 8-bit formats keep an fp32 LM head. vllm
            engine: vLLM's dtype ("bf16", "fp16") or its online "fp8" quantization (GPU), fixed when it
            starts. "auto": bf16 for an fp32 policy where the machine multiplies bf16 natively (CPU flags
            avx512_bf16 / amx_bf16, GPU capability >= 8.0), else the policy's; printed with the reason.
        return_logprobs: also return the (n_prompts * G, C') fp32 log-probs of the sampled tokens under
            softmax(logits / T) (T = 1 when greedy) over the whole vocabulary, before the filters: the
            distribution the trainer's loss scores, so an exact engine's ratio to the trainer is 1 whatever
            the truncation; 0 on padding.

    Returns:
        (completion_ids, completion_mask), (n_prompts * G, C') with C' <= C the longest completion, and the
        log-probs third with return_logprobs.
    """
    check_counts(num_generations, max_new_tokens)
    kind, reason = resolve_engine(model, engine)
    kw = dict(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p or 0.0, eos_token_id=eos_token_id,
        repetition_penalty=check_repetition_penalty(repetition_penalty),
    )  # fmt: skip
    if kind == "native":
        return native.engine_for(model).generate(
            prompt_ids, prompt_mask, num_generations, max_new_tokens, share_prefix=share_prefix,
            generator=generator, all_done=all_done, return_logprobs=return_logprobs, compile=compile,
            rollout_dtype=rollout_dtype, **kw,
        )  # fmt: skip
    if kind == "vllm" and (vllm_options or {}).get("mode") == "server":
        opts = {k: v for k, v in vllm_options.items() if k != "mode"}
        return server.engine_for(model, **opts).generate(
            model, prompt_ids, prompt_mask, num_generations, max_new_tokens, generator=generator,
            return_logprobs=return_logprobs, **kw,
        )  # fmt: skip
    if kind == "vllm":  # prefix caching shares each group's prompt KV by itself
        opts = {"logprobs_mode": vllm_engine.logprobs_mode_for(temperature), **(vllm_options or {})}
        opts["rollout_dtype"] = rollout_dtype
        return vllm_engine.engine_for(model, **opts).generate(
            model, prompt_ids, prompt_mask, num_generations, max_new_tokens, generator=generator,
            return_logprobs=return_logprobs, **kw,
        )  # fmt: skip
    if rollout_dtype not in ("model", "auto"):
        raise ValueError(
            f"rollout_dtype={rollout_dtype!r} needs the native or vllm engine, got engine {kind!r}"
        )
    if engine == "auto" and reason not in _said:
        _said.add(reason)
        print(f"grpo-fast rollout: reference engine ({reason})", flush=True)
    gen = reference.generate_shared if share_prefix else reference.generate_plain
    return gen(
        model, prompt_ids, prompt_mask, num_generations, max_new_tokens, generator=generator,
        all_done=all_done, return_logprobs=return_logprobs, **kw,
    )  # fmt: skip


__all__ = ["generate_groups", "resolve_engine", "is_exact", "ENGINES", "EXACT_ENGINES"]
