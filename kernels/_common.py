"""Shared plumbing for the kernel modules: implementation dispatch, argument checks, the compute dtype.

Every public kernel takes `impl="auto"|"triton"|"torch"`; "auto" picks Triton for CUDA tensors and the
PyTorch twin otherwise. Triton on CPU only works through its interpreter, which Triton reads when a kernel
is *defined*, so TRITON_INTERPRET=1 must be in the environment before `grpo_fast.kernels` is imported.
Mixed precision: `compute_dtype` is the one rule for the dtype of the LM-head GEMMs (ambient autocast's,
else the shared dtype, else the 16-bit one of hidden and weight); the kernels run with autocast off.
"""

import contextlib
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


_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the LM-head GEMMs (logits, d hidden, d weight) run in, accumulating in fp32.

    torch.autocast enabled for the inputs' device type: its dtype (as F.linear would). Otherwise hidden's and
    weight's shared dtype, or, when they differ, the 16-bit one of the two (bf16 or fp16 activations on an
    fp32 master weight, or the reverse). Two different 16-bit dtypes, or two wider ones, raise a TypeError.
    """
    device_type = hidden.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if hidden.dtype == weight.dtype:
        return hidden.dtype
    low = [d for d in (hidden.dtype, weight.dtype) if d in _SIXTEEN_BIT]
    if len(low) != 1:
        raise TypeError(
            "hidden and weight must share a dtype, or one of them be 16-bit (bf16 or fp16; the GEMMs then "
            f"run in it): got hidden {hidden.dtype} and weight {weight.dtype}"
        )
    return low[0]


def autocast_off(device: torch.device):
    """A context with autocast disabled on `device`'s type: inside the kernels every cast is explicit."""
    if not torch.amp.is_autocast_available(device.type):  # e.g. meta tensors: no autocast to turn off
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


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
