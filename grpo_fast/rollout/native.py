"""The native rollout engine: a static KV cache and one fixed-shape, compiled decode step, no host sync per
token.

For Llama / Qwen2 / Qwen3 / Mistral-style models. The prompts are prefilled once by the model's own forward;
their KV stays one copy per group (shared prefix) or one per sample (plain), and each sample gets a completion
KV of fixed capacity, allocated once per call and written in place. Every decode step runs the same shapes
over static buffers: embedding, the decoder layers (the model's own norm / projection / MLP modules, called on
their live weights, so an optimizer step between calls is seen), the last position's logits, the draw, and the
bookkeeping (EOS, lengths, output), so it compiles once (Inductor on CPU; CUDA graphs on CUDA) and the host
never waits on the device inside a window of `SYNC_EVERY` tokens. Rows that finished are dropped (the batch is
compacted, group by group) once at most half of them are still running, so a long tail does not cost the full
batch.

Attention of a decoding row: one partial softmax over its group's prompt KV (the group's rows and GQA's query
heads as rows of one product: the prompt KV is read once per group) and one over its own completion KV (masked
beyond the current position), merged through their log-sum-exps, in fp32. Eager on a CPU, a step whose layers
are Llama-style (RMSNorm, SiLU MLP, no q / k norms; fp32 or bf16) runs between its linears in the C++ kernels
of `cpu_decode` (norm and residual add, RoPE + KV write + one softmax over prompt and own keys, SiLU * up):
four calls a layer in place of ~30 PyTorch operators.

Draws: inverse CDF of softmax(logits / T) after the repetition penalty, top-k and top-p, with one uniform per
row and token made up front from the caller's generator, so the step itself holds no RNG state (CUDA graphs
replay it). The penalty reads a (rows, vocabulary) mask of each row's context, updated in place per token.
"""

import time
import weakref
from concurrent import futures
from dataclasses import dataclass

import torch

from ..models.model_parts import causal_lm, position_ids_from_mask
from . import cpu_decode
from .dtypes import HEAD_FORMATS, Packed, check_rollout_dtype, fused_linear, packable
from .graphs import PROMPT_STEP, Static, select_rows
from .sampling import draw, eos_and_pad, is_eos, mark_seen, seen_tokens

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3", "mistral")
SYNC_EVERY = 16  # tokens between host checks of "all done" (and compaction) on CUDA
SYNC_EVERY_CPU = 1  # eager on the CPU a check waits for nothing: stop as soon as every row is done
COMPACT_AT = 0.5  # compact when the rows still running fill at most this share of the batch
DYNAMIC = True
CAPACITY_STEP = 64  # completion KV capacity is rounded up to this, so that nearby lengths reuse a compile
PACK_CPU_WEIGHTS = True


def packs_fp32_weights(device_type: str, dtype, compiled: bool) -> bool:
    """Whether a call at the policy's own precision copies its weights (fp32, packed for the CPU's linears):
    eager on a CPU only (Inductor's step and CUDA read the modules). The memory planner asks the same."""
    return (
        PACK_CPU_WEIGHTS and device_type == "cpu" and dtype == torch.float32
        and torch.backends.mkldnn.is_available() and not compiled
    )  # fmt: skip


def kv_capacity(max_new_tokens: int) -> int:
    """Completion KV slots a row of a call gets: C rounded up to CAPACITY_STEP (C - 1 tokens are fed after
    the first, and rows that finished keep writing one scratch slot past their last)."""
    return max(1, -(-max_new_tokens // CAPACITY_STEP) * CAPACITY_STEP)


def kv_dtype(rollout_dtype: str, model_dtype):
    """The dtype of a call's KV cache, as `check_rollout_dtype` resolves `rollout_dtype`: a bf16 rollout
    keeps its keys and values in bf16, as a bf16 policy (and vLLM, and HF's generate on a bf16 model) does:
    half the bytes the decode's attention reads, and half the cache; any other keeps the policy's (the
    prefill's). The memory planner and the decode profile's floor ask the same."""
    return torch.bfloat16 if rollout_dtype == "bf16" else model_dtype


def unsupported_reason(model) -> str | None:
    """Why the native engine cannot run `model`, or None when it can."""
    from torch.distributed.tensor import DTensor

    lm = causal_lm(model)
    cfg = getattr(lm, "config", None)
    if cfg is None:
        return f"{type(model).__name__} is not a transformers causal LM"
    if cfg.model_type not in SUPPORTED_TYPES:
        return f"model type {cfg.model_type!r} is not one of {', '.join(SUPPORTED_TYPES)}"
    base = getattr(lm, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if base is None or not hasattr(base, name):
            return f"{cfg.model_type} model without `{name}`"
    if any(isinstance(p, DTensor) for p in lm.parameters()):
        return "sharded (FSDP) parameters"
    window = getattr(cfg, "sliding_window", None)
    if window and (cfg.model_type == "mistral" or getattr(cfg, "use_sliding_window", False)):
        return f"sliding-window attention (window {window})"
    if getattr(cfg, "layer_types", None) and any(t != "full_attention" for t in cfg.layer_types):
        return "layers other than full attention"
    return None


@dataclass
class _Buffers:
    """One call's decode state: every tensor the step reads or writes, at fixed addresses."""

    prompt_k: list  # per layer (n, kvh, P, d): the prompts' KV, one copy per group
    prompt_v: list
    prompt_bias: torch.Tensor  # (n, 1, 1, P) 0 or -inf (left padding), fp32
    comp_k: list  # per layer (R, kvh, Cap, d): each row's completion KV
    comp_v: list
    plen: torch.Tensor  # (R,) real prompt tokens: the RoPE position of completion token j is plen + j
    out: torch.Tensor  # (R, C) sampled tokens
    logp: torch.Tensor  # (R, C) fp32 log-probs of the sampled tokens under softmax(logits / T)
    done: torch.Tensor  # (R,) bool: not decoding (ended, at the length limit, or waiting for a tool)
    lengths: torch.Tensor  # (R,) long
    t: torch.Tensor  # (R,) long: each row's completion position being fed (a done row stays put)
    noise: torch.Tensor  # (C + 1, R) uniforms for the draws
    # multi-turn bookkeeping (host side, never read by the step): waiting for a tool / over for good
    parked: torch.Tensor  # (R,) bool
    final: torch.Tensor  # (R,) bool
    # the keys again, in blocks of 64 transposed (.., slots / 64, d, 64), for the CPU decode kernels
    # (`_block_keys`)
    prompt_kt: list | None = None
    comp_kt: list | None = None
    # under a repetition penalty (R, V) bool: the tokens of each row's context so far (prompt, its own turns)
    seen: torch.Tensor | None = None


def _norm(mod):
    """An HF RMSNorm as one `F.rms_norm` call (the module's own math in fp32), any other norm as itself."""
    eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
    if type(mod).__name__.endswith("RMSNorm") and eps is not None and mod.weight.dtype == torch.float32:
        return lambda x: torch.nn.functional.rms_norm(x, (x.shape[-1],), mod.weight, eps)
    return mod


@dataclass
class _Layer:
    """One decoder layer as the step calls it."""

    norm1: object
    qkv: object  # h -> (R, (heads + 2 kv heads) * d)
    q_norm: object
    k_norm: object
    o: object
    norm2: object
    gate_up: object  # h -> (R, 2 * intermediate), or None: `mlp` runs as a module
    act: object
    down: object
    mlp: object
    # for the CPU decode kernels (cpu_decode): the RMSNorms' (weight, eps) and the dtype the linears take,
    # or None where the layer is not theirs (another norm or activation, q / k norms, fp16)
    kernel_args: tuple | None = None


_LINEARS = ("qkv", "o", "gate_up", "down")  # the _Layer fields a rollout format copies

# the dtype each linear format takes its input in (None: the modules themselves, in the policy's dtype)
_INPUT_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.float32, "fp8": torch.float32}
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _rms(mod):
    """(weight, eps) of an HF RMSNorm the kernels can run, else None."""
    eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
    w = getattr(mod, "weight", None)
    if (
        not type(mod).__name__.endswith("RMSNorm")
        or eps is None
        or w is None
        or w.dtype not in _KERNEL_DTYPES
    ):
        return None
    return w.detach(), float(eps)


def _kernel_args(layer, fmt, f_attn, f_mlp):
    """(norm1, norm2, linears' input dtype) of a layer for the CPU decode kernels, or None."""
    a, m = layer.self_attn, layer.mlp
    dtype = _INPUT_DTYPE.get(f_attn) if f_attn else a.q_proj.weight.dtype
    act = getattr(m, "act_fn", None)
    n1, n2 = _rms(layer.input_layernorm), _rms(layer.post_attention_layernorm)
    if (
        hasattr(a, "q_norm") or f_attn != f_mlp or dtype not in _KERNEL_DTYPES or n1 is None or n2 is None
        or type(act).__name__ not in ("SiLU", "SiLUActivation") or not hasattr(m, "gate_proj")
    ):  # fmt: skip
        return None
    return n1, n2, dtype


def _layer(layer, fmt, rows: int, old: "_Layer | None" = None) -> _Layer:
    """A decoder layer as the step calls it; `fmt` a LINEAR_FORMATS key or None (the modules); `old`: this
    layer from an earlier call in the same format, whose weight copies are rewritten in place and reused."""
    a, m = layer.self_attn, layer.mlp
    attn = [a.q_proj, a.k_proj, a.v_proj, a.o_proj]
    f_attn = fmt if fmt and all(packable(x, fmt) for x in attn) else None
    mlp_ok = all(hasattr(m, x) for x in ("gate_proj", "up_proj", "down_proj", "act_fn"))
    mlp = [m.gate_proj, m.up_proj, m.down_proj] if mlp_ok else []
    f_mlp = fmt if fmt and mlp_ok and all(packable(x, fmt) for x in mlp) else None
    gate_up = down = None
    if mlp_ok:
        gate_up = fused_linear([m.gate_proj, m.up_proj], f_mlp, rows, into=getattr(old, "gate_up", None))
        down = fused_linear([m.down_proj], f_mlp, rows, into=getattr(old, "down", None))
    return _Layer(
        norm1=_norm(layer.input_layernorm),
        qkv=fused_linear([a.q_proj, a.k_proj, a.v_proj], f_attn, rows, into=getattr(old, "qkv", None)),
        q_norm=_norm(a.q_norm) if hasattr(a, "q_norm") else None,
        k_norm=_norm(a.k_norm) if hasattr(a, "k_norm") else None,
        o=fused_linear([a.o_proj], f_attn, rows, into=getattr(old, "o", None)),
        norm2=_norm(layer.post_attention_layernorm),
        gate_up=gate_up,
        act=m.act_fn if mlp_ok else None,
        down=down,
        mlp=m,
        kernel_args=_kernel_args(layer, fmt, f_attn, f_mlp) if mlp_ok else None,
    )


def _linears(weights) -> list:
    """Every linear of (layers, head), in order: a Packed copy or what runs as the module."""
    layers, head = weights
    return [getattr(ly, f) for ly in layers for f in _LINEARS] + [head]


def _packed_for(weights, rows: int) -> bool:
    """Whether kept weight copies (layers, head) serve a call of `rows` rows: none was packed for another
    row count (oneDNN's reorder is; cpu_decode's packing and the 8-bit formats are not)."""
    return all(c.rows in (None, rows) for c in _linears(weights) if isinstance(c, Packed))


def _same_copies(old, new) -> bool:
    """Whether `new` (layers, head) runs on `old`'s weight copies: each of its Packed is old's own (rewritten
    in place), and nothing old ran as a copy runs as a module now, or the other way round."""
    pairs = zip(_linears(old), _linears(new), strict=True)
    return all(a is b if isinstance(a, Packed) else not isinstance(b, Packed) for a, b in pairs)


@dataclass
class _Kernels:
    """cpu_decode's module for a generate call, and `_stack_args` of its layers (None: layer by layer)."""

    mod: object
    stack: tuple | None


def _kernel_kv(b: _Buffers, i: int) -> tuple:
    """Layer i's KV as cpu_decode's rope_attend takes it."""
    return b.comp_k[i], b.comp_kt[i], b.comp_v[i], b.prompt_kt[i], b.prompt_v[i]


def _stack_args(layers, final_rms):
    """cpu_decode.decode_layers' weight arguments for `layers` (norm weights, their eps, packed linears, their
    biases and output counts, the linears' input dtype), or None where a linear is not the kernel's (int8 /
    fp8 formats, oneDNN's, a module) or the layers take different dtypes: the step then calls the kernels
    layer by layer from Python."""
    lins = [getattr(ly, name) for ly in layers for name in _LINEARS]
    if not all(isinstance(f, Packed) and f.outputs is not None for f in lins):
        return None
    if len({ly.kernel_args[2] for ly in layers}) != 1:
        return None
    norms = [nw for ly in layers for nw in ly.kernel_args[:2]] + [final_rms]
    return (
        [w for w, _ in norms], [eps for _, eps in norms], [f.tensors[0] for f in lins],
        [f.tensors[1] for f in lins], [f.outputs for f in lins], layers[0].kernel_args[2],
    )  # fmt: skip


def _block_keys(b: _Buffers) -> None:
    """The prompts' keys again, in blocks of 64 transposed (`cpu_decode.blocked_keys`), for the CPU decode
    kernels: made, or written into those a `graphs.Static` keeps. The completion keys' twins start empty
    (zeros, as `_refill` leaves them on a kept Static); the step writes both."""
    pkt = [cpu_decode.blocked_keys(k) for k in b.prompt_k]
    if b.prompt_kt is None:
        b.prompt_kt = pkt
        b.comp_kt = [cpu_decode.blocked_zeros(k) for k in b.comp_k]
        return
    for dst, src in zip(b.prompt_kt, pkt):
        dst.copy_(src)


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _merge_attention(q, pk, pv, ck, cv, prompt_bias, own_bias, scaling):
    """q (R, h, d) over its group's prompt KV (n, kvh, P, d) and its own completion KV (R, kvh, Cap, d): one
    softmax over both. `prompt_bias` (n, 1, 1, P) and `own_bias` (R, 1, 1, Cap) hold 0 / -inf (padding,
    unwritten slots) in the KV's dtype. Queries of another dtype (fp32 activations over a bf16 rollout's bf16
    KV) are cast to it; the output is in the queries' dtype. On a CPU: one flash-attention call each (the
    group's G rows x rep heads as the rows of the prompt's, so its KV is read once per group) merged by their
    log-sum-exps (fp32): 1.7x faster than the products below at SmolLM2's decode shapes in bf16, 1.2x in
    fp32, where ~15 small ops cost more than their arithmetic."""
    if q.device.type != "cpu":
        return _merge_attention_products(q, pk, pv, ck, cv, prompt_bias, own_bias, scaling)
    out_dtype, q = q.dtype, q.to(pk.dtype)
    R, h, d = q.shape
    n, kvh = pk.shape[0], pk.shape[1]
    G, rep = R // n, h // kvh
    qg = q.view(n, G, kvh, rep, d).transpose(1, 2).reshape(n, kvh, G * rep, d)
    o_p, lse_p = _cpu_flash(qg, pk, pv, attn_mask=prompt_bias, scale=scaling)
    o_o, lse_o = _cpu_flash(q.view(R, kvh, rep, d), ck, cv, attn_mask=own_bias, scale=scaling)
    o_p = o_p.view(n, kvh, G, rep, d).transpose(1, 2).reshape(R, kvh, rep, d)
    lse_p = lse_p.view(n, kvh, G, rep).transpose(1, 2).reshape(R, kvh, rep, 1)
    w = torch.sigmoid(lse_p - lse_o.unsqueeze(-1))  # the prompt's share of the merged softmax's mass
    return torch.lerp(o_o.float(), o_p.float(), w).to(out_dtype).reshape(R, h * d)


def _merge_attention_products(q, pk, pv, ck, cv, prompt_bias, own_bias, scaling):
    """`_merge_attention` as batched products and one fp32 softmax over the concatenated scores (any
    device)."""
    out_dtype, q = q.dtype, q.to(pk.dtype)
    R, h, d = q.shape
    n, kvh, P = pk.shape[0], pk.shape[1], pk.shape[2]
    G, rep, cap = R // n, h // kvh, ck.shape[2]
    q = q * scaling
    qg = q.view(n, G, kvh, rep, d).permute(0, 2, 1, 3, 4).reshape(n, kvh, G * rep, d)
    s_p = torch.matmul(qg, pk.transpose(-1, -2)).view(n, kvh, G, rep, P).permute(0, 2, 1, 3, 4)
    q5 = q.view(n, G, kvh, rep, d)
    s_o = torch.matmul(q5, ck.view(n, G, kvh, cap, d).transpose(-1, -2))
    bias = torch.cat(
        [prompt_bias.view(n, 1, 1, 1, P).expand(n, G, 1, 1, P), own_bias.view(n, G, 1, 1, cap)], dim=-1
    )
    p = torch.softmax(torch.cat([s_p, s_o], dim=-1).float() + bias.float(), dim=-1).to(pv.dtype)
    p_p = p[..., :P].permute(0, 2, 1, 3, 4).reshape(n, kvh, G * rep, P)
    o = torch.matmul(p_p, pv).view(n, kvh, G, rep, d).permute(0, 2, 1, 3, 4)
    o = o + torch.matmul(p[..., P:], cv.view(n, G, kvh, cap, d))
    return o.reshape(R, h * d).to(out_dtype)


_cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # (out, log-sum-exp)


COMPILE_MODES = ("auto", "graphs", True, False)


class NativeEngine:
    """One per model; `generate` is `generate_groups`' contract. `compile`: "auto" (CUDA graphs on CUDA, eager
    on a CPU, where the packed eager step through cpu_decode's kernels is the fastest: Inductor took minutes
    to compile a 30-layer step for ~25% less time per token than the unpacked eager step), "graphs" (the
    step at fixed addresses on padded batch buckets, `graphs.Static`: replayed as CUDA graphs on CUDA; on a
    CPU the same buckets run eagerly, with that reason in `stats`), True (Inductor, `torch.compile`: on an
    H200 the first compiled call of a 24-layer 0.5B model had not returned after 170 s, bench/results/h200;
    eager with a one-line reason if compiling fails), or False (eager)."""

    def __init__(self, model):
        lm = causal_lm(model)
        # the model held weakly: _ENGINES is keyed by it, and an engine holding it would keep it (and the
        # engine's buffers and weight copies) alive after its last user let go
        self._lm = weakref.ref(lm)
        attn = self.base.layers[0].self_attn
        self.n_heads = lm.config.num_attention_heads
        self.n_kv = lm.config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.final_norm = _norm(self.base.norm)
        self.final_rms = _rms(self.base.norm)
        self.compile_mode = "auto"  # of the call in progress
        self.rollout_dtype = "model"  # of the call in progress
        self._compiled = None
        self._module_weights = None
        # (key, weights): a CPU call's weight copies, rewritten in place by the next call with that key
        self._kept = None
        self._static = None  # graphs.Static of the last call shape run on buckets
        self._kernel_steps = 0  # of the call in progress: steps through cpu_decode's kernels
        self.stats = {
            "compile_s": 0.0, "compiled": False, "eager_reason": None, "calls": 0,
            "capture_s": 0.0, "graphs": 0, "graph_reason": None,
        }  # fmt: skip
        # the last call's phases in host seconds (prefill: the model's forward over the prompts; pack: the
        # weights copied into the step's format; decode: the token steps), for profiles against the floor
        self.last_call: dict = {}

    @property
    def lm(self):
        return self._lm()

    @property
    def base(self):
        return self._lm().model

    # ---------------------------------------------------------------------------------------------------
    # The decode step: one token per row, every shape fixed by the buffers
    # ---------------------------------------------------------------------------------------------------
    def _decoder(self, x, cos, sin, layers, attend):
        """The decoder layers on rows x (N, H) at RoPE (cos, sin); `attend(i, q, k, v)` stores layer i's keys
        and values and returns the attention output (N, heads * d)."""
        N = x.shape[0]
        nh, kvh, d = self.n_heads, self.n_kv, self.head_dim
        for i, ly in enumerate(layers):
            qkv = ly.qkv(ly.norm1(x)).to(x.dtype)  # RoPE and the KV cache in the activations' dtype
            qk = qkv[:, : (nh + kvh) * d].view(N, nh + kvh, d)
            v = qkv[:, (nh + kvh) * d :].view(N, kvh, d)
            if ly.q_norm is not None:
                qk = torch.cat([ly.q_norm(qk[:, :nh]), ly.k_norm(qk[:, nh:])], dim=1)
            qk = _rope(qk, cos, sin)  # queries and keys rotated together
            x = x + ly.o(attend(i, qk[:, :nh], qk[:, nh:], v))  # a 16-bit output is promoted by the add
            h = ly.norm2(x)
            if ly.gate_up is None:
                x = x + ly.mlp(h)
            else:
                g, u = ly.gate_up(h).chunk(2, dim=-1)  # in the linears' dtype up to `down`
                x = x + ly.down(ly.act(g) * u)
        return x

    def _decoder_kernels(self, x, cos, sin, layers, b: _Buffers, kern):
        """`_decoder` for one token per row through the CPU decode kernels (cpu_decode): per layer four
        linears and four kernel calls, all layers in one call (decode_layers) where every linear is the
        kernel's; x (the residual stream) is updated in place."""
        R, n = x.shape[0], b.prompt_bias.shape[0]
        cos, sin = cos.reshape(R, -1).float(), sin.reshape(R, -1).float()
        valid = (b.prompt_bias.view(n, -1) == 0).to(torch.uint8)
        if kern.stack is not None:  # all layers in one call: no return to Python between kernels
            norms, eps, packed, bias, outs, dtype = kern.stack
            kv = [t for i in range(len(layers)) for t in _kernel_kv(b, i)]
            return kern.mod.decode_layers(
                x, cos, sin, valid, b.t, norms, eps, packed, bias, outs, kv, self.n_heads, self.scaling, dtype
            )
        mod = kern.mod
        delta = None  # the last linear's output, added to x by the next norm
        for i, ly in enumerate(layers):
            (w1, eps1), (w2, eps2), dtype = ly.kernel_args
            h = mod.add_rms_norm(x, delta, w1, eps1, dtype)
            a = mod.rope_attend(
                ly.qkv(h), cos, sin, *_kernel_kv(b, i), valid, b.t, self.n_heads, self.scaling, dtype
            )
            h = mod.add_rms_norm(x, ly.o(a), w2, eps2, dtype)
            delta = ly.down(mod.silu_mul(ly.gate_up(h)))
        w, eps = self.final_rms
        return mod.add_rms_norm(x, delta, w, eps, x.dtype)

    def _kernels_for(self, layers, b: _Buffers, device):
        """The CPU decode kernels (a `_Kernels`) where this step can run on them, else None."""
        if not self._eager_cpu(device) or self.final_rms is None or b.comp_k[0].dtype not in _KERNEL_DTYPES:
            return None
        if any(ly.kernel_args is None for ly in layers) or self.head_dim % 2:
            return None
        mod = cpu_decode.active()
        return None if mod is None else _Kernels(mod, _stack_args(layers, self.final_rms))

    def _step(
        self,
        b: _Buffers,
        layers,
        head,
        kern,
        eos,
        pad: int,
        temperature: float,
        top_k: int,
        top_p: float,
        min_p: float,
        penalty: float,
    ):
        R, cap = b.out.shape[0], b.comp_k[0].shape[2]
        kvh, d = self.n_kv, self.head_dim
        t = b.t
        tok = b.out.gather(1, t[:, None]).squeeze(1)
        x = self.base.embed_tokens(tok)  # (R, H)
        cos, sin = self.base.rotary_emb(x[:, None, :], (b.plen + t).unsqueeze(1))  # (R, 1, d)
        if kern is not None:
            self._kernel_steps += 1
            logits = head(self._decoder_kernels(x.contiguous(), cos, sin, layers, b, kern))
            return self._draw_and_book(b, logits, eos, pad, temperature, top_k, top_p, min_p, penalty, kern)
        # the completion slots attended: eager on a CPU only those written so far (a host read costs nothing
        # there; SmolLM2's own-KV attention over a 256-slot capacity, fp32: 298 -> 82 us at 64 slots written,
        # 344 -> 240 us at 256); a compiled or GPU step keeps the full capacity, its shapes fixed
        hi = int(t.max()) + 1 if self._eager_cpu(x.device) else cap
        own = torch.arange(hi, device=x.device)[None, :] <= t[:, None]
        kv_type = b.comp_k[0].dtype  # a bf16 rollout's bf16: the fp32 activations are cast to it
        own_bias = torch.where(own, 0.0, float("-inf")).to(kv_type).view(R, 1, 1, hi)
        prompt_bias = b.prompt_bias.to(kv_type)
        # where each row's new key / value goes in a layer's (R, kvh, Cap, d) buffer, as rows of its (-1, d)
        # view: an index copy of R * kvh rows (a scatter_ along Cap ran 7x slower in bf16 at decode shapes)
        slot = ((torch.arange(R, device=t.device) * kvh)[:, None] + torch.arange(kvh, device=t.device)) * cap
        slot = (slot + t[:, None]).view(-1)

        def attend(i, q, k, v):
            b.comp_k[i].view(-1, d).index_copy_(0, slot, k.reshape(-1, d).to(kv_type))
            b.comp_v[i].view(-1, d).index_copy_(0, slot, v.reshape(-1, d).to(kv_type))
            ck, cv = b.comp_k[i], b.comp_v[i]
            if hi < cap:
                ck, cv = ck[:, :, :hi], cv[:, :, :hi]
            pk, pv = b.prompt_k[i], b.prompt_v[i]
            return _merge_attention(q, pk, pv, ck, cv, prompt_bias, own_bias, self.scaling)

        logits = head(self.final_norm(self._decoder(x, cos, sin, layers, attend)))
        return self._draw_and_book(b, logits, eos, pad, temperature, top_k, top_p, min_p, penalty)

    def _draw_and_book(
        self, b: _Buffers, logits, eos, pad, temperature, top_k, top_p, min_p, penalty, kern=None
    ):
        t, C = b.t, b.out.shape[1] - 1
        u = b.noise.gather(0, (t + 1)[None, :]).squeeze(0)
        if kern is not None and temperature > 0 and not top_k and top_p >= 1 and not min_p:  # one-pass draw
            nxt, logp = kern.mod.draw(logits.float(), u, float(temperature), b.seen, penalty)
        else:
            nxt, logp = draw(logits, u, temperature, top_k, top_p, min_p, b.seen, penalty)
        # bookkeeping on the device: rows already done emit padding (into the scratch column past their end),
        # stop counting and stay at their position
        if b.seen is not None:
            mark_seen(b.seen, nxt, ~b.done)
        nxt = torch.where(b.done, pad, nxt)
        b.out.scatter_(1, (t + 1)[:, None], nxt.unsqueeze(1))
        b.logp.scatter_(1, (t + 1)[:, None], torch.where(b.done, 0.0, logp).unsqueeze(1))
        running = (~b.done).long()
        b.lengths.add_(running)
        t.add_(running)
        # (== and any, not torch.isin: with many ids isin sorts, reading back on the host: no CUDA graph)
        b.done.logical_or_(is_eos(nxt, eos) | (b.lengths >= C))

    def _extend(self, b: _Buffers, r: int, tokens, layers):
        """Append `tokens` (a tool's turn) to buffer row r, whose last token is the EOS ending its turn:
        the EOS and all of them but the last are run through the layers at once onto the row's own KV
        (its prompt KV shared with its group, its completion KV so far: nothing is prefilled again); the last
        is fed by the next decode step, which draws the model's next token. The row decodes on."""
        e, L = int(b.lengths[r]) - 1, len(tokens)
        b.out[r, e + 1 : e + 1 + L] = torch.tensor(tokens, dtype=b.out.dtype, device=b.out.device)
        if b.seen is not None:  # the tool's tokens are context the penalty reads, as in a resubmitted prompt
            b.seen[r, b.out[r, e + 1 : e + 1 + L]] = True
        b.logp[r, e + 1 : e + 1 + L] = 0.0
        n = b.prompt_bias.shape[0]
        g, cap, kvh, d = r // (b.out.shape[0] // n), b.comp_k[0].shape[2], self.n_kv, self.head_dim
        slots = torch.arange(e, e + L, device=b.out.device)
        x = self.base.embed_tokens(b.out[r, e : e + L])  # (L, H)
        cos, sin = self.base.rotary_emb(x[:, None, :], (b.plen[r] + slots)[:, None])
        dtype = b.comp_k[0].dtype
        own = torch.arange(cap, device=x.device)[None, :] <= slots[:, None]
        own_bias = torch.where(own, 0.0, float("-inf")).to(dtype).view(L, 1, 1, cap)
        prompt_bias = b.prompt_bias[g : g + 1].to(dtype)

        def attend(i, q, k, v):
            b.comp_k[i][r, :, e : e + L] = k.transpose(0, 1)
            b.comp_v[i][r, :, e : e + L] = v.transpose(0, 1)
            if b.comp_kt is not None:
                cpu_decode.write_blocked_keys(b.comp_kt[i][r], slots, k.to(dtype))
            ck, cv = (c[i][r : r + 1].expand(L, kvh, cap, d) for c in (b.comp_k, b.comp_v))
            pk, pv = b.prompt_k[i][g : g + 1], b.prompt_v[i][g : g + 1]
            return _merge_attention(q, pk, pv, ck, cv, prompt_bias, own_bias, self.scaling)

        self._decoder(x, cos, sin, layers, attend)
        b.t[r] = e + L
        b.lengths[r] = e + L + 1
        b.done[r] = False

    def _eager_cpu(self, device) -> bool:
        return device.type == "cpu" and not self.compiles(device)

    def compiles(self, device) -> bool:
        """Whether the call in progress runs the Inductor-compiled step."""
        return self.compile_mode is True and not self.stats["eager_reason"]

    def on_buckets(self, device) -> bool:
        """Whether the call in progress runs the bucketed fixed-address step (`graphs`): CUDA graphs."""
        mode = self.compile_mode
        return mode == "graphs" or (mode == "auto" and device.type == "cuda")

    def _weights(self, rows, device, dtype, static=None):
        """The layers and LM head as the step calls them: copied for this call into the rollout dtype's format
        (the optimizer has moved the weights since the last call; fp32 packed on a CPU, or a low-precision
        copy), or the modules themselves (built once, so that a compiled step keeps seeing the same
        functions). The copies are kept between calls on buckets (`static`, a graphs.Static: a captured graph
        reads them where they are) and on a CPU (`_kept`: an allocation of the whole copy, its pages faulted
        in afresh, cost more than the packing), and then rewritten in place one matrix at a time, never two
        whole copies; elsewhere (eager CUDA) a call's copy is freed with the call."""
        fmt = self.rollout_dtype
        if fmt == "model":
            pack = packs_fp32_weights(device.type, dtype, self.compiles(device))
            fmt = "fp32" if pack else None  # (on buckets on a CPU too: they copy the packed weights in place)
        if fmt is None:
            self._kept = None
            if self._module_weights is None:
                self._module_weights = ([_layer(x, None, rows) for x in self.base.layers], self.lm.lm_head)
            return self._module_weights
        lm_head = self.lm.lm_head
        head_fmt = HEAD_FORMATS[fmt] if packable(lm_head, HEAD_FORMATS[fmt]) else None
        key = (fmt, device, cpu_decode.active() is not None)  # the kernels switched: other linears
        if static is not None:
            old, self._kept = static.weights, None  # the Static's copies are the ones kept
        else:
            kept, self._kept = self._kept, None
            old = kept[1] if kept and kept[0] == key and _packed_for(kept[1], rows) else None
            del kept  # a copy that does not serve this call is freed before the new one is made
        # kept copies are ordinary tensors even when a call runs under inference mode: the next call, in or
        # out of it, rewrites them in place
        with torch.inference_mode(False):
            layers = [
                _layer(x, fmt, rows, old[0][i] if old else None) for i, x in enumerate(self.base.layers)
            ]
            weights = layers, fused_linear([lm_head], head_fmt, rows, into=old[1] if old else None)
        if static is not None:
            if old is not None and not _same_copies(old, weights):  # a linear changed format (LoRA added)
                static.graphs.clear()  # captured on copies this call no longer uses: recaptured
                old = None
            static.weights = old or weights  # its own _Layer objects: the ones its graphs were captured on
            return static.weights
        if device.type == "cpu":
            self._kept = key, weights
        return weights

    def _run_step(self, b, *args):
        if not self.compiles(b.out.device):
            return self._step(b, *args)
        if self._compiled is None:
            mode = "reduce-overhead" if b.out.is_cuda else None
            self._compiled = torch.compile(self._step, mode=mode, fullgraph=True, dynamic=DYNAMIC)
        t0 = time.perf_counter()
        try:
            self._compiled(b, *args)
        except Exception as exc:  # noqa: BLE001 - compiling is an optimization: say why, then run eager
            if self.compile_mode is True:
                raise
            reason = (
                f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}" if str(exc) else type(exc).__name__
            )
            self.stats["eager_reason"] = reason
            print(f"grpo-fast native rollout: decode step not compiled, running eager ({reason})", flush=True)
            return self._step(b, *args)
        if not self.stats["compiled"]:
            self.stats["compiled"] = True
            self.stats["compile_s"] += time.perf_counter() - t0

    # ---------------------------------------------------------------------------------------------------
    # One call
    # ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self, prompt_ids, prompt_mask, G, max_new_tokens, *, temperature, top_p, top_k, eos_token_id,
        share_prefix, generator, all_done, return_logprobs, compile="auto", rollout_dtype="model",
        turn_hook=None, min_p=0.0, repetition_penalty=1.0,
    ):  # fmt: skip
        """`generate_groups`' contract; `turn_hook` (grpo_fast.rollout.trajectories) makes the rows
        multi-turn: when row s ends a turn at EOS, `turn_hook.start(s, tokens)` (its tokens so far) returns
        None (the row is over) or a concurrent Future; the row waits, the others decode on; once the future is
        done, `turn_hook.finish(s, future)` returns the tokens to append (the tool's turn; None: over) and the
        row goes on from its own KV cache. `max_new_tokens` bounds the whole row, tool turns included."""
        if compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {compile!r}")
        self.rollout_dtype = check_rollout_dtype(rollout_dtype, prompt_ids.device, self.lm.dtype)
        self.compile_mode = compile if self.rollout_dtype == "model" or compile is not True else False
        n = prompt_ids.shape[0]
        if not share_prefix:  # one prompt copy per sample: groups of one
            prompt_ids = prompt_ids.repeat_interleave(G, 0)
            prompt_mask = prompt_mask.repeat_interleave(G, 0)
            n, G = n * G, 1
        device = prompt_ids.device
        R, C = n * G, max_new_tokens
        eos, pad = eos_and_pad(eos_token_id)
        eos_t = torch.tensor(eos, dtype=torch.long, device=device)
        t_start = time.perf_counter()
        # 1. prefill: the model's own forward, once per prompt (per sample when not shared)
        pos = position_ids_from_mask(prompt_mask)
        res = self.lm(
            input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=pos, use_cache=True,
            logits_to_keep=1,
        )  # fmt: skip
        from ..models.hf_compat import cache_of

        cache = cache_of(res)
        # (values come transposed from the projection); in the rollout's KV dtype (kv_dtype)
        model_dtype = cache.layers[0].keys.dtype
        kv_type = kv_dtype(self.rollout_dtype, model_dtype)
        pk = [layer.keys.to(kv_type).contiguous() for layer in cache.layers]
        pv = [layer.values.to(kv_type).contiguous() for layer in cache.layers]
        # 2. buffers (a row's tokens, and its KV slots, up to C; one scratch column past them): this call's
        # own, or on buckets the Static of this call shape's, refilled in place
        cap = kv_capacity(C)
        noise = torch.rand(C + 1, R, generator=generator, device=device) if temperature > 0 else None
        penalty = float(repetition_penalty)
        seen = None
        if penalty != 1.0:  # each row's context so far: its prompt
            seen = seen_tokens(prompt_ids, prompt_mask, res.logits.shape[-1]).repeat_interleave(G, 0)
        fill = dict(
            pk=pk, pv=pv, bias=torch.where(prompt_mask.bool(), 0.0, float("-inf"))[:, None, None, :].float(),
            plen=prompt_mask.long().sum(1).repeat_interleave(G, 0), pad=pad,
            noise=noise if noise is not None else torch.zeros(C + 1, R, device=device), seen=seen,
        )  # fmt: skip
        st, bucket = None, (n, G)
        if self.on_buckets(device):
            key = (n, G, cap, C, pk[0].dtype, device, self.rollout_dtype, float(temperature), top_k, top_p,
                   float(min_p), penalty, tuple(eos))  # fmt: skip
            st = self._static_for(key, fill, cap)
            if st.eos is None:
                st.eos = eos_t
            eos_t = st.eos  # the step reads it: the graphs captured by an earlier call read this one
            b = st.view(n, G)
        else:
            b = _fresh_buffers(fill, cap, self.n_kv, self.head_dim, pk[0].shape[2])
        # 3. the first token, from the prefill's last logits
        first = res.logits[:, -1].repeat_interleave(G, 0)
        tok, lp = draw(first, b.noise[0], temperature, top_k, top_p, min_p, b.seen, penalty)
        if b.seen is not None:
            mark_seen(b.seen, tok, ~b.done)
        b.out[:, 0], b.logp[:, 0] = tok, lp
        b.done |= is_eos(tok, eos_t) | (b.lengths >= C)
        t_prefill = time.perf_counter()
        layers, head = self._weights(R, device, model_dtype, st)
        kern = self._kernels_for(layers, b, device)  # for the whole call
        if kern is not None:
            _block_keys(st.full if st is not None else b)
            b = st.view(n, G) if st is not None else b
        filters = (float(temperature), int(top_k or 0), float(top_p), float(min_p), penalty)
        args = (layers, head, kern, eos_t, pad, *filters)
        t_pack, steps, capture_s = time.perf_counter(), 0, st.capture_s if st is not None else 0.0
        self._kernel_steps = 0
        # 4. decode in windows: no host sync inside one; between them the turns, "all done?" and compaction
        final = _Final(R, C, pad, device)
        rows = torch.arange(R, device=device)  # original row of each buffer row (-1: filler)
        pending = {}  # original row -> its tool's future (turn_hook)
        # eager on a CPU, a check waits for nothing; a compiled step keeps windows: compacting at any token
        # would give it a new batch shape (a recompile) at each
        window = SYNC_EVERY if device.type == "cuda" or self.compiles(device) or st else SYNC_EVERY_CPU
        while True:
            if turn_hook is not None:
                self._turns(b, rows, pending, turn_hook, eos_t, layers)
            running = ~b.done
            local_done = not bool(running.any()) and not pending
            if all_done(local_done) if all_done else local_done:
                break
            if not bool(running.any()):  # every row waits for a tool: wait for the first
                futures.wait(list(pending.values()), return_when=futures.FIRST_COMPLETED)
                continue
            alive = running | b.parked.to(device)
            if int(alive.sum()) <= COMPACT_AT * b.out.shape[0]:
                if st is None:
                    b, rows = _compact(b, rows, final, alive)
                else:
                    bucket, b, rows = st.compact(b, bucket, rows, final, alive)
            for _ in range(window):
                if st is None:
                    self._run_step(b, *args)
                else:
                    st.step(bucket, b, self._step, args)
            steps += window
        final.take(b, rows)
        self.stats["calls"] += 1
        capture_s = st.capture_s - capture_s if st is not None else 0.0
        self.stats["capture_s"] += capture_s
        if capture_s:
            print(
                f"grpo-fast native rollout: CUDA graphs of {len(st.graphs)} batch buckets captured so far "
                f"for this shape ({R} rows, C={C}), {capture_s:.2f} s in this call", flush=True,
            )  # fmt: skip
        self.stats["graphs"] = len(st.graphs) if st is not None else 0
        if st is not None and st.failed:
            self.stats["graph_reason"] = st.failed
        self.last_call = dict(
            prefill_s=t_prefill - t_start, pack_s=t_pack - t_prefill, decode_s=time.perf_counter() - t_pack,
            decode_steps=steps, rows=R, prompt_tokens=int(prompt_mask.sum()), kernel_steps=self._kernel_steps,
            capture_s=capture_s, graphs=self.stats["graphs"], buckets=st is not None,
        )  # fmt: skip
        return final.result(return_logprobs)

    def _static_for(self, key, fill, cap) -> Static:
        """The Static of this call shape, refilled for this call, or a new one (the old one's buffers and
        graphs freed first). On CUDA its prompt slots are rounded up to PROMPT_STEP and a shorter prompt
        reuses it."""
        P = fill["pk"][0].shape[2]
        st = self._static
        if st is None or not st.fits(key, P):
            self._static = st = None  # its memory back before the new one's
            cuda = fill["pk"][0].is_cuda
            p_cap = -(-P // PROMPT_STEP) * PROMPT_STEP if cuda else P
            full = _fresh_buffers(fill, cap, self.n_kv, self.head_dim, p_cap)
            st = Static(key, full, *key[:2], p_cap, strict=self.compile_mode == "graphs")
            self._static = st
            if not cuda and not self.stats["graph_reason"]:
                self.stats["graph_reason"] = "no CUDA device: the bucketed step runs eagerly, no graphs"
                print(f"grpo-fast native rollout: {self.stats['graph_reason']}", flush=True)
            return st
        _refill(st.full, fill)
        return st

    def _turns(self, b: _Buffers, rows, pending, hook, eos, layers):
        """Rows that just ended a turn go to the hook (parked while their tool runs); rows whose tool has
        answered get its turn appended and decode on."""
        C = b.out.shape[1] - 1
        ended = (b.done.cpu() & ~b.parked & ~b.final).nonzero().squeeze(1).tolist()
        for r in ended:
            s, n = int(rows[r]), int(b.lengths[r])
            fut = None
            if s >= 0 and n < C and bool(is_eos(b.out[r, n - 1], eos)):
                fut = hook.start(s, b.out[r, :n].tolist())
            if fut is None:
                b.final[r] = True
            else:
                b.parked[r] = True
                pending[s] = fut
        for s in [s for s, f in pending.items() if f.done()]:
            r = int((rows == s).nonzero()[0])
            tokens = hook.finish(s, pending.pop(s))
            b.parked[r] = False
            if tokens and int(b.lengths[r]) + len(tokens) < C:
                self._extend(b, r, tokens, layers)
            else:
                b.final[r] = True


def _fresh_buffers(fill, cap, kvh, d, p_cap) -> _Buffers:
    """A call's buffers: the prompts' KV (padded to `p_cap` slots, masked), completion KV of `cap` slots,
    allocated here and filled by `_refill` (the prompts' KV and uniforms are fill's own where they fit)."""
    pk, pv, noise = fill["pk"], fill["pv"], fill["noise"]
    n, P, R, C1 = pk[0].shape[0], pk[0].shape[2], noise.shape[1], noise.shape[0]
    device, dtype = pk[0].device, pk[0].dtype
    empty = lambda *shape, dtype=dtype: torch.empty(*shape, device=device, dtype=dtype)  # noqa: E731
    prompt = lambda kv: kv if p_cap == P else [empty(n, kvh, p_cap, d) for _ in kv]  # noqa: E731
    return _refill(
        _Buffers(
            prompt_k=prompt(pk), prompt_v=prompt(pv), prompt_bias=empty(n, 1, 1, p_cap, dtype=torch.float32),
            comp_k=[empty(R, kvh, cap, d) for _ in pk], comp_v=[empty(R, kvh, cap, d) for _ in pk],
            plen=empty(R, dtype=torch.long), out=empty(R, C1, dtype=torch.long),
            logp=empty(R, C1, dtype=torch.float32), done=empty(R, dtype=torch.bool),
            t=empty(R, dtype=torch.long), lengths=empty(R, dtype=torch.long), noise=noise,
            parked=torch.empty(R, dtype=torch.bool), final=torch.empty(R, dtype=torch.bool),
            seen=None if fill["seen"] is None else empty(*fill["seen"].shape, dtype=torch.bool),
        ),
        fill,
    )  # fmt: skip


def _refill(b: _Buffers, fill) -> _Buffers:
    """A call's starting values written into buffers `b` (new ones, or those a `graphs.Static` keeps): the
    prompts' KV (the slots past the prompt zeroed and masked), no completion yet (its KV zeroed: masked, but
    read by the attention, where garbage could be NaN). A tensor that is fill's own is left as it is."""
    P = fill["pk"][0].shape[2]
    for dst, src in zip([*b.prompt_k, *b.prompt_v], [*fill["pk"], *fill["pv"]]):
        if dst is not src:
            dst[:, :, :P].copy_(src)
            dst[:, :, P:].zero_()
    b.prompt_bias.fill_(float("-inf"))
    b.prompt_bias[..., :P].copy_(fill["bias"])
    for x in [*b.comp_k, *b.comp_v, *(b.comp_kt or []), b.logp, b.done, b.t, b.parked, b.final]:
        x.zero_()
    b.plen.copy_(fill["plen"])
    b.out.fill_(fill["pad"])
    b.lengths.fill_(1)
    if b.noise is not fill["noise"]:
        b.noise.copy_(fill["noise"])
    if b.seen is not None:
        b.seen.copy_(fill["seen"])
    return b


class _Final:
    """The (R, C) results by original row, filled as rows leave the buffers (compaction) and at the end."""

    def __init__(self, R, C, pad, device):
        self.out = torch.full((R, C + 1), pad, dtype=torch.long, device=device)
        self.logp = torch.zeros(R, C + 1, device=device)
        self.lengths = torch.zeros(R, dtype=torch.long, device=device)

    def take(self, b: _Buffers, rows):
        real = rows >= 0
        idx = rows[real]
        self.out[idx] = b.out[real]
        self.logp[idx] = b.logp[real]
        self.lengths[idx] = b.lengths[real]

    def result(self, with_logprobs):
        width = int(self.lengths.max()) if self.lengths.numel() else 0
        mask = (torch.arange(width, device=self.out.device)[None, :] < self.lengths[:, None]).long()
        ids = self.out[:, :width]  # padding (EOS, or 0 without one) after each row's end
        if with_logprobs:
            return ids, mask, self.logp[:, :width] * mask
        return ids, mask


def _compact(b: _Buffers, rows, final: _Final, alive):
    """Drop finished rows: keep the groups with rows `alive` (decoding or waiting for a tool), each with as
    many rows as its busiest group has (the others padded with finished filler rows), and their prompt KV
    once. Returns the new buffers and original-row map; rows that leave are copied to `final` first."""
    final.take(b, rows)
    n = b.prompt_bias.shape[0]
    _, groups, src, filler = select_rows(alive, n, b.out.shape[0] // n, lambda g, r: (g, r))
    new_rows = torch.where(filler, -1, rows[src])
    take = lambda x: x.index_select(0, src)  # noqa: E731
    nb = _Buffers(
        prompt_k=[x.index_select(0, groups) for x in b.prompt_k],
        prompt_v=[x.index_select(0, groups) for x in b.prompt_v],
        prompt_bias=b.prompt_bias.index_select(0, groups), comp_k=[take(x) for x in b.comp_k],
        comp_v=[take(x) for x in b.comp_v], plen=take(b.plen), out=take(b.out), logp=take(b.logp),
        done=take(b.done) | filler, lengths=take(b.lengths), t=take(b.t),
        noise=b.noise.index_select(1, src), parked=b.parked[src.cpu()] & ~filler.cpu(),
        final=b.final[src.cpu()] | filler.cpu(),
        prompt_kt=None if b.prompt_kt is None else [x.index_select(0, groups) for x in b.prompt_kt],
        comp_kt=None if b.comp_kt is None else [take(x) for x in b.comp_kt],
        seen=None if b.seen is None else take(b.seen),
    )  # fmt: skip
    return nb, new_rows


_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def engine_for(model) -> NativeEngine:
    """The engine of this model (built once: its compiled step is reused by every later call)."""
    lm = causal_lm(model)
    eng = _ENGINES.get(lm)
    if eng is None:
        eng = _ENGINES[lm] = NativeEngine(model)
    return eng
