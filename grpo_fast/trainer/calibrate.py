"""Precision by measurement: how fast this CPU trains and samples in each recipe, measured once and cached.

One decoder layer at the run's shapes (hidden, intermediate, heads of its model; one micro-batch's tokens,
capped at MAX_TOKENS) runs forward + backward in each training recipe (`TRAIN_RECIPES`: fp32; bf16 autocast
on fp32 weights; bf16 weights, whose fp32 master and AdamW state live in the optimizer), and one decode step
(a batch of single tokens against a KV cache) in fp32 and bf16, each twice (the second pass in reverse
order; each recipe's faster pass counts, so that other work starting or ending meanwhile does not decide).
Ratios are fp32's time over the recipe's (> 1: faster than fp32). The result is cached in
$GRPO_FAST_CACHE/precision-calibration.json (default ~/.cache/grpo-fast), keyed by CPU model name, flags,
torch version, threads and shapes, so that only a machine's first run of a shape pays the few seconds.
GRPO_FAST_CALIBRATE=0 turns measuring off (precision.py then falls back to its table); GRPO_FAST_CPU_BF16
pins the choice whatever was measured.
"""

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

CALIBRATE_ENV = "GRPO_FAST_CALIBRATE"
# a micro-batch's tokens above this are not measured: the layer's GEMMs have 256+ rows, where CPU BLAS runs
# near its large-M rate, and each recipe takes one or a few calls a pass: ~7 s for both passes at
# SmolLM2-135M's widths where bf16 is emulated (AMD Zen 3, idle: 12x slower than fp32 there)
MAX_TOKENS = 256
DECODE_BATCH, DECODE_CONTEXT = 16, 256
# a recipe is taken over fp32 only when it is this much faster: below it, timer noise on a shared machine
# could flip the choice between runs
MIN_GAIN = 1.05
BUDGET_S = 0.3  # per recipe, after the warm-up call; at least one timed call whatever it costs

TRAIN_RECIPES = ("fp32", "bf16_autocast", "bf16_weights")
DECODE_RECIPES = ("fp32", "bf16")


@dataclass(frozen=True)
class Shapes:
    """What a decoder layer costs: the model's widths and one micro-batch's tokens."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    tokens: int

    @classmethod
    def of_model_config(cls, config: dict, tokens: int) -> "Shapes":
        heads = config.get("num_attention_heads", 1)
        return cls(
            hidden=config["hidden_size"],
            intermediate=config.get("intermediate_size", 4 * config["hidden_size"]),
            heads=heads,
            kv_heads=config.get("num_key_value_heads", heads),
            tokens=max(1, min(tokens, MAX_TOKENS)),
        )


# SmolLM2-135M's: the shapes measured where the run's model config cannot be read without loading it
DEFAULT_MODEL = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
}


def shapes_of(cfg) -> Shapes:
    """The run's layer shapes: its model's config.json (a local directory, or the Hub cache offline), one
    micro-batch of prompt + completion tokens."""
    from .modeling import model_path

    config = None
    try:
        path = Path(model_path(cfg))
        if (path / "config.json").is_file():
            config = json.loads((path / "config.json").read_text())
        else:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(str(path), local_files_only=True).to_dict()
    except Exception:  # the model is checked (and named in the error) where it is loaded
        config = None
    rows = cfg.prompts_per_step * cfg.num_generations // max(1, cfg.gradient_accumulation_steps)
    tokens = rows * (cfg.max_prompt_length + cfg.max_completion_length)
    return Shapes.of_model_config(config or DEFAULT_MODEL, tokens)


class _Layer(torch.nn.Module):
    """A Llama-style decoder layer (RMSNorm, grouped-query attention, SwiGLU): what the GEMMs of one training
    layer cost. RoPE is left out: elementwise, the same in every recipe."""

    def __init__(self, s: Shapes):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s.heads, s.kv_heads, s.hidden // s.heads
        kv = self.kv_heads * self.head_dim
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.q, self.k, self.v, self.o = (
            lin(s.hidden, s.hidden),
            lin(s.hidden, kv),
            lin(s.hidden, kv),
            lin(s.hidden, s.hidden),
        )
        self.gate, self.up, self.down = (
            lin(s.hidden, s.intermediate),
            lin(s.hidden, s.intermediate),
            lin(s.intermediate, s.hidden),
        )
        self.norm1, self.norm2 = torch.nn.RMSNorm(s.hidden), torch.nn.RMSNorm(s.hidden)

    def attention(self, x, cache=None):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        if cache is not None:  # decode: one new token against the cached context
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None, enable_gqa=True)
        return self.o(a.transpose(1, 2).reshape(B, T, -1))

    def forward(self, x, cache=None):
        x = x + self.attention(self.norm1(x), cache)
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _train_step(s: Shapes, recipe: str):
    """A closure running one forward + backward of the layer in `recipe`."""
    layer = _Layer(s)
    dtype = torch.bfloat16 if recipe == "bf16_weights" else torch.float32
    layer = layer.to(dtype)
    x = torch.randn(1, s.tokens, s.hidden, dtype=dtype, requires_grad=True)
    dy = torch.randn(1, s.tokens, s.hidden, dtype=dtype)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe == "bf16_autocast"):
            y = layer(x)
        y.backward(dy.to(y.dtype))

    return step


def _decode_step(s: Shapes, recipe: str):
    """A closure running one decode step of the layer (DECODE_BATCH tokens, DECODE_CONTEXT cached)."""
    dtype = torch.bfloat16 if recipe == "bf16" else torch.float32
    layer = _Layer(s).to(dtype)
    hd = s.hidden // s.heads
    cache = [torch.randn(DECODE_BATCH, s.kv_heads, DECODE_CONTEXT, hd, dtype=dtype) for _ in range(2)]
    x = torch.randn(DECODE_BATCH, 1, s.hidden, dtype=dtype)

    @torch.inference_mode()
    def step():
        layer(x, cache)

    return step


def time_call(name: str, fn) -> float:
    """Seconds per call of `fn` (the median of the timed calls after one warm-up); `name` is the recipe's,
    for a stub that times by name."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    if first > 2 * BUDGET_S:  # a recipe this slow is decided by one call (its one-time costs are noise)
        return first
    times, spent = [], 0.0
    while not times or (spent < BUDGET_S and len(times) < 9):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        spent += times[-1]
    return sorted(times)[len(times) // 2]


@dataclass(frozen=True)
class Calibration:
    """Measured ratios over fp32 (> 1: faster) of each training and decode recipe, and what they cost."""

    train: dict  # recipe -> fp32 time / recipe time (a decoder layer's forward + backward)
    decode: dict  # recipe -> fp32 time / recipe time (a decode step)
    seconds: float  # what measuring cost
    key: str  # what the measurement is valid for (cache_key's)

    def train_choice(self) -> tuple[bool, str]:
        """(bf16 autocast?, why) for --bf16 unset on fp32 weights: the fastest recipe that keeps every
        update (fp32 weights; bf16 weights would need --dtype bf16, which keeps fp32 master weights in the
        optimizer: said, not taken, since it changes what is stored and saved)."""
        r = self.train
        bf16 = r["bf16_autocast"] >= MIN_GAIN
        said = f"measured: bf16 autocast {r['bf16_autocast']:.2f}x fp32"
        if "bf16_weights" in r:
            said += f", bf16 weights (--dtype bf16) {r['bf16_weights']:.2f}x"
        return bf16, f"{said} on this CPU"

    def rollout_choice(self) -> tuple[str, str]:
        """("bf16" | "model", why) for --rollout-dtype auto on an fp32 policy: bf16 where its decode step is
        measured faster (its mismatch to the fp32 trainer is within rollout.native.AUTO_MISMATCH_K3: mean k3
        8.8e-4 measured on SmolLM2-135M)."""
        r = self.decode.get("bf16", 0.0)
        return ("bf16" if r >= MIN_GAIN else "model"), f"measured: bf16 decode step {r:.2f}x fp32 on this CPU"


def cache_path() -> Path:
    root = Path(os.environ.get("GRPO_FAST_CACHE", Path.home() / ".cache" / "grpo-fast"))
    return root / "precision-calibration.json"


def cache_key(shapes: Shapes) -> str:
    """CPU model name, a digest of its flags, torch version and ATen capability, threads, shapes: what a ratio
    depends on."""
    from ..rollout import native

    info = native._cpuinfo()
    flags = hashlib.sha1(" ".join(sorted(native.cpu_flags())).encode()).hexdigest()[:12]
    parts = [
        info.get("model name", "unknown CPU"),
        f"flags {flags}",
        f"torch {torch.__version__}",
        f"ATen {torch.backends.cpu.get_cpu_capability()}",  # ATEN_CPU_CAPABILITY picks other kernels
        f"threads {torch.get_num_threads()}",
        "shapes " + ",".join(f"{k}={v}" for k, v in asdict(shapes).items()),
    ]
    return " | ".join(parts)


def _timed(timer, name: str, fn) -> float:
    """timer(name, fn), or inf (never chosen) for a 16-bit recipe this torch cannot run here: bf16 SDPA under
    ATEN_CPU_CAPABILITY=avx2 on an AMX CPU raises "pack_vnni2 is only supported when avx512 is supported"."""
    try:
        return timer(name, fn)
    except RuntimeError:
        if name.endswith("/fp32"):
            raise
        return math.inf


def measure(shapes: Shapes, timer=None) -> Calibration:
    """Time every recipe at `shapes` (a few seconds; `timer(name, fn)` -> seconds per call, time_call's)."""
    timer = timer or time_call
    t0 = time.perf_counter()
    torch.manual_seed(0)
    steps = {f"train/{r}": _train_step(shapes, r) for r in TRAIN_RECIPES}
    steps |= {f"decode/{r}": _decode_step(shapes, r) for r in DECODE_RECIPES}
    best: dict = {}
    for order in (list(steps), list(steps)[::-1]):  # two passes, the second reversed: each recipe's faster
        for name in order:  # one (other work that came or went meanwhile slows one pass, not both)
            best[name] = min(best.get(name, math.inf), _timed(timer, name, steps[name]))
    train = {r: best[f"train/{r}"] for r in TRAIN_RECIPES}
    decode = {r: best[f"decode/{r}"] for r in DECODE_RECIPES}
    return Calibration(
        train={r: train["fp32"] / t for r, t in train.items()},
        decode={r: decode["fp32"] / t for r, t in decode.items()},
        seconds=time.perf_counter() - t0,
        key=cache_key(shapes),
    )


def calibration(shapes: Shapes, timer=None) -> tuple[Calibration, bool]:
    """(this machine's Calibration at `shapes`, whether it was measured now): from the cache, else measured
    and cached."""
    key, path = cache_key(shapes), cache_path()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if key in cached:
        return Calibration(**cached[key]), False
    cal = measure(shapes, timer)
    cached[key] = asdict(cal)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        tmp.replace(path)  # atomic: concurrent runs each leave a whole file
    except OSError:  # a read-only home still trains; it measures again next time
        pass
    return cal, True


def enabled() -> bool:
    value = os.environ.get(CALIBRATE_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{CALIBRATE_ENV}: expected 0 (use the table) or 1 (measure), got {value!r}")
    return value == "1"


def report() -> dict:
    """This machine measured now at SmolLM2-135M's shapes, with what each choice takes (not cached)."""
    cal = measure(Shapes.of_model_config(DEFAULT_MODEL, MAX_TOKENS))
    return {**asdict(cal), "train_choice": cal.train_choice(), "rollout_choice": cal.rollout_choice()}


if __name__ == "__main__":  # python -m grpo_fast.trainer.calibrate
    print(json.dumps(report(), indent=1))
