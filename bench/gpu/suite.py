"""GPU suite for one CUDA GPU (an H200 here) with no network, sized for a short loan (15 minutes of device
time, one command at most 10 minutes): the most valuable rows first, every row on disk as it is measured.

    bash bench/gpu/suite.sh OUTDIR [--budget S] [--tier 1|2] [--sections a,b] [--dry-run]
    python -m bench.gpu.suite --out OUTDIR [the same options]    (what the shell runs, from a copy)

Sections (bench/gpu/kernels.py and models.py, run by bench/gpu/sections.py; the plan in results.py), each
in its own process so that a CUDA fault or an OOM in one cannot poison the next. Tier 1 (the first call, in
order of value):
  correctness  one JIT pass of every Triton kernel at a small shape (it decides whether later Triton rows
               run), then Triton and the twin vs fp64 at N, H, V = 4096, 4096, 151936, bf16 and fp32
  speed        loss fwd+bwd and log-prob forward at 16384, 4096, 151936 bf16: ours vs naive, Liger, CCE
  backward     the first LM-head shape: chunked vs atomic vs naive (torch.compile'd naive last)
  precision    the mixed-precision step: ours --bf16 vs TRL bf16=True, 1 warm-up + 1 measured step
  generation   native on CUDA graphs (capture seconds) and eager, bf16 and fp8, vs HF generate
  e2e          TRL, ours at its default, ours fastest (colocated async --bf16)
Tier 2 (a second call): atomics, tiles, prefix, memory (every bench_memory configuration, precision recipes
included), decode (the compiled decode: a 2-layer model first, recompiles logged). Only by --sections:
backward_shapes (the other two LM-head shapes), server (needs vLLM and two GPUs).

A section runs while the budget holds its minimum and every later section's; it gets at most its planned
seconds. OUTDIR holds at most four files: gpu_suite.json and report.md (rewritten after every row, by the
section's process itself, atomically: a kill at any moment keeps every finished row), gpu_suite.log (the
shell's tee) and compile_cache.tar.gz (Triton's cache and torch.compiler's artifacts; put it in
bench/gpu_cache/ and carry that folder: the next loan starts warm). Exit status 1 when a section errored,
124 when the suite was killed. --dry-run: tiny shapes on the CPU, Triton through its interpreter (the tests).
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from bench.gpu.results import SECTIONS, publish, timeline

BUDGET_S = 480  # one 10-minute command with 2 minutes to spare (the tree's copy, wheels, the last report)
SHELL_MARGIN_S = 30  # suite.sh kills at budget + this: the suite's own deadline comes first
RESERVE_S = 8  # for the report and the cache file after the last section
DRY_SCALE = 3  # a dry run's sections may take 3x their plan: a shared 2-core CPU under Triton's interpreter
CACHE_FILE = "compile_cache.tar.gz"
CACHE_MAX_BYTES = 15 * 2**20  # the device returns files of at most 16 MiB


class Killed(Exception):
    """SIGTERM (the shell's or the device's time-out): stop the section in flight, keep what is written."""


# ---------------------------------------------------------------------------------------------------------
# Compile caches: restored from a carried file, returned as one file
# ---------------------------------------------------------------------------------------------------------
def restore_cache(src: Path | None, cache: Path) -> str:
    """Unpack a compile_cache.tar.gz of an earlier loan into `cache` (triton/, artifacts/); a note."""
    (cache / "triton").mkdir(parents=True, exist_ok=True)
    (cache / "artifacts").mkdir(exist_ok=True)
    if src is None or not src.is_file():
        return "Compile caches: cold (no carried bench/gpu_cache/compile_cache.tar.gz)."
    try:
        with tarfile.open(src) as tar:
            kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python >= 3.12, 3.11.4
            tar.extractall(cache, **kw)
    except (OSError, tarfile.TarError) as exc:
        return f"Compile caches: {src.name} unreadable ({exc}); cold."
    n = sum(1 for p in cache.rglob("*") if p.is_file())
    return f"Compile caches: restored {n} files from {src.name}."


def pack_cache(cache: Path, out: Path) -> int:
    """OUTDIR/compile_cache.tar.gz of `cache`: torch.compiler's artifacts first, then Triton's cache while
    the file stays under the device's return limit. Returns its size (0: nothing cached yet)."""
    files = sorted((cache / "artifacts").glob("*.bin")) + sorted(p for p in (cache / "triton").rglob("*"))
    files = [p for p in files if p.is_file()]
    if not files:
        return 0
    tmp = out / f".{CACHE_FILE}.tmp"
    total = 0
    with tarfile.open(tmp, "w:gz") as tar:
        for p in files:
            total += p.stat().st_size
            if total > 3 * CACHE_MAX_BYTES:  # uncompressed; gzip takes Triton's text (PTX, IR) to ~1/3
                break
            tar.add(p, arcname=str(p.relative_to(cache)))
    os.replace(tmp, out / CACHE_FILE)
    return (out / CACHE_FILE).stat().st_size


# ---------------------------------------------------------------------------------------------------------
# The plan and the run
# ---------------------------------------------------------------------------------------------------------
def plan(tier: int, sections: list[str] | None) -> list[str]:
    """The sections of a call in the order they run: the tier's, or the ones named, in their order."""
    if sections:
        return list(sections)
    return [n for n, (t, _, _) in SECTIONS.items() if t == tier]


def allowance(name: str, left: float, later: list[str], scale: float = 1) -> float:
    """Seconds `name` may take: its planned seconds, less whatever the later sections' minimums need."""
    return min(scale * SECTIONS[name][2], left - sum(SECTIONS[n][1] for n in later))


def run_section(name: str, later: list[str], out: Path, deadline: float, opts: list[str]) -> dict:
    need = SECTIONS[name][1]
    room = allowance(name, deadline - time.time(), later, DRY_SCALE if "--dry-run" in opts else 1)
    if room < need:
        sec = {"skipped": f"{room:.0f} s left for it (later sections' minimums kept); it needs {need} s"}
        return publish(out, name=name, section=sec)["sections"][name]
    t0 = time.time()
    publish(out, name=name, section={"planned_s": round(room), "started": t0, "status": "running"})
    print(f"== {name} (planned {room:.0f} s)", flush=True)
    cmd = [sys.executable, "-m", "bench.gpu.sections", name, str(out), str(t0 + room), *opts]
    killed = False
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stderr=err, text=True)
        try:
            proc.wait(timeout=room + 5)
            error = None
        except subprocess.TimeoutExpired:
            error = f"stopped at its limit ({room:.0f} s); rows so far kept"
        except Killed:
            killed, error = True, "killed by the suite's time-out; rows so far kept"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            err.seek(0)
            tail = err.read()[-3000:]
            sys.stderr.write(tail)
    if error is None and proc.returncode != 0:
        error = tail.strip() or f"exit {proc.returncode}"
    done = {"seconds": round(time.time() - t0, 1), "status": "done"}
    sec = publish(out, name=name, section=dict(done, **({"error": error} if error else {})))["sections"][name]
    print(f"== {name}: {sec['seconds']} s of {room:.0f}{', ERROR' if error else ''}", flush=True)
    if killed:
        raise Killed
    return sec


def budget_of(argv) -> int:
    """The --budget of a command line (the shell derives its time-out from it)."""
    return parse(argv).budget


def parse(argv):
    ap = argparse.ArgumentParser(description="The GPU suite (see bench/gpu/suite.py's docstring).")
    ap.add_argument("out", nargs="?", default=None, help="results folder (or --out)")
    ap.add_argument("--out", dest="out_flag", default=None)
    ap.add_argument("--budget", type=int, default=BUDGET_S, help=f"seconds for the whole call ({BUDGET_S})")
    ap.add_argument("--tier", type=int, default=1, choices=(1, 2, 3), help="1: the first call, 2: the second")
    ap.add_argument("--sections", default=None, help="comma-separated, in place of --tier")
    ap.add_argument("--cache-from", default=None, help="a compile_cache.tar.gz from an earlier loan")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    args = ap.parse_known_args(argv)[0]
    if args.sections is not None:
        names = [s for s in args.sections.split(",") if s]
        unknown = [s for s in names if s not in SECTIONS]
        if unknown or not names:
            ap.error(f"--sections: expected a comma-separated subset of {', '.join(SECTIONS)}, got {unknown}")
        args.sections = names
    args.out = Path(args.out_flag or args.out or "bench/results/h200")
    return args


def _on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # `timeout` signals us and then our group: once is enough
    raise Killed


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu_suite: no CUDA device (use --dry-run for the CPU smoke run)")
    start = time.time()
    deadline = start + args.budget - RESERVE_S
    cache = Path(tempfile.mkdtemp(prefix="gpu_suite_cache_"))  # removed at the end: packed into OUTDIR
    try:
        return _run(args, out, start, deadline, cache)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _run(args, out: Path, start: float, deadline: float, cache: Path) -> int:
    from bench._utils import machine_info

    note = restore_cache(Path(args.cache_from) if args.cache_from else None, cache)
    os.environ.update(TRITON_CACHE_DIR=str(cache / "triton"), GRPO_FAST_SUITE_CACHE=str(cache))
    names = plan(args.tier, args.sections)
    result = {"machine": machine_info(), "dry_run": args.dry_run, "budget_s": args.budget, "order": names,
              "cache": note, "sections": {}}  # fmt: skip
    publish(out, result)
    opts = ["--dry-run"] if args.dry_run else []
    signal.signal(signal.SIGTERM, _on_sigterm)
    killed = False
    try:
        for i, name in enumerate(names):
            sec = run_section(name, names[i + 1 :], out, deadline, opts)
            if name == "correctness" and "skipped" not in sec and not sec.get("triton_ok", False):
                opts = [*opts, "--no-triton"]
            if "skipped" not in sec:
                pack_cache(cache, out)
    except Killed:
        killed = True
    result = json.loads((out / "gpu_suite.json").read_text())
    result["seconds"] = round(time.time() - start, 1)
    result["errored"] = [n for n, s in result["sections"].items() if "error" in s]
    size = pack_cache(cache, out)
    result["cache"] += f" Returned: {CACHE_FILE}, {size / 2**20:.1f} MiB." if size else ""
    publish(out, result)
    print("\n".join(["", *timeline(result), ""]))
    print(f"wrote {out}/gpu_suite.json and {out}/report.md in {time.time() - start:.0f} s")
    if killed:
        print("gpu_suite: killed by a time-out; finished rows kept", file=sys.stderr)
        return 124
    if result["errored"]:
        print(f"gpu_suite: sections with errors: {', '.join(result['errored'])}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
