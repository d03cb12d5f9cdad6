"""Precision by measurement: how fast this CPU trains and samples in each recipe, measured once and cached.

One decoder layer at the run's shapes (hidden, intermediate, heads of its model; one micro-batch's tokens,
capped at MAX_TOKENS) runs forward + backward in each training recipe (`TRAIN_RECIPES`: fp32; bf16 autocast
on fp32 weights; bf16 weights, whose fp32 master and AdamW state live in the optimizer), and one decode step
(a batch of single tokens against a KV cache, its linear layers in the native engine's fp32 or bf16 format)
in fp32 and bf16. Each recipe is warmed up (its first calls pay
oneDNN's kernel creation), then the recipes of a kind are timed call by call in turn, round after round
(MIN_CALLS to MAX_CALLS rounds, BUDGET_S of timed work per recipe), so that other work on the machine falls
on all of them alike; a recipe's ratio is the median of its per-round ratios fp32 / recipe (> 1: faster than
fp32), with a distribution-free 95% lower bound (the sign test's order statistic). A recipe is chosen only
when that lower bound clears 1.0 and the median MIN_GAIN; a median outside PLAUSIBLE (what no CPU does
between these recipes) is measured again, then recorded as noisy and never chosen. The result is cached in
$GRPO_FAST_CACHE/precision-calibration.json (default ~/.cache/grpo-fast; versioned, written under a file
lock, an unreadable entry measured again with a note), keyed by CPU model name, flags, the ISA settings
that change kernels, torch version, threads and shapes, so that only a machine's first run of a shape pays
the few seconds. GRPO_FAST_CALIBRATE=0 turns measuring off (precision.py then falls back to its table);
GRPO_FAST_CPU_BF16 pins the choice whatever was measured.
"""

import fcntl
import hashlib
import json
import math
import os
import statistics
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
# rounds of timed calls per kind of recipe: at least MIN_CALLS (one pre-empted call moves neither the median
# nor its lower bound, the 2nd smallest of 10), then until every recipe has BUDGET_S of typical timed work
# (rounds x its median call: a pre-empted call does not end the measuring early) and its bounds are on one
# side of fp32, or MAX_CALLS rounds
MIN_CALLS, MAX_CALLS, BUDGET_S = 10, 40, 0.3
# a recipe is taken when its 95% lower bound clears 1.0 and its median this gain: a few percent is not worth
# a 16-bit recipe's rounding (the demo model's bf16 autocast measures 1.03-1.05x with a core busy)
MIN_GAIN = 1.1
SAMPLE_S = 0.02  # a timed sample repeats a call until it lasts this long (time_call)
WARMUP_CALLS = 2  # untimed calls per recipe first: oneDNN creates its kernels for a shape at its first call
# ratios over fp32 that no CPU shows between these recipes (AMX bf16 GEMMs are ~10x AVX-512 fp32 at best;
# emulated bf16 is ~12x slower): a median outside is another process's doing, measured again, then noisy
PLAUSIBLE = (1 / 40, 8.0)
SCHEMA = 2  # of the cache file: {"schema": SCHEMA, "entries": {key: Calibration as a dict}}
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")  # settings that change kernels

TRAIN_RECIPES = ("fp32", "bf16_autocast", "bf16_weights")
DECODE_RECIPES = ("fp32", "bf16")
DECODE_RECIPE_VERSION = 2  # in the cache key: 2, the bf16 step's KV in bf16 (as the engine's, since 2026-12)


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
    """The run's layer shapes: its model's config.json (a local directory, the Hub cache, else fetched from
    the Hub: a few KB the model's load fetches anyway, so that a model not yet downloaded is measured at its
    own widths), one micro-batch of prompt + completion tokens. Where no config can be read, SmolLM2-135M's
    widths, said in one line."""
    from .modeling import model_path

    config, path = None, cfg.model or cfg.task
    try:
        path = model_path(cfg)
        if (Path(path) / "config.json").is_file():
            config = json.loads((Path(path) / "config.json").read_text())
        else:
            from transformers import AutoConfig

            try:
                config = AutoConfig.from_pretrained(path, local_files_only=True).to_dict()
            except OSError:  # not in the cache: its config alone from the Hub
                config = AutoConfig.from_pretrained(path).to_dict()
    except Exception:  # the model is checked (and named in the error) where it is loaded
        config = None
    if config is None:
        print(
            f"grpo-fast precision: no config readable for {path!r}: measured at SmolLM2-135M's widths",
            flush=True,
        )
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
    """A closure running one decode step of the layer as the native engine runs it (DECODE_BATCH tokens,
    DECODE_CONTEXT cached): its linear layers in the rollout dtype's format (oneDNN-packed where the CPU runs
    it natively, `rollout.dtypes.LINEAR_FORMATS`), fp32 activations and norms, the attention over a KV cache
    in the engine's KV dtype for that rollout (`native.kv_dtype`: bf16 for bf16), the queries cast to it."""
    from ..rollout.dtypes import LINEAR_FORMATS
    from ..rollout.native import kv_dtype

    layer = _Layer(s)
    B, hd = DECODE_BATCH, s.hidden // s.heads
    fmt = LINEAR_FORMATS["bf16" if recipe == "bf16" else "fp32"]
    qkv = fmt([m.weight.detach() for m in (layer.q, layer.k, layer.v)], None, B)
    o, down = (fmt([m.weight.detach()], None, B) for m in (layer.o, layer.down))
    gate_up = fmt([m.weight.detach() for m in (layer.gate, layer.up)], None, B)
    kv = kv_dtype(recipe, torch.float32)
    cache = [torch.randn(B, s.kv_heads, DECODE_CONTEXT, hd, dtype=kv) for _ in range(2)]
    x = torch.randn(B, s.hidden)

    @torch.inference_mode()
    def step():
        q = qkv(layer.norm1(x))[:, : s.hidden].to(kv).view(B, s.heads, 1, hd)
        a = F.scaled_dot_product_attention(q, *cache, enable_gqa=True).float()
        y = x + o(a.reshape(B, s.hidden))
        g, u = gate_up(layer.norm2(y)).chunk(2, dim=-1)
        return y + down(F.silu(g) * u)

    return step


def time_call(name: str, fn) -> float:
    """Seconds per call of `fn`, over as many calls as fill SAMPLE_S (a sample shorter than the scheduler's
    time slices is all or nothing on a busy core: one call of a tiny model's layer runs ~0.1 ms); `name` is
    the recipe's, for a stub that times by name."""
    calls, t0 = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        spent = time.perf_counter() - t0
        if spent >= SAMPLE_S:
            return spent / calls


def lower_bound_index(n: int, alpha: float = 0.05) -> int:
    """k such that the k-th smallest of n samples (0-based) is a one-sided (1 - alpha) lower confidence bound
    of their median: the largest k with P(Binomial(n, 1/2) <= k) <= alpha (0 when n is too small for any
    bound but the minimum)."""
    cdf = lambda k: sum(math.comb(n, i) for i in range(k + 1)) / 2**n  # noqa: E731
    return max((k for k in range(n) if cdf(k) <= alpha), default=0)


def summarize(ratios: list) -> dict:
    """The median of paired ratios and its 95% lower and upper confidence bounds (sign test order stats)."""
    r = sorted(ratios)
    n, k = len(r), lower_bound_index(len(r))
    mid = r[n // 2] if n % 2 else (r[n // 2 - 1] + r[n // 2]) / 2
    return {"ratio": mid, "low": r[k], "high": r[n - 1 - k], "n": n}


@dataclass(frozen=True)
class Calibration:
    """Measured ratios over fp32 (> 1: faster) of each training and decode recipe, their confidence, and what
    measuring cost."""

    train: dict  # recipe -> fp32 time / recipe time (a decoder layer's forward + backward), the median
    decode: dict  # recipe -> fp32 time / recipe time (a decode step)
    seconds: float  # what measuring cost
    key: str  # what the measurement is valid for (cache_key's)
    bounds: dict = None  # "train/<recipe>" -> [low, high]: the median's 95% confidence bounds
    calls: dict = None  # "train" / "decode" -> timed rounds
    noisy: tuple = ()  # recipes whose median stayed implausible (PLAUSIBLE) when measured again: never taken

    def _taken(self, kind: str, recipe: str) -> bool:
        low = (self.bounds or {}).get(f"{kind}/{recipe}", [0.0, 0.0])[0]
        r = getattr(self, kind).get(recipe, 0.0)
        return f"{kind}/{recipe}" not in self.noisy and low > 1.0 and r >= MIN_GAIN

    def _said(self, kind: str, recipe: str, what: str) -> str:
        r = getattr(self, kind).get(recipe, 0.0)
        low, high = (self.bounds or {}).get(f"{kind}/{recipe}", [r, r])
        noisy = ", noisy: not taken" if f"{kind}/{recipe}" in self.noisy else ""
        return f"{what} {r:.2f}x fp32 (95% {low:.2f}-{high:.2f}{noisy})"

    def train_choice(self) -> tuple[bool, str]:
        """(bf16 autocast?, why) for --bf16 unset on fp32 weights: bf16 autocast where its lower bound clears
        1.0 (bf16 weights would need --dtype bf16, which keeps fp32 master weights in the optimizer: said, not
        taken, since it changes what is stored and saved)."""
        said = "measured: " + self._said("train", "bf16_autocast", "bf16 autocast")
        if "bf16_weights" in self.train:
            said += ", " + self._said("train", "bf16_weights", "bf16 weights (--dtype bf16)")
        return self._taken("train", "bf16_autocast"), f"{said} on this CPU"

    def rollout_choice(self) -> tuple[str, str]:
        """("bf16" | "model", why) for --rollout-dtype auto on an fp32 policy: bf16 where its decode step is
        measured faster, lower bound over 1.0 (its mismatch to the fp32 trainer is within
        rollout.dtypes.AUTO_MISMATCH_K3: mean k3 8.8e-4 measured on SmolLM2-135M)."""
        said = "measured: " + self._said("decode", "bf16", "bf16 decode step")
        return ("bf16" if self._taken("decode", "bf16") else "model"), f"{said} on this CPU"


def cache_path() -> Path:
    root = Path(os.environ.get("GRPO_FAST_CACHE", Path.home() / ".cache" / "grpo-fast"))
    return root / "precision-calibration.json"


def cache_key(shapes: Shapes) -> str:
    """CPU model name, a digest of its flags, torch version and ATen capability, the ISA settings of the
    environment, threads, shapes, a digest of the CPU decode kernels' source (the decode recipes run their
    linear kernel: a newer kernel is measured again) and the decode recipe's version: what a ratio depends
    on."""
    from ..rollout import cpu_decode, dtypes

    info = dtypes.cpu_info()
    flags = hashlib.sha1(" ".join(sorted(dtypes.cpu_flags())).encode()).hexdigest()[:12]
    isa = [f"{k}={os.environ[k]}" for k in ISA_ENV if os.environ.get(k)]
    parts = [
        info.get("model name", "unknown CPU"),
        f"flags {flags}",
        f"torch {torch.__version__}",
        f"ATen {torch.backends.cpu.get_cpu_capability()}",  # ATEN_CPU_CAPABILITY picks other kernels
        *isa,
        f"threads {torch.get_num_threads()}",
        "shapes " + ",".join(f"{k}={v}" for k, v in asdict(shapes).items()),
        "decode kernels " + hashlib.sha1(cpu_decode._SOURCE.encode()).hexdigest()[:8],
        f"decode recipe {DECODE_RECIPE_VERSION}",
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


def _rounds(timer, steps: dict) -> dict:
    """{name: [seconds per call, one per round]} of recipes timed call by call in turn (the order reversed
    every other round, so that a slowdown starting or ending inside a round falls on both ends alike)."""
    names = list(steps)
    for name in names:
        for _ in range(WARMUP_CALLS):
            if _timed(timer, name, steps[name]) == math.inf:
                break
    times: dict = {name: [] for name in names}
    while True:
        order = names if len(times[names[0]]) % 2 == 0 else names[::-1]
        for name in order:
            ran = times[name] and times[name][-1] == math.inf
            times[name].append(math.inf if ran else _timed(timer, name, steps[name]))
        n = len(times[names[0]])
        spent = min(n * statistics.median(t) for t in times.values())
        if n >= MIN_CALLS and (n >= MAX_CALLS or (spent >= BUDGET_S and _decided(times))):
            return times


def _decided(times: dict) -> bool:
    """Whether every recipe's 95% bounds are on one side of fp32 (1.0): while one straddles it, more rounds
    (up to MAX_CALLS) narrow it, so that a busy machine decides as an idle one does."""
    recipes = [n for n, t in times.items() if not n.endswith("/fp32") and math.inf not in t]
    got = _ratios(times)
    return all(not got[n]["low"] <= 1.0 <= got[n]["high"] for n in recipes)


def _ratios(times: dict) -> dict:
    """{name: summarize(fp32 / that recipe, round by round)} of one kind's rounds (fp32's own: 1)."""
    base = next(t for name, t in times.items() if name.endswith("/fp32"))
    return {name: summarize([b / x for b, x in zip(base, t)]) for name, t in times.items()}


def measure(shapes: Shapes, timer=None) -> Calibration:
    """Time every recipe at `shapes` (a few seconds; `timer(name, fn)`: seconds of one call, as time_call)."""
    timer = timer or time_call
    t0 = time.perf_counter()
    torch.manual_seed(0)
    kinds = {"train": (TRAIN_RECIPES, _train_step), "decode": (DECODE_RECIPES, _decode_step)}
    stats, calls, noisy = {}, {}, []
    for kind, (recipes, make) in kinds.items():
        steps = {f"{kind}/{r}": make(shapes, r) for r in recipes}
        for attempt in range(2):  # an implausible median is measured again once
            times = _rounds(timer, steps)
            got = _ratios(times)
            odd = [
                n for n, g in got.items() if g["ratio"] > 0 and not PLAUSIBLE[0] <= g["ratio"] <= PLAUSIBLE[1]
            ]
            if not odd:
                break
        noisy += odd
        calls[kind] = len(times[f"{kind}/fp32"])
        stats |= got
    return Calibration(
        train={r: stats[f"train/{r}"]["ratio"] for r in TRAIN_RECIPES},
        decode={r: stats[f"decode/{r}"]["ratio"] for r in DECODE_RECIPES},
        seconds=time.perf_counter() - t0,
        key=cache_key(shapes),
        bounds={name: [g["low"], g["high"]] for name, g in stats.items()},
        calls=calls,
        noisy=tuple(noisy),
    )


def _entry(raw, key: str) -> Calibration:
    """A cached entry as a Calibration, or ValueError saying what is wrong with it."""
    if not isinstance(raw, dict):
        raise ValueError(f"an entry of type {type(raw).__name__}, not an object")
    need = {"train": TRAIN_RECIPES, "decode": DECODE_RECIPES}
    for kind, recipes in need.items():
        got = raw.get(kind)
        if not isinstance(got, dict) or any(not isinstance(got.get(r), (int, float)) for r in recipes):
            raise ValueError(f"no {kind} ratio for each of {', '.join(recipes)}")
    bounds = raw.get("bounds")
    names = [f"{k}/{r}" for k, rs in need.items() for r in rs]
    if not isinstance(bounds, dict) or any(
        not isinstance(bounds.get(n), list) or len(bounds[n]) != 2 for n in names
    ):
        raise ValueError("no confidence bounds")
    if not isinstance(raw.get("seconds"), (int, float)) or raw.get("key") != key:
        raise ValueError("no cost or another key")
    return Calibration(
        train=dict(raw["train"]), decode=dict(raw["decode"]), seconds=float(raw["seconds"]), key=key,
        bounds={n: list(bounds[n]) for n in names}, calls=dict(raw.get("calls") or {}),
        noisy=tuple(raw.get("noisy") or ()),
    )  # fmt: skip


def _read(path: Path) -> tuple[dict, str | None]:
    """(the cache's entries, what is wrong with the file or None): a missing file is an empty cache."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}, None
    except OSError as exc:
        return {}, f"unreadable ({exc.strerror})"
    try:
        data = json.loads(text)
    except ValueError:
        return {}, "not JSON"
    if (
        not isinstance(data, dict)
        or data.get("schema") != SCHEMA
        or not isinstance(data.get("entries"), dict)
    ):
        return {}, f"not a schema-{SCHEMA} calibration cache"
    return data["entries"], None


def _note(path: Path, why: str) -> None:
    print(f"grpo-fast precision: {path}: {why}; measuring again", flush=True)


def _store(path: Path, key: str, entry: dict) -> None:
    """One entry added under an exclusive lock (read, merge, atomic replace): concurrent runs keep all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries, _ = _read(path)  # a file another writer left malformed is replaced by a sound one
        entries[key] = entry
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"schema": SCHEMA, "entries": entries}, indent=1))
        tmp.replace(path)


def calibration(shapes: Shapes, timer=None) -> tuple[Calibration, bool]:
    """(this machine's Calibration at `shapes`, whether it was measured now): from the cache, else measured
    and cached. A cache file or entry that cannot be read is measured again, with a one-line note."""
    key, path = cache_key(shapes), cache_path()
    entries, wrong = _read(path)
    if wrong:
        _note(path, wrong)
    elif key in entries:
        try:
            return _entry(entries[key], key), False
        except ValueError as exc:
            _note(path, f"its entry for this machine and shape is unusable ({exc})")
    cal = measure(shapes, timer)
    try:
        _store(path, key, asdict(cal))
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
