"""Optimizers by HF's `optim` names, and an AdamW for 16-bit weights that never rounds an update away.

    build_optimizer(params, optim, lr=..., betas=..., weight_decay=...) -> torch.optim.Optimizer

fp32 weights: `adamw_torch` (torch.optim.AdamW as HF builds it), `adamw_torch_fused` (fused=True: one kernel
per tensor, CPU and GPU; HF's default from torch 2.8, ours), `adamw_8bit` / `paged_adamw_8bit` (bitsandbytes'
8-bit states; paging is CUDA's, a CPU runs them unpaged).

16-bit (bf16) weights: plain AdamW adds each update to the bf16 weight and loses it wherever it is under half
an ulp (lr 1e-6 on weights of std 0.02: ~98% of them never move). `AdamW16` keeps every update, three ways:
    master      an fp32 copy of each 16-bit weight in the optimizer state: fp32 AdamW's trajectory exactly,
                the weight its round-to-nearest; 2 + 4 + 8 bytes per parameter (adamw_torch[_fused])
    kahan       a bf16 buffer of what rounding dropped (Kahan summation): weight + compensation carries ~16
                bits more than the weight; 2 + 2 + 8 (adamw_kahan)
    stochastic  the fp32 result rounded up or down at random in proportion, unbiased in expectation;
                2 + 8 (adamw_stochastic)
A step rebuilds each tensor's fp32 weight (the master; weight + compensation; the weight), runs torch's own
AdamW kernel on it (fused where torch has one), and stores it back: one implementation of the math.
"""

from dataclasses import dataclass

import torch
from torch.optim.adamw import adamw as _adamw_kernel


@dataclass(frozen=True)
class OptimizerSpec:
    state_bytes: float  # optimizer state per trainable parameter (two fp32 moments = 8)
    master_bytes: float  # per trainable 16-bit parameter: its fp32 master (4), compensation (2), or none
    mode: str | None  # how AdamW16 keeps 16-bit weights' updates; None: refused on 16-bit weights
    fused: bool  # torch's fused AdamW kernel
    # what a step allocates while it steps one tensor, bytes per element of the largest, on a CPU, for fp32 /
    # 16-bit weights (measured, torch 2.13, bitsandbytes 0.50: bench/models/precision.py "step transient")
    step_bytes: tuple = (0, 0)
    bnb_class: str | None = None  # a bitsandbytes optimizer


OPTIMIZERS = {
    "adamw_torch_fused": OptimizerSpec(8, 4, "master", True, (0, 4)),  # HF's default; 16-bit: the fp32 grad
    "adamw_torch": OptimizerSpec(8, 4, "master", False, (8, 12)),  # per tensor on CPU, foreach on CUDA
    "adamw_kahan": OptimizerSpec(8, 2, "kahan", True, (0, 12)),  # 16-bit: fp32 weight and grad
    "adamw_stochastic": OptimizerSpec(8, 0, "stochastic", True, (0, 14)),  # + the rounding's noise
    "adamw_8bit": OptimizerSpec(2, 0, None, False, (20, 0), "AdamW8bit"),  # CPU: the states dequantized
    "paged_adamw_8bit": OptimizerSpec(2, 0, None, False, (20, 0), "PagedAdamW8bit"),  # paged on CUDA only
}


def check_optimizer(precision, device: torch.device) -> None:
    """A ValueError naming --optim when it cannot run this precision here."""
    spec = OPTIMIZERS.get(precision.optim)
    if spec is None:
        raise ValueError(f"--optim must be one of {tuple(OPTIMIZERS)}, got {precision.optim!r}")
    if spec.bnb_class is None:
        return
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise ValueError(
            f"--optim {precision.optim} needs bitsandbytes (pip install bitsandbytes): {exc}"
        ) from exc
    if precision.storage != "fp32":
        raise ValueError(
            f"--optim {precision.optim} with --dtype {precision.storage}: bitsandbytes steps 16-bit weights "
            "in place and rounds small updates away; use --dtype fp32 (4 + 2 bytes a parameter with 8-bit "
            "states), or adamw_kahan / adamw_torch_fused on bf16 weights"
        )


def build_optimizer(params, optim: str, lr: float, betas=(0.9, 0.999), weight_decay=0.0, eps=1e-8):
    """The optimizer `optim` names over `params`: torch's AdamW when every parameter is fp32 (exactly HF's),
    AdamW16 when some are 16-bit, bitsandbytes' for its names."""
    params = list(params)
    spec = OPTIMIZERS[optim]
    kw = dict(lr=lr, betas=betas, weight_decay=weight_decay, eps=eps)
    if spec.bnb_class is not None:
        import bitsandbytes

        optimizer = getattr(bitsandbytes.optim, spec.bnb_class)(params, **kw)
    elif all(p.dtype == torch.float32 for p in params):
        optimizer = torch.optim.AdamW(params, fused=True if spec.fused else None, **kw)
    else:
        optimizer = AdamW16(params, mode=spec.mode, fused=spec.fused, **kw)
    optimizer.register_step_post_hook(_bump_versions)
    return optimizer


def _bump_versions(optimizer, args, kwargs) -> None:
    """Mark every stepped parameter as changed in place. torch's fused AdamW writes the parameters without
    bumping their version counters (torch 2.13), and whatever keys on them would miss the step: the vLLM
    engine pushes only the weights whose version changed, and would sample from the old policy forever."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                torch.autograd.graph.increment_version(p)


class AdamW16(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, as torch.optim.AdamW) whose 16-bit parameters keep every update: `mode`
    "master" (fp32 copy in the state), "kahan" (16-bit compensation in the state) or "stochastic" (stochastic
    rounding, bf16). Moments are fp32; fp32 parameters are stepped as torch.optim.AdamW steps them."""

    MODES = ("master", "kahan", "stochastic")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, mode="master",
                 fused=True):  # fmt: skip
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}, got {mode!r}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.mode, self.fused = mode, fused
        for group in self.param_groups:
            for p in group["params"]:
                if mode == "stochastic" and p.dtype not in (torch.float32, torch.bfloat16):
                    raise ValueError(f"mode 'stochastic' rounds to bf16, got a {p.dtype} parameter")

    def _state(self, p) -> dict:
        st = self.state[p]
        if not st:
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device if self.fused else "cpu")
            st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            if p.dtype != torch.float32 and self.mode == "master":
                st["master"] = p.detach().float().clone(memory_format=torch.preserve_format)
            elif p.dtype != torch.float32 and self.mode == "kahan":
                st["compensation"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return st

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, except that the state keeps its own dtypes: torch casts every floating state tensor to
        its parameter's dtype, which would round the fp32 moments and masters of a bf16 weight to bf16."""
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(i, {}).items():
                if key != "step" and torch.is_tensor(value) and value.is_floating_point():
                    self.state[p][key] = value.to(device=p.device, copy=True)

    @torch.no_grad()
    def seed_from(self, fp32_of) -> int:
        """Start 16-bit parameters' masters (compensations) from their fp32 originals: `fp32_of(p)` gives
        the fp32 tensor a parameter was rounded from (a checkpoint stored in fp32), or None. The optimizer
        then follows the fp32 run's trajectory from its first step, not that of the rounded weights.
        Returns how many parameters were seeded."""
        seeded = 0
        for group in self.param_groups:
            for p in group["params"]:
                src = fp32_of(p) if p.dtype != torch.float32 and self.mode != "stochastic" else None
                if src is None:
                    continue
                st = self._state(p)
                src = src.to(device=p.device, dtype=torch.float32)
                if hasattr(p, "device_mesh"):  # an FSDP2 shard: this rank's part of the full original
                    from torch.distributed.tensor import distribute_tensor

                    src = distribute_tensor(src, p.device_mesh, p.placements)
                if self.mode == "master":
                    st["master"].copy_(src)
                else:
                    st["compensation"].copy_(src - p.float())
                seeded += 1
        return seeded

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self._state(p)
                half = p.dtype != torch.float32
                # 1. the fp32 weight this step updates (one parameter at a time: one fp32 temporary)
                if not half:
                    w = p
                elif self.mode == "master":
                    w = st["master"]
                elif self.mode == "kahan":
                    w = p.float().add_(st["compensation"])  # mixed-dtype in place: no second temporary
                else:
                    w = p.float()
                g = p.grad if p.grad.dtype == torch.float32 else p.grad.float()
                # 2. torch's AdamW math on it
                _adamw_kernel(
                    [w], [g], [st["exp_avg"]], [st["exp_avg_sq"]], [], [st["step"]],
                    foreach=False, fused=self.fused or None, amsgrad=False, beta1=beta1, beta2=beta2,
                    lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
                )  # fmt: skip
                if not half:
                    continue
                # 3. back into the 16-bit weight: nearest (master), nearest + what it dropped (kahan), random
                if self.mode == "stochastic":
                    p.copy_(stochastic_round_bf16(w, inplace=True))
                else:
                    p.copy_(w)
                    if self.mode == "kahan":  # exact in fp32: w and its rounding are within an ulp
                        st["compensation"].copy_(w.sub_(p))
        return loss


def stochastic_round_bf16(
    x: torch.Tensor, generator: torch.Generator | None = None, inplace: bool = False
) -> torch.Tensor:
    """fp32 -> bf16 rounded up or down at random, P(up) = the dropped fraction of an ulp: uniform noise added
    to the 16 bits that bf16 drops, then truncated (sign-magnitude, so symmetric for negative values).
    inplace: `x` (contiguous) is overwritten on the way."""
    bits = (x if inplace else x.contiguous().clone()).view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    return bits.add_(noise).bitwise_and_(-65536).view(torch.float32).to(torch.bfloat16)
