"""Shared plumbing for the kernel modules: implementation dispatch and argument checks.

Every public kernel takes `impl="auto"|"triton"|"torch"`; "auto" picks Triton for CUDA tensors and the
PyTorch twin otherwise. Triton on CPU only works through its interpreter, which Triton reads when a kernel
is *defined*, so TRITON_INTERPRET=1 must be in the environment before `grpo_fast.kernels` is imported.
"""

import os

import torch

IMPLS = ("auto", "triton", "torch")

# Under the interpreter `tl.dot` on bf16/fp16 tiles gives wrong numbers, so kernels upcast tiles to fp32
# there; compiled kernels keep the low-precision tensor-core path (with fp32 accumulation).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_impl(impl: str, *tensors: torch.Tensor) -> str:
    """Turn `impl` into "triton" or "torch" for these tensors."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")
    on_cuda = any(d.type == "cuda" for d in devices)
    if impl == "auto":
        return "triton" if on_cuda else "torch"
    if impl == "triton" and not on_cuda and not INTERPRET:
        raise ValueError(
            "impl='triton' with CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
            "before importing grpo_fast.kernels, or use impl='torch'"
        )
    return impl


def check_tensor(name: str, t, ndims: tuple[int, ...], floating: bool = True) -> None:
    """Raise a TypeError/ValueError naming `name` unless `t` is a tensor with one of `ndims` dimensions."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() not in ndims:
        raise ValueError(
            f"{name} must have {' or '.join(map(str, ndims))} dimensions, got shape {tuple(t.shape)}"
        )
    if floating and not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"{name} must be a number > 0, got {value!r}")


def check_nonnegative(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and value >= 0):
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
