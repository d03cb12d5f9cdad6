"""TRL's GRPOTrainer on grpo-fast's kernels: change one import, keep every argument and GRPOConfig.

    from grpo_fast.integrations.trl import GRPOTrainer      # instead of: from trl import GRPOTrainer

What changes (TRL 1.16):
- the policy loss goes through `fused_linear_grpo_loss` on the decoder's last hidden states: the (tokens x
  vocab) logits never exist, and d hidden / d weight come out of the same pass;
- the policy forward runs each prompt once per group (`shared_prefix_forward`) when the micro-batch holds
  whole, equal-sized groups and the model is a RoPE decoder we have tested (llama, qwen2, qwen3); otherwise
  the plain forward of [prompt; completion], as TRL does. Both give the same numbers (RoPE is relative, so
  left padding does not move anything);
- reference and old log-probs come from `fused_linear_logprobs` on the same hidden states.

Opt-in: `GRPOTrainer(..., rollout="native")` generates with grpo-fast's native engine (static KV cache, each
prompt prefilled once per group, no per-token host sync; `grpo_fast.rollout`) instead of TRL's
`model.generate`, with TRL's repetition_penalty, temperature, top_k, top_p and min_p in transformers'
order, as the user's generation_kwargs override them (max_new_tokens and eos_token_id too); what it does
not cover (vLLM, continuous batching, multimodal prompts or tools, generation_kwargs it lacks such as
no_repeat_ngram_size or do_sample=False, a model it does not support, a distributed wrapper) keeps TRL's
generation, with a warning saying why.

Every loss option of TRL 1.16 goes to the kernel with TRL's meaning: every loss_type (grpo, bnpo, dr_grpo,
dapo, cispo, sapo, luspo, vespo), delta, the vLLM importance-sampling correction (the kernel recomputes TRL's
ratio from old_per_token_logps and sampling_per_token_logps), off_policy_mask_threshold, top_entropy_quantile
and entropy_coef, static or adaptive (use_adaptive_entropy: TRL's controller state, measured on the entropies
the kernel computes in the same sweep over the vocabulary).

What does not change: generation (by default), rewards, advantages, logging, checkpoints, accelerate. Anything
this path does not cover (MoE aux losses, multimodal inputs, logit scaling or
soft-capping, a model wrapped or sharded for distributed training: DDP, FSDP, ZeRO-3) runs TRL's own code,
with a one-line warning saying why. Metrics (docs/trl.md's table): TRL's names, scaling and timing for kl,
clip_ratio/{low,high,region}_mean, cispo_clip_ratio, vespo/phi_seq_mean and, with the entropy bonus,
policy_loss (each micro-batch) and entropy_coef (each optimizer step); `entropy` only when the options
compute it; clip_ratio/low_min and clip_ratio/high_max are not logged on the fused path.
"""

import warnings
from contextlib import nullcontext

import torch
import trl

from ..kernels import fused_linear_grpo_loss, fused_linear_logprobs
from ..kernels.loss_variants import adaptive_entropy_coef
from ..models.model_parts import decoder_of, lm_head_of
from ..models.shared_prefix import shared_prefix_forward
from ..rollout import dtypes, generate_groups, is_exact, native

FUSED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
ITEM_NORMALIZED = (
    "dapo",
    "cispo",
    "vespo",
)  # TRL divides these by num_items_in_batch, the others by accumulation
SHARED_PREFIX_MODEL_TYPES = ("llama", "qwen2", "qwen3")
_LOGIT_SCALES = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier")
_MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)
# TRL's generation config (its own keys updated by the user's generation_kwargs): what the native engine
# samples with, and what does not change the draw
_NATIVE_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_INERT_GENERATION_KEYS = (
    "pad_token_id",
    "bos_token_id",
    "cache_implementation",
    "use_cache",
    "disable_compile",
)


def equal_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """(order, G) such that rows `order` come in runs of G sharing one prompt, or None if the batch's prompts
    do not split into equal groups of at least two."""
    key = torch.where(prompt_mask.bool(), prompt_ids, -1)
    _, inverse, counts = torch.unique(key, dim=0, return_inverse=True, return_counts=True)
    G = int(counts[0])
    if G < 2 or bool((counts != G).any()):
        return None
    return torch.argsort(inverse, stable=True), G


class GRPOTrainer(trl.GRPOTrainer):
    __doc__ = (trl.GRPOTrainer.__doc__ or "") + "\n\n(grpo-fast: " + __doc__.split("\n\n")[1] + ")"

    def __init__(self, *args, rollout: str = "trl", rollout_dtype: str = "model", **kwargs):
        if rollout not in ("trl", "native"):
            raise ValueError(
                f"rollout must be 'trl' (TRL's generation) or 'native' (grpo-fast's), got {rollout!r}"
            )
        if rollout_dtype not in dtypes.ROLLOUT_DTYPES or (rollout_dtype != "model" and rollout != "native"):
            raise ValueError(
                f"rollout_dtype must be one of {dtypes.ROLLOUT_DTYPES} (other than 'model' only with "
                f"rollout='native'), got {rollout_dtype!r}"
            )
        super().__init__(*args, **kwargs)
        self.grpo_fast_rollout = rollout
        self.grpo_fast_rollout_dtype = rollout_dtype
        self.fused_fallback_reason = self._config_fallback_reason()
        self._fallback_warned = set()
        if self.fused_fallback_reason:
            self._warn_fallback(self.fused_fallback_reason)

    # ---------------------------------------------------------------------------------------------------
    # When TRL's own path runs instead
    # ---------------------------------------------------------------------------------------------------
    def _config_fallback_reason(self) -> str | None:
        text_config = self.model.config.get_text_config()
        scaled = [n for n in _LOGIT_SCALES if getattr(text_config, n, None) not in (None, 1.0)] + (
            ["logits_scaling"] if getattr(text_config, "logits_scaling", None) not in (None, 1.0) else []
        )
        checks = [
            (
                self.loss_type not in FUSED_LOSS_TYPES,
                f"loss_type={self.loss_type!r} is not one of {FUSED_LOSS_TYPES}",
            ),
            (self.aux_loss_enabled, "a MoE router aux loss"),
            (bool(scaled), f"the model scales or soft-caps its logits ({', '.join(scaled)})"),
            (not isinstance(lm_head_of(self.model), torch.nn.Linear), "the LM head is not a plain nn.Linear"),
        ]
        return next((why for bad, why in checks if bad), None)

    def _sharded_reason(self, model) -> str | None:
        """Our forward calls the decoder and reads the LM head weight directly: not under a wrapper's
        forward (DDP), nor with parameters sharded in place (FSDP, DeepSpeed ZeRO-3)."""
        if self.accelerator.unwrap_model(model) is not model:
            return "the model is wrapped for distributed training (the fused forward would bypass it)"
        if getattr(self, "is_fsdp_enabled", False) or getattr(self, "is_deepspeed_enabled", False):
            return "FSDP / DeepSpeed (parameters sharded outside the fused forward)"
        weight = lm_head_of(model).weight
        if type(weight).__name__ == "DTensor" or hasattr(weight, "ds_id"):
            return "parameters sharded in place (fully_shard / ZeRO-3)"
        return None

    def _batch_fallback_reason(self, model, inputs) -> str | None:
        if why := self._sharded_reason(model):
            return why
        if any(inputs.get(k) is not None for k in _MULTIMODAL_KEYS):
            return "multimodal inputs"
        if inputs["advantages"].dim() != 1:
            return "per-token advantages"
        return None

    def _warn_fallback(self, why: str) -> None:
        if why not in self._fallback_warned:
            self._fallback_warned.add(why)
            warnings.warn(f"grpo_fast GRPOTrainer: TRL's own loss path runs because of {why}", stacklevel=3)

    # ---------------------------------------------------------------------------------------------------
    # Generation with the native engine (opt-in)
    # ---------------------------------------------------------------------------------------------------
    def _native_rollout_reason(self, images, multimodal_fields, has_tool_images) -> str | None:
        model = self.accelerator.unwrap_model(self.model)
        checks = [
            (self.use_vllm, "vLLM generation"),
            (self.use_transformers_continuous_batching, "continuous batching"),
            (bool(images) or bool(multimodal_fields) or has_tool_images, "multimodal prompts"),
            (model is not self.model or self._sharded_reason(model) is not None, "a distributed wrapper"),
        ]
        why = next((why for bad, why in checks if bad), None)
        return why or self._generation_kwargs_reason() or native.unsupported_reason(model)

    def _generation_kwargs_reason(self) -> str | None:
        """The generation_kwargs the native engine cannot honour, named; None where it samples what TRL's
        `model.generate` would (sampling options, max_new_tokens, eos_token_id, keys changing nothing)."""
        kwargs = self.generation_kwargs
        if kwargs.get("do_sample") is False:
            return "generation_kwargs do_sample=False (greedy decoding leaves no sampling log-probs)"
        known = (
            *_NATIVE_SAMPLING_KEYS,
            *_INERT_GENERATION_KEYS,
            "do_sample",
            "max_new_tokens",
            "eos_token_id",
        )
        other = sorted(k for k, v in kwargs.items() if k not in known and v is not None)
        if other:
            return f"generation_kwargs {', '.join(other)} (transformers' options the engine lacks)"
        unset = sorted(k for k, v in (self.args.generation_kwargs or {}).items() if v is None and k in known)
        if unset:  # transformers then takes the model's generation_config.json value or its own default
            return f"generation_kwargs {', '.join(unset)} set to None (transformers' defaults)"
        return None

    def _native_sampling(self) -> dict:
        """generate_groups' options from TRL's generation config as the user's generation_kwargs left it (they
        override TRL's own temperature, top_p, ..., as in TRL's transformers path); None means off."""
        kw = self.generation_kwargs
        off = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
        options = {k: kw[k] if kw.get(k) is not None else off[k] for k in _NATIVE_SAMPLING_KEYS}
        # TRL's generate stops at the config's EOS and TRL then cuts each completion after the first of its
        # own eos_token_ids: a completion ends at the first of either
        eos = kw.get("eos_token_id")
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        options["eos_token_id"] = eos + [e for e in self.eos_token_ids if e not in eos]
        options["max_new_tokens"] = kw.get("max_new_tokens") or self.max_completion_length
        return options

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        if self.grpo_fast_rollout != "native":
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        why = self._native_rollout_reason(images, multimodal_fields, has_tool_images)
        if why:
            if why not in self._fallback_warned:
                self._fallback_warned.add(why)
                warnings.warn(f"grpo_fast GRPOTrainer: TRL's generation runs because of {why}", stacklevel=2)
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        device = self.accelerator.device
        # TRL repeats each prompt for its samples, consecutively: runs of equal rows are one group
        G = 1
        while G < len(prompt_ids) and prompt_ids[G] == prompt_ids[0]:
            G += 1
        if len(prompt_ids) % G or any(prompt_ids[i] != prompt_ids[i - i % G] for i in range(len(prompt_ids))):
            G = 1
        unique = prompt_ids[::G]
        P = max(len(p) for p in unique)
        pad = self._tokenizer.pad_token_id or 0
        ids = torch.tensor([[pad] * (P - len(p)) + list(p) for p in unique], device=device)
        mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in unique], device=device)
        options = self._native_sampling()
        completion, cmask, logp = generate_groups(
            self.accelerator.unwrap_model(self.model), ids, mask, G, options.pop("max_new_tokens"), **options,
            share_prefix=G > 1, engine="native",
            rollout_dtype=self.grpo_fast_rollout_dtype, return_logprobs=True,
        )  # fmt: skip
        rows = [
            (c[m.bool()].tolist(), lp[m.bool()].tolist())
            for c, m, lp in zip(completion.cpu(), cmask.cpu(), logp.cpu())
        ]
        # the engine's log-probs reach TRL's batch as sampling_per_token_logps (the correction's input)
        return [c for c, _ in rows], [lp for _, lp in rows]

    # ---------------------------------------------------------------------------------------------------
    # Hidden states and log-probs without logits
    # ---------------------------------------------------------------------------------------------------
    def _completion_hidden(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask):
        """(B, C, H) decoder states predicting each completion token; shared prefix when the batch allows."""
        groups = None
        if getattr(model.config, "model_type", None) in SHARED_PREFIX_MODEL_TYPES:
            groups = equal_groups(prompt_ids, prompt_mask)
        if groups is not None:
            order, G = groups
            first = order[::G]
            hidden = shared_prefix_forward(
                model, prompt_ids[first], prompt_mask[first], completion_ids[order], completion_mask[order]
            )
            return hidden[torch.argsort(order)]
        ids = torch.cat([prompt_ids, completion_ids], dim=1)
        mask = torch.cat([prompt_mask, completion_mask], dim=1)
        out = decoder_of(model)(input_ids=ids, attention_mask=mask, use_cache=False)
        return out.last_hidden_state[:, prompt_ids.shape[1] - 1 : -1]

    @staticmethod
    def _head(model):
        head = lm_head_of(model)
        return head.weight, head.bias

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        """Reference / old log-probs (and entropies when asked) through `fused_linear_logprobs`; TRL's own
        wherever its loss runs too (`fused_fallback_reason`: a model that scales or soft-caps its logits is
        scored as TRL's fused head scores it, from the config)."""
        if (
            getattr(self, "fused_fallback_reason", None)
            or compute_aux_loss
            or self._sharded_reason(model)
            or any(v is not None for v in multimodal.values())
        ):
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size,
                compute_entropy,
                compute_aux_loss,
                **multimodal,
            )
        weight, bias = self._head(model)
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
            with self.accelerator.autocast():  # as TRL's forward (bf16 / fp16 mixed precision)
                out = decoder_of(model)(input_ids=ids, attention_mask=mask, use_cache=False)
            hidden = out.last_hidden_state
            hidden = hidden[:, -logits_to_keep - 1 : -1].to(weight.dtype)
            with self._head_precision():
                out = fused_linear_logprobs(
                    hidden,
                    weight,
                    ids[:, -logits_to_keep:],
                    bias=bias,
                    temperature=self.temperature,
                    return_entropy=compute_entropy,
                )
            logps.append(out[0] if compute_entropy else out)
            if compute_entropy:
                entropies.append(out[1])
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None

    # ---------------------------------------------------------------------------------------------------
    # The loss
    # ---------------------------------------------------------------------------------------------------
    def _head_precision(self):
        """The LM head's precision, as TRL's forward has it: inside the mixed-precision autocast (bf16 / fp16
        GEMM, fp32 accumulation and log-probs in the kernels), unless cast_lm_head_to_fp32 keeps it fp32."""
        if getattr(self.args, "cast_lm_head_to_fp32", False):
            return nullcontext()
        return self.accelerator.autocast()

    def _compute_loss(self, model, inputs):
        why = self.fused_fallback_reason or self._batch_fallback_reason(model, inputs)
        if why:
            self._warn_fallback(why)
            return super()._compute_loss(model, inputs)
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        weight, bias = self._head(model)
        with self.accelerator.autocast():  # as TRL's forward (bf16 / fp16 mixed precision)
            hidden = self._completion_hidden(
                model, inputs["prompt_ids"], inputs["prompt_mask"], completion_ids, completion_mask
            )
        hidden = hidden.to(weight.dtype)  # an fp32 head (cast_lm_head_to_fp32) gets fp32 states

        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        num_items = None
        if self.loss_type in ITEM_NORMALIZED:  # TRL's normalizer: the generation batch's tokens, per window
            num_items = inputs["num_items_in_batch"].clamp(min=1.0).float() / self.accelerator.num_processes
            if mode == "train":
                num_items = num_items * accumulation / self.args.steps_per_generation
        # TRL corrects vLLM's samples; ours too when the native engine ran a low-precision copy of the policy,
        # or when the training forward is mixed precision (no engine equals a bf16 / fp16 forward)
        mixed = bool(self.args.bf16 or self.args.fp16)
        inexact = self.use_vllm or (
            self.grpo_fast_rollout == "native"
            and (mixed or not is_exact("native", native.engine_for(model).rollout_dtype))
        )
        correcting = inexact and self.vllm_importance_sampling_correction
        args = self.args
        # TRL's gating: the adaptive coefficient acts only once the last optimizer step measured an entropy at
        # or below the target
        entropy_coef = self.entropy_coef if self._entropy_bonus_enabled else 0.0
        if self.use_adaptive_entropy and not self._last_world_entropy <= args.entropy_target:
            entropy_coef = 0.0
        if self.loss_type in ITEM_NORMALIZED:  # TRL's bonus is / accumulation whatever the loss type
            entropy_coef = entropy_coef / accumulation
        with self._head_precision():
            loss, metrics = fused_linear_grpo_loss(
                hidden,
                weight,
                completion_ids,
                mask,
                inputs["advantages"],
                bias=bias,
                temperature=self.temperature,
                old_logps=inputs.get("old_per_token_logps"),
                ref_logps=inputs.get("ref_per_token_logps") if self.beta != 0.0 else None,
                sampling_logps=inputs.get("sampling_per_token_logps"),
                beta=self.beta,
                epsilon_low=self.epsilon_low,
                epsilon_high=self.epsilon_high,
                loss_type=self.loss_type,
                importance_sampling_level=self.importance_sampling_level,
                max_completion_length=self.max_completion_length,
                num_items_in_batch=num_items,
                use_bias_correction_kl=args.use_bias_correction_kl,
                delta=args.delta,
                sampling_correction=self.vllm_importance_sampling_mode if correcting else None,
                sampling_clip_max=self.vllm_importance_sampling_clip_max,
                sampling_clip_min=self.vllm_importance_sampling_clip_min,
                off_policy_mask_threshold=self.off_policy_mask_threshold,
                sapo_temperature_pos=args.sapo_temperature_pos,
                sapo_temperature_neg=args.sapo_temperature_neg,
                vespo_k_pos=args.vespo_k_pos,
                vespo_lambda_pos=args.vespo_lambda_pos,
                vespo_k_neg=args.vespo_k_neg,
                vespo_lambda_neg=args.vespo_lambda_neg,
                top_entropy_quantile=self.top_entropy_quantile,
                entropy_coef=entropy_coef,
                compute_entropy=self.use_adaptive_entropy,  # measured at a coefficient of 0 too
            )
        if self._entropy_bonus_enabled:
            self._entropy_bonus_step(mode, loss.detach(), entropy_coef, metrics)
        if self.loss_type not in ITEM_NORMALIZED:  # TRL scales these for accumulation; num_items does it
            loss = loss / accumulation

        def reduce_mean(value):  # token-weighted across ranks, as TRL's global_masked_mean
            count = mask.sum().float()
            totals = self.accelerator.reduce(torch.stack([value.detach() * count, count]), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        names = {
            "kl": "kl",
            "entropy": "entropy",
            "clip_ratio_low": "clip_ratio/low_mean",
            "clip_ratio_high": "clip_ratio/high_mean",
            "clip_ratio": "clip_ratio/region_mean",
            "cispo_clip_ratio": "cispo_clip_ratio",
            "vespo_phi_mean": "vespo/phi_seq_mean",
            # our rollout's correction (TRL logs vLLM's at generation)
            "is_ratio_mean": "sampling/importance_sampling_ratio/mean",
            "sampling_logp_diff_mean": "sampling/sampling_logp_difference/mean",
        }
        # the sampling metrics only for the native engine's samples: TRL logs vLLM's at generation, and none
        # for log-probs a rollout_func returns without vLLM
        ours_sampled = self.grpo_fast_rollout == "native" and not self.use_vllm and self.rollout_func is None
        for ours, theirs in names.items():
            if ours in metrics and (ours_sampled or not theirs.startswith("sampling/")):
                self._metrics[mode][theirs].append(reduce_mean(metrics[ours]))
        return loss

    def _entropy_bonus_step(self, mode, loss, entropy_coef, metrics):
        """TRL's entropy-bonus bookkeeping, names and timing. `policy_loss` each micro-batch: the loss before
        the bonus (the kernel's loss is policy_loss - coef x H, H the mean entropy of the tokens the bonus
        acts on: the kernel's `bonus_entropy`), before the accumulation scaling of the loss types that take
        it after. Under use_adaptive_entropy (training only), the window's token-weighted entropy over all
        ranks moves the coefficient at the optimizer step, in TRL's own state (saved and restored by its
        checkpoints). `entropy_coef` each optimizer step, after that update."""
        entropy, tokens = metrics.pop("bonus_entropy"), metrics.pop("bonus_tokens")
        policy_loss = loss + entropy_coef * entropy
        self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
        if mode != "train":
            return
        if self.use_adaptive_entropy:
            stats = torch.stack([entropy * tokens, tokens]).detach()
            window = self._entropy_window_stats
            self._entropy_window_stats = stats if window is None else window + stats
            if self.accelerator.sync_gradients:
                total, count = self.accelerator.reduce(self._entropy_window_stats, reduction="sum").tolist()
                world_entropy, a = total / max(count, 1.0), self.args
                self.entropy_coef = adaptive_entropy_coef(
                    self.entropy_coef, world_entropy, target=a.entropy_target, delta=a.entropy_coef_delta,
                    coef_min=a.entropy_coef_min, coef_max=a.entropy_coef_max,
                )  # fmt: skip
                self._last_world_entropy, self._entropy_window_stats = world_entropy, None
        if self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
