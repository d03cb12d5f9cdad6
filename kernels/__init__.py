"""grpo_fast.kernels: fused GRPO kernels, Triton on GPU and PyTorch twins on CPU (torch and triton only)."""

from .advantages import group_advantages
from .fused_loss import fused_linear_grpo_loss
from .logprobs import fused_linear_logprobs
from .loss import grpo_loss

__all__ = ["fused_linear_logprobs", "group_advantages", "grpo_loss", "fused_linear_grpo_loss"]
