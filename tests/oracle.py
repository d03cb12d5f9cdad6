"""Naive references for the tests: full logits, plain formulas, fp64. Independent of the code under test."""

import torch

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def naive_logits(hidden, weight, bias, temperature, dtype):
    """Logits the plain PyTorch way in `dtype` (matmul in dtype), returned as float64."""
    z = hidden.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        z = z + bias.to(dtype)
    return z.double() / temperature


def naive_logprobs(hidden, weight, targets, bias=None, temperature=1.0, dtype=torch.float64):
    z = naive_logits(hidden, weight, bias, temperature, dtype)
    return torch.log_softmax(z, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def naive_entropy(hidden, weight, bias=None, temperature=1.0, dtype=torch.float64):
    z = naive_logits(hidden, weight, bias, temperature, dtype)
    logp = torch.log_softmax(z, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def naive_advantages(rewards, group_size, scale="group", eps=1e-4):
    r = rewards.double().view(-1, group_size)
    out = torch.empty_like(r)
    batch_std = rewards.double().std().item() if rewards.numel() > 1 else 0.0
    for i, g in enumerate(r):
        mean = sum(g.tolist()) / group_size
        if group_size > 1:
            std = (sum((x - mean) ** 2 for x in g.tolist()) / (group_size - 1)) ** 0.5
        else:
            std = 0.0
        for j, x in enumerate(g.tolist()):
            if max(g.tolist()) == min(g.tolist()):
                out[i, j] = 0.0
            elif scale == "group":
                out[i, j] = (x - mean) / (std + eps)
            elif scale == "batch":
                out[i, j] = (x - mean) / (batch_std + eps)
            else:
                out[i, j] = x - mean
    return out.view(-1)


def naive_grpo_loss(
    logps,
    advantages,
    mask,
    old_logps=None,
    ref_logps=None,
    beta=0.0,
    epsilon_low=0.2,
    epsilon_high=None,
    loss_type="dapo",
    importance_sampling_level="token",
    max_completion_length=None,
    num_items_in_batch=None,
    use_bias_correction_kl=False,
):
    """TRL 1.16's GRPOTrainer._compute_loss written out plainly (float64 in, float64 out)."""
    eps_hi = epsilon_low if epsilon_high is None else epsilon_high
    mask = mask.double()
    adv = advantages.double().unsqueeze(1)
    old = logps.detach() if old_logps is None else old_logps.double()
    log_ratio = logps - old
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + eps_hi)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if beta != 0.0:
        d = ref_logps.double() - logps
        kl = torch.exp(d) - d - 1
        if use_bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + beta * kl
    per_token = per_token * mask  # broadcasts a (B, 1) sequence-level loss over the tokens
    if loss_type == "grpo":
        loss = (per_token.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = per_token.sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = per_token.sum() / (per_token.size(0) * max_completion_length)
    else:
        n = mask.sum() if num_items_in_batch is None else torch.tensor(float(num_items_in_batch))
        loss = per_token.sum() / n.clamp(min=1.0)
    low = (ratio < 1 - epsilon_low) & (adv < 0)
    high = (ratio > 1 + eps_hi) & (adv > 0)

    def mean(x):
        if x.shape[1] == 1:
            return x.double().mean()
        return (x.double() * mask).sum() / mask.sum().clamp(min=1.0)

    metrics = {"clip_ratio_low": mean(low), "clip_ratio_high": mean(high), "clip_ratio": mean(low | high)}
    if kl is not None:
        metrics["kl"] = (kl * mask).sum() / mask.sum().clamp(min=1.0)
    return loss, metrics


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_within(name, out, ref, lowp, dtype):
    """flash-attention's rule: the kernel's error at most twice plain PyTorch's in that dtype, plus tol."""
    err, err_lp = max_err(out, ref), max_err(lowp, ref)
    scale = max(1.0, ref.double().abs().max().item()) if ref.numel() else 1.0
    mean_err = (out.double() - ref.double()).abs().mean().item() if out.numel() else 0.0
    assert err <= 2 * err_lp + TOL[dtype] * scale, (
        f"{name}: max err {err:.3g} (mean {mean_err:.3g}) vs plain torch {dtype} max err {err_lp:.3g}"
    )


# --------------------------------------------------------------------------------------------------------
# Greedy decoding compared across code paths
# --------------------------------------------------------------------------------------------------------
NEAR_TIE = 1e-4  # of the top logit's size: ~100x fp32 rounding through a model's layers


def hf_greedy(model, prompt, max_new_tokens, eos, **generate_kwargs):
    """HF `generate`'s greedy continuation (1-D ids) of the unpadded 1-D `prompt`, stopping at `eos`;
    `generate_kwargs`: transformers' other options (repetition_penalty, ...)."""
    out = model.generate(
        prompt[None], max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos,
        **generate_kwargs,
    )  # fmt: skip
    return out[0, prompt.numel() :]


def assert_greedy_row_equal(model, prompt, got, want, tie=NEAR_TIE, repetition_penalty=1.0):
    """Greedy continuations `got` and `want` (1-D ids after the unpadded 1-D `prompt`) are equal, or first
    differ where the model's two best next tokens (on the common prefix, one plain forward; under a
    repetition penalty its logits penalized here, token by token) are exactly the two chosen and a near-tie:
    their logits within `tie` of the top logit's size. Another summation order (AVX2 / AVX-512 / AMX kernels,
    another batch shape) may pick either there, and what follows differs legitimately. Any other difference
    fails."""
    n = min(len(got), len(want))
    differ = (got[:n] != want[:n]).nonzero()
    if len(differ) == 0:
        assert len(got) == len(want), f"equal tokens, different lengths {len(got)} vs {len(want)}"
        return
    j = int(differ[0])
    with torch.no_grad():
        context = torch.cat([prompt, want[:j]])
        z = model(context[None].to(prompt.device)).logits[0, -1].double()
    for tok in set(context.tolist()) if repetition_penalty != 1.0 else ():
        z[tok] = z[tok] / repetition_penalty if z[tok] > 0 else z[tok] * repetition_penalty
    top = z.topk(2)
    gap, size = (top.values[0] - top.values[1]).item(), max(1.0, abs(top.values[0].item()))
    chosen = {int(got[j]), int(want[j])}
    assert chosen == set(top.indices.tolist()) and gap <= tie * size, (
        f"greedy tokens differ at position {j} ({int(got[j])} vs {int(want[j])}); there the reference's two "
        f"best are {top.indices.tolist()}, {gap:.3g} apart (a near-tie is <= {tie * size:.3g})"
    )


def assert_greedy_equal(model, prompt_ids, prompt_mask, G, got, want, tie=NEAR_TIE, repetition_penalty=1.0):
    """`assert_greedy_row_equal` for every row of two batched rollouts: `got` and `want` are (ids, mask) of
    shape (n * G, C), row s continuing prompt s // G of the left-padded (prompt_ids, prompt_mask)."""
    assert got[0].shape[0] == want[0].shape[0] == prompt_ids.shape[0] * G
    for s in range(got[0].shape[0]):
        prompt = prompt_ids[s // G][prompt_mask[s // G].bool()]
        row = [ids[s][mask[s].bool()] for ids, mask in (got, want)]
        assert_greedy_row_equal(model, prompt, *row, tie=tie, repetition_penalty=repetition_penalty)


def assert_draws_follow(tok, probs):
    """N drawn tokens (N,) against fp64 probabilities (V,): none of mass 0; each token's frequency within 5
    standard errors of its probability; the chi-square statistic under dof + 5 sd."""
    N = tok.numel()
    freq = torch.bincount(tok, minlength=probs.numel()).double() / N
    keep = probs > 0
    assert freq[~keep].sum() == 0
    se = (probs * (1 - probs) / N).sqrt()
    assert ((freq - probs).abs() <= 5 * se + 1e-9).all()
    chi2 = (N * (freq - probs)[keep] ** 2 / probs[keep]).sum()
    dof = int(keep.sum()) - 1
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (chi2, dof)
