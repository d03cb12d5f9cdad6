"""grpo-fast: a lean GRPO trainer on fused kernels."""

__version__ = "0.1.0"


def __getattr__(name):
    # lazy: `import grpo_fast.kernels` must not pull in transformers
    if name == "generate_groups":
        from .rollout import generate_groups

        return generate_groups
    if name == "shared_prefix_forward":
        from .shared_prefix import shared_prefix_forward

        return shared_prefix_forward
    raise AttributeError(f"module 'grpo_fast' has no attribute {name!r}")
