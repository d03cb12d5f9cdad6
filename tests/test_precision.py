"""Precision recipes (grpo_fast.trainer.precision, grpo_fast.trainer.optimizers): bf16 weights that keep
their updates, bf16 autocast on fp32 master weights, the choices and their errors. References: AdamW written
out in fp64 here, naive full-logit GRPO in fp64 and in plain autocast, TRL's and transformers' own config
classes."""

import json
import math
import shutil
from dataclasses import asdict

import pytest
import torch
from oracle import naive_grpo_loss
from replay import first_step_batch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import grpo_fast.trainer.setup as setup_mod
from grpo_fast.rollout import dtypes
from grpo_fast.tasks import default_task
from grpo_fast.trainer import precision
from grpo_fast.trainer.config import parse_config
from grpo_fast.trainer.evaluate import eval_engine_options
from grpo_fast.trainer.optimizers import OPTIMIZERS, AdamW16, build_optimizer, stochastic_round_bf16
from grpo_fast.trainer.step import engine_options, sampling_correction
from grpo_fast.trainer.train import train

ASSET = default_task.ASSET_DIR
QUICK = ["--num-generations", "4", "--prompts-per-step", "2", "--max-completion-length", "16",
         "--eval-max-samples", "0", "--save-steps", "0", "--warmup-steps", "0",
         "--lr-scheduler-type", "constant"]  # fmt: skip


def _cfg(out, *extra):
    return parse_config(["--output-dir", str(out), *QUICK, *extra])


# --------------------------------------------------------------------------------------------------------
# The optimizer against AdamW in fp64
# --------------------------------------------------------------------------------------------------------
def fp64_adamw(w0, grads, lr, wd, betas=(0.9, 0.999), eps=1e-8):
    """torch.optim.AdamW's update (decoupled weight decay, bias-corrected moments), written out in fp64."""
    w = w0.double().clone()
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    b1, b2 = betas
    for t, g in enumerate(grads, 1):
        g = g.double()
        w = w * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        w = w - lr / (1 - b1**t) * m / ((v / (1 - b2**t)).sqrt() + eps)
    return w


def _bf16_problem(steps=10, shape=(384, 97)):
    g = torch.Generator().manual_seed(3)
    w0 = (torch.randn(shape, generator=g) * 0.02).bfloat16()  # a linear layer's init
    grads = [torch.randn(shape, generator=g).bfloat16() for _ in range(steps)]
    return w0, grads


def _run(opt_factory, w0, grads):
    p = torch.nn.Parameter(w0.clone())
    opt = opt_factory([p])
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt.state[p]


@pytest.mark.parametrize("lr", [1e-6, 1e-5])
def test_master_weights_follow_fp64_adamw_and_the_weight_is_their_rounding(lr):
    w0, grads = _bf16_problem()
    ref = fp64_adamw(w0, grads, lr, wd=0.01)
    for optim in ("adamw_torch_fused", "adamw_torch"):
        p, st = _run(lambda ps: build_optimizer(ps, optim, lr, weight_decay=0.01), w0, grads)
        assert p.dtype == torch.bfloat16 and st["master"].dtype == torch.float32
        err = (st["master"].double() - ref).abs().max().item()
        fp32_rounding = len(grads) * 2.0**-24 * ref.abs().max().item()  # half an fp32 ulp per step
        assert err <= 2 * fp32_rounding, f"{optim}: master vs fp64 AdamW max err {err:.3g}"
        assert torch.equal(p, st["master"].bfloat16())  # round to nearest of the fp32 weight
        assert (p != ref.float().bfloat16()).float().mean() < 1e-3  # fp64's rounding but for near-ties


@pytest.mark.parametrize("lr", [1e-6, 1e-5])
def test_kahan_weight_plus_compensation_follows_fp64_adamw(lr):
    w0, grads = _bf16_problem()
    ref = fp64_adamw(w0, grads, lr, wd=0.01)
    p, st = _run(lambda ps: build_optimizer(ps, "adamw_kahan", lr, weight_decay=0.01), w0, grads)
    assert st["compensation"].dtype == torch.bfloat16
    moved = (ref - w0.double()).abs().mean().item()
    err = (p.double() + st["compensation"].double() - ref).abs()
    # the compensation's own bf16 rounding is what remains: ~0.3% of the movement (plain AdamW: ~90-100%)
    assert err.mean() < 0.01 * moved and err.max() < 0.1 * moved, (err.mean() / moved, err.max() / moved)
    # the stored weight is the fp64 result's nearest bf16 almost everywhere (ties of the compensation aside)
    assert (p != ref.float().bfloat16()).float().mean() < 0.01


def test_plain_adamw_on_bf16_weights_loses_the_updates_our_optimizers_keep():
    """What --dtype bf16 did before: torch AdamW on bf16 weights. Its weights end far from fp64 AdamW's on
    the bf16 grid; every AdamW16 mode moves them as far as fp64 AdamW does (stochastic: unbiased, noisier)."""
    lr = 1e-5
    w0, grads = _bf16_problem(steps=12)
    target = fp64_adamw(w0, grads, lr, wd=0.0).float().bfloat16().double()
    ref_moved = (target - w0.double()).abs().mean().item()

    def moved(p):
        return (p.double() - w0.double()).abs().mean().item() / ref_moved

    plain, _ = _run(lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.0), w0, grads)
    assert moved(plain) < 0.5
    for optim in ("adamw_torch_fused", "adamw_kahan", "adamw_stochastic"):
        p, _ = _run(lambda ps: build_optimizer(ps, optim, lr), w0, grads)
        assert 0.5 <= moved(p) <= 2.0, (optim, moved(p))


def test_stochastic_rounding_is_unbiased_and_exact_on_the_grid():
    g = torch.Generator().manual_seed(0)
    grid = torch.randn(1000, generator=g).bfloat16().float()
    assert torch.equal(stochastic_round_bf16(grid, g).float(), grid)
    # 0.25 of an ulp above a grid value: rounds up a quarter of the time, the mean is the value
    x = torch.full((200_000,), 1.0 + 2.0**-7 / 4)
    r = stochastic_round_bf16(x, g).double()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    assert abs((r == 1.0 + 2.0**-7).double().mean().item() - 0.25) < 0.005
    assert abs(r.mean().item() - x.double()[0].item()) < 1e-5
    neg = stochastic_round_bf16(-x, g).double()
    assert abs(neg.mean().item() + x.double()[0].item()) < 1e-5


def test_fp32_parameters_step_as_torch_adamw_does():
    g = torch.Generator().manual_seed(1)
    w0 = torch.randn(64, 33, generator=g)
    grads = [torch.randn(64, 33, generator=g) for _ in range(5)]
    a, _ = _run(lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1), w0, grads)
    b, _ = _run(lambda ps: AdamW16(ps, lr=1e-3, weight_decay=0.1, mode="kahan", fused=False), w0, grads)
    assert torch.allclose(a, b, rtol=0, atol=1e-7)
    opt = build_optimizer([torch.nn.Parameter(w0.clone())], "adamw_torch_fused", 1e-3)
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"]  # all-fp32: torch's own, as HF builds it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch", "adamw_kahan", "adamw_stochastic"])
def test_a_step_marks_the_stepped_parameters_changed(optim, dtype):
    """Whatever keys on version counters (the vLLM engine pushes the weights whose version changed) sees
    every step: torch's fused AdamW alone does not bump them."""
    if optim == "adamw_stochastic" and dtype == torch.float32:
        pytest.skip("fp32 weights need no rounding")
    stepped, frozen = torch.nn.Parameter(torch.randn(8, dtype=dtype)), torch.nn.Parameter(torch.randn(8))
    opt = build_optimizer([stepped, frozen], optim, 1e-3)
    before = stepped._version, frozen._version
    stepped.grad = torch.ones_like(stepped)
    opt.step()
    assert stepped._version > before[0] and frozen._version == before[1]


def test_optimizer_names_and_default_are_transformers_own(tmp_path):
    from transformers.training_args import OptimizerNames
    from trl import GRPOConfig as TRLConfig

    ours = {f.name: f for f in __import__("dataclasses").fields(parse_config([]).__class__)}
    trl_cfg = TRLConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    trl_optim = getattr(trl_cfg.optim, "value", trl_cfg.optim)
    assert ours["optim"].default == trl_optim
    hf = {o.value for o in OptimizerNames}
    assert {"adamw_torch_fused", "adamw_torch", "adamw_8bit", "paged_adamw_8bit"} <= hf
    assert set(ours["optim"].metadata["choices"]) == set(OPTIMIZERS)
    assert set(OPTIMIZERS) - hf == {"adamw_kahan", "adamw_stochastic"}  # ours: HF has no name for these
    # TRL's mixed-precision flags keep their names here; its bf16 means autocast on fp32 weights
    assert hasattr(trl_cfg, "bf16") and hasattr(trl_cfg, "fp16") and trl_cfg.bf16 is True


def test_8bit_optimizers_refuse_bf16_weights():
    with pytest.raises(ValueError, match="--optim adamw_8bit.*--dtype bf16|needs bitsandbytes"):
        precision.resolve(parse_config(["--dtype", "bf16", "--optim", "adamw_8bit"]), torch.device("cpu"))


# --------------------------------------------------------------------------------------------------------
# Choosing the precision
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "vendor,flags,on",
    [
        ("AuthenticAMD", {"avx2", "fma"}, False),  # Zen 3, measured: 0.04x
        ("GenuineIntel", {"avx2", "avx512f", "avx512_bf16", "avx512_fp16"}, False),  # measured: 0.78x
        ("AuthenticAMD", {"avx2", "avx512f", "avx512_bf16"}, True),  # Zen 4, measured: 1.71x
        ("GenuineIntel", {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, False),  # not measured
        ("", {"avx2", "avx512f", "avx512_bf16"}, False),  # no vendor: no row
    ],
)
def test_auto_bf16_reads_the_measured_table(monkeypatch, vendor, flags, on):
    monkeypatch.delenv(precision.CPU_BF16_ENV, raising=False)
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: flags)
    monkeypatch.setattr(dtypes, "cpu_vendor", lambda: vendor)
    got, why = precision.auto_bf16(torch.device("cpu"))
    isa = precision.cpu_isa(flags)
    assert got is on and isa in why
    measured = precision.CPU_BF16_TRAIN_SPEEDUP.get((vendor, isa))
    assert got == (measured is not None and measured > 1.0)
    monkeypatch.setattr(precision, "CPU_BF16_TRAIN_SPEEDUP", {(vendor, isa): 1.4})
    assert precision.auto_bf16(torch.device("cpu"))[0] is True  # a faster measurement turns it on
    monkeypatch.setattr(precision, "CPU_BF16_TRAIN_SPEEDUP", {(vendor, isa): 0.9})
    assert precision.auto_bf16(torch.device("cpu"))[0] is False


def _stub_timer(train, decode):
    """A timer that says each recipe's seconds per call by name (a list: call by call, cycled), and counts
    its calls."""
    calls = []

    def timer(name, fn):
        calls.append(name)
        kind, recipe = name.split("/")
        t = (train if kind == "train" else decode)[recipe]
        return t[calls.count(name) % len(t)] if isinstance(t, list) else t

    return timer, calls


@pytest.mark.parametrize(
    "train,decode,bf16,rollout",
    [
        ({"fp32": 1.0, "bf16_autocast": 0.5, "bf16_weights": 0.4}, {"fp32": 1.0, "bf16": 0.8}, True, "bf16"),
        (
            {"fp32": 1.0, "bf16_autocast": 1.3, "bf16_weights": 0.7},
            {"fp32": 1.0, "bf16": 1.2},
            False,
            "model",
        ),
        # faster in half the rounds, slower in the others: noise, not a gain (the 95% bound is below 1)
        (
            {"fp32": 1.0, "bf16_autocast": [0.9, 1.08], "bf16_weights": 0.97},
            {"fp32": 1.0, "bf16": [0.93, 1.1]},
            False,
            "model",
        ),
    ],
)
def test_auto_bf16_follows_the_measurement(tmp_path, monkeypatch, train, decode, bf16, rollout):
    """--bf16 unset on a CPU takes what a stubbed timer measured, says the ratio, caches it (a second run
    measures nothing) under GRPO_FAST_CACHE; GRPO_FAST_CPU_BF16 still pins; measuring off reads the table."""
    from grpo_fast.trainer import calibrate

    monkeypatch.delenv(precision.CPU_BF16_ENV, raising=False)
    monkeypatch.setenv("GRPO_FAST_CACHE", str(tmp_path))
    timer, calls = _stub_timer(train, decode)
    monkeypatch.setattr(calibrate, "time_call", timer)
    cfg = parse_config([])
    got, why = precision.auto_bf16(torch.device("cpu"), cfg)
    said = "bf16 autocast "  # the ratio with its bounds; a noise-free timer's bounds are the ratio itself
    if not isinstance(train["bf16_autocast"], list):
        ratio = train["fp32"] / train["bf16_autocast"]
        said = f"bf16 autocast {ratio:.2f}x fp32 (95% {ratio:.2f}-{ratio:.2f})"
    assert got is bf16 and said in why and "calibrated in" in why, why
    # seconds per call >= the budget: each recipe warmed up, then timed MIN_CALLS rounds; a kind whose
    # bounds straddle fp32 (the noisy timer) is timed for MAX_CALLS rounds
    want = []
    for kind, ratios in (("train", train), ("decode", decode)):
        noisy = any(isinstance(t, list) for t in ratios.values())
        n = calibrate.WARMUP_CALLS + (calibrate.MAX_CALLS if noisy else calibrate.MIN_CALLS)
        want += n * [f"{kind}/{r}" for r in ratios]
    assert sorted(calls) == sorted(want)
    cal, fresh = calibrate.calibration(calibrate.shapes_of(cfg))
    assert not fresh and len(calls) == len(want)  # from the cache
    assert cal.rollout_choice()[0] == rollout
    cpu = torch.device("cpu")  # --rollout-dtype auto: the decode measurement decides; engines see its pick
    auto = parse_config(["--rollout-dtype", "auto"])
    assert precision.resolve(auto, cpu)[0].rollout_dtype == ("bf16" if rollout == "bf16" else "fp32")
    server = ["--rollout", "vllm", "--vllm-mode", "server", "--vllm-server-base-url", "http://127.0.0.1:1"]
    on_server = parse_config([*server, "--rollout-dtype", "auto"])
    assert precision.resolve(on_server, cpu)[0].rollout_dtype == "auto"  # the server's dtype is its own
    cached = json.loads(calibrate.cache_path().read_text())
    assert cached["schema"] == calibrate.SCHEMA and list(cached["entries"]) == [cal.key]
    assert calibrate.cache_key(calibrate.shapes_of(cfg)) == cal.key
    assert "torch " + torch.__version__ in cal.key and f"threads {torch.get_num_threads()}" in cal.key
    for value in ("0", "1"):  # the environment pins whatever was measured
        monkeypatch.setenv(precision.CPU_BF16_ENV, value)
        assert precision.auto_bf16(torch.device("cpu"), cfg)[0] is (value == "1")
    monkeypatch.delenv(precision.CPU_BF16_ENV)
    monkeypatch.setenv(calibrate.CALIBRATE_ENV, "0")  # measuring off: the table's fallback
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: {"avx2"})
    monkeypatch.setattr(dtypes, "cpu_vendor", lambda: "AuthenticAMD")
    assert precision.auto_bf16(torch.device("cpu"), cfg) == (
        False,
        precision.auto_bf16(torch.device("cpu"))[1],
    )
    assert len(calls) == len(want)


SHAPES_SMALL = dict(hidden=64, intermediate=128, heads=2, kv_heads=1, tokens=8)


@pytest.mark.parametrize("bf16_s,chosen", [(0.8, True), (1.25, False)])
def test_one_preempted_call_per_recipe_does_not_decide(bf16_s, chosen):
    """Each recipe has one call 60x slower than its others (another process ran then): the rounds' median
    keeps each recipe's real ratio, bf16 is taken when it is faster (its 95% bound over 1) and only then,
    and nothing implausible is stored."""
    from grpo_fast.trainer import calibrate

    seen: dict = {}
    base = {"fp32": 0.01, "bf16_autocast": 0.01 * bf16_s, "bf16_weights": 0.012, "bf16": 0.01 * bf16_s}

    def timer(name, fn):
        seen[name] = seen.get(name, 0) + 1
        t = base[name.split("/")[1]]
        outlier = {"fp32": 4, "bf16_autocast": 6, "bf16_weights": 5, "bf16": 7}[name.split("/")[1]]
        return 60 * t if seen[name] == calibrate.WARMUP_CALLS + outlier else t

    cal = calibrate.measure(calibrate.Shapes(**SHAPES_SMALL), timer)
    assert cal.train["bf16_autocast"] == pytest.approx(1 / bf16_s) and cal.decode["bf16"] == pytest.approx(
        1 / bf16_s
    )
    assert cal.train_choice()[0] is chosen and (cal.rollout_choice()[0] == "bf16") is chosen
    low, high = cal.bounds["train/bf16_autocast"]
    assert low * (1 - 1e-9) <= 1 / bf16_s <= high * (1 + 1e-9) and not cal.noisy
    assert all(
        calibrate.PLAUSIBLE[0] <= r <= calibrate.PLAUSIBLE[1]
        for r in [*cal.train.values(), *cal.decode.values()]
    )


def test_an_implausible_ratio_is_measured_again_then_never_taken():
    """bf16 autocast 100x fp32 in every round (no CPU does that: the fp32 calls were starved): measured a
    second time, stored as noisy and not taken; the decode recipes, plausible, are measured once."""
    from grpo_fast.trainer import calibrate

    timer, calls = _stub_timer(
        {"fp32": 100.0, "bf16_autocast": 1.0, "bf16_weights": 90.0}, {"fp32": 1.0, "bf16": 0.5}
    )
    cal = calibrate.measure(calibrate.Shapes(**SHAPES_SMALL), timer)
    n = calibrate.WARMUP_CALLS + calibrate.MIN_CALLS
    assert calls.count("train/fp32") == 2 * n and calls.count("decode/fp32") == n
    assert cal.noisy == ("train/bf16_autocast",) and cal.train_choice()[0] is False
    assert "noisy: not taken" in cal.train_choice()[1]
    assert cal.rollout_choice()[0] == "bf16"  # 2x, plausible, its bound over 1


@pytest.mark.parametrize(
    "content,why",
    [
        ("null", "not a schema-2 calibration cache"),
        ("[]", "not a schema-2 calibration cache"),
        ("{not json", "not JSON"),
        ('{"some-key": {"train": {}}}', "not a schema-2 calibration cache"),  # the schema-1 layout
        ("ENTRY_WITHOUT_SECONDS", "unusable (no cost or another key)"),
        ("ENTRY_WITHOUT_AUTOCAST", "unusable (no train ratio for each of"),
        ("ENTRY_NOT_AN_OBJECT", "unusable (an entry of type list, not an object)"),
    ],
)
def test_a_malformed_cache_is_measured_again_with_a_note(tmp_path, monkeypatch, capsys, content, why):
    """Valid JSON of another shape, or none at all: the run measures again, says so naming the file, and
    leaves a sound cache behind."""
    from grpo_fast.trainer import calibrate

    monkeypatch.setenv("GRPO_FAST_CACHE", str(tmp_path))
    shapes = calibrate.Shapes(**SHAPES_SMALL)
    timer, calls = _stub_timer(
        {"fp32": 1.0, "bf16_autocast": 0.5, "bf16_weights": 0.9}, {"fp32": 1.0, "bf16": 0.5}
    )
    good = asdict(calibrate.measure(shapes, timer))
    entry = {
        "ENTRY_WITHOUT_SECONDS": {k: v for k, v in good.items() if k != "seconds"},
        "ENTRY_WITHOUT_AUTOCAST": dict(good, train={"fp32": 1.0, "bf16_weights": 1.1}),
        "ENTRY_NOT_AN_OBJECT": [1, 2],
    }.get(content)
    if entry is not None:
        content = json.dumps({"schema": calibrate.SCHEMA, "entries": {good["key"]: entry}})
    calibrate.cache_path().write_text(content)
    calls.clear()
    cal, fresh = calibrate.calibration(shapes, timer)
    out = capsys.readouterr().out
    assert (
        fresh and calls and f"{calibrate.cache_path()}: " in out and why in out and "measuring again" in out
    ), out
    assert calibrate.calibration(shapes, timer) == (cal, False)  # the file it left is sound


STORE_SCRIPT = """
import sys
from pathlib import Path
from grpo_fast.trainer import calibrate
path, who = Path(sys.argv[1]), sys.argv[2]
for i in range(25):
    calibrate._store(path, f"{who}-{i}", {"i": i})
"""


def test_concurrent_writers_keep_every_entry(tmp_path):
    """Three runs calibrating at once, each storing 25 entries: all 75 are in the file (read-merge-replace
    under the lock; without it a writer's replace drops what another wrote meanwhile)."""
    import subprocess
    import sys

    script = tmp_path / "store.py"
    script.write_text(STORE_SCRIPT)
    path = tmp_path / "cache" / "precision-calibration.json"
    procs = [subprocess.Popen([sys.executable, str(script), str(path), w]) for w in "abc"]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    data = json.loads(path.read_text())
    assert data["schema"] == 2 and len(data["entries"]) == 75


RANK_SCRIPT = """
import json, os, sys
import torch, torch.distributed as td
from grpo_fast.trainer import calibrate, precision
from grpo_fast.trainer.config import parse_config
from grpo_fast.trainer.distributed import DistInfo

rank = int(sys.argv[1])
os.environ["GRPO_FAST_CACHE"] = sys.argv[2] + f"/cache-{rank}"  # each rank its own: none reads another's
os.environ.pop("GRPO_FAST_CPU_BF16", None)
measured = []

def timer(name, fn):  # rank 0: bf16 measured faster in both; a rank 1 that measured would say fp32
    measured.append(name)
    return {"fp32": 1.0}.get(name.split("/")[1], 0.5 if rank == 0 else 2.0)

calibrate.time_call = timer
td.init_process_group("gloo", init_method="file://" + sys.argv[2] + "/store", rank=rank, world_size=2)
cfg, prec = precision.resolve_agreed(parse_config(["--rollout-dtype", "auto"]), torch.device("cpu"),
                                     DistInfo(rank=rank, world=2, kind="ddp"))
said = {"bf16": cfg.bf16, "rollout": cfg.rollout_dtype, "compute": prec.compute, "measured": measured}
print(json.dumps(said))
td.barrier()  # every rank is done before any tears the group down (gloo aborts a rank torn down mid-use)
td.destroy_process_group()
# no interpreter teardown: gloo's threads torn down there aborted a rank once in CI ("terminate called
# without an active exception", after its answer was printed); what the test reads is out by now
sys.stdout.flush()
os._exit(0)
"""


def test_under_torchrun_rank_0_alone_measures_and_every_rank_takes_its_choice(tmp_path):
    """--bf16 unset and --rollout-dtype auto under torchrun: rank 0 measures (each rank's timer would say
    otherwise), the others measure nothing and train and sample as rank 0 decided."""
    import subprocess
    import sys

    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    cmd = [sys.executable, str(script)]
    procs = [
        subprocess.Popen([*cmd, str(r), str(tmp_path)], stdout=subprocess.PIPE, text=True) for r in [0, 1]
    ]
    said = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert said[0]["measured"] and not said[1]["measured"], said
    for s in said:
        assert (s["bf16"], s["rollout"], s["compute"]) == (True, "bf16", "bf16"), said


def test_the_calibration_measures_this_machine_in_seconds(tmp_path, monkeypatch):
    """A real measurement at small shapes: every recipe timed, fp32 the unit, the cost said and cached."""
    from grpo_fast.trainer import calibrate

    monkeypatch.setenv("GRPO_FAST_CACHE", str(tmp_path))
    shapes = calibrate.Shapes(hidden=128, intermediate=384, heads=4, kv_heads=2, tokens=128)
    cal, fresh = calibrate.calibration(shapes)
    assert fresh and cal.seconds < 20
    assert set(cal.train) == set(calibrate.TRAIN_RECIPES) and set(cal.decode) == set(calibrate.DECODE_RECIPES)
    assert cal.train["fp32"] == cal.decode["fp32"] == 1.0
    assert all(0 <= r < math.inf for r in [*cal.train.values(), *cal.decode.values()])
    # 0: a recipe this torch cannot run here (bf16 SDPA under ATEN_CPU_CAPABILITY=avx2 on an AMX CPU), never
    # chosen; it must really fail
    for kind, make in (("train", calibrate._train_step), ("decode", calibrate._decode_step)):
        for recipe, r in getattr(cal, kind).items():
            if r == 0:
                with pytest.raises(RuntimeError):
                    make(shapes, recipe)()
    assert calibrate.calibration(shapes) == (cal, False)


def test_the_environment_pins_the_cpu_default(monkeypatch):
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    monkeypatch.setattr(dtypes, "cpu_vendor", lambda: "AuthenticAMD")  # a row that says bf16
    for value, on in (("0", False), ("1", True)):
        monkeypatch.setenv(precision.CPU_BF16_ENV, value)
        got, why = precision.auto_bf16(torch.device("cpu"))
        assert got is on and precision.CPU_BF16_ENV in why
    monkeypatch.setenv(precision.CPU_BF16_ENV, "yes")
    with pytest.raises(ValueError, match="GRPO_FAST_CPU_BF16: expected 0 .* or 1"):
        precision.auto_bf16(torch.device("cpu"))


def test_auto_bf16_on_gpus_by_compute_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for cap, on in (((7, 5), False), ((8, 0), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=cap: c)
        assert precision.auto_bf16(torch.device("cuda", 0))[0] is on


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--bf16", "--fp16"], "--bf16 and --fp16"),
        (["--fp16", "--dtype", "bf16"], "--fp16 with --dtype bf16"),
        (["--dtype", "bf16", "--no-bf16"], "--dtype bf16 with --no-bf16"),
    ],
)
def test_conflicting_precision_flags(argv, words):
    with pytest.raises(ValueError, match=words):
        precision.resolve(parse_config(argv), torch.device("cpu"))


def test_recipes_resolve_to_their_dtypes(monkeypatch):
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: {"avx2"})
    cpu = torch.device("cpu")
    table = {
        (): ("fp32", "fp32", False, "model"),
        ("--bf16",): ("fp32", "bf16", True, "bf16"),
        ("--fp16",): ("fp32", "fp16", True, "fp16"),
        ("--dtype", "bf16"): ("bf16", "bf16", False, "model"),
    }
    for argv, (storage, compute, autocast, rollout) in table.items():
        cfg, p = precision.resolve(parse_config(list(argv)), cpu)
        assert (p.storage, p.compute, p.autocast, p.rollout_dtype) == (storage, compute, autocast, rollout)
        assert cfg.bf16 is (compute == "bf16")
    # bytes per trainable parameter: weights, master (or compensation), AdamW's two fp32 moments, gradient
    bf16 = precision.Precision("bf16", "bf16", "adamw_torch_fused").bytes_per_param()
    assert bf16 == {"weights": 2, "master": 4, "optimizer": 8, "gradients": 2}
    kahan = precision.Precision("bf16", "bf16", "adamw_kahan").bytes_per_param()
    assert sum(kahan.values()) == 2 + 2 + 8 + 2


def test_the_rollout_and_evaluation_follow_the_training_precision():
    """--bf16 on fp32 weights: rollouts and held-out evaluation sample in bf16 (the native engine's copy),
    and since no engine equals a 16-bit training forward, the mismatch correction is on; fp32: exact."""
    mp, _ = precision.resolve(parse_config(["--bf16"]), torch.device("cpu"))
    assert engine_options(mp)["rollout_dtype"] == eval_engine_options(mp)["rollout_dtype"] == "bf16"
    assert sampling_correction(mp, "native") == "sequence_mask"
    assert sampling_correction(mp, "native", "model") == "sequence_mask"
    low, _ = precision.resolve(parse_config(["--bf16", "--rollout-dtype", "int8"]), torch.device("cpu"))
    assert engine_options(low)["rollout_dtype"] == "int8"
    assert eval_engine_options(low)["rollout_dtype"] == "bf16"
    bf16w, _ = precision.resolve(parse_config(["--dtype", "bf16"]), torch.device("cpu"))
    assert "rollout_dtype" not in engine_options(bf16w)  # the bf16 policy's own weights
    assert sampling_correction(bf16w, "native") == "sequence_mask"
    fp32, _ = precision.resolve(parse_config(["--no-bf16"]), torch.device("cpu"))
    assert "rollout_dtype" not in engine_options(fp32) and sampling_correction(fp32, "native") is None


# --------------------------------------------------------------------------------------------------------
# Through the trainer
# --------------------------------------------------------------------------------------------------------
def _movement(run_dir, steps, base):
    """Mean |saved - base| on the bf16 grid, over every weight of the saved model."""
    saved = load_file(run_dir / f"checkpoint-{steps}" / "model.safetensors")
    total = n = 0
    for name, w in saved.items():
        d = (w.bfloat16().double() - base[name].bfloat16().double()).abs()
        total, n = total + d.sum().item(), n + d.numel()
    return total / n


@pytest.mark.slow
def test_bf16_weights_move_as_far_as_fp32_weights(tmp_path, monkeypatch):
    """Issue 31's measurement at test size: GRPO at lr 1e-5 moves bf16-stored weights (default optimizer:
    fp32 masters) as far as fp32 weights on the bf16 grid; torch AdamW stepping the bf16 weights in place
    (the path before) does not."""
    base = {k: v for k, v in AutoModelForCausalLM.from_pretrained(ASSET).state_dict().items()}
    # 12 steps as measured on SmolLM2: the masters must gather more than half a bf16 ulp before a weight moves
    args = ["--max-steps", "12", "--learning-rate", "1e-5"]
    train(_cfg(tmp_path / "fp32", *args))
    ref = _movement(tmp_path / "fp32", 12, base)
    train(_cfg(tmp_path / "bf16", *args, "--dtype", "bf16"))
    ratio = _movement(tmp_path / "bf16", 12, base) / ref
    plain = lambda params, optim, lr, betas, weight_decay: torch.optim.AdamW(params, lr=lr, betas=betas)  # noqa: E731
    monkeypatch.setattr(setup_mod, "build_optimizer", plain)
    train(_cfg(tmp_path / "plain", *args, "--dtype", "bf16"))
    plain_ratio = _movement(tmp_path / "plain", 12, base) / ref
    print(f"bf16 weights' movement over fp32's: {ratio:.3f} (plain AdamW: {plain_ratio:.3f})")
    assert 0.5 <= ratio <= 2.0 and plain_ratio < 0.5, (ratio, plain_ratio)


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_kahan"])
def test_resume_of_a_bf16_run_is_bitwise_the_uninterrupted_run(tmp_path, optim):
    args = ["--dtype", "bf16", "--optim", optim, "--learning-rate", "1e-4"]
    train(_cfg(tmp_path / "full", "--max-steps", "3", *args))
    train(_cfg(tmp_path / "part", "--max-steps", "2", *args))
    opt = torch.load(tmp_path / "part" / "checkpoint-2" / "optimizer.pt", weights_only=False)["optimizer"]
    kept = "master" if optim == "adamw_torch_fused" else "compensation"
    assert all(kept in s for s in opt["state"].values())  # the master state is in the checkpoint
    train(_cfg(tmp_path / "part", "--max-steps", "3", "--resume", *args))
    a = load_file(tmp_path / "full" / "checkpoint-3" / "model.safetensors")
    b = load_file(tmp_path / "part" / "checkpoint-3" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].dtype == torch.bfloat16 for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    sa = torch.load(tmp_path / "full" / "checkpoint-3" / "optimizer.pt", weights_only=False)["optimizer"]
    sb = torch.load(tmp_path / "part" / "checkpoint-3" / "optimizer.pt", weights_only=False)["optimizer"]
    for name, st in sa["state"].items():
        for k, v in st.items():
            assert torch.equal(v, sb["state"][name][k]), (name, k)
    # the saved model loads in transformers as usual, bf16
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "part" / "checkpoint-3")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_bf16_autocast_step_equals_naive_autocast_grpo(tmp_path, monkeypatch):
    """One --bf16 step (autocast on fp32 weights) against full logits: the update's error to fp64 math is at
    most about twice plain PyTorch autocast's (STYLE.md's rule), and gradients land on fp32 weights."""
    lr, seed = 1e-2, 7
    sgd = lambda params, optim, lr, *a, **k: torch.optim.SGD(params, lr=lr)  # noqa: E731
    monkeypatch.setattr(setup_mod, "build_optimizer", sgd)
    cfg = _cfg(tmp_path, "--max-steps", "1", "--learning-rate", str(lr), "--max-grad-norm", "1e9",
               "--seed", str(seed), "--bf16", "--rollout-dtype", "fp32",
               "--no-vllm-importance-sampling-correction")  # fmt: skip
    train(cfg)
    after = load_file(tmp_path / "checkpoint-1" / "model.safetensors")
    assert all(v.dtype == torch.float32 for v in after.values())

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(ASSET)
    b = first_step_batch(cfg, model, seed)

    def grads(dtype, autocast):
        m = AutoModelForCausalLM.from_pretrained(ASSET, dtype=dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = m(input_ids=b.full_ids, attention_mask=b.full_mask, position_ids=b.position_ids).logits
        logits = logits[:, b.P - 1 : -1]
        logps = torch.log_softmax(logits.double(), -1).gather(-1, b.completion_ids[..., None]).squeeze(-1)
        loss, _ = naive_grpo_loss(
            logps, b.advantages, b.completion_mask, loss_type="dapo", max_completion_length=16
        )
        loss.backward()
        return {n: p.grad.double() for n, p in m.named_parameters()}

    exact, lowp = grads(torch.float64, False), grads(torch.float32, True)
    checked = 0
    for name, g64 in exact.items():
        if name not in after:
            continue  # a tied head: its gradient is on the embedding
        ours = (model.state_dict()[name].double() - after[name].double()) / lr
        err, err_lowp = (ours - g64).abs().max().item(), (lowp[name] - g64).abs().max().item()
        scale = max(1e-3, g64.abs().max().item())
        assert err <= 2 * err_lowp + 1e-3 * scale, f"{name}: ours {err:.3g}, plain autocast {err_lowp:.3g}"
        checked += 1
    assert checked == len(after)


def test_fp16_autocast_scales_the_loss_and_resumes_its_scale(tmp_path):
    train(_cfg(tmp_path / "a", "--max-steps", "2", "--fp16", "--save-steps", "1", "--learning-rate", "1e-4"))
    state = torch.load(tmp_path / "a" / "checkpoint-2" / "optimizer.pt", weights_only=False)
    assert state["scaler"] is not None and state["scaler"]["scale"] > 0
    recs = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in steps)
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["resolved"]["precision"]["compute"] == "fp16" and cfg["resolved"]["precision"]["autocast"]


def test_lora_under_bf16_autocast_and_on_bf16_weights(tmp_path):
    """Adapters stay fp32 (peft's own cast) whether the base is fp32 under autocast or stored bf16; both
    train and move the adapters."""
    for name, extra in (("mp", ["--bf16"]), ("bf16", ["--dtype", "bf16"])):
        out = tmp_path / name
        train(_cfg(out, "--max-steps", "2", "--lora-r", "4", "--learning-rate", "1e-3", *extra))
        adapters = load_file(out / "checkpoint-2" / "adapter_model.safetensors")
        assert adapters and all(v.dtype == torch.float32 for v in adapters.values())
        assert any(v.abs().max() > 0 for k, v in adapters.items() if "lora_B" in k)


def test_resume_keeps_the_runs_precision_when_the_measurement_changes(tmp_path, monkeypatch, capsys):
    """Two steps trained in bf16 autocast with a bf16 rollout (this machine measured bf16 faster), then
    resumed after the cache is gone and the measurement now says fp32: steps 3-4 still train and sample in
    bf16, the log says the measurement differs, and the run's config keeps its precision."""
    from grpo_fast.trainer import calibrate

    monkeypatch.delenv(precision.CPU_BF16_ENV, raising=False)
    monkeypatch.setenv("GRPO_FAST_CACHE", str(tmp_path / "cache"))
    bf16_faster = {"fp32": 1.0, "bf16_autocast": 0.5, "bf16_weights": 0.5}, {"fp32": 1.0, "bf16": 0.5}
    fp32_faster = {"fp32": 1.0, "bf16_autocast": 2.0, "bf16_weights": 2.0}, {"fp32": 1.0, "bf16": 2.0}
    monkeypatch.setattr(calibrate, "time_call", _stub_timer(*bf16_faster)[0])
    out = tmp_path / "run"
    train(_cfg(out, "--max-steps", "2", "--rollout-dtype", "auto"))
    before = json.loads((out / "config.json").read_text())
    assert (before["bf16"], before["rollout_dtype"]) == (True, "bf16")
    shutil.rmtree(tmp_path / "cache")
    timer, calls = _stub_timer(*fp32_faster)
    monkeypatch.setattr(calibrate, "time_call", timer)
    capsys.readouterr()
    train(_cfg(out, "--max-steps", "4", "--rollout-dtype", "auto", "--resume"))
    said = capsys.readouterr().out
    assert calls  # measured again, to say what it would choose now
    assert "kept from checkpoint-2: bf16 autocast, rollout bf16" in said, said
    assert "measurement now differs (fp32, rollout fp32)" in said, said
    after = json.loads((out / "config.json").read_text())
    for key in ("bf16", "rollout_dtype"):
        assert after[key] == before[key]
    assert after["resolved"]["precision"]["compute"] == "bf16" and after["resolved"]["precision"]["autocast"]
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert (state["config"]["bf16"], state["config"]["rollout_dtype"]) == (True, "bf16")
    # a flag given on the command line wins over the kept decision
    capsys.readouterr()
    train(_cfg(out, "--max-steps", "5", "--rollout-dtype", "fp32", "--no-bf16", "--resume"))
    assert "kept from" not in capsys.readouterr().out
    state = json.loads((out / "checkpoint-5" / "trainer_state.json").read_text())
    assert (state["config"]["bf16"], state["config"]["rollout_dtype"]) == (False, "fp32")


def test_a_hub_model_not_yet_downloaded_is_measured_at_its_own_widths(monkeypatch, capsys):
    """--model a Hub id absent from the cache: its config alone is fetched (not SmolLM2's widths measured in
    its place); where none can be read, the fallback is said."""
    import transformers
    from transformers import LlamaConfig

    from grpo_fast.trainer import calibrate

    asked = []
    big = LlamaConfig(
        hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4
    )

    def from_pretrained(path, local_files_only=False, **kw):
        asked.append((path, local_files_only))
        if local_files_only:
            raise OSError("not in the cache")
        return big

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_pretrained)
    shapes = calibrate.shapes_of(parse_config(["--model", "Qwen/Qwen2.5-7B", "--reward", "accuracy"]))
    assert asked == [("Qwen/Qwen2.5-7B", True), ("Qwen/Qwen2.5-7B", False)]
    assert (shapes.hidden, shapes.intermediate, shapes.heads, shapes.kv_heads) == (3584, 18944, 28, 4)
    assert "no config readable" not in capsys.readouterr().out

    def unreachable(path, local_files_only=False, **kw):
        raise OSError("no network")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", unreachable)
    shapes = calibrate.shapes_of(parse_config(["--model", "Qwen/Qwen2.5-7B", "--reward", "accuracy"]))
    assert shapes.hidden == calibrate.DEFAULT_MODEL["hidden_size"]
    said = capsys.readouterr().out
    assert "no config readable for 'Qwen/Qwen2.5-7B': measured at SmolLM2-135M's widths" in said
