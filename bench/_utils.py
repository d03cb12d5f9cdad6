"""Shared benchmark plumbing: one provider per process, peak memory above the inputs, median times, reports.

Each measurement runs in a fresh `python -m bench.<script> --worker ...` process so that one provider's
allocator state cannot hide another's peak. On CPU the peak is the resident-set high-water mark (VmHWM, reset
through /proc/self/clear_refs after the inputs exist); on CUDA it is torch.cuda.max_memory_allocated.
"""

import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from grpo_fast.trainer.plotting import pyplot

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


# ---------------------------------------------------------------------------------------------------------
# Machine and versions
# ---------------------------------------------------------------------------------------------------------
# the instruction-set flags that decide which CPU kernels run (oneDNN, ATen's vectorized paths, fbgemm): a
# result holds for the set it was measured on
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")  # fmt: skip


def cpu_model_and_flags() -> tuple[str, list[str]]:
    """The CPU's model name and which of ISA_FLAGS it reports (/proc/cpuinfo; x86 `flags`, Arm `Features`)."""
    cpu, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and cpu == platform.processor():
                cpu = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return cpu, [f for f in ISA_FLAGS if f in flags]


def cpu_line(info: dict) -> str:
    """'AMD EPYC (2 cores; avx2 avx512f ...; ATen AVX512)': the line beside every figure."""
    flags = " ".join(info.get("cpu_flags") or []) or "flags not recorded"
    kernels = f"; ATen {info['aten_cpu_capability']}" if info.get("aten_cpu_capability") else ""
    return f"{info['cpu']} ({info['cores']} cores; {flags}{kernels})"


def machine_info() -> dict:
    cpu, flags = cpu_model_and_flags()
    info = {
        "cpu": cpu,
        "cpu_flags": flags,
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    versions = {}
    for pkg in ("torch", "triton", "transformers", "trl", "liger_kernel", "cut_cross_entropy"):
        try:
            versions[pkg] = __import__(pkg).__version__
        except Exception:  # noqa: BLE001 - absent or broken packages are reported, not fatal
            try:
                from importlib.metadata import version

                versions[pkg] = version(pkg.replace("_", "-"))
            except Exception:  # noqa: BLE001
                versions[pkg] = None
    info["versions"] = versions
    info["git_commit"] = git_commit()
    return info


def git_commit() -> str | None:
    """The commit measured: GRPO_FAST_GIT_COMMIT when set (a copy without .git, e.g. the GPU suite's), else
    `git rev-parse` of this checkout, with "-dirty" when files differ from it."""
    if os.environ.get("GRPO_FAST_GIT_COMMIT"):
        return os.environ["GRPO_FAST_GIT_COMMIT"]
    try:
        git = dict(cwd=ROOT, capture_output=True, text=True, check=True)
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], **git).stdout.strip()
        # results the benchmarks themselves rewrite do not make the measured code dirty
        status = ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results"]
        dirty = subprocess.run(status, **git).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except Exception:  # noqa: BLE001 - no git, or not a checkout
        return None


# AMD families / model ranges -> their microarchitecture (AMD's published family and model numbers)
AMD_CORES = {23: ((0x00, 0x2F, "zen"), (0x30, 0xFF, "zen2")),
             25: ((0x00, 0x0F, "zen3"), (0x10, 0x1F, "zen4"), (0x20, 0x5F, "zen3"), (0x60, 0xAF, "zen4")),
             26: ((0x00, 0xFF, "zen5"),)}  # fmt: skip


def machine_name() -> str:
    """The folder of this machine's results under bench/results/: the GPU's name ("h200"), else the CPU's
    core (AMD: "zen3", "zen4", ... by family and model; Intel: "xeon-amx" with AMX, "xeon-avx512", "xeon"),
    else its model name, lower-cased."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name().lower().removeprefix("nvidia").strip(" -").replace(" ", "-")
    from grpo_fast.rollout.dtypes import cpu_flags, cpu_info

    info, flags = cpu_info(), cpu_flags()
    if info.get("vendor_id") == "AuthenticAMD" and info.get("cpu family", "").isdigit():
        model = int(info.get("model", "0") or 0)
        for lo, hi, core in AMD_CORES.get(int(info["cpu family"]), ()):
            if lo <= model <= hi:
                return core
    if info.get("vendor_id") == "GenuineIntel":
        return "xeon-amx" if "amx_bf16" in flags else "xeon-avx512" if "avx512f" in flags else "xeon"
    name = info.get("model name") or platform.processor() or "cpu"
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split())[:40]


# ---------------------------------------------------------------------------------------------------------
# Memory and time, inside a worker
# ---------------------------------------------------------------------------------------------------------
def peak_memory_mb(fn, device) -> float:
    """Peak memory (MiB) that `fn()` uses above what is allocated when it starts."""
    from grpo_fast.trainer.memory import peak_mib

    base = baseline_mib(device)
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return peak_mib(device) - base


def baseline_mib(device) -> float:
    """What is live now (MiB: freed memory handed back first), with the peak restarted from it
    (grpo_fast.trainer.memory)."""
    from grpo_fast.trainer.memory import current_mib, release_free_memory, reset_peak

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    release_free_memory(device, 0)
    reset_peak(device)
    return current_mib(device)


def time_ms(fn, device, repeats: int) -> dict:
    """Median and spread of `repeats` timed calls (one warm-up call is the caller's)."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {
        "median_ms": statistics.median(times),
        "min_ms": times[0],
        "max_ms": times[-1],
        "repeats": repeats,
    }


def measure_mode(fn, mode: str, leaves, device, repeats: int, upstream=None) -> dict:
    """Measure `fn()` forward only (no grad) or forward+backward ("fwd_bwd"); the gradients of `leaves`
    are freed after each step, so each baseline holds the inputs only. Reports their size as grad_mb."""
    if mode == "fwd":

        def step():
            with torch.no_grad():
                fn()
    else:

        def step():
            out = fn().float()
            out.backward(upstream)
            for x in leaves:
                x.grad = None

    res = measure(step, device, repeats)
    res["grad_mb"] = sum(x.numel() * x.element_size() for x in leaves) / 2**20 if mode == "fwd_bwd" else 0.0
    return res


def measure(fn, device, repeats: int) -> dict:
    fn()  # warm-up: lazy initialization, compilation
    mem = peak_memory_mb(fn, device)
    out = time_ms(fn, device, repeats)
    out["peak_mem_mb"] = mem
    return out


# ---------------------------------------------------------------------------------------------------------
# Running workers and writing reports
# ---------------------------------------------------------------------------------------------------------
def vllm_python() -> str | None:
    """The interpreter of the vLLM environment (`make setup-vllm`; or $GRPO_FAST_VLLM_PYTHON), None if absent:
    vLLM rows run there (vLLM pins transformers < 5.20), every other row here."""
    path = os.environ.get("GRPO_FAST_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    return path if Path(path).is_file() else None


NO_VLLM = "vLLM not installed here (make setup-vllm)"


def run_worker(module: str, args: dict, timeout: float = 1800, python: str | None = None) -> dict:
    """Run `python -m bench.<module> --worker` (`module`: e.g. "models.e2e") with `args` in a fresh process
    (of `python`, default this one); return its JSON result."""
    cmd = [python or sys.executable, "-m", f"bench.{module}", "--worker", json.dumps(args)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    err = (proc.stderr or proc.stdout).strip().splitlines()
    return {"error": err[-1] if err else f"exit code {proc.returncode}"}


def worker_main(measure_one) -> bool:
    """If this process is a worker, run `measure_one(args)` and print its JSON; return True."""
    if len(sys.argv) >= 3 and sys.argv[1] == "--worker":
        args = json.loads(sys.argv[2])
        print(json.dumps(measure_one(args)))
        return True
    return False


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    head = "| " + " | ".join(title for _, title in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    lines = [head, sep]
    for r in rows:
        cells = []
        for key, _ in columns:
            v = r.get(key)
            if isinstance(v, float):
                cells.append(f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3g}")
            else:
                cells.append("-" if v is None else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(name: str, payload: dict, markdown: str, out_dir: Path | None = None) -> Path:
    out_dir = out_dir or RESULTS / machine_name()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=2))
    info = payload.get("machine")
    if info and "Machine:" not in markdown:  # every table says the CPU and instruction set it holds for
        machine = f"Machine: {cpu_line(info)}, commit {info.get('git_commit')}."
        markdown = markdown.rstrip("\n") + f"\n\n{machine}\n"
    (out_dir / f"{name}.md").write_text(markdown)
    return out_dir


def sweep(module: str, providers: list[str], ns: list[int], modes: list[str], base: dict) -> list[dict]:
    """Measure every (N, mode, provider) in its own process; print each row as it lands."""
    rows = []
    for n in ns:
        for mode in modes:
            for p in providers:
                args = dict(base, provider=p, N=n, mode=mode)
                t0 = time.time()
                res = run_worker(module, args)
                row = dict(args, **res)
                rows.append(row)
                shown = res.get("error") or f"{res['median_ms']:.1f} ms, peak {res['peak_mem_mb']:.0f} MiB"
                print(f"  N={n:<6} {mode:<8} {p:<22} {shown}   ({time.time() - t0:.0f}s)", flush=True)
    for r in rows:  # ratios against the naive provider of the same (N, mode), same run
        naive = next(
            (
                x
                for x in rows
                if x["N"] == r["N"]
                and x["mode"] == r["mode"]
                and x["provider"] == "naive"
                and "error" not in x
            ),
            None,
        )
        if naive and "error" not in r:
            r["time_vs_naive"] = r["median_ms"] / naive["median_ms"]
            r["mem_vs_naive"] = r["peak_mem_mb"] / max(naive["peak_mem_mb"], 1e-9)
    return rows


def plot_sweep(rows: list[dict], path: Path, title: str) -> None:
    plt = pyplot(str(path))
    if plt is None:
        return

    modes = sorted({r["mode"] for r in rows}, reverse=True)
    fig, axes = plt.subplots(len(modes), 2, figsize=(11, 4 * len(modes)), squeeze=False)
    if len({r["N"] for r in rows}) == 1:  # one size: bars per provider, not a sweep
        for i, mode in enumerate(modes):
            done = [r for r in rows if r["mode"] == mode and "error" not in r]
            names = [r["provider"] for r in done]
            for j, (key, unit) in enumerate((("median_ms", "median time, ms"), ("peak_mem_mb", "peak MiB"))):
                axes[i][j].bar(names, [r[key] for r in done], color=[f"C{k}" for k in range(len(done))])
                axes[i][j].set(title=f"{mode} at N={done[0]['N']}: {unit}")
                axes[i][j].tick_params(axis="x", labelsize=8, rotation=20)
                axes[i][j].grid(True, axis="y", which="both", alpha=0.3)
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return
    for i, mode in enumerate(modes):
        for p in dict.fromkeys(r["provider"] for r in rows):
            pts = sorted(
                (r["N"], r["median_ms"], r["peak_mem_mb"])
                for r in rows
                if r["mode"] == mode and r["provider"] == p and "error" not in r
            )
            if not pts:
                continue
            ns, ts, ms = zip(*pts)
            axes[i][0].plot(ns, ts, marker="o", label=p)
            axes[i][1].plot(ns, ms, marker="o", label=p)
        axes[i][0].set(
            title=f"{mode}: median time", xlabel="tokens N", ylabel="ms", xscale="log", yscale="log"
        )
        axes[i][1].set(
            title=f"{mode}: peak memory above inputs",
            xlabel="tokens N",
            ylabel="MiB",
            xscale="log",
            yscale="log",
        )
        for ax in axes[i]:
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sweep_main(argv, *, module: str, name: str, doc: str, providers: list[str], title: str) -> None:
    """The command line of a kernel sweep: providers x N x (fwd, fwd_bwd), table, JSON and plot; `module`:
    the worker's (e.g. "kernels.loss"), `name`: the results' (e.g. "bench_loss")."""
    import argparse

    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    ap.add_argument("--providers", default=",".join(providers))
    ap.add_argument("--ns", default=None, help="comma-separated token counts")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    H, V = (64, 4096) if args.quick else (1024, 151936)
    ns = (
        [int(x) for x in args.ns.split(",")] if args.ns else ([256, 512] if args.quick else [512, 1024, 2048])
    )
    base = dict(H=H, V=V, dtype="float32", repeats=args.repeats)
    print(f"{name}: H={H} V={V} fp32, N in {ns}", flush=True)
    rows = sweep(module, args.providers.split(","), ns, ["fwd", "fwd_bwd"], base)
    for r in rows:
        if "error" not in r:
            r["peak_above_grads_mb"] = r["peak_mem_mb"] - r["grad_mb"]
    info = machine_info()
    cols = SWEEP_COLUMNS[:5] + [("peak_above_grads_mb", "peak MiB above inputs+grads")] + SWEEP_COLUMNS[5:]
    md = (
        f"# {title} (H={H}, V={V}, fp32)\n\nMachine: {cpu_line(info)}, torch "
        f"{info['versions']['torch']}, commit {info['git_commit']}.\n\n" + markdown_table(rows, cols) + "\n"
    )
    name += "_quick" if args.quick else ""
    out = write_results(name, {"machine": info, "config": base, "rows": rows}, md)
    plot_sweep(rows, out / f"{name}.png", f"{title}, H={H}, V={V}, fp32")
    print(md)
    print(f"wrote {out}/{name}.{{json,md,png}}")


SWEEP_COLUMNS = [
    ("N", "N"),
    ("mode", "mode"),
    ("provider", "provider"),
    ("median_ms", "median ms"),
    ("peak_mem_mb", "peak MiB above inputs"),
    ("time_vs_naive", "time / naive"),
    ("mem_vs_naive", "memory / naive"),
    ("error", "error"),
]
