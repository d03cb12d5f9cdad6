"""grpo-fast: a lean GRPO trainer on fused kernels."""

__version__ = "0.1.0"
