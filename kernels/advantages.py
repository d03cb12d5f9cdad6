"""Group-relative advantages: each reward against the other samples of its prompt's group.

    rewards (n_groups * G,) any float dtype, consecutive groups of G  ->  fp32 advantages (n_groups * G,)
    "group": (r - mean_g) / (std_g + eps)   "batch": (r - mean_g) / (std_batch + eps)   "none": r - mean_g
std is unbiased (torch.std, TRL). A group whose rewards are all equal, and G == 1, gives exactly 0.
"""

import torch
import triton
import triton.language as tl

from ._common import check_nonnegative, check_tensor, resolve_impl

SCALES = ("group", "batch", "none")


@triton.jit
def _advantages_kernel(r_ptr, out_ptr, batch_std, eps, G, SCALE: tl.constexpr, BLOCK_G: tl.constexpr):
    # One program per group: SCALE 0 = group std, 1 = the batch std passed in, 2 = no scaling.
    pid = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_G)
    mask = offs < G
    r = tl.load(r_ptr + pid * G + offs, mask=mask, other=0.0).to(tl.float32)
    # 1. group mean and unbiased std in fp32 (two passes: no catastrophic cancellation)
    mean = tl.sum(r, axis=0) / G
    centered = tl.where(mask, r - mean, 0.0)
    # 2. exactly 0 for a constant group: r - mean can be a rounding residue, not 0
    r_max = tl.max(tl.where(mask, r, float("-inf")), axis=0)
    r_min = tl.min(tl.where(mask, r, float("inf")), axis=0)
    if SCALE == 0:
        std = tl.sqrt(tl.sum(centered * centered, axis=0) / tl.maximum(G - 1, 1))
        adv = centered / (std + eps)
    elif SCALE == 1:
        adv = centered / (batch_std + eps)
    else:
        adv = centered
    adv = tl.where(r_max == r_min, 0.0, adv)
    tl.store(out_ptr + pid * G + offs, adv, mask=mask)


def _advantages_triton(rewards, group_size, scale, eps):
    out = torch.empty(rewards.shape, dtype=torch.float32, device=rewards.device)
    # the batch std is one reduction over a few thousand floats: torch does it, the kernel uses it
    batch_std = float(rewards.float().std()) if scale == "batch" and rewards.numel() > 1 else 0.0
    block = max(16, triton.next_power_of_2(group_size))
    _advantages_kernel[(rewards.numel() // group_size,)](
        rewards,
        out,
        batch_std,
        eps,
        group_size,
        SCALE=SCALES.index(scale),
        BLOCK_G=block,
    )
    return out


def _advantages_torch(rewards, group_size, scale, eps):
    r = rewards.float().view(-1, group_size)
    centered = r - r.mean(dim=1, keepdim=True)
    if scale == "group":
        std = r.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(r[:, :1])
        adv = centered / (std + eps)
    elif scale == "batch":
        std = r.std() if r.numel() > 1 else torch.zeros((), device=r.device)
        adv = centered / (std + eps)
    else:
        adv = centered
    constant = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)
    return adv.masked_fill(constant, 0.0).view(-1)


def group_advantages(rewards, group_size, *, scale="group", eps=1e-4, impl="auto"):
    """Advantages of GRPO: rewards relative to their group.

    Args:
        rewards: (n_groups * group_size,) float tensor, the G samples of each prompt consecutive.
        group_size: G, an int >= 1 dividing len(rewards).
        scale: "group" (divide by the group's std), "batch" (by the whole batch's std) or "none"
            (Dr. GRPO: only subtract the group mean).
        eps: float >= 0 added to the std.
        impl: "auto" (Triton for CUDA tensors, else the twin), "triton" or "torch".

    Returns:
        fp32 (n_groups * group_size,) advantages; exactly 0 for groups whose rewards are all equal.
    """
    check_tensor("rewards", rewards, (1,))
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if rewards.numel() == 0 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards (length {rewards.numel()}) must split into whole groups of group_size={group_size}"
        )
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    check_nonnegative("eps", eps)
    if not bool(torch.isfinite(rewards).all()):
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten()[:5].tolist()
        raise ValueError(f"rewards must be finite; non-finite values at indices {bad}")
    impl = resolve_impl(impl, rewards)
    fn = _advantages_triton if impl == "triton" else _advantages_torch
    return fn(rewards.contiguous(), group_size, scale, float(eps))


__all__ = ["group_advantages"]
