"""The rollout dtype: which one a run samples in (`check_rollout_dtype`; "auto": `auto_rollout_dtype`, from
what the machine multiplies natively, `cpu_flags`) and how the native engine's decode step runs a linear layer
in it (`LINEAR_FORMATS`: the policy's weights copied at every call, packed for cpu_decode's linear kernel
(fp32 / bf16 on AVX-512 or AVX2) or oneDNN's (fp32 / bf16 / fp16), or W8A8 int8 / fp8; `fused_linear`
concatenates a layer's projections into one such matrix)."""

import functools

import torch

from ..models.model_parts import merged_lora_weight
from . import cpu_decode
from .cpu_decode import cpu_info


def _weight_of(m):
    """(weight, bias) of a Linear, or of a LoRA layer with its adapters merged (W + scale * B A)."""
    if type(m) is torch.nn.Linear:
        return m.weight.detach(), m.bias
    return merged_lora_weight(m), m.get_base_layer().bias


class Packed:
    """A linear layer in a rollout format: `fn(x, *tensors)`, its weights (and scales, bias) in `tensors`.
    `refresh(newer)` copies a newer copy's tensors into these in place: their addresses stay, so a captured
    CUDA graph (or a copy kept between calls) samples from the newer weights. `repack(weights, bias)`, where
    not None, does that straight from the policy's weights (a list of (N_i, K), stacked by rows), with no
    newer copy made first (False where it cannot: a bias came or went). `outputs`: where it is cpu_decode's
    `linear` (tensors: the packed weights, the fp32 bias or None), its output count N
    (cpu_decode.decode_layers calls it with these), else None. `rows`: the row count it was packed for where
    the packing depends on it (oneDNN's reorder), else None."""

    def __init__(self, fn, *tensors, outputs: int | None = None, repack=None, rows: int | None = None):
        self.fn, self.tensors, self.outputs, self.repack, self.rows = fn, tensors, outputs, repack, rows

    def __call__(self, x):
        return self.fn(x, *self.tensors)

    def refresh(self, newer: "Packed") -> None:
        for mine, theirs in zip(self.tensors, newer.tensors, strict=True):
            if mine is not None:
                mine.copy_(theirs)


def _stacked(ws):
    return torch.cat(ws) if len(ws) > 1 else ws[0]


def _packed(ws, bias, rows, dtype) -> Packed:
    """The weights `ws` (a list of (N_i, K), stacked by rows) copied into `dtype`, its inputs cast to it and
    its outputs left in it (the step casts only where fp32 is needed: a residual add promotes on its own, and
    the MLP's product feeds the next 16-bit linear as it is): packed for cpu_decode's linear kernel where it
    is built for that dtype (repacked in place, no concatenated copy), else oneDNN-packed on a CPU whose
    oneDNN runs that dtype natively, else a plain `F.linear` in it (a GPU; fp16 on a CPU without avx512_fp16
    / AMX-fp16)."""
    cast = lambda x: x if x.dtype == dtype else x.to(dtype)  # noqa: E731
    ours = _our_linear(ws[0], dtype)
    if ours is not None:
        pack, linear = ours
        N, K = sum(w.shape[0] for w in ws), ws[0].shape[1]

        def run(x, packed, bias32):
            return linear(cast(x).reshape(-1, K), packed, bias32, N).view(*x.shape[:-1], N)

        def repack(newer, newer_bias) -> bool:
            if (newer_bias is None) != (bias32 is None):
                return False  # a bias came or went: a new copy
            pack([w.detach() for w in newer], dtype, out=packed)
            if bias32 is not None:
                bias32.copy_(newer_bias)
            return True

        packed = pack([w.detach() for w in ws], dtype)
        bias32 = None if bias is None else bias.detach().float()
        return Packed(run, packed, bias32, outputs=N, repack=repack)
    w = _stacked(ws)
    b = None if bias is None else bias.detach().to(dtype)
    if w.device.type == "cpu" and dtype in _ONEDNN_NATIVE and _ONEDNN_NATIVE[dtype]():
        linear = torch.ops.mkldnn._linear_pointwise
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().to(dtype), rows)
        return Packed(lambda x, wp, bp: linear(cast(x), wp, bp, "none", [], ""), packed, b, rows=rows)
    wd = w.detach().to(dtype)
    return Packed(lambda x, wd, bd: torch.nn.functional.linear(cast(x), wd, bd), wd, b)


def _our_linear(w, dtype):
    """cpu_decode's linear kernel for `w` in `dtype` on a CPU where it is built (fp32 / bf16 on AVX-512 or
    AVX2; bf16 needs an even K), else None: at decode shapes it is faster than oneDNN's packed linear
    (cpu_decode)."""
    if w.device.type != "cpu" or (dtype == torch.bfloat16 and w.shape[1] % 2):
        return None
    return cpu_decode.linear_for(dtype)


_ONEDNN_NATIVE = {
    torch.float32: lambda: True,
    torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
    torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported,
}


def _scales(t, qmax):
    """Symmetric scales, one per row of `t` (its last dimension reduced), so that t / scale fits +-qmax."""
    return (t.abs().amax(-1, keepdim=True).float() / qmax).clamp(min=1e-12)


def _w8a8(w, bias, qmax, to_8bit, matmul) -> Packed:
    """An 8-bit layer: weights with one symmetric scale per output channel, activations quantized per row
    at every call (dynamic, per token); `matmul(x8, w8, x_scales, w_scales)`: the dequantized fp32 product."""
    ws = _scales(w, qmax)  # (N, 1)
    wq = to_8bit(w.float() / ws).t()  # (K, N), column-major

    def run(x, wq, ws, b):
        xs = _scales(x, qmax)
        y = matmul(to_8bit(x / xs), wq, xs, ws)
        return (y if b is None else y + b).to(x.dtype)

    return Packed(run, wq, ws.view(1, -1), None if bias is None else bias.detach().float())


def _int8(ws, bias, rows):
    """W8A8 int8, int8 x int8 -> int32 products (`torch._int_mm`: oneDNN VNNI / AMX on x86)."""
    to_int8 = lambda t: torch.round(t).to(torch.int8)  # noqa: E731 - |t| <= 127 by the scales
    return _w8a8(_stacked(ws), bias, 127, to_int8, lambda x8, w8, xs, ws: torch._int_mm(x8, w8) * (xs * ws))


def _fp8(ws, bias, rows):
    """W8A8 fp8 (e4m3), the same scales, run by `torch._scaled_mm` (fp8 tensor cores on a GPU of compute
    capability >= 8.9; emulated, slowly, on a CPU)."""
    e4m3, w = torch.float8_e4m3fn, _stacked(ws)
    out = torch.bfloat16 if w.is_cuda else torch.float32  # row-wise scaled outputs are bf16 on CUDA

    def matmul(x8, w8, xs, ws):
        return torch._scaled_mm(x8, w8, scale_a=xs, scale_b=ws, out_dtype=out).float()

    return _w8a8(w, bias, torch.finfo(e4m3).max, lambda t: t.to(e4m3), matmul)


# how the decode step runs a linear layer, by rollout dtype: `(weights, bias, rows) -> Packed`, the weights a
# list of (N_i, K) stacked by rows (copied from the policy: afresh, or in place into a kept copy per call)
LINEAR_FORMATS = {
    "fp32": lambda w, b, rows: _packed(w, b, rows, torch.float32),
    "bf16": lambda w, b, rows: _packed(w, b, rows, torch.bfloat16),
    "fp16": lambda w, b, rows: _packed(w, b, rows, torch.float16),
    "int8": _int8,
    "fp8": _fp8,
}
# the LM head's format per rollout dtype (the 8-bit ones keep an fp32 head: the logits are what is sampled)
HEAD_FORMATS = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "int8": "fp32", "fp8": "fp32"}
ROLLOUT_DTYPES = ("model", "auto", *LINEAR_FORMATS)


def fused_linear(mods, fmt, rows: int, into=None):
    """x -> the outputs of the Linear modules `mods` on x, concatenated. With a format (LINEAR_FORMATS) their
    weights are copied into one matrix of that format, a `Packed` (fp32 packed: 3-4x faster than `F.linear`
    for the LM head at 16 rows, 1.5x for the layers): into `into` (the same modules' Packed from an earlier
    call, same format and rows) in place, returned, else a new one; None: the modules run as they are (on
    their live weights)."""
    if fmt is not None:
        weights, biases = zip(*(_weight_of(m) for m in mods))
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat(
                [b if b is not None else weights[0].new_zeros(m.out_features) for b, m in zip(biases, mods)]
            )
        if isinstance(into, Packed) and into.repack is not None and into.repack(weights, bias):
            return into
        newer = LINEAR_FORMATS[fmt](list(weights), bias, rows)
        if isinstance(into, Packed) and into.repack is None and _same_shapes(into, newer):
            into.refresh(newer)
            return into
        return newer
    if len(mods) == 1:
        return mods[0]
    return lambda x: torch.cat([m(x) for m in mods], dim=-1)


def _same_shapes(a: Packed, b: Packed) -> bool:
    return len(a.tensors) == len(b.tensors) and all(
        (x is None) == (y is None) and (x is None or (x.shape, x.dtype) == (y.shape, y.dtype))
        for x, y in zip(a.tensors, b.tensors)
    )


def packable(m, fmt) -> bool:
    """Whether `m` can be copied into `fmt`: a plain Linear, or (low precision) a LoRA layer, merged."""
    if type(m) is torch.nn.Linear:
        return True
    base = getattr(m, "get_base_layer", None)
    return fmt != "fp32" and base is not None and type(base()) is torch.nn.Linear


def check_rollout_dtype(rollout_dtype, device, model_dtype) -> str:
    """The rollout dtype as the engine runs it ("model" = the policy's own), or a ValueError saying why."""
    if rollout_dtype not in ROLLOUT_DTYPES:
        raise ValueError(f"rollout_dtype must be one of {ROLLOUT_DTYPES}, got {rollout_dtype!r}")
    if rollout_dtype == "auto":
        rollout_dtype = auto_rollout_dtype(device, model_dtype)[0]
    if rollout_dtype == "int8" and device.type != "cpu":
        raise ValueError(
            f"rollout_dtype='int8' runs on the CPU (oneDNN's int8 kernels); on {device.type} use 'fp8' or "
            "'bf16'"
        )
    if rollout_dtype == "int8" and not int8_exact():
        raise ValueError(
            "rollout_dtype='int8' needs exact int8 products, and this CPU's (oneDNN without VNNI: pairs of "
            "products summed in 16 bits) saturate; use 'bf16' or 'model'"
        )
    if rollout_dtype == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(
            f"rollout_dtype='fp8' needs fp8 tensor cores (compute capability >= 8.9), got "
            f"{torch.cuda.get_device_capability(device)}; use 'bf16'"
        )
    if rollout_dtype in HALF and model_dtype != torch.float32:
        if HALF[rollout_dtype] == model_dtype:
            return "model"
        raise ValueError(
            f"rollout_dtype={rollout_dtype!r} is a copy of an fp32 policy, got a {model_dtype} one "
            "(a 16-bit policy samples in its own dtype, 'fp8' or 'int8')"
        )
    return "model" if rollout_dtype == "fp32" else rollout_dtype


HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


@functools.cache
def int8_exact() -> bool:
    """Whether `torch._int_mm` multiplies int8 exactly on this CPU. oneDNN without VNNI (AVX2: u8 x s8
    products summed in pairs into 16 bits) saturates: products of large values come out wrong (measured
    off by 88,576 in 471,766 at random int8 values under ONEDNN_MAX_CPU_ISA=AVX2)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (16, 64), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (64, 32), dtype=torch.int8, generator=g)
    a[0], b[:, 0] = 127, 127  # a row and a column at the extremes: the pairs' sums saturate there if at all
    a[1], b[:, 1] = -127, 127
    return torch.equal(torch._int_mm(a, b.t().contiguous().t()), a.int() @ b.int())


def cpu_flags() -> set:
    return set(cpu_info().get("flags", "").split())


def cpu_vendor() -> str:
    """GenuineIntel, AuthenticAMD, ... ("" where /proc/cpuinfo does not say)."""
    return cpu_info().get("vendor_id", "")


_auto_said: set = set()
AUTO_MISMATCH_K3 = 5e-3  # the largest mean k3 (rollout vs fp32 trainer) that "auto" takes


def auto_rollout_dtype(device, model_dtype) -> tuple[str, str]:
    """(rollout dtype, reason) for "auto": bf16 for an fp32 policy where the machine multiplies bf16 natively
    (a CPU with avx512_bf16 / AMX-bf16, a GPU of compute capability >= 8.0), else the policy's dtype: the
    fastest choice whose mismatch to the fp32 trainer stays under AUTO_MISMATCH_K3 in the measured table
    (bench/results/zen4/bench_generate_rollout_dtype.md; SmolLM2-135M, AMD EPYC with avx512_bf16: bf16 1.87x
    fp32's tokens/s at mean k3 9.5e-4; fp16 0.26x, no avx512_fp16; int8 0.87x at k3 0.039, fp8 emulated
    0.09x at k3 0.045: both over the bound, asked for by name only)."""
    flags = cpu_flags() if device.type == "cpu" else set()
    bf16 = flags & {"avx512_bf16", "amx_bf16"}
    gpu = device.type == "cuda" and torch.cuda.is_available()
    cap = torch.cuda.get_device_capability(device) if gpu else None
    if model_dtype != torch.float32:
        pick, why = "model", f"the policy is {model_dtype}"
    elif cap is not None and cap >= (8, 0):
        pick, why = "bf16", f"the GPU's compute capability {cap} >= 8.0"
    elif device.type != "cpu":
        pick, why = "model", f"{device.type}: no native bf16 known"
    elif bf16:
        pick, why = "bf16", f"the CPU has {', '.join(sorted(bf16))}"
    else:
        pick, why = "model", "the CPU has no native bf16 (avx512_bf16 / amx_bf16)"
    if why not in _auto_said:
        _auto_said.add(why)
        print(f"grpo-fast rollout dtype auto: {pick if pick != 'model' else 'fp32'} ({why})", flush=True)
    return pick, why
