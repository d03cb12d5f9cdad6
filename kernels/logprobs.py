"""Token log-probabilities (and entropy) straight from hidden states and the LM head, logits never whole.

    z = (hidden @ weight.T + bias) / T          hidden (N, H), weight (V, H), bias (V,), any float dtype
    logp[n] = z[n, targets[n]] - logsumexp(z[n])   fp32 (N,)
    entropy[n] = logsumexp(z[n]) - sum_v softmax(z[n])_v * z[n, v]   fp32 (N,)

Triton: the forward sweeps vocabulary tiles with an online logsumexp (fp32) and writes only per-token
statistics; the backward (TRITON_BACKWARD "chunked", rows.py) takes chunks of tokens: logits by a GEMM, d
logits in place by a row kernel, d hidden and d weight by GEMMs, one writer per output; "atomic" recomputes
each logits tile from the saved LSE and adds its share of the gradients with fp32 atomics. The PyTorch twin
does the chunked backward with torch's ops.
Mixed precision: the GEMMs run in `compute_dtype(hidden, weight)` (autocast's dtype, else the shared one, else
the 16-bit one: bf16 activations on an fp32 master head), fixed at the forward and reused by the backward;
Triton casts tiles as they load, the twin the weight once per call. Gradients come back in each input's own
dtype (an fp32 weight's accumulated in fp32); the bias is added in fp32.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import INTERPRET, autocast_off, check_positive, check_tensor, compute_dtype, resolve_impl
from .rows import TritonRows

# The twin's logits tile: at most this many fp32 elements (64 MiB) live at once, plus one temporary of the
# same size. 2**24 keeps 110 tokens per chunk at V=151,936: large enough for an efficient CPU matmul.
TWIN_TILE_ELEMS = 1 << 24
TWIN_MAX_ROWS = 2048  # forward-only blocks: tokens per block, the vocabulary sliced to fit the tile

# Triton tiles: (BLOCK_N tokens x BLOCK_V vocabulary) logits per program, K steps of BLOCK_H, launch options,
# per input width. One configuration per kernel, no autotuning (the interpreter cannot run several); module
# constants so that bench/gpu/suite.py's "tiles" section can time the alternatives. 16-bit: measured on an
# H200 at N, H, V = 16384, 4096, 151936 bf16 (bench/results/h200): forward 42 ms (484 TFLOP/s) vs 86 ms for
# 64x128x64; backward ~1.6x faster than 64x128x64 (its atomics scale with 1/BLOCK_N + 1/BLOCK_V). 32-bit
# tiles take twice the shared memory per stage, so fp32 keeps the smaller tile (checked on the H200). The key
# is the compute dtype's width; see `_tiles` for operands wider than it (an fp32 master head on bf16 GEMMs).
FWD_TILES = {
    16: dict(BLOCK_N=128, BLOCK_V=256, BLOCK_H=64, num_warps=8, num_stages=3),
    32: dict(BLOCK_N=64, BLOCK_V=128, BLOCK_H=64, num_warps=8),
}
BWD_TILES = {
    16: dict(BLOCK_N=128, BLOCK_V=256, BLOCK_H=32, num_warps=8),
    32: dict(BLOCK_N=64, BLOCK_V=128, BLOCK_H=64, num_warps=8),
}


def _tiles(table, cdtype, h_dtype, w_dtype):
    """The compute dtype's tiles. An operand wider than it is cast in registers after the pipelined load, so
    its tiles sit in shared memory at their own width: BLOCK_H is halved (down to tl.dot's minimum K of 16)
    until a K step's two tiles take no more bytes than in the measured configuration (unmeasured on a GPU)."""
    tiles = dict(table[32 if cdtype == torch.float32 else 16])

    def step_bytes(h_size, w_size):
        return (tiles["BLOCK_N"] * h_size + tiles["BLOCK_V"] * w_size) * tiles["BLOCK_H"]

    budget = step_bytes(cdtype.itemsize, cdtype.itemsize)
    while tiles["BLOCK_H"] > 16 and step_bytes(h_dtype.itemsize, w_dtype.itemsize) > budget:
        tiles["BLOCK_H"] //= 2
    return tiles


# torch dtype -> Triton dtype of the tiles fed to tl.dot (the CDTYPE constexpr)
_TL_DTYPES = {
    torch.float32: tl.float32,
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
    torch.float64: tl.float64,
}


# The backward adds each (token block x vocab block) tile's share of d hidden and d weight with fp32 atomics
# (~2.4e11 adds at N=16k, H=4096, V=152k). Their order is irrelevant to a sum, so they are "relaxed" (Triton's
# default, "acq_rel", fences every add). Programs run in groups of BWD_GROUP_N token blocks per vocabulary
# block, so that the programs resident at one time spread over ~16 d-hidden and ~16 d-weight row blocks
# instead of all adding into the same d-weight rows (token block fastest, BWD_GROUP_N = 0). Both settings are
# module constants so that bench/gpu/suite.py can time the alternatives.
BWD_ATOMIC_SEM = "relaxed"
BWD_GROUP_N = 16

# Triton's backward: "chunked" (rows.py: per chunk of tokens the logits by a GEMM, d logits in place by a row
# kernel, d hidden and d weight by GEMMs; one writer per output) or "atomic" (the tile kernel below, which
# recomputes logits tiles and adds their gradient shares with atomics). A module constant so that
# bench/gpu/sections.py times both; the default is the chunked path (the atomic one measured 2.1x naive
# torch's time on an H200, 205 of its 247 ms in the atomics).
TRITON_BACKWARD = "chunked"


# --------------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------------
@triton.jit
def _logits_tile(
    h_ptr,
    w_ptr,
    b_ptr,
    offs_n,
    offs_v,
    n_mask,
    v_mask,
    H,
    stride_h,
    stride_w,
    inv_t,
    HAS_BIAS: tl.constexpr,
    CDTYPE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # (BLOCK_N, BLOCK_V) tile of z = (h @ w.T + b) / T, accumulated in fp32 over K steps of BLOCK_H
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_mask = offs_h < H
        # operands cast to the compute dtype as they load (a no-op in it): no copy of an fp32 master head
        a = tl.load(
            h_ptr + offs_n[:, None] * stride_h + offs_h[None, :],
            mask=n_mask[:, None] & h_mask[None, :],
            other=0.0,
        ).to(CDTYPE)
        b = tl.load(
            w_ptr + offs_v[:, None] * stride_w + offs_h[None, :],
            mask=v_mask[:, None] & h_mask[None, :],
            other=0.0,
        ).to(CDTYPE)
        if UPCAST:  # the interpreter's tl.dot is wrong on bf16/fp16 tiles
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_v, mask=v_mask, other=0.0).to(tl.float32)[None, :]
    return acc * inv_t


@triton.heuristics({"HAS_BIAS": lambda args: args["b_ptr"] is not None})
@triton.jit
def _logprob_fwd_kernel(
    h_ptr,
    w_ptr,
    b_ptr,
    tgt_ptr,
    m_ptr,
    s_ptr,
    zt_ptr,
    sz_ptr,  # partial statistics, (SPLIT, N) fp32 each
    N,
    V,
    H,
    v_per_split,
    stride_h,
    stride_w,
    inv_t,
    HAS_BIAS: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    CDTYPE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pid_n = tl.program_id(0).to(tl.int64)  # int64 before pointer math: N * H overflows int32
    pid_s = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    tgt = tl.load(tgt_ptr + offs_n, mask=n_mask, other=-1)

    # 1. online logsumexp over this split's vocabulary tiles (fp32)
    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    zt = tl.zeros((BLOCK_N,), dtype=tl.float32)
    sz = tl.zeros((BLOCK_N,), dtype=tl.float32)
    v_start = pid_s * v_per_split
    v_end = tl.minimum(v_start + v_per_split, V)
    for v0 in range(v_start, v_end, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        v_mask = offs_v < v_end
        z = _logits_tile(
            h_ptr,
            w_ptr,
            b_ptr,
            offs_n,
            offs_v,
            n_mask,
            v_mask,
            H,
            stride_h,
            stride_w,
            inv_t,
            HAS_BIAS,
            CDTYPE,
            UPCAST,
            PRECISION,
            BLOCK_N,
            BLOCK_V,
            BLOCK_H,
        )
        z = tl.where(v_mask[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(z - m_new[:, None])
        s = s * alpha + tl.sum(p, axis=1)
        # 2. the chosen token's logit, and sum p*z for the entropy (rescaled like s)
        zt += tl.sum(tl.where(offs_v[None, :] == tgt[:, None], z, 0.0), axis=1)
        if WITH_ENTROPY:
            sz = sz * alpha + tl.sum(p * tl.where(v_mask[None, :], z, 0.0), axis=1)
        m = m_new

    out = pid_s * N + offs_n
    tl.store(m_ptr + out, m, mask=n_mask)
    tl.store(s_ptr + out, s, mask=n_mask)
    tl.store(zt_ptr + out, zt, mask=n_mask)
    if WITH_ENTROPY:
        tl.store(sz_ptr + out, sz, mask=n_mask)


@triton.heuristics({"HAS_BIAS": lambda args: args["b_ptr"] is not None})
@triton.jit
def _logprob_bwd_kernel(
    h_ptr,
    w_ptr,
    b_ptr,
    tgt_ptr,
    lse_ptr,
    glp_ptr,
    gent_ptr,
    ez_ptr,
    gh_ptr,
    gw_ptr,
    gb_ptr,  # fp32 gradient accumulators
    N,
    V,
    H,
    stride_h,
    stride_w,
    inv_t,
    HAS_BIAS: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    WITH_GW: tl.constexpr,  # False for a frozen head (LoRA): no d weight, no hidden tiles loaded
    CDTYPE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    SEM: tl.constexpr,
    GROUP_N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # 0. which tile: a 1D grid walked GROUP_N token blocks at a time per vocabulary block (see BWD_GROUP_N)
    pid = tl.program_id(0).to(tl.int64)
    n_blocks = tl.cdiv(N, BLOCK_N)
    if GROUP_N == 0:
        pid_n = pid % n_blocks
        pid_v = pid // n_blocks
    else:
        per_group = GROUP_N * tl.cdiv(V, BLOCK_V)
        first_n = (pid // per_group) * GROUP_N
        rows = tl.minimum(n_blocks - first_n, GROUP_N)
        pid_n = first_n + (pid % per_group) % rows
        pid_v = (pid % per_group) // rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    n_mask = offs_n < N
    v_mask = offs_v < V

    # 1. recompute the logits tile and softmax from the saved LSE
    z = _logits_tile(
        h_ptr,
        w_ptr,
        b_ptr,
        offs_n,
        offs_v,
        n_mask,
        v_mask,
        H,
        stride_h,
        stride_w,
        inv_t,
        HAS_BIAS,
        CDTYPE,
        UPCAST,
        PRECISION,
        BLOCK_N,
        BLOCK_V,
        BLOCK_H,
    )
    lse = tl.load(lse_ptr + offs_n, mask=n_mask, other=0.0)
    p = tl.exp(z - lse[:, None])

    # 2. dz = g_logp * (onehot - p) + g_ent * p * (E_p[z] - z), then d logits = dz / T
    tgt = tl.load(tgt_ptr + offs_n, mask=n_mask, other=-1)
    g = tl.load(glp_ptr + offs_n, mask=n_mask, other=0.0)
    dz = tl.where(offs_v[None, :] == tgt[:, None], g[:, None], 0.0) - g[:, None] * p
    if WITH_ENTROPY:
        ge = tl.load(gent_ptr + offs_n, mask=n_mask, other=0.0)
        ez = tl.load(ez_ptr + offs_n, mask=n_mask, other=0.0)
        dz += ge[:, None] * p * (ez[:, None] - z)
    dz = tl.where(n_mask[:, None] & v_mask[None, :], dz * inv_t, 0.0)
    if HAS_BIAS:
        tl.atomic_add(gb_ptr + offs_v, tl.sum(dz, axis=0), mask=v_mask, sem=SEM)

    # 3. this tile's share of d hidden = dz @ W and d W = dz.T @ hidden, accumulated in fp32
    dz_mm = dz.to(CDTYPE)
    if UPCAST:
        dz_mm = dz
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_mask = offs_h < H
        w = tl.load(
            w_ptr + offs_v[:, None] * stride_w + offs_h[None, :],
            mask=v_mask[:, None] & h_mask[None, :],
            other=0.0,
        ).to(CDTYPE)
        if UPCAST:
            w = w.to(tl.float32)
        gh = tl.dot(dz_mm, w, input_precision=PRECISION)
        tl.atomic_add(
            gh_ptr + offs_n[:, None] * H + offs_h[None, :],
            gh,
            mask=n_mask[:, None] & h_mask[None, :],
            sem=SEM,
        )
        if WITH_GW:
            x = tl.load(
                h_ptr + offs_n[:, None] * stride_h + offs_h[None, :],
                mask=n_mask[:, None] & h_mask[None, :],
                other=0.0,
            ).to(CDTYPE)
            if UPCAST:
                x = x.to(tl.float32)
            gw = tl.dot(tl.trans(dz_mm), x, input_precision=PRECISION)
            tl.atomic_add(
                gw_ptr + offs_v[:, None] * H + offs_h[None, :],
                gw,
                mask=v_mask[:, None] & h_mask[None, :],
                sem=SEM,
            )


# --------------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------------
def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs follow torch's own matmul setting (TF32 only when the user allowed it)
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _num_splits(n_blocks: int, V: int, block_v: int, device: torch.device) -> int:
    # Split the vocabulary across programs when there are too few token blocks to fill the GPU.
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(4 * sms, n_blocks), triton.cdiv(V, 8 * block_v)))


def _interpreter_operands(hidden, weight, cdtype):
    # The interpreter casts fp32 -> bf16 toward zero (GPUs round to nearest even, as torch does), which would
    # double the rounding error: under it the operands are cast here and the kernels' tile casts are no-ops.
    if INTERPRET:
        return hidden.to(cdtype), weight.to(cdtype)
    return hidden, weight


def _logprob_fwd(hidden, weight, bias, targets, inv_t, with_entropy, cdtype):
    # the tiles from the operands as given: the interpreter runs the GPU's configuration
    tiles = _tiles(FWD_TILES, cdtype, hidden.dtype, weight.dtype)
    hidden, weight = _interpreter_operands(hidden, weight, cdtype)
    N, H = hidden.shape
    V = weight.shape[0]
    n_blocks = triton.cdiv(N, tiles["BLOCK_N"])
    splits = _num_splits(n_blocks, V, tiles["BLOCK_V"], hidden.device)
    v_per_split = triton.cdiv(triton.cdiv(V, splits), tiles["BLOCK_V"]) * tiles["BLOCK_V"]
    splits = triton.cdiv(V, v_per_split)
    stats = torch.zeros(4, splits, N, dtype=torch.float32, device=hidden.device)
    if N == 0:
        return stats[0, 0], stats[0, 0], stats[0, 0], stats[0, 0]
    _logprob_fwd_kernel[(n_blocks, splits)](
        hidden,
        weight,
        bias,
        targets,
        stats[0],
        stats[1],
        stats[2],
        stats[3],
        N,
        V,
        H,
        v_per_split,
        hidden.stride(0),
        weight.stride(0),
        inv_t,
        WITH_ENTROPY=with_entropy,
        CDTYPE=_TL_DTYPES[cdtype],
        UPCAST=INTERPRET,
        PRECISION=_precision(cdtype),
        **tiles,
    )
    # 3. merge the splits' partial logsumexps (a few floats per token)
    m, s, zt, sz = stats
    m_all = m.max(dim=0).values
    scale = torch.exp(m - m_all)
    s_all = (s * scale).sum(0)
    lse = m_all + torch.log(s_all)
    logp = zt.sum(0) - lse
    if not with_entropy:
        return logp, lse, None, None
    ez = (sz * scale).sum(0) / s_all
    return logp, lse, lse - ez, ez


def _logprob_bwd(hidden, weight, bias, targets, inv_t, lse, g_logp, g_ent, ez, with_w, cdtype):
    tiles = _tiles(BWD_TILES, cdtype, hidden.dtype, weight.dtype)
    hidden, weight = _interpreter_operands(hidden, weight, cdtype)
    N, H = hidden.shape
    V = weight.shape[0]
    gh = torch.zeros(N, H, dtype=torch.float32, device=hidden.device)
    gw = torch.zeros(V, H, dtype=torch.float32, device=hidden.device) if with_w else None
    gb = torch.zeros(V, dtype=torch.float32, device=hidden.device) if bias is not None else None
    with_entropy = g_ent is not None
    if N == 0:
        return gh, gw, gb
    grid = (triton.cdiv(N, tiles["BLOCK_N"]) * triton.cdiv(V, tiles["BLOCK_V"]),)
    _logprob_bwd_kernel[grid](
        hidden,
        weight,
        bias,
        targets,
        lse,
        g_logp.contiguous(),
        g_ent.contiguous() if with_entropy else None,
        ez if with_entropy else None,
        gh,
        gw,
        gb,
        N,
        V,
        H,
        hidden.stride(0),
        weight.stride(0),
        inv_t,
        WITH_ENTROPY=with_entropy,
        WITH_GW=with_w,
        CDTYPE=_TL_DTYPES[cdtype],
        UPCAST=INTERPRET,
        PRECISION=_precision(cdtype),
        SEM=BWD_ATOMIC_SEM,
        GROUP_N=BWD_GROUP_N,
        **tiles,
    )
    return gh, gw, gb


# --------------------------------------------------------------------------------------------------------
# PyTorch twin: the same math over chunks of tokens (CPU path, benchmark baseline)
# --------------------------------------------------------------------------------------------------------
def twin_chunk_rows(V: int) -> int:
    """Tokens per twin chunk: TWIN_TILE_ELEMS // V rounded up to a multiple of 64 when that is more than 64.

    CPU BLAS runs a (rows x H) @ (H x V) product ~1.4x faster at 128 rows than at 110 (register blocking)."""
    rows = max(1, TWIN_TILE_ELEMS // V)
    return rows if rows < 64 else -(-rows // 64) * 64


def twin_logits(h_chunk, weight, bias, inv_t, out=None):
    """fp32 (C, V) logits of a chunk; h_chunk and weight come in the compute dtype and the matmul runs in it,
    as in plain PyTorch. A bias of that dtype goes into the matmul (as before); any other is added in fp32.

    `out` is a reusable fp32 buffer of at least C * V elements (fresh pages cost a fault each on CPU)."""
    in_mm = bias is not None and bias.dtype == weight.dtype
    if out is not None and h_chunk.dtype == torch.float32:
        # computed as (V, C) = W @ h.T and used through its transpose: BLAS runs this shape faster
        zt = out[: h_chunk.shape[0] * weight.shape[0]].view(weight.shape[0], h_chunk.shape[0])
        if in_mm:
            torch.addmm(bias[:, None], weight, h_chunk.T, out=zt)
        else:
            torch.mm(weight, h_chunk.T, out=zt)
        z = zt.T
    else:
        z = (torch.addmm(bias, h_chunk, weight.T) if in_mm else h_chunk @ weight.T).float()
    if bias is not None and not in_mm:
        z += bias.float()  # an fp32 master bias on bf16 GEMMs: added in fp32, not rounded to bf16
    return z if inv_t == 1.0 else z.mul_(inv_t)


def twin_grad_from_logits(z, lse, targets, g_logp, inv_t, g_ent=None, ez=None):
    """Turn the fp32 logits tile `z` into d loss / d logits in place and return it."""
    ent_term = None
    if g_ent is not None:
        # d entropy / dz = p * (E_p[z] - z): (E_p[z] - z) g taken while z is intact, times p once p exists
        ent_term = torch.sub(ez[:, None], z).mul_(g_ent[:, None])
    p = z.sub_(lse[:, None]).exp_()
    if ent_term is not None:
        ent_term.mul_(p)
    return twin_grad_from_probs(p, targets, g_logp, inv_t, ent_term)


def twin_grad_from_probs(p, targets, g_logp, inv_t, extra=None):
    """d loss / d logits = (g * (onehot - p) + extra) / T, computed in place of the softmax tile `p`."""
    dz = p.mul_(-g_logp[:, None])
    rows = torch.arange(dz.shape[0], device=dz.device)
    dz[rows, targets] += g_logp
    if extra is not None:
        dz += extra
    return dz if inv_t == 1.0 else dz.mul_(inv_t)


def twin_accumulate(dz, h_chunk, weight, grad_w, grad_b, with_w=True):
    """d hidden of the chunk (in the compute dtype of h_chunk and weight), and d weight / d bias accumulated
    in fp32. `grad_w` None: this chunk starts it (no zero-filled weight-sized buffer to add into). with_w
    False (a frozen head, as under LoRA): no d weight, a third of the chunk's matmuls saved. Returns
    (grad_h, grad_w)."""
    grad_h = dz.to(weight.dtype) @ weight
    if with_w and grad_w is None:
        grad_w = torch.mm(dz.T, h_chunk.float())
    elif with_w:
        grad_w.addmm_(dz.T, h_chunk.float())
    if grad_b is not None:
        grad_b += dz.sum(0)
    return grad_h, grad_w


class TwinRows:
    """The twin's operations on one chunk of tokens (the interface `rows.TritonRows` shares): matmuls in the
    compute dtype `cdtype` as plain PyTorch runs them, the softmax taken in place of the logits."""

    def __init__(self, cdtype: torch.dtype):
        self.cdtype = cdtype

    chunk_rows = staticmethod(lambda V: twin_chunk_rows(V))
    logits = staticmethod(twin_logits)
    accumulate = staticmethod(twin_accumulate)

    def operand(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.cdtype)

    @staticmethod
    def score(z, targets):
        """(logp, None): the log-probs at `targets`; `z` becomes the softmax, in place."""
        zt = z.gather(1, targets[:, None]).squeeze(1)
        m = z.amax(dim=1)
        p = z.sub_(m[:, None]).exp_()
        s = p.sum(1)
        p.div_(s[:, None])
        return zt - (m + torch.log(s)), None

    @staticmethod
    def grad(z, lse, targets, g, inv_t, g_ent=None, ez=None):
        """d loss / d logits in place of `z`: the softmax (lse None, after `score`), or the logits."""
        if lse is None:
            return twin_grad_from_probs(z, targets, g, inv_t)
        return twin_grad_from_logits(z, lse, targets, g, inv_t, g_ent, ez)


def _twin_fwd(hidden, weight, bias, targets, inv_t, with_entropy, cdtype):
    # Blocks of up to TWIN_MAX_ROWS tokens x a vocabulary slice, merged with an online logsumexp: the
    # matmuls keep a large M (a (110 x V) token chunk runs ~1.3x slower per flop on CPU BLAS).
    N, V = hidden.shape[0], weight.shape[0]
    weight = weight.to(cdtype)  # once per call (a no-op in the compute dtype); hidden per block below
    f32 = dict(dtype=torch.float32, device=hidden.device)
    logp, lse = torch.empty(N, **f32), torch.empty(N, **f32)
    ent, ez = (torch.empty(N, **f32), torch.empty(N, **f32)) if with_entropy else (None, None)
    rows = max(1, min(N, TWIN_MAX_ROWS))
    vc = min(V, max(128, TWIN_TILE_ELEMS // rows))
    buf = torch.empty(rows * vc, **f32)
    ebuf = torch.empty(rows * vc, **f32) if with_entropy else None  # the entropy's one temporary
    for i in range(0, N, rows):
        h, t = hidden[i : i + rows].to(cdtype), targets[i : i + rows]
        n = h.shape[0]
        m = torch.full((n,), float("-inf"), **f32)
        s, zt, sz = torch.zeros(n, **f32), torch.zeros(n, **f32), torch.zeros(n, **f32)
        for v0 in range(0, V, vc):
            z = twin_logits(
                h, weight[v0 : v0 + vc], None if bias is None else bias[v0 : v0 + vc], inv_t, out=buf
            )
            # 1. the chosen tokens that fall in this slice
            here = ((t >= v0) & (t < v0 + z.shape[1])).nonzero().squeeze(1)
            zt[here] = z[here, t[here] - v0]
            # 2. online logsumexp (and sum p*z for the entropy), consuming z in place
            m_new = torch.maximum(m, z.amax(dim=1))
            alpha = torch.exp(m - m_new)
            if with_entropy:  # one exp of the slice: e = exp(z - m) gives s, then e * z (in place) gives sz
                e = ebuf[: z.numel()].as_strided(z.shape, z.stride())  # z's layout: no strided copy
                e = torch.sub(z, m_new[:, None], out=e).exp_()
                s = s * alpha + e.sum(1)
                sz = sz * alpha + e.mul_(z).sum(1)
            else:
                s = s * alpha + z.sub_(m_new[:, None]).exp_().sum(1)
            m = m_new
        lse[i : i + n] = m + torch.log(s)
        logp[i : i + n] = zt - lse[i : i + n]
        if with_entropy:
            ez[i : i + n] = sz / s
            ent[i : i + n] = lse[i : i + n] - ez[i : i + n]
    return logp, lse, ent, ez


def _chunked_bwd(hidden, weight, bias, targets, inv_t, lse, g_logp, g_ent, ez, with_w, ops):
    """The backward over chunks of tokens, one writer per output: each chunk's logits recomputed, turned
    into d logits in place, then d hidden and d weight by matmuls (`ops`: TwinRows or rows.TritonRows)."""
    N, H = hidden.shape
    w_c = ops.operand(weight)  # once per call; hidden per chunk
    grad_h = torch.empty(N, H, dtype=hidden.dtype, device=hidden.device)
    grad_w = None
    grad_b = (
        torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if bias is not None else None
    )
    step = ops.chunk_rows(weight.shape[0])
    buf = torch.empty(min(N, step) * weight.shape[0], dtype=torch.float32, device=hidden.device)
    part = lambda x, sl: None if x is None else x[sl]  # noqa: E731
    for i in range(0, N, step):
        sl = slice(i, i + step)
        h_c = ops.operand(hidden[sl])
        z = ops.logits(h_c, w_c, bias, inv_t, out=buf)
        dz = ops.grad(z, lse[sl], targets[sl], g_logp[sl], inv_t, part(g_ent, sl), part(ez, sl))
        grad_h[sl], grad_w = ops.accumulate(dz, h_c, w_c, grad_w, grad_b, with_w)
    if grad_w is None and with_w:
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    return grad_h, grad_w, grad_b


# --------------------------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Params:
    inv_t: float
    with_entropy: bool
    impl: str
    compute_dtype: torch.dtype  # decided once at entry (ambient autocast included), reused by the backward


class _FusedLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, params: _Params):
        fwd = _logprob_fwd if params.impl == "triton" else _twin_fwd
        with autocast_off(hidden.device):  # ambient autocast would re-cast the twin's matmuls: casts explicit
            logp, lse, ent, ez = fwd(
                hidden, weight, bias, targets, params.inv_t, params.with_entropy, params.compute_dtype
            )
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ez)
        ctx.params = params
        if ent is None:
            ent = torch.zeros_like(logp)  # autograd needs a tensor; never returned to the caller
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, targets, lse, ez = ctx.saved_tensors
        p = ctx.params
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        g_ent = g_ent.float() if (p.with_entropy and g_ent is not None) else None
        with_w = ctx.needs_input_grad[1]
        with autocast_off(hidden.device):  # the forward's compute dtype, whatever autocast is on here
            g_logp, cdtype = g_logp.float(), p.compute_dtype
            args = (hidden, weight, bias, targets, p.inv_t, lse, g_logp, g_ent, ez, with_w)
            if p.impl == "torch":
                gh, gw, gb = _chunked_bwd(*args, TwinRows(cdtype))
            elif TRITON_BACKWARD == "chunked":
                gh, gw, gb = _chunked_bwd(*args, TritonRows(cdtype))
            else:
                gh, gw, gb = _logprob_bwd(*args, cdtype)
        # each input's own dtype: an fp32 master weight gets its fp32 accumulator, never rounded to bf16
        return (
            gh.to(hidden.dtype) if ctx.needs_input_grad[0] else None,
            gw.to(weight.dtype) if with_w else None,
            gb.to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None,
            None,
            None,
        )


def check_logprob_inputs(hidden, weight, targets, bias, temperature):
    """Validate the shared (hidden, weight, targets, bias, temperature) arguments; return flat views."""
    check_tensor("hidden", hidden, (2, 3))
    check_tensor("weight", weight, (2,))
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden's last dimension ({hidden.shape[-1]}) must equal weight.shape[1] ({weight.shape[1]})"
        )
    if not isinstance(targets, torch.Tensor) or targets.dtype not in (torch.int64, torch.int32):
        got = targets.dtype if isinstance(targets, torch.Tensor) else type(targets).__name__
        raise TypeError(f"targets must be an int64 (or int32) tensor, got {got}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"targets must have hidden's leading shape {tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}"
        )
    if bias is not None:
        check_tensor("bias", bias, (1,))
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    check_positive("temperature", temperature)
    V = weight.shape[0]
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= V):
        raise ValueError(
            f"targets must lie in [0, {V}), got values in [{int(targets.min())}, {int(targets.max())}]"
        )
    return hidden.reshape(-1, hidden.shape[-1]).contiguous(), targets.reshape(-1).long().contiguous()


def linear_logprobs(flat_hidden, weight, bias, flat_targets, temperature, with_entropy, impl, cdtype):
    """`fused_linear_logprobs` on validated, flattened (N, H) / (N,) inputs with a resolved impl and the
    GEMMs' compute dtype (`compute_dtype`)."""
    params = _Params(inv_t=1.0 / temperature, with_entropy=with_entropy, impl=impl, compute_dtype=cdtype)
    bias_c = bias.contiguous() if bias is not None else None
    return _FusedLinearLogprobs.apply(flat_hidden, weight.contiguous(), bias_c, flat_targets, params)


def fused_linear_logprobs(
    hidden, weight, targets, *, bias=None, temperature=1.0, return_entropy=False, impl="auto"
):
    """Log-probability of each target token under `softmax((hidden @ weight.T + bias) / temperature)`.

    The (tokens x vocab) logits are never materialized. Triton holds one (64 x 128) fp32 tile per program;
    the PyTorch twin holds one fp32 tile of about 2**24 elements (64 MiB; 128 tokens x V at V=151,936, see
    `twin_chunk_rows`) plus one temporary of the same size. Log-probs, LSE and entropy are fp32.

    Mixed precision: the matmuls run in the compute dtype, with fp32 accumulation: under `torch.autocast`
    (enabled for the inputs' device type) autocast's dtype, else hidden's and weight's shared dtype, else
    the 16-bit one of the two (bf16 hidden on an fp32 master weight: bf16; the reverse too). The twin then
    holds one copy of the weight in that dtype. Gradients come back in each input's dtype (an fp32 weight's
    accumulated in fp32); the backward runs in the forward's compute dtype whatever autocast is on then.

    Args:
        hidden: (N, H) or (B, T, H) float tensor, the LM head's input.
        weight: (V, H) float tensor, the LM head's weight: hidden's dtype, or fp32 with 16-bit hidden (or
            16-bit with fp32 hidden); bf16 with fp16 is a TypeError (outside autocast).
        targets: int64 tensor of hidden's leading shape, values in [0, V).
        bias: optional (V,) LM head bias, any float dtype (added to the logits in fp32).
        temperature: float > 0; logits are divided by it before the softmax.
        return_entropy: also return the entropy of softmax(logits / temperature), fp32.
        impl: "auto" (Triton for CUDA tensors, else the twin), "triton" or "torch".

    Returns:
        fp32 log-probs with hidden's leading shape; with return_entropy, a (logps, entropy) pair.
        Differentiable with respect to hidden, weight and bias.
    """
    flat_h, flat_t = check_logprob_inputs(hidden, weight, targets, bias, temperature)
    cdtype = compute_dtype(hidden, weight)
    impl = resolve_impl(impl, hidden, weight, targets, bias)
    logp, ent = linear_logprobs(
        flat_h, weight, bias, flat_t, float(temperature), bool(return_entropy), impl, cdtype
    )
    lead = hidden.shape[:-1]
    if return_entropy:
        return logp.view(lead), ent.view(lead)
    return logp.view(lead)


__all__ = ["fused_linear_logprobs"]
