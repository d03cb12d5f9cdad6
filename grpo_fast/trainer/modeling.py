"""Loading the policy (full or LoRA) and taking completion hidden states from it.

The trainer never asks the model for logits over the completions: it runs the decoder (the backbone) and
hands its last hidden states, with the LM head's weight, to the fused loss.
"""

import json
from pathlib import Path

import torch

from ..models.model_parts import (
    checkpointing_kwargs,
    decoder_of,
    enable_checkpointing,
    position_ids_from_mask,
)
from ..models.shared_prefix import shared_prefix_forward
from ..tasks import task_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def load_tokenizer(path: str):
    """AutoTokenizer, except for a plain `tokenizers`-backed tokenizer saved as such: transformers 5's
    AutoTokenizer would swap in the model type's own class (e.g. Qwen2Tokenizer) and lose its vocabulary."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    saved = Path(path) / "tokenizer_config.json"
    if saved.is_file():
        if json.loads(saved.read_text()).get("tokenizer_class") in (
            "TokenizersBackend",
            "PreTrainedTokenizerFast",
        ):
            return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def model_path(cfg) -> str:
    """--model, or the embedded task's (smollm2: built offline on first use); a local path must be a model
    directory."""
    path = cfg.model or task_model(cfg.task)
    local = Path(path)
    if (local.exists() or path.startswith((".", "/"))) and not (local / "config.json").is_file():
        raise ValueError(f"--model {path!r}: not a model directory (no config.json there)")
    return path


def load_model_and_tokenizer(cfg, device):
    from transformers import AutoModelForCausalLM

    path = model_path(cfg)
    # flash-attn where it can run (CUDA, half precision, installed): the shared-prefix forward then packs
    # groups for its varlen kernel; elsewhere SDPA
    flash = _flash_attn_version() if device.type == "cuda" and cfg.dtype == "bf16" else None
    extra = {"attn_implementation": "flash_attention_2"} if flash else {}
    try:
        tokenizer = load_tokenizer(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[cfg.dtype], **extra)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--model {path!r}: could not load it ({type(exc).__name__}: {exc})") from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(device)
    if cfg.liger_kernels:
        apply_liger_kernels(model, device)
    model = prepare_for_training(model, cfg)
    lora = cfg.lora_r > 0
    info = {
        "model": path,
        "lora": lora,
        "dtype": cfg.dtype,
        "device": str(device),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "flash_attn": flash,
        "liger_kernels": bool(cfg.liger_kernels),
        "n_params": sum(p.numel() for p in model.parameters()),
        "n_trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    return model, tokenizer, info


def prepare_for_training(model, cfg):
    """Gradient checkpointing, LoRA adapters and disable_dropout as `cfg` asks (the memory estimator's probe
    does the same)."""
    if cfg.gradient_checkpointing:
        # the recomputation runs the forward's attention (shared_prefix_forward's segment attention)
        enable_checkpointing(model, checkpointing_kwargs(model))
        model.config.use_cache = False
    if cfg.lora_r > 0:
        from peft import LoraConfig, get_peft_model

        targets = cfg.lora_target_modules
        targets = targets if targets == "all-linear" else [t.strip() for t in targets.split(",")]
        model = get_peft_model(
            model,
            LoraConfig(
                r=cfg.lora_r,
                lora_alpha=cfg.lora_alpha,
                lora_dropout=cfg.lora_dropout,
                target_modules=targets,
                task_type="CAUSAL_LM",
            ),
        )
    if cfg.disable_dropout:  # TRL's: every nn.Dropout module (LoRA's too) at p = 0; the reference is a copy
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    return model


def _flash_attn_version():
    try:
        import flash_attn

        return flash_attn.__version__
    except ImportError:
        return None


def apply_liger_kernels(model, device) -> None:
    """Liger's RMSNorm / RoPE / SwiGLU Triton kernels, through Liger's own API (its fused cross-entropy stays
    off: our loss never asks the model for logits)."""
    if device.type != "cuda":
        raise ValueError("--liger-kernels: Liger's kernels need a CUDA device; none is available")
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError as exc:
        raise ValueError("--liger-kernels: liger-kernel is not installed (pip install liger-kernel)") from exc
    _apply_liger_kernel_to_instance(
        model=model,
        rms_norm=True,
        rope=True,
        swiglu=True,
        cross_entropy=False,
        fused_linear_cross_entropy=False,
    )


def completion_hidden_states(
    model, prompt_ids, prompt_mask, completion_ids, completion_mask, share_prefix=True, counts=None
):
    """(n * G, C, H) last hidden states; [s, j] is the state that predicts completion token j of sample s.

    Prompts are (n, P), completions (n * G, C) with sample s answering prompt s // G. With share_prefix each
    prompt runs once per group (grpo_fast.models.shared_prefix); otherwise it is repeated for each sample.
    One prompt with one completion (a group split into single completions, --group-split 1) runs as one
    causal sequence of its real tokens: no mask is built (a mask is quadratic in the length: 270 MB at 16k
    tokens). counts: completions per prompt when they differ (micro-batches packed to a memory budget); None:
    G each."""
    if prompt_ids.shape[0] == 1 and completion_ids.shape[0] == 1 and bool(prompt_mask.any()):
        return _single_sequence(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    if share_prefix:
        return shared_prefix_forward(
            model, prompt_ids, prompt_mask, completion_ids, completion_mask, counts=counts
        )
    G = completion_ids.shape[0] // prompt_ids.shape[0]
    rep = G if counts is None else torch.tensor(counts, device=prompt_ids.device)
    ids = torch.cat([prompt_ids.repeat_interleave(rep, 0), completion_ids], dim=1)
    mask = torch.cat([prompt_mask.repeat_interleave(rep, 0), completion_mask], dim=1)
    out = decoder_of(model)(
        input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=False
    )
    P = prompt_ids.shape[1]
    return out.last_hidden_state[:, P - 1 : -1]


def _single_sequence(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """completion_hidden_states of one prompt and one completion: [its prompt's real tokens; its completion up
    to its last real token] through the decoder with no mask (causal attention), zeros beyond the end."""
    prompt = prompt_ids[0][prompt_mask[0].bool()]
    n_real = int(completion_mask[0].nonzero().max()) + 1 if bool(completion_mask.any()) else 0
    ids = torch.cat([prompt, completion_ids[0, :n_real]])[None]
    hidden = decoder_of(model)(input_ids=ids, use_cache=False).last_hidden_state
    out = hidden[:, prompt.shape[0] - 1 : prompt.shape[0] - 1 + n_real]
    C = completion_ids.shape[1]
    if n_real < C:
        out = torch.cat([out, out.new_zeros(1, C - n_real, out.shape[-1])], dim=1)
    return out


def fp32_source(model, path: str) -> dict | None:
    """{parameter: its fp32 original} when `path` stores fp32 weights that `model` holds in a 16-bit dtype
    (--dtype bf16 of an fp32 checkpoint), for the optimizer's master weights; None otherwise."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    if not files or next(model.parameters()).dtype == torch.float32:
        return None
    with safe_open(str(files[0]), "pt") as f:
        first = next(iter(f.keys()), None)
        if first is None or f.get_slice(first).get_dtype() != "F32":
            return None
    full = dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).named_parameters())
    return {p: full[n].detach() for n, p in model.named_parameters() if n in full}


def load_weights_from_checkpoint(model, ckpt: Path, lora: bool) -> None:
    """Put a checkpoint's weights into the already-built model (optimizer state stays bound to its params)."""
    from safetensors.torch import load_file

    if lora:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(ckpt / "adapter_model.safetensors"))
        return
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(ckpt, dtype=next(model.parameters()).dtype)
    model.load_state_dict(saved.state_dict())
