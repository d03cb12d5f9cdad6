"""Choosing the next token: temperature, then top-k, then top-p, then a draw; temperature 0 is greedy.

`sample_next` draws with `torch.multinomial` (the reference engine); `draw` with the inverse CDF at uniforms
made up front (the native engine: its step holds no RNG state, so CUDA graphs can replay it). Both filter the
logits the same way (`filtered`).
"""

import torch


def eos_and_pad(eos_token_id) -> tuple[list, int]:
    """The EOS ids (an int, a list, or None) as a list, and the padding id after a sample's end: the first
    EOS, or 0 without one."""
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    return eos, (int(eos[0]) if eos else 0)


def filtered(scaled, top_k: int, top_p: float):
    """(rows, V) temperature-scaled logits with the tokens outside top-k, then outside top-p, at -inf."""
    if top_k and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, -1)
        # drop a token when the tokens before it already hold top_p of the mass (the first always stays)
        sorted_logits = sorted_logits.masked_fill(probs.cumsum(-1) - probs > top_p, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
    return scaled


def sample_next(logits, temperature, top_p, top_k, generator):
    """One token per row from (rows, V) logits; temperature 0 is greedy."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(filtered(logits.float() / temperature, top_k, top_p), -1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def draw(logits, u, temperature: float, top_k: int, top_p: float):
    """(tokens, log-probs) from (R, V) logits: temperature, top-k, top-p, then the inverse CDF at u (R,); the
    log-prob is of softmax(logits / T) (T = 1 when greedy), before top-k / top-p, as training computes it."""
    logits = logits.float()
    scaled = logits / temperature if temperature > 0 else logits
    logp_all = torch.log_softmax(scaled, dim=-1)
    if temperature == 0:
        tok = logits.argmax(-1)
    else:
        cdf = torch.softmax(filtered(scaled, top_k, top_p), -1).cumsum(-1)
        x = (u * cdf[:, -1]).unsqueeze(-1)  # right=True: never a token of probability 0
        tok = torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp(max=scaled.shape[-1] - 1)
    return tok, logp_all.gather(-1, tok[:, None]).squeeze(-1)


def check_counts(num_generations: int, max_new_tokens: int) -> None:
    if num_generations < 1 or max_new_tokens < 1:
        raise ValueError(
            f"num_generations and max_new_tokens must be >= 1, got {num_generations}, {max_new_tokens}"
        )
