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


def eos_likely_lm(kind: str, vocab: int, eos: int, seed: int = 0, factor: float = 4.0, **kw):
    """`tiny_lm` with the EOS row of the LM head scaled by `factor`: completions end at different lengths."""
    model = tiny_lm(kind, vocab, eos, seed, **kw)
    with torch.no_grad():
        model.get_output_embeddings().weight[eos] *= factor
    return model


def ragged_prompts(vocab: int, n: int = 3, P: int = 7):
    """(ids, mask) of n left-padded prompts of lengths 7, 4, 1, 5 (the first n), ids in [2, vocab)."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([7, 4, 1, 5][:n])
    mask = (torch.arange(P)[None, :] >= P - lengths[:, None]).long()
    return torch.randint(2, vocab, (n, P), generator=g) * mask, mask
