"""Precision recipes: where the weights live, what the GEMMs compute in, what the optimizer keeps.

One place says what a run's precision is (`Precision`, from `resolve(cfg, device)`), read by the trainer (the
autocast region, the rollout dtype, whether the rollout is exact), the memory planner (bytes per parameter)
and the benchmarks. TRL's names and meaning:
- `--dtype` fp32 | bf16: the parameters' storage dtype (TRL: `model_init_kwargs` dtype, fp32 by default);
- `--bf16` / `--fp16`: autocast the training forward to that dtype on the stored weights (TRL's mixed
  precision; TRL defaults `bf16` to on). Ours defaults to on only where bf16 is faster: a GPU with bf16
  tensor cores, a CPU where a decoder layer at the run's shapes measured faster under bf16 autocast
  (grpo_fast.trainer.calibrate: measured on a machine's first run, cached); fp16 scales the loss;
- `--optim` (HF's names, grpo_fast.trainer.optimizers): bf16 weights never lose an update, each optimizer
  keeps fp32 master weights or compensates the rounding (Kahan) or rounds stochastically.
"""

import os
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch

HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
STORAGE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# The fallback where measuring is off (GRPO_FAST_CALIBRATE=0): a Linear's forward + backward under bf16
# autocast, over fp32, at SmolLM2-135M's training shapes (4096 tokens, 576 -> 1536 and back), per CPU vendor
# and instruction set (bench/models/precision.py; torch 2.13). The same flag runs at different speeds on
# different cores (avx512_bf16: 0.78x on an Intel Xeon, 1.71x on an AMD Zen 4), which is why "auto" measures
# (calibrate.py) rather than reads this; a CPU with no row stays fp32.
CPU_BF16_TRAIN_SPEEDUP = {
    # Intel Xeon, avx512_bf16 + avx512_fp16, no AMX flag (measured for issue 31)
    ("GenuineIntel", "avx512_bf16"): 0.78,
    # AMD EPYC (Zen 4), avx512_bf16 (bench/results/zen4/bench_precision.md; SmolLM2-135M's whole
    # training phase on one rollout: 1.48x, bench/results/zen4/profile_train_bf16.md)
    ("AuthenticAMD", "avx512_bf16"): 1.71,
    # AMD EPYC (Zen 3), avx2 + fma, no avx512: bf16 GEMMs run a non-native path
    # (bench/results/zen3/bench_precision.md)
    ("AuthenticAMD", "avx2"): 0.04,
}


# pins what --bf16 unset means on a CPU (0: fp32, 1: bf16 autocast) whatever is measured; the test suite
# sets 0 so that its runs do not depend on which CPU they land on (and measure nothing)
CPU_BF16_ENV = "GRPO_FAST_CPU_BF16"


def cpu_isa(flags: set) -> str:
    """The instruction-set class that decides CPU bf16 speed: amx_bf16 > avx512_bf16 > avx512f > avx2."""
    for isa in ("amx_bf16", "avx512_bf16", "avx512f", "avx2"):
        if isa in flags:
            return isa
    return "other"


def cpu_class() -> tuple[str, str]:
    """(vendor, instruction-set class) of this CPU: the key of CPU_BF16_TRAIN_SPEEDUP."""
    from ..rollout import dtypes

    return dtypes.cpu_vendor(), cpu_isa(dtypes.cpu_flags())


@dataclass(frozen=True)
class Precision:
    """A run's precision recipe: storage dtype of the parameters, compute dtype of the training forward
    (autocast when they differ), the optimizer (HF name) and how it keeps 16-bit weights' updates."""

    storage: str  # "fp32" | "bf16": the parameters as stored and saved
    compute: str  # "fp32" | "bf16" | "fp16": the training forward's GEMMs
    optim: str  # HF's optimizer name (grpo_fast.trainer.optimizers.OPTIMIZERS)
    reason: str = ""  # why compute is what it is (auto)

    @property
    def autocast(self) -> bool:
        return self.compute != self.storage

    @property
    def exact_rollout_possible(self) -> bool:
        """Only a full-fp32 run has a rollout that can equal its training forward up to rounding: in 16 bits
        the engine's GEMMs (decode shapes) round differently from the training forward's."""
        return self.compute == "fp32"

    @property
    def rollout_dtype(self) -> str:
        """The rollout dtype that samples in the training precision ("model": the policy's own)."""
        return self.compute if self.storage == "fp32" and self.compute != "fp32" else "model"

    def autocast_context(self, device: torch.device):
        """The training forward's autocast region (a no-op when compute is the storage dtype)."""
        if not self.autocast:
            return nullcontext()
        return torch.autocast(device.type, dtype=HALF_DTYPES[self.compute])

    def bytes_per_param(self, trainable: bool = True) -> dict:
        """Persistent bytes per parameter by part: weights, master copy (or compensation), optimizer state,
        gradient (grpo_fast.trainer.optimizers.OPTIMIZERS has the optimizer's)."""
        from .optimizers import OPTIMIZERS

        w = STORAGE_DTYPES[self.storage].itemsize
        if not trainable:
            return {"weights": w, "master": 0, "optimizer": 0, "gradients": 0}
        spec = OPTIMIZERS[self.optim]
        return {
            "weights": w,
            "master": spec.master_bytes if self.storage != "fp32" else 0,
            "optimizer": spec.state_bytes,
            "gradients": w,
        }


def auto_bf16(device: torch.device, cfg=None) -> tuple[bool, str]:
    """(bf16 autocast on?, why) for --bf16 left unset: where bf16 is measured (or known) faster than fp32. On
    a CPU: GRPO_FAST_CPU_BF16 if set, else the calibration at `cfg`'s shapes (measured once per machine and
    shape, cached), else (measuring off, or no config) the table."""
    if device.type == "cuda":
        if not torch.cuda.is_available():  # sizing a GPU run from here (grpo-fast estimate --device cuda)
            return True, "CUDA, assumed to have bf16 tensor cores (no GPU visible here to ask)"
        cap = torch.cuda.get_device_capability(device)
        if cap >= (8, 0):
            return True, f"the GPU has bf16 tensor cores (compute capability {cap[0]}.{cap[1]} >= 8.0)"
        return False, f"the GPU has no bf16 tensor cores (compute capability {cap[0]}.{cap[1]} < 8.0)"
    if device.type != "cpu":
        return False, f"{device.type}: bf16 speed not measured"
    pinned = os.environ.get(CPU_BF16_ENV, "")
    if pinned:
        if pinned not in ("0", "1"):
            raise ValueError(f"{CPU_BF16_ENV}: expected 0 (fp32) or 1 (bf16 autocast), got {pinned!r}")
        return pinned == "1", f"{CPU_BF16_ENV}={pinned} in the environment"
    from . import calibrate

    if cfg is not None and calibrate.enabled():
        cal, said = _calibration(cfg)
        bf16, why = cal.train_choice()
        return bf16, why + said
    vendor, isa = cpu_class()
    speedup = CPU_BF16_TRAIN_SPEEDUP.get((vendor, isa))
    if speedup is None:
        return False, f"bf16 training speed is not measured on this CPU ({vendor or 'unknown vendor'}, {isa})"
    faster = speedup > 1.0
    return faster, f"bf16 autocast trains at {speedup:.2f}x fp32 on this CPU ({vendor}, {isa})"


def _calibration(cfg):
    """(this machine's calibration at `cfg`'s shapes, what to add to a reason: its cost when measured now)."""
    from . import calibrate

    cal, fresh = calibrate.calibration(calibrate.shapes_of(cfg))
    said = f"; calibrated in {cal.seconds:.1f} s, cached in {calibrate.cache_path()}" if fresh else ""
    return cal, said


def auto_rollout_dtype(device: torch.device, cfg) -> tuple[str, str]:
    """("bf16" | "fp32" | "model", why) for --rollout-dtype auto: on a CPU with fp32 weights, the
    calibration's decode step (bf16 where it measured faster; its mismatch to the fp32 trainer is within
    rollout.dtypes.AUTO_MISMATCH_K3); elsewhere, or with measuring off, the native engine's rule (bf16 where
    the machine multiplies bf16 natively)."""
    from . import calibrate

    if device.type == "cpu" and cfg.dtype == "fp32" and calibrate.enabled():
        cal, said = _calibration(cfg)
        pick, why = cal.rollout_choice()
        return ("fp32" if pick == "model" else pick), why + said
    from ..rollout import dtypes

    pick, why = dtypes.auto_rollout_dtype(device, STORAGE_DTYPES[cfg.dtype])
    return ("fp32" if pick == "model" and cfg.dtype == "fp32" else pick), why


_said: set = set()


def _say(what: str, reason: str) -> None:
    if reason not in _said:
        _said.add(reason)
        print(f"grpo-fast {what} ({reason})", flush=True)


def kept_on_resume(cfg, device: torch.device, main: bool = True):
    """--resume: the precision the run decided before (its latest checkpoint's config) for what the command
    leaves to decide (--bf16 unset, --rollout-dtype auto), so that a run keeps its recipe across restarts,
    hosts, thread counts and torch upgrades; said once, with what this machine's measurement would choose now
    where that differs (`main`: the rank that measures and speaks). Returns cfg with them filled in."""
    from .checkpoint import latest_checkpoint, trainer_state

    if not cfg.resume or (cfg.bf16 is not None and cfg.rollout_dtype != "auto"):
        return cfg
    ckpt = latest_checkpoint(Path(cfg.output_dir))
    if ckpt is None:
        return cfg
    saved = trainer_state(ckpt).get("config") or {}
    kept = {}
    if cfg.bf16 is None and isinstance(saved.get("bf16"), bool):
        kept["bf16"] = saved["bf16"]
    if cfg.rollout_dtype == "auto" and saved.get("rollout_dtype") not in (None, "auto"):
        kept["rollout_dtype"] = saved["rollout_dtype"]
    if not kept or not main:
        return replace(cfg, **kept)
    now = {}
    if "bf16" in kept and cfg.fp16 is False and cfg.dtype == "fp32":
        now["bf16"] = auto_bf16(device, cfg)[0]
    if "rollout_dtype" in kept:
        now["rollout_dtype"] = auto_rollout_dtype(device, cfg)[0]
    names = {"bf16": lambda v: "bf16 autocast" if v else "fp32", "rollout_dtype": lambda v: f"rollout {v}"}
    said = ", ".join(names[k](v) for k, v in kept.items())
    differs = [names[k](v) for k, v in now.items() if v != kept[k] and not (k == "rollout_dtype" and
               {v, kept[k]} <= {"model", "fp32"})]  # fmt: skip
    note = f"; this machine's measurement now differs ({', '.join(differs)})" if differs else ""
    print(
        f"grpo-fast precision: kept from {ckpt.name}: {said}{note}; pass --bf16 / --no-bf16 or "
        "--rollout-dtype to change it",
        flush=True,
    )
    return replace(cfg, **kept)


def resolve_agreed(cfg, device: torch.device, dist):
    """`resolve` under torchrun: rank 0 decides what is left to decide (--bf16 unset, --rollout-dtype auto:
    measured there alone, since ranks measuring at once would time each other's contention) and every rank
    takes its decision (ranks that decided apart would train apart)."""
    if not dist.on or (cfg.bf16 is not None and cfg.rollout_dtype != "auto"):
        return resolve(cfg, device)
    from .distributed import from_rank0

    def decide():
        decided, _ = resolve(cfg, device)
        return decided.bf16, decided.rollout_dtype

    bf16, rollout = from_rank0(decide, dist)
    return resolve(replace(cfg, bf16=bf16, rollout_dtype=rollout), device)


def resolve(cfg, device: torch.device):
    """(cfg with `bf16` decided, Precision): --bf16 unset becomes on or off here (auto), said once with the
    reason; every combination checked, with an error naming the arguments."""
    from .optimizers import check_optimizer

    if cfg.bf16 and cfg.fp16:
        raise ValueError("--bf16 and --fp16 are both set: choose one autocast dtype")
    if cfg.fp16 and cfg.dtype == "bf16":
        raise ValueError("--fp16 with --dtype bf16: fp16 autocast needs fp32 (or fp16) weights; use --bf16")
    bf16, reason = cfg.bf16, "asked for" if cfg.bf16 else ""
    if bf16 is None:
        if cfg.fp16:
            bf16, reason = False, "--fp16 asked for"
        elif cfg.dtype == "bf16":
            bf16, reason = True, "the weights are bf16"
        else:
            bf16, reason = auto_bf16(device, cfg)
            _say(f"precision: {'bf16 autocast' if bf16 else 'fp32'}", reason)
    if cfg.dtype == "bf16" and bf16 is False:
        raise ValueError("--dtype bf16 with --no-bf16: bf16 weights compute in bf16 (drop --no-bf16)")
    compute = "bf16" if bf16 or cfg.dtype == "bf16" else "fp16" if cfg.fp16 else "fp32"
    precision = Precision(cfg.dtype, compute, cfg.optim, reason or ("--fp16" if cfg.fp16 else "fp32"))
    check_optimizer(precision, device)
    rollout = cfg.rollout_dtype
    on_server = cfg.rollout == "vllm" and cfg.vllm_mode == "server"  # a server's dtype is its own
    if rollout == "auto" and not on_server:
        rollout, why = auto_rollout_dtype(device, cfg)
        said = "the policy's own dtype" if rollout == "model" else rollout
        _say(f"rollout dtype auto: {said}", why)
    return replace(cfg, bf16=bool(bf16), rollout_dtype=rollout), precision


def of_config(cfg) -> Precision:
    """The Precision of a config whose `bf16` is already decided (after `resolve`), or of any config on the
    CPU it would run on (auto decided here)."""
    if cfg.bf16 is None:
        return resolve(cfg, torch.device("cpu"))[1]
    compute = "bf16" if cfg.bf16 or cfg.dtype == "bf16" else "fp16" if cfg.fp16 else "fp32"
    return Precision(cfg.dtype, compute, cfg.optim)


def rollout_dtype_of(cfg) -> str:
    """The rollouts' precision: --rollout-dtype, or with "model" the training precision's (a bf16 copy of
    fp32 weights under bf16 autocast: rollouts sample as the policy trains)."""
    return cfg.rollout_dtype if cfg.rollout_dtype != "model" else of_config(cfg).rollout_dtype
