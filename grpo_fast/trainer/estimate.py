"""The memory of a GRPO step before running it: `grpo-fast estimate` and the planner behind --max-memory-gb.

    grpo-fast estimate [train flags] [--device cpu|cuda] [--max-memory-gb X]

Parts, from the model's config alone (no weights are loaded):
- parameters, gradients, optimizer state, the reference model: counted on a model built on the meta device
  (LoRA adapters as the trainer adds them) in the precision recipe's bytes (grpo_fast.trainer.precision:
  weights in the storage dtype, 16-bit weights' fp32 masters or compensations, the optimizer's state per
  parameter), and the optimizer step's own temporaries (16-bit weights: the largest tensor's fp32 gradient
  and weight);
- the rollout (native engine): the prompt KV (once per group with prefix sharing, else once per sample) and
  each sample's completion KV at the engine's capacity, in the policy's dtype or a bf16 rollout's bf16 (on a
  CPU the keys twice: the decode kernels' transposed copy), the prefill's working set, and on a CPU the copy
  of the linear weights the engine makes for the call (fp32 packed, none under Inductor's step, or the
  --rollout-dtype's: bf16 half of it, int8 a quarter with the LM head kept fp32);
  on CUDA with the engine on CUDA graphs (`--rollout-compile auto|graphs`) the KV, the weight copy and the
  graphs' pool (the decode step's working set) stay allocated through training (the graphs read them there),
  on a CPU the weight copy does (the next call rewrites it in place);
- training activations of one micro-batch: a probe runs the trainer's own forward (`completion_hidden_states`,
  gradient checkpointing, LoRA and the autocast region applied the same way: autocast's bf16 weight copies
  are saved for backward, so they count per layer) and backward on a 1- and a 2-layer model of this
  config at three small token counts, counting every tensor the step allocates and frees (a dispatch mode over
  storages); the bytes per layer and token, the fixed part and the quadratic part (the shared-prefix mask) are
  fitted from those six runs and scaled to the real layer and token counts;
- the loss's working set: the fp32 LM-head gradient and logits tiles (the PyTorch twin's chunk on a CPU, the
  Triton kernels' d hidden on CUDA), and the twin's 16-bit copy of the head weight in mixed precision;
- on a CPU the process itself (Python, torch, transformers: this process's resident set when it starts).
On CUDA the figure is `max_memory_allocated`: the CUDA context (~0.5 GB) and the caching allocator's reserve
come on top. Checked against measured peaks in tests/test_estimate.py and bench/models/memory.py.

The planner (`plan`): gradient checkpointing on or off and the bytes a micro-batch may take, the cheapest
that fits a budget at the longest lengths; the trainer packs each step's micro-batches to that size from the
real lengths (grpo_fast.trainer.batching: whole groups, or sub-batches of a group that each carry its prompt,
with gradients identical to the whole step's).
"""

import sys
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..models.model_parts import lm_head_of
from ..rollout.native import kv_capacity, kv_dtype, packs_fp32_weights
from .batching import Packer, partition, tokens_run
from .config import GRPOConfig, generation_steps, prompts_per_rollout
from .modeling import DTYPES
from .optimizers import OPTIMIZERS
from .precision import Precision, resolve, rollout_dtype_of

MIB = 2**20


# --------------------------------------------------------------------------------------------------------
# Counting what a piece of code allocates
# --------------------------------------------------------------------------------------------------------
class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storages created inside the context and still alive, and their peak. Storages that
    existed before (parameters, inputs) are not counted when an op returns a view of them."""

    def __init__(self, known=()):
        super().__init__()
        self.live = self.peak = 0
        self.sizes = {}
        self.known = {t.untyped_storage().data_ptr() for t in known}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key, n = st.data_ptr(), st.nbytes()
            if n == 0 or key in self.sizes or key in self.known:
                continue
            self.sizes[key] = n
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(st, self._free, key)
        return out

    def _free(self, key):
        self.live -= self.sizes.pop(key, 0)


# --------------------------------------------------------------------------------------------------------
# The model from its config
# --------------------------------------------------------------------------------------------------------
def model_config(cfg: GRPOConfig):
    from transformers import AutoConfig

    from .modeling import model_path

    return AutoConfig.from_pretrained(model_path(cfg))


def _build(config, cfg: GRPOConfig, layers: int | None, device: str):
    """The trainer's model (LoRA, checkpointing) of `config`, random weights, on `device` (meta: shapes)."""
    from transformers import AutoModelForCausalLM

    from .modeling import prepare_for_training

    if layers is not None:
        config = type(config).from_dict({**config.to_dict(), "num_hidden_layers": layers})
    config._attn_implementation = "sdpa"
    with torch.device(device):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[cfg.dtype])
    return prepare_for_training(model, cfg)


def parameter_bytes(config, cfg: GRPOConfig) -> dict:
    model = _build(config, cfg, None, "meta")
    params = list(model.parameters())
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    linear = [m.weight for m in lm.modules() if type(m) is torch.nn.Linear]  # what the CPU engine packs
    trainable = [p for p in params if p.requires_grad]
    return {
        "head_trainable": lm_head_of(model).weight.requires_grad,
        "params": sum(p.numel() for p in params),
        "weights": sum(p.numel() * p.element_size() for p in params),
        "trainable": sum(p.numel() * p.element_size() for p in trainable),
        "trainable_params": sum(p.numel() for p in trainable),
        "trainable_16bit_params": sum(p.numel() for p in trainable if p.element_size() == 2),
        "largest_16bit_trainable": max((p.numel() for p in trainable if p.element_size() == 2), default=0),
        "largest_trainable": max((p.numel() for p in trainable), default=0),
        "linear_weights": sum(w.numel() * 4 for w in linear),
        "head_elements": lm_head_of(model).weight.numel(),
    }


# bytes per weight element of the native engine's per-call copy, by rollout dtype: (layers, LM head)
COPY_BYTES = {"fp32": (4, 4), "bf16": (2, 2), "fp16": (2, 2), "int8": (1, 4), "fp8": (1, 4)}


def engine_copy_bytes(p: dict, cfg: GRPOConfig, device: str) -> float:
    """The native engine's copy of the linear weights (fp32 packed on a CPU, or the rollout dtype's; kept
    between calls on a CPU and on CUDA graphs); `cfg` as `precision.resolve` leaves it."""
    dtype = rollout_dtype_of(cfg)  # cfg resolved: "auto" decided (precision.resolve)
    compiled = cfg.rollout_compile == "on"
    if dtype in ("model", "fp32") and not packs_fp32_weights(device, DTYPES[cfg.dtype], compiled):
        return 0.0  # the modules themselves
    layers_b, head_b = COPY_BYTES["fp32" if dtype == "model" else dtype]
    head = p["head_elements"]
    return (p["linear_weights"] / 4 - head) * layers_b + head * head_b


# --------------------------------------------------------------------------------------------------------
# The activation probe
# --------------------------------------------------------------------------------------------------------
PROBE_SHAPES = ((16, 16), (16, 64), (16, 256))  # (P, C) of one prompt and G=2 completions


@dataclass
class ActivationModel:
    """Bytes of a micro-batch of `count` sequences of S tokens through L layers (a sequence: a group's packed
    prompt and completions with prefix sharing, else one prompt and completion): count x (rest(S) + L x
    layer(S)), each a + b S + c S^2 (c: the attention mask). `train`: the forward's saved tensors plus the
    backward's working set; `nograd`: a no-grad forward's peak (old / reference log-probs, the prefill)."""

    layer: tuple  # (a, b, c) of one layer's saved bytes per sequence
    rest: tuple  # (a, b, c) of the rest: embeddings, final norm, masks, the backward's working set
    nograd: tuple  # (a, b, c) of a no-grad forward's peak (any number of layers: one runs at a time)
    rest_saved: tuple = (0.0, 0.0, 0.0)  # (a, b, c) of the rest's saved bytes alone (no backward)

    def train(self, L, S, count=1):
        """The peak from the forward to the end of the backward."""
        return count * (_poly(self.rest, S) + L * _poly(self.layer, S))

    def saved(self, L, S, count=1):
        """What the forward leaves for the backward (live when the loss runs)."""
        return count * (_poly(self.rest_saved, S) + L * _poly(self.layer, S))

    def forward_nograd(self, S, count=1):
        return count * _poly(self.nograd, S)


def _poly(abc, T):
    return max(0.0, abc[0] + abc[1] * T + abc[2] * T * T)


def _fit(ts, ys):
    """Least squares a + b T + c T^2 through three points (exact)."""
    A = torch.tensor([[1.0, t, t * t] for t in ts], dtype=torch.float64)
    return tuple(torch.linalg.solve(A, torch.tensor(ys, dtype=torch.float64)).tolist())


def probe_activations(config, cfg: GRPOConfig, precision: Precision) -> ActivationModel:
    from .modeling import completion_hidden_states

    autocast = precision.autocast_context(torch.device("cpu"))

    runs = {}
    for layers in (1, 2):
        model = _build(config, cfg, layers, "cpu")
        emb = model.get_input_embeddings()
        emb.weight.requires_grad_(False)  # its gradient is counted with the others, not here
        state = {}
        hook = emb.register_forward_hook(lambda m, i, o: state.__setitem__("x", o.requires_grad_()))
        known = list(model.parameters()) + list(model.buffers())
        for P, C in PROBE_SHAPES:
            G, n = 2, 1
            g = torch.Generator().manual_seed(0)
            V = config.vocab_size
            ones = torch.ones(n * G, C, dtype=torch.long)
            batch = (torch.randint(2, V, (n, P), generator=g), torch.ones(n, P, dtype=torch.long),
                     torch.randint(2, V, (n * G, C), generator=g), ones)  # fmt: skip
            # per sequence: the group's packed layout (shared), or one of G plain sequences
            T, per = (P + G * C, 1) if cfg.share_prefix else (P + C, G)
            model.train()
            with LiveBytes(known + list(batch)) as live:
                with autocast:
                    h = completion_hidden_states(model, *batch, share_prefix=cfg.share_prefix)
                saved = live.live
                (grad,) = torch.autograd.grad(h.float().square().sum(), state["x"])
                peak = live.peak
            del h, grad
            with torch.no_grad(), LiveBytes(known + list(batch)) as live, autocast:
                completion_hidden_states(model, *batch, share_prefix=cfg.share_prefix)
                nograd = live.peak
            runs[(layers, T)] = (saved / per, peak / per, nograd / per)
        hook.remove()
    ts = sorted({t for _, t in runs})
    layer = _fit(ts, [runs[(2, t)][0] - runs[(1, t)][0] for t in ts])
    rest = _fit(ts, [runs[(1, t)][1] - _poly(layer, t) for t in ts])
    rest_saved = _fit(ts, [runs[(1, t)][0] - _poly(layer, t) for t in ts])
    nograd = _fit(ts, [runs[(2, t)][2] for t in ts])
    return ActivationModel(layer, rest, nograd, rest_saved)


# --------------------------------------------------------------------------------------------------------
# The estimate
# --------------------------------------------------------------------------------------------------------
@dataclass
class Plan:
    gradient_checkpointing: bool
    micro_batch_bytes: float | None = None  # micro-batches packed up to this (None: the configured layout)


def _runtime_bytes(device: str, cfg: GRPOConfig) -> float:
    if device == "cuda":
        return 0.0
    import importlib

    from .memory import current_mib

    # the process as the trainer has it: its modules imported, and what this run imports later (peft under
    # LoRA: 63 MiB resident on an Intel Xeon with transformers 5.25, most of a LoRA estimate's shortfall
    # there), no more (datasets and pandas, which a file of another format needs, are ~90 MiB). A
    # measurement, not a dependency: train imports this module, so it is imported by name here.
    importlib.import_module(__package__ + ".train")
    if cfg.lora_r:
        importlib.import_module("peft")

    return current_mib("cpu") * MIB


class Estimator:
    """The memory model of one config (model, flags); `estimate(plan)` gives the parts of a step's peak."""

    def __init__(self, cfg: GRPOConfig, device: str = "cpu"):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {device!r}")
        self.cfg, self.precision = resolve(cfg, torch.device(device))
        self.device = device
        self.runtime = _runtime_bytes(device, cfg)
        self.config = model_config(cfg)
        self.params = parameter_bytes(self.config, cfg)
        self._probes = {}

    def probe(self, gc: bool, share: bool) -> ActivationModel:
        if (gc, share) not in self._probes:
            import dataclasses

            self._probes[(gc, share)] = probe_activations(
                self.config,
                dataclasses.replace(self.cfg, gradient_checkpointing=gc, share_prefix=share),
                self.precision,
            )
        return self._probes[(gc, share)]

    def micro_batch_bytes(self, groups, P: int, C: int, gc: bool) -> tuple[float, float, float, float]:
        """(activations' peak through the backward, the loss's per-row part, a no-grad forward's peak, the
        activations the forward saves: live while the loss runs) of one micro-batch of `groups` [(prompt
        length, [completion lengths])] with prompts P and completions C wide, laid out as
        modeling.completion_hidden_states lays it out."""
        L, H = self.config.num_hidden_layers, self.config.hidden_size
        rows = sum(len(lens) for _, lens in groups)
        if len(groups) == 1 and rows == 1:  # one causal sequence of its real tokens, no mask
            seq, share = (groups[0][0] + groups[0][1][0], 1), False
        elif self.cfg.share_prefix:  # a row per group: its prompt and completions, padded to the longest
            seq, share = (max(p + sum(lens) for p, lens in groups), len(groups)), True
        else:  # a row per completion, behind its (padded) prompt
            seq, share = (P + C, rows), False
        acts = self.probe(gc, share)
        N = rows * C
        return (
            acts.train(L, *seq),
            N * H * 4 + (N * 64 if self.device == "cuda" else 0),
            acts.forward_nograd(*seq),
            acts.saved(L, *seq),
        )

    def packer(self, plan: Plan) -> Packer | None:
        """The trainer's micro-batch packing under `plan` (None: the configured layout)."""
        if plan.micro_batch_bytes is None:
            return None
        gc = plan.gradient_checkpointing
        return Packer(
            lambda groups, P, C: sum(self.micro_batch_bytes(groups, P, C, gc)[:2]), plan.micro_batch_bytes
        )

    def estimate(self, plan: Plan | None = None, C: int | None = None, G: int | None = None) -> dict:
        """The parts of a step's peak at the longest prompts and completions."""
        cfg, c = self.cfg, self.config
        plan = plan or Plan(cfg.gradient_checkpointing)
        C = C or cfg.max_completion_length
        G = G or cfg.num_generations
        # a rollout generates for `steps` optimizer steps' prompts; each step trains n of them
        P, n, steps = cfg.max_prompt_length, cfg.prompts_per_step, generation_steps(cfg)
        b = DTYPES[cfg.dtype].itemsize
        L, H, V = c.num_hidden_layers, c.hidden_size, c.vocab_size
        kvh = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        hd = getattr(c, "head_dim", None) or H // c.num_attention_heads
        p = self.params
        optim = OPTIMIZERS[self.precision.optim]
        parts = {
            "runtime": self.runtime,
            "weights": p["weights"],
            "reference model": p["weights"] if cfg.beta != 0 and cfg.lora_r == 0 else 0.0,
            "master weights": optim.master_bytes * p["trainable_16bit_params"],
            "optimizer state": optim.state_bytes * p["trainable_params"],
        }
        # rollout: the native engine's KV (in the rollout's KV dtype: a bf16 rollout's is bf16), its prefill
        # (the policy's dtype), and (CPU, eager) its copy of the linear weights
        kv_b = kv_dtype(rollout_dtype_of(cfg), DTYPES[cfg.dtype]).itemsize
        kv_tok = L * 2 * kvh * hd * kv_b
        prompt_rows = n * steps if cfg.share_prefix else n * steps * G
        cap = kv_capacity(C)
        # on a CPU the decode kernels (grpo_fast.rollout.cpu_decode) keep the keys a second time, transposed,
        # the prompt's padded to 64 slots
        kt_tok = L * kvh * hd * kv_b if self.device == "cpu" else 0
        prompt_kv = kv_tok * P + kt_tok * -(-P // 64) * 64  # a prompt row's
        completion_kv = (kv_tok + kt_tok) * n * steps * G * cap
        kv = prompt_kv * prompt_rows + completion_kv
        kv_unshared = prompt_kv * n * steps * G + completion_kv
        packed = engine_copy_bytes(p, cfg, self.device)
        prefill = self.probe(plan.gradient_checkpointing, cfg.share_prefix).forward_nograd(P, prompt_rows)
        prefill += L * 2 * kvh * hd * b * prompt_rows * P
        # logits, probabilities, the draw's buffers; tokens, log-probs; under a repetition penalty each
        # row's context mask (bool) and the penalized logits' fp32 temporaries (sampling.penalized: three at
        # its peak)
        penalty = V * (1 + 4 * 3) if cfg.repetition_penalty != 1.0 else 0
        decode = n * steps * G * (V * 4 * 3 + penalty + C * 12)
        rollout = {
            "rollout KV cache": kv,
            "rollout working set": max(prefill, packed + decode),
        }
        server = cfg.rollout == "vllm" and cfg.vllm_mode == "server"
        if server:  # the servers' memory is theirs (the push writes one tensor at a time)
            rollout = {"rollout KV cache": 0.0, "rollout working set": 0.0}
        elif cfg.rollout == "vllm":  # vLLM's own copy of the weights and the KV space it is given
            if self.device == "cuda":
                raise ValueError(
                    "--rollout vllm on CUDA takes --vllm-gpu-memory-utilization of the GPU for its weights "
                    "and KV cache: that share is its memory; estimate the trainer's with --rollout native"
                )
            rollout = {"rollout KV cache": cfg.vllm_kv_cache_gb * 2**30, "rollout working set": p["weights"]}
        # training: the largest micro-batch (grpo_fast.trainer.batching, at the longest lengths), the loss,
        # gradients
        prompt_lens, completion_lens = [P] * n, [C] * (n * G)
        chunks = partition(prompt_lens, completion_lens, G, cfg.gradient_accumulation_steps, P, C,
                           cfg.group_split, self.packer(plan))  # fmt: skip
        micro = [part for chunk in chunks for part in chunk]
        sizes = [
            self.micro_batch_bytes(
                [(P, [C] * len(rows)) for _, rows in part], P, C, plan.gradient_checkpointing
            )
            for part in micro
        ]
        act, loss_rows, nograd, saved = max(sizes, key=lambda x: x[0] + x[1])
        head_grad = V * H * 4 if p["head_trainable"] else 0.0  # fp32 d weight (a frozen head: none)
        tokens = max(sum(len(rows) for _, rows in part) for part in micro) * C
        sixteen = self.precision.compute != "fp32"
        if self.device == "cpu":
            from ..kernels.logprobs import twin_chunk_rows

            # the twin's logits tile and one temporary (a chunk: at most the micro-batch's tokens)
            loss_fixed = 2 * min(tokens, twin_chunk_rows(V)) * V * 4 + head_grad
        else:
            from ..kernels.rows import TritonRows

            # Triton's chunked backward: the fp32 logits chunk, its 16-bit copy for the gradient GEMMs
            loss_fixed = min(tokens, TritonRows.chunk_rows(V)) * V * (6 if sixteen else 4) + head_grad
        # in mixed precision the 16-bit copy of the (fp32) head weight
        loss_fixed += V * H * 2 if self.precision.autocast else 0.0
        # held through the rollout's steps: old log-probs for each step that trains off-policy (all of them
        # under num_iterations > 1, else steps 2..k: the first is on-policy), reference ones for each (beta)
        held = (steps if cfg.num_iterations > 1 else steps - 1) + (steps if cfg.beta != 0 else 0)
        logps = held * n * G * C * 4
        old_ref = nograd if (cfg.beta != 0 or steps * cfg.num_iterations > 1) else 0.0
        train = {
            "gradients": p["trainable"],
            "activations": act,
            "loss working set": loss_fixed + loss_rows,
            "old / reference log-probs": logps,
        }
        # the optimizer step: gradients still held, activations gone; one tensor's temporaries at a time
        # (measured per optimizer: OPTIMIZERS' step_bytes), except torch's unfused AdamW on CUDA (foreach:
        # temporaries of every tensor at once) and bitsandbytes' fused CUDA kernels (none)
        largest16, largest = p["largest_16bit_trainable"], p["largest_trainable"]
        step_temps = max(largest * optim.step_bytes[0], largest16 * optim.step_bytes[1])
        if self.device == "cuda" and not optim.fused:
            step_temps = 0.0 if optim.bnb_class else 8.0 * p["trainable_params"]
        # the loss runs on the forward's saved activations with its tiles; the backward frees the tiles
        # (the twin's gradients are made in the forward) and keeps only the head's d weight and d hidden
        # (gradients exist by then only from an earlier micro-batch: the first one's backward makes them)
        grads_at_loss = p["trainable"] if len(micro) > 1 else 0.0
        at_loss = grads_at_loss + saved + loss_fixed + loss_rows
        in_backward = p["trainable"] + act + head_grad + loss_rows
        # colocated asynchronous GRPO: the generation thread's own copy of the weights, and its rollout of the
        # next batch running through the training of this one (the worst case a budget must hold)
        overlap = 0.0
        if cfg.max_staleness and not server:
            parts["generation thread's weights"] = p["weights"]
            overlap = sum(rollout.values())
        # the native engine on CUDA graphs (its default on CUDA, grpo_fast.rollout.graphs) keeps its decode
        # buffers and weight copies at their addresses between calls, and the graphs' pool (the largest
        # bucket's step: its logits and the draw's buffers): through training too
        kept = {}
        native = cfg.rollout in ("auto", "native")
        graphs = native and cfg.rollout_compile in ("auto", "graphs")
        if self.device == "cuda" and graphs and not overlap:
            kept = {"rollout buffers kept (CUDA graphs)": kv + packed + decode}
        elif self.device == "cpu" and native and packed and not overlap:
            # on a CPU the engine keeps its weight copy between calls (rewritten in place by the next)
            kept = {"rollout weight copy kept": packed}
        persistent = sum(parts.values())
        rollout_peak = persistent + sum(rollout.values())
        train_peak = (
            persistent
            + overlap
            + sum(kept.values())
            + max(logps + max(at_loss, in_backward), old_ref + logps, p["trainable"] + step_temps)
        )
        return {
            "parts": {**parts, **rollout, **train, **kept},
            "rollout_peak": rollout_peak,
            "train_peak": train_peak,
            "peak": max(rollout_peak, train_peak),
            "kv_cache_unshared": kv_unshared,
            "plan": plan,
            # what a micro-batch may take under a budget: the budget less everything else in training
            "train_fixed": persistent + overlap + sum(kept.values()) + p["trainable"] + loss_fixed + logps,
            "micro_batches": len(micro),
            "tokens_run": tokens_run(chunks, prompt_lens, completion_lens),
        }

    def fits(self, budget_bytes: float, **kw) -> bool:
        return self.estimate(**kw)["peak"] <= budget_bytes

    def largest(self, budget_bytes: float, what: str, plan: Plan | None = None) -> int:
        """The largest completion length ("C") or group size ("G") whose step fits the budget (0: none)."""
        lo, hi = 0, 1
        while self.fits(budget_bytes, plan=plan, **{what: hi}) and hi < 2**20:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.fits(budget_bytes, plan=plan, **{what: mid}) else (lo, mid)
        return lo if what == "C" or lo >= 2 else 0


PLAN_MARGIN = 0.9  # plans fill at most this share of the budget: the estimate's error, the allocator's slack


def plan(cfg: GRPOConfig, budget_gb: float, device: str = "cpu", estimator: Estimator | None = None):
    """The cheapest plan whose estimated peak fits PLAN_MARGIN of `budget_gb` GiB: gradient checkpointing on
    or off, and micro-batches packed up to what the budget leaves them (grpo_fast.trainer.batching). Returns
    (Plan, estimate at the longest lengths), or raises a ValueError naming what would fit. Cost at the longest
    lengths: tokens run forward and backward (checkpointing: a second forward, 4/3; a sub-batch re-runs its
    prompt), then micro-batches."""
    est = estimator or Estimator(cfg, device)
    budget = budget_gb * 2**30 * PLAN_MARGIN
    candidates = []
    for gc in (False, True):
        smallest = est.estimate(plan=Plan(gc, 0.0))  # one completion per micro-batch
        if smallest["peak"] > budget:
            continue
        p = Plan(gc, budget - smallest["train_fixed"])
        e = est.estimate(plan=p)
        if e["peak"] <= budget:
            candidates.append(((e["tokens_run"] * (4 / 3 if gc else 1), e["micro_batches"]), p, e))
    if candidates:
        _, p, e = min(candidates, key=lambda x: x[0])
        return p, e
    smallest = est.estimate(plan=Plan(True, 0.0))
    what = f"--max-completion-length {est.largest(budget, 'C', Plan(True, 0.0))}"
    gib = {k: smallest[k] / 2**30 for k in ("peak", "rollout_peak", "train_peak")}
    raise ValueError(
        f"--max-memory-gb {budget_gb:g}: no plan fits. The smallest (one completion per micro-batch, "
        f"gradient checkpointing) needs {gib['peak']:.2f} GiB (rollout {gib['rollout_peak']:.2f}, training "
        f"{gib['train_peak']:.2f}), and a plan keeps {1 - PLAN_MARGIN:.0%} of the budget spare; within "
        f"{budget_gb:g} GiB this config fits {what} (or fewer --prompts-per-step, --num-generations, LoRA)"
    )


# --------------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------------
def table(e: dict) -> str:
    rows = [(k, v) for k, v in e["parts"].items()]
    width = max(len(k) for k, _ in rows) + 2
    lines = [f"{'part':<{width}}{'MiB':>10}"]
    lines += [f"{k:<{width}}{v / MIB:>10.0f}" for k, v in rows]
    lines += [
        f"{'peak in the rollout':<{width}}{e['rollout_peak'] / MIB:>10.0f}",
        f"{'peak in training':<{width}}{e['train_peak'] / MIB:>10.0f}",
        f"{'PEAK':<{width}}{e['peak'] / MIB:>10.0f}",
    ]
    return "\n".join(lines)


def estimate_from_flags(flags: list[str], device: str) -> dict:
    """The estimate of `grpo-fast train` flags on `device` (used by bench/models/memory.py)."""
    from .config import parse_config

    cfg = parse_config(flags, require_reward=False)
    e = Estimator(cfg, device).estimate()
    parts = {k: v / MIB for k, v in e["parts"].items()}
    return {"peak_mib": e["peak"] / MIB, "rollout_mib": e["rollout_peak"] / MIB,
            "train_mib": e["train_peak"] / MIB, "parts_mib": parts}  # fmt: skip


def main(argv=None) -> None:
    from .config import parse_config

    argv = list(sys.argv[1:] if argv is None else argv)
    device = "cpu"
    if "--device" in argv:
        i = argv.index("--device")
        device = argv[i + 1] if i + 1 < len(argv) else ""
        del argv[i : i + 2]
    try:
        cfg = parse_config(argv, require_reward=False)  # memory does not depend on the rewards
        est = Estimator(cfg, device)
        e = est.estimate()
    except ValueError as err:
        print(f"grpo-fast estimate: error: {err}", file=sys.stderr)
        sys.exit(2)
    c = est.config
    print(
        f"model: {cfg.model or 'the embedded default'} ({est.params['params'] / 1e6:.1f}M params, "
        f"{c.num_hidden_layers} layers, vocabulary {c.vocab_size}), device {device}"
    )
    pr = est.precision
    bpp = pr.bytes_per_param()
    print(
        f"precision: {pr.storage} weights, {pr.compute} compute{' (autocast)' if pr.autocast else ''}, "
        f"--optim {pr.optim}: {' + '.join(f'{v:g}' for v in bpp.values())} bytes per trainable parameter "
        f"({', '.join(bpp)})"
    )
    print(
        f"step: {cfg.prompts_per_step} prompts x G={cfg.num_generations}, P<={cfg.max_prompt_length}, "
        f"C<={cfg.max_completion_length}, {'LoRA r=' + str(cfg.lora_r) if cfg.lora_r else 'full fine-tuning'}"
        f", beta {cfg.beta}, gradient checkpointing {'on' if cfg.gradient_checkpointing else 'off'}, prefix "
        f"sharing {'on' if cfg.share_prefix else 'off'}, {cfg.gradient_accumulation_steps} micro-batch(es)"
        + (f"; a rollout of {prompts_per_rollout(cfg)} prompts for {generation_steps(cfg)} steps"
           if generation_steps(cfg) > 1 else "")
    )  # fmt: skip
    print(table(e))
    print(f"(rollout KV cache without prefix sharing: {e['kv_cache_unshared'] / MIB:.0f} MiB)")
    gc = not cfg.gradient_checkpointing
    other = est.estimate(plan=Plan(gc))["parts"]["activations"]
    print(
        f"(training activations {'with' if gc else 'without'} gradient checkpointing: {other / MIB:.0f} MiB)"
    )
    if device == "cuda":
        print(
            "CUDA: max_memory_allocated; the CUDA context (~0.5 GiB) and the allocator's reserve come on top"
        )
    if cfg.max_memory_gb:
        budget = cfg.max_memory_gb * 2**30
        try:
            p, pe = plan(cfg, cfg.max_memory_gb, device, est)
            print(f"the trainer's plan: {describe(p, pe)}; estimated peak {pe['peak'] / MIB:.0f} MiB")
        except ValueError as err:
            print(str(err))
        # what train --max-memory-gb can reach: its smallest plans (one completion per micro-batch) that fit
        smallest = [Plan(gc, 0.0) for gc in (False, True)]
        planned = {w: max(est.largest(budget * PLAN_MARGIN, w, s) for s in smallest) for w in ("C", "G")}
        print(
            f"within --max-memory-gb {cfg.max_memory_gb:g} with the trainer's plan: largest "
            f"--max-completion-length {planned['C']}, largest --num-generations {planned['G']}"
        )
        whole = {w: est.largest(budget, w) for w in ("C", "G")}
        label = (
            f"within --max-memory-gb {cfg.max_memory_gb:g} as one micro-batch (no plan: the whole step at "
            f"once, checkpointing {'on' if cfg.gradient_checkpointing else 'off'} as configured)"
        )
        if whole["C"] == 0:
            print(f"{label}: nothing fits (at --max-completion-length 1 the step needs "
                  f"{est.estimate(C=1)['peak'] / MIB:.0f} MiB)")  # fmt: skip
        else:
            print(f"{label}: largest --max-completion-length {whole['C']}, "
                  f"largest --num-generations {whole['G']}")  # fmt: skip


def describe(p: Plan, e: dict) -> str:
    """The plan in words; `e`: its estimate (at the longest lengths)."""
    return (
        f"gradient checkpointing {'on' if p.gradient_checkpointing else 'off'}, micro-batches packed up to "
        f"{p.micro_batch_bytes / MIB:.0f} MiB each from the real lengths ({e['micro_batches']} at the "
        f"longest completions; fewer when they are shorter)"
    )
