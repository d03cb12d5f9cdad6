"""The chunked GPU path's pieces: GEMMs with fp32 output, and Triton kernels over the rows of a logits chunk.

One writer per output, no atomics: a chunk of tokens' fp32 logits come from one cuBLAS GEMM (16-bit operands,
fp32 accumulation and output); `row_lse` reads each row once for its logsumexp and the target's log-prob;
once d loss / d log-prob (`g`) is known, `row_grad` writes d loss / d logits over the logits in place
(g * (onehot - softmax), plus the entropy's term, over T); d hidden = dz @ W and d weight += dz^T @ H are
cuBLAS GEMMs again, the weight's into one fp32 accumulator. Used by logprobs.py and fused_loss.py through
`TritonRows`. Under the Triton interpreter (CPU tests) the GEMMs run in fp32 on operands rounded to the
compute dtype first: the products a GPU's fp32-accumulating 16-bit GEMM forms, summed in fp32.
"""

import torch
import triton
import triton.language as tl

from ._common import _SIXTEEN_BIT, INTERPRET

# The fp32 logits chunk's bytes: the path's working set beside the fp32 weight gradient (a module constant so
# that bench/gpu/sections.py can time others). 1 GiB: 1,766 tokens per chunk at V=151,936.
CHUNK_BYTES = 1 << 30
ROW_BLOCK_V = 2048  # vocabulary entries per step of a row program


@triton.jit
def _row_lse_kernel(z_ptr, tgt_ptr, logp_ptr, lse_ptr, V, stride, BLOCK_V: tl.constexpr):
    # one program per row: online logsumexp over BLOCK_V lanes, merged at the end
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride
    offs = tl.arange(0, BLOCK_V)
    m = tl.full([BLOCK_V], -3.0e38, tl.float32)  # finite: exp(m - m_new) of an empty lane stays 1, not NaN
    s = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        z = tl.load(base + v0 + offs, mask=v0 + offs < V, other=float("-inf"))
        m_new = tl.maximum(m, z)
        s = s * tl.exp(m - m_new) + tl.exp(z - m_new)
        m = m_new
    m_all = tl.max(m, axis=0)
    lse = m_all + tl.log(tl.sum(s * tl.exp(m - m_all), axis=0))
    zt = tl.load(base + tl.load(tgt_ptr + row))
    tl.store(lse_ptr + row, lse)
    tl.store(logp_ptr + row, zt - lse)


@triton.jit
def _row_grad_kernel(
    z_ptr, tgt_ptr, g_ptr, lse_ptr, gent_ptr, ez_ptr, V, stride, inv_t,
    HAS_ENT: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    # d loss / d z = (g * (onehot - p) + g_ent * p * (E_p[z] - z)) / T, written over z
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride
    offs = tl.arange(0, BLOCK_V)
    g = tl.load(g_ptr + row)
    lse = tl.load(lse_ptr + row)
    tgt = tl.load(tgt_ptr + row)
    if HAS_ENT:
        g_ent = tl.load(gent_ptr + row)
        ez = tl.load(ez_ptr + row)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        inside = cols < V
        z = tl.load(base + cols, mask=inside, other=0.0)
        p = tl.exp(z - lse)
        dz = tl.where(cols == tgt, g, 0.0) - g * p
        if HAS_ENT:
            dz += g_ent * p * (ez - z)
        tl.store(base + cols, dz * inv_t, mask=inside)


def row_lse(z: torch.Tensor, targets: torch.Tensor):
    """(logp, lse) of each row of the fp32 logits `z` (C, V) (rows contiguous) at `targets` (C,)."""
    C, V = z.shape
    logp = torch.empty(C, dtype=torch.float32, device=z.device)
    lse = torch.empty(C, dtype=torch.float32, device=z.device)
    if C:
        _row_lse_kernel[(C,)](z, targets, logp, lse, V, z.stride(0), BLOCK_V=min(ROW_BLOCK_V, _pow2(V)))
    return logp, lse


def row_grad(z, lse, targets, g, inv_t, g_ent=None, ez=None) -> torch.Tensor:
    """Turn the fp32 logits `z` into d loss / d logits in place (g: d loss / d log-prob per row; g_ent, ez:
    the entropy's gradient and E_p[z] per row, or None) and return it."""
    C, V = z.shape
    if C:
        has_ent = g_ent is not None
        _row_grad_kernel[(C,)](
            z, targets, g.contiguous(), lse, g_ent if has_ent else g, ez if has_ent else g, V, z.stride(0),
            float(inv_t), HAS_ENT=has_ent, BLOCK_V=min(ROW_BLOCK_V, _pow2(V)),
        )  # fmt: skip
    return z


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def mm_f32(a: torch.Tensor, b: torch.Tensor, out=None) -> torch.Tensor:
    """a @ b accumulated and returned in fp32: cuBLAS's fp32-output GEMM on 16-bit CUDA operands (no rounding
    of the result to 16 bits), else an fp32 GEMM of the operands as given."""
    if a.is_cuda and a.dtype in _SIXTEEN_BIT:
        try:
            return torch.mm(a, b, out_dtype=torch.float32, out=out)
        except (TypeError, RuntimeError, NotImplementedError):  # a torch without the fp32-output GEMM
            a, b = a.float(), b.float()
    return torch.mm(a.float(), b.float(), out=out)


def addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc += a @ b into the fp32 accumulator `acc`, without a temporary of its size on CUDA."""
    if a.is_cuda and a.dtype in _SIXTEEN_BIT:
        try:
            return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        except (TypeError, RuntimeError, NotImplementedError):
            pass
    return acc.addmm_(a.float(), b.float())


class TritonRows:
    """The chunked path's operations on one chunk of tokens, in the GEMMs' compute dtype `cdtype` (the same
    interface as logprobs.TwinRows): logits with fp32 output, the row kernels, dz in `cdtype` for the
    gradient GEMMs (as a 16-bit GEMM takes it), d weight into an fp32 accumulator."""

    def __init__(self, cdtype: torch.dtype):
        self.cdtype = cdtype

    @staticmethod
    def chunk_rows(V: int) -> int:
        rows = max(1, CHUNK_BYTES // (4 * V))
        return rows if rows < 128 else rows // 128 * 128

    def operand(self, x: torch.Tensor) -> torch.Tensor:
        # the interpreter (CPU): rounded to the compute dtype, then fp32 for torch's CPU GEMMs
        x = x.to(self.cdtype)
        return x.float() if (INTERPRET and not x.is_cuda) else x

    def logits(self, h_c, weight, bias, inv_t, out=None):
        n = h_c.shape[0] * weight.shape[0]
        z = mm_f32(h_c, weight.T, out=None if out is None else out[:n].view(h_c.shape[0], weight.shape[0]))
        if bias is not None:
            z += bias.float()
        return z if inv_t == 1.0 else z.mul_(inv_t)

    @staticmethod
    def score(z, targets):
        return row_lse(z, targets)

    @staticmethod
    def grad(z, lse, targets, g, inv_t, g_ent=None, ez=None):
        return row_grad(z, lse, targets, g, inv_t, g_ent, ez)

    def accumulate(self, dz, h_c, weight, grad_w, grad_b, with_w=True):
        dz_c = self.operand(dz)  # the 16-bit GEMMs' operand (the interpreter: its rounding, in fp32)
        grad_h = dz_c @ weight
        if with_w:
            if grad_w is None:
                grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=dz.device)
            addmm_f32_(grad_w, dz_c.T, h_c)
        if grad_b is not None:
            grad_b += dz.sum(0)
        return grad_h, grad_w
