"""grpo_fast.kernels: fused GRPO kernels, Triton on GPU and PyTorch twins on CPU (torch and triton only).

This folder is the package `grpo_fast.kernels`. Where the repository root is on `sys.path` (`python -m ...` or
pytest run from a checkout) it also answers to the top-level name `kernels`, which belongs to Hugging Face's
kernel hub, a dependency that transformers >= 5.25 imports. Under that name it hands over to the hub's package
when one is installed further down `sys.path`; without one it stays this package, with no `__version__` (older
transformers, which import it to read one, then count the hub as absent).
"""


def _the_hub():
    """The import spec of Hugging Face's `kernels` on sys.path past this checkout's root, or None."""
    import importlib.machinery
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    return importlib.machinery.PathFinder.find_spec("kernels", rest)


def _hand_over(spec) -> None:
    import importlib.util
    import sys

    hub = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = hub  # `import kernels` returns what sys.modules holds once this file has run
    spec.loader.exec_module(hub)


if __name__ == "kernels" and (_hub := _the_hub()) is not None:
    _hand_over(_hub)
else:
    from .advantages import group_advantages
    from .fused_loss import fused_linear_grpo_loss
    from .logprobs import fused_linear_logprobs
    from .loss import grpo_loss

    __all__ = ["fused_linear_logprobs", "group_advantages", "grpo_loss", "fused_linear_grpo_loss"]
