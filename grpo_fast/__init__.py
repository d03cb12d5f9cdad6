"""grpo-fast: a lean GRPO trainer on fused kernels.

The parts, each a folder whose docstring says what lives there and what it may import, lowest first:
`kernels` (torch and triton only), `tasks` (the embedded tasks and assets), `models` (model parts, the
shared-prefix layout), `rewards` (built-in rewards, the code sandbox and judge), `rollout` (generate_groups
and its engines, multi-turn tools), `trainer` (grpo-fast train / estimate), `integrations` (TRL), `cli`. No
arrow runs back up. Public: `grpo_fast.generate_groups`, `grpo_fast.shared_prefix_forward`,
`grpo_fast.kernels`, `grpo_fast.integrations.trl`, the `grpo-fast` command (`python -m grpo_fast.train`).
"""

__version__ = "0.1.0"


def __getattr__(name):
    # lazy: `import grpo_fast.kernels` must not pull in transformers
    if name == "generate_groups":
        from .rollout import generate_groups

        return generate_groups
    if name == "shared_prefix_forward":
        from .models.shared_prefix import shared_prefix_forward

        return shared_prefix_forward
    raise AttributeError(f"module 'grpo_fast' has no attribute {name!r}")
