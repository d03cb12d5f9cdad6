"""grpo-fast: a lean GRPO trainer on fused kernels."""

__version__ = "0.1.0"


def __getattr__(name):
    # lazy: `import grpo_fast.kernels` must not pull in transformers
    if name in ("generate_groups", "shared_prefix_forward"):
        from . import shared_prefix

        return getattr(shared_prefix, name)
    raise AttributeError(f"module 'grpo_fast' has no attribute {name!r}")
