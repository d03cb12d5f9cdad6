"""Choosing the next token: temperature, then top-k, then top-p, then a draw; temperature 0 is greedy."""

import torch


def sample_next(logits, temperature, top_p, top_k, generator):
    """One token per row from (rows, V) logits; temperature 0 is greedy."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, -1)
        # drop a token when the tokens before it already hold top_p of the mass (the first always stays)
        drop = probs.cumsum(-1) - probs > top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, -1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_counts(num_generations: int, max_new_tokens: int) -> None:
    if num_generations < 1 or max_new_tokens < 1:
        raise ValueError(
            f"num_generations and max_new_tokens must be >= 1, got {num_generations}, {max_new_tokens}"
        )
