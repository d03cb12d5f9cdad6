"""grpo_fast.kernels: fused GRPO kernels, Triton on GPU and PyTorch twins on CPU (torch and triton only).

This folder is the package `grpo_fast.kernels`. Where the repository root is on `sys.path` (`python -m ...` or
pytest run from a checkout) it also answers to the top-level name `kernels`, which belongs to Hugging Face's
kernel hub, a dependency that transformers >= 5.25 imports. Under that name it hands over to the hub's package
found on the rest of `sys.path` (or raises ModuleNotFoundError, as if it were not there) and defines nothing.
"""


def _hand_over_the_name():
    import importlib.machinery
    import importlib.util
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", rest)
    if spec is None:
        raise ModuleNotFoundError(
            "No module named 'kernels' (Hugging Face's kernel hub: pip install kernels); "
            f"{os.path.join(root, 'kernels')} is grpo_fast.kernels: import it under that name",
            name="kernels",
        )
    hub = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = hub  # `import kernels` returns what sys.modules holds once this file has run
    spec.loader.exec_module(hub)


if __name__ == "kernels":
    _hand_over_the_name()
else:
    from .advantages import group_advantages
    from .fused_loss import fused_linear_grpo_loss
    from .logprobs import fused_linear_logprobs
    from .loss import grpo_loss

    __all__ = ["fused_linear_logprobs", "group_advantages", "grpo_loss", "fused_linear_grpo_loss"]
