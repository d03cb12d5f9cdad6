"""Where things are inside a Hugging Face causal LM (plain, under PEFT, DDP or FSDP wrappers), and the model
inputs every path builds the same way."""

from contextlib import contextmanager, nullcontext

import torch


def hf_model_of(model: torch.nn.Module) -> torch.nn.Module:
    """The first transformers `PreTrainedModel` in `model` (itself, or under PEFT / DDP / FSDP wrappers)."""
    from transformers import PreTrainedModel

    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            return m
    raise TypeError(f"{type(model).__name__} holds no transformers PreTrainedModel")


def causal_lm(model):
    """The transformers CausalLM inside a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def lm_head_of(model) -> torch.nn.Linear:
    return causal_lm(model).get_output_embeddings()


def decoder_of(model):
    lm = causal_lm(model)
    return lm.get_decoder() if hasattr(lm, "get_decoder") else getattr(lm, lm.base_model_prefix)


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """RoPE positions that ignore left padding: the first real token is position 0."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


@contextmanager
def attention_implementation(model, name):
    """Temporarily route every attention module of `model` through the implementation `name`."""
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values()
    saved = [(c, c._attn_implementation) for c in configs]
    for c, _ in saved:
        c._attn_implementation = name
    try:
        yield
    finally:
        for c, impl in saved:
            c._attn_implementation = impl


def enable_checkpointing(model, kwargs: dict) -> None:
    """Activation (gradient) checkpointing of `model`'s layers with `kwargs` for torch's checkpoint, under the
    name transformers has for it: `activation_checkpointing_enable` from 5.25 on (the old name warns)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def checkpointing_kwargs(model) -> dict:
    """`gradient_checkpointing_kwargs` under which a checkpointed layer's recomputation (in the backward,
    after the forward has returned) runs the attention implementation its forward ran: shared_prefix_forward
    routes its forward through attention functions of its own, and without this the recomputation would run
    the model's default attention over the packed layout."""

    def context_fn():
        name = model.config._attn_implementation  # at forward time: what the layer runs now
        return nullcontext(), attention_implementation(model, name)

    context_fn.restores_attention = True
    return {"use_reentrant": False, "context_fn": context_fn}


def recomputes_attention_safely(model) -> bool:
    """False where a layer of `model` will be recomputed in the backward by a checkpoint that does not
    restore the forward's attention implementation (see checkpointing_kwargs)."""
    if not (model.training and torch.is_grad_enabled()):
        return True
    for m in model.modules():
        if getattr(m, "gradient_checkpointing", False) and hasattr(m, "_gradient_checkpointing_func"):
            fn = m._gradient_checkpointing_func
            return getattr(getattr(fn, "keywords", {}).get("context_fn"), "restores_attention", False)
    return True


def merged_lora_weight(layer) -> torch.Tensor:
    """W + scale * B A of a PEFT LoRA layer, from its active adapters (fp32 math), in W's dtype; an adapter
    of another variant (DoRA: a magnitude vector too) merged by that variant's own rule (PEFT's)."""
    w = layer.get_base_layer().weight.detach()
    if getattr(layer, "merged", False):
        return w
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    variants = getattr(layer, "lora_variant", {})
    delta = sum(layer.get_delta_weight(a).float() for a in active if a not in variants)
    out = (w.float() + delta).to(w.dtype) if torch.is_tensor(delta) else w
    for a in active:
        if a in variants:
            out = variants[a].merge_safe(layer, a, out)
    return out
