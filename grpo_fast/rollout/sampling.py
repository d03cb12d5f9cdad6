"""Choosing the next token: the repetition penalty, temperature, then top-k, then top-p, then min-p
(transformers' order), then a draw; temperature 0 is greedy.

`sample_next` draws with `torch.multinomial` (the reference engine); `draw` with the inverse CDF at uniforms
made up front (the native engine: its step holds no RNG state, so CUDA graphs can replay it). Both filter the
logits the same way (`filtered`).
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How a rollout samples, `generate_groups`' options with their defaults: softmax(logits / temperature)
    (0: greedy) after the repetition penalty (1: off), top-k (0: off), top-p and min-p (0: off), stopping at
    `eos_token_id` (an id or a list), drawing from `generator`, with the sampled tokens' log-probs when
    `return_logprobs`. An engine that takes them as `**options` builds one (an unknown option is a TypeError
    naming it)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    eos_token_id: object = None
    generator: object = None
    return_logprobs: bool = False


def eos_and_pad(eos_token_id) -> tuple[list, int]:
    """The EOS ids (an int, a list, or None) as a list, and the padding id after a sample's end: the first
    EOS, or 0 without one."""
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    return eos, (int(eos[0]) if eos else 0)


def is_eos(tokens, eos):
    """Which of `tokens` are one of the EOS ids `eos` (a 1-D tensor, maybe empty): compared, never sorted
    (torch.isin sorts, reading back on the host: not inside a CUDA graph)."""
    return (tokens[..., None] == eos).any(-1)


def check_repetition_penalty(penalty) -> float:
    """The repetition penalty as a float, or a ValueError: it divides positive logits."""
    if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not penalty > 0:
        raise ValueError(f"repetition_penalty must be a number > 0 (1.0: off), got {penalty!r}")
    return float(penalty)


def seen_tokens(ids, mask, vocab: int):
    """(rows, vocab) bool: which tokens each row of (rows, L) `ids` holds where `mask` is 1 (its context, as
    the repetition penalty reads it; padding is not context)."""
    at = torch.where(mask.bool(), ids, vocab)  # padding goes to a column past the vocabulary, then dropped
    seen = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.bool, device=ids.device)
    return seen.scatter_(1, at, True)[:, :vocab].contiguous()


def mark_seen(seen, tokens, live) -> None:
    """Add each live row's token of (rows,) `tokens` to its `seen` row, in place (a row that is not live,
    done or waiting, keeps its set as it is: fixed shapes, no host read)."""
    at = tokens[:, None]
    seen.scatter_(1, at, seen.gather(1, at) | live[:, None])


def penalized(logits, seen, penalty: float):
    """The repetition penalty of CTRL (Keskar et al., 2019) as transformers and vLLM apply it: the fp32 logit
    of every token in the row's context (`seen`: its prompt and what it has sampled so far) divided by
    `penalty` where positive, multiplied by it where negative; the others as they are."""
    logits = logits.float()
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def filtered(scaled, top_k: int, top_p: float, min_p: float = 0.0):
    """(rows, V) temperature-scaled logits with the tokens outside top-k, then outside top-p, then below
    min_p x the likeliest token's probability (min-p), at -inf (the same tensor when none filters)."""
    if top_k and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, -1)
        # drop a token when the tokens before it already hold top_p of the mass (the first always stays)
        sorted_logits = sorted_logits.masked_fill(probs.cumsum(-1) - probs > top_p, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
    if min_p > 0.0:  # p / p_max = exp(z - z_max), whatever was filtered before (tensor ops only: min_p may
        # be a symbolic float in a compiled step)
        ratio = torch.exp(scaled - scaled.amax(-1, keepdim=True))
        scaled = scaled.masked_fill(ratio < min_p, float("-inf"))
    return scaled


def sample_next(logits, temperature, top_p, top_k, generator, min_p=0.0, seen=None, penalty=1.0):
    """One token per row from (rows, V) logits, under the repetition penalty over `seen` (None: none);
    temperature 0 is greedy."""
    if seen is not None:
        logits = penalized(logits, seen, penalty)
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(filtered(logits.float() / temperature, top_k, top_p, min_p), -1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def draw(logits, u, temperature: float, top_k: int, top_p: float, min_p: float = 0.0, seen=None, penalty=1.0):
    """(tokens, log-probs) from (R, V) logits: the repetition penalty over `seen` (R, V) (None: none),
    temperature, top-k, top-p, min-p, then the inverse CDF at u (R,); the log-prob is of softmax(logits / T)
    (T = 1 when greedy), before the penalty and the filters, as training computes it."""
    logits = logits.float()
    scaled = logits / temperature if temperature not in (0, 1) else logits
    if seen is None:
        shaped = scaled
    else:
        shaped = penalized(logits, seen, penalty)
        shaped = shaped / temperature if temperature not in (0, 1) else shaped
    kept = filtered(shaped, top_k, top_p, min_p) if temperature != 0 else None
    if kept is scaled:  # nothing shaped or filtered: one pass over the exponentials serves both
        probs = torch.softmax(scaled, dim=-1)
        tok = inverse_cdf(probs, u)  # never a token of probability 0, so its log is finite
        return tok, probs.gather(-1, tok[:, None]).squeeze(-1).log()
    logp_all = torch.log_softmax(scaled, dim=-1)
    tok = shaped.argmax(-1) if kept is None else inverse_cdf(torch.softmax(kept, -1), u)
    return tok, logp_all.gather(-1, tok[:, None]).squeeze(-1)


BLOCK = 256  # inverse_cdf's blocks of tokens


def inverse_cdf(probs, u):
    """The token i of each row of (R, V) non-negative `probs` with cdf[i - 1] <= u * total < cdf[i], never one
    of mass 0, found in two levels: the sums of blocks of BLOCK tokens, then the chosen block's tokens. A row
    runs V / BLOCK + BLOCK cumulative sums instead of V (one scan over the vocabulary was the draw's largest
    cost on a CPU), each sum in fp32 over at most BLOCK terms."""
    R, V = probs.shape
    nb = -(-V // BLOCK)
    blocks = torch.nn.functional.pad(probs, (0, nb * BLOCK - V)).view(R, nb, BLOCK)
    sums = blocks.sum(-1)
    cdf = sums.cumsum(-1)
    x = (u * cdf[:, -1]).unsqueeze(-1)
    j = torch.searchsorted(cdf, x, right=True).clamp(max=nb - 1)  # right=True: a block with mass
    inner = blocks.gather(1, j.unsqueeze(-1).expand(R, 1, BLOCK)).squeeze(1).cumsum(-1)
    # what is left of x inside the block, kept inside it against rounding (0: its first token with mass)
    rest = (x - cdf.gather(1, j) + sums.gather(1, j)).clamp(min=0.0)
    rest = torch.minimum(rest, inner[:, -1:] * (1 - 2**-20))
    k = torch.searchsorted(inner, rest, right=True).clamp(max=BLOCK - 1)
    return (j * BLOCK + k).squeeze(-1).clamp(max=V - 1)


def check_counts(num_generations: int, max_new_tokens: int) -> None:
    if num_generations < 1 or max_new_tokens < 1:
        raise ValueError(
            f"num_generations and max_new_tokens must be >= 1, got {num_generations}, {max_new_tokens}"
        )
