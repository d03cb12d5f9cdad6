"""Tiny random-init causal LMs of the supported families (2 layers, GQA), for exactness tests."""

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}


def tiny_lm(kind: str, vocab: int = 97, eos: int = 1, seed: int = 0, head_dim: int = 8, tie: bool = False):
    """4 query heads of `head_dim` (vLLM's CPU attention wants head_dim >= 32), 2 KV heads; `tie`: the LM
    head shares the embedding's weight."""
    torch.manual_seed(seed)
    config_cls, model_cls = FAMILIES[kind]
    config = config_cls(
        vocab_size=vocab,
        hidden_size=4 * head_dim,
        intermediate_size=8 * head_dim,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=eos,
        tie_word_embeddings=tie,
        **(dict(head_dim=head_dim) if kind == "qwen3" else {}),
    )
    return model_cls(config).eval()
