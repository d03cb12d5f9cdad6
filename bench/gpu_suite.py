"""GPU suite for one CUDA GPU (an H200 here) with no network: kernel correctness and speed, one command.

    bash bench/gpu_suite.sh OUTDIR [--dry-run] [--sections a,b]    (runs python -m bench.gpu_suite, same args)

Sections (bench/gpu_sections.py), in order of value, each in its own process so that a CUDA fault or an OOM in
one cannot poison the next, each bounded by what is left of the suite's BUDGET_S:
  compile      seconds: every Triton kernel and variant at small shapes vs fp64; on failure Triton rows are
               skipped and the other rows still run
  correctness  Triton and the twin vs fp64 at N, H, V = 4096, 4096, 151936, bf16 and fp32, with bias,
               temperature, entropy, and the loss with old/reference log-probs and beta > 0 (values and
               d hidden / d weight / d bias), under the flash-attention rule
  speed        GRPO loss fwd+bwd and log-probs fwd at N, H, V = 16384, 4096, 151936 bf16: naive torch, Liger
               (when its wheel is there), Triton, the twin; TFLOP/s against the matmul rate measured
  precision    bf16 mixed precision: e2e steps of TRL bf16=False / True and ours fp32 / --bf16, and the
               memory estimate beside measured peaks for each precision recipe
  atomics      the backward's atomic semantics and program order vs the twin's matmuls: what impl="auto"
               should pick on this GPU
  tiles        tile sizes and launch options of the forward and backward kernels
  prefix       shared vs unshared training step, Qwen2.5-0.5B-shaped
  generation   HF generate vs the rollout engines, Qwen2.5-0.5B-shaped, 8 and 32 prompts, G=8, C=512
  memory       peak memory of real `grpo-fast train` steps, SmolLM2-135M-shaped, six configurations, beside
               `grpo-fast estimate` (bench/bench_memory.py)
  e2e          bench_e2e vs TRL (TRL rows when its wheels are there), with what time is left
  server       rollouts on a vLLM server on a GPU of its own vs colocated, synchronous and async (needs vLLM
               and two GPUs; else one row saying why)
OUTDIR/gpu_suite.json and OUTDIR/report.md are rewritten after every section. Exit status 1 when a section
errored or timed out. --dry-run: tiny shapes on the CPU, Triton through its interpreter (the test suite runs
it, in our environment and in a bare one).
"""

import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUDGET_S = 470  # the device tool allows 8 minutes a command with room to spare; gpu_suite.sh kills at 470 s
RESERVE_S = 8  # for the report after the last section
# name: (seconds it needs to be worth starting, seconds it may take at most)
SECTIONS = {
    "compile": (20, 90),
    "correctness": (30, 100),
    "speed": (40, 120),
    "backward": (40, 150),
    "precision": (60, 170),
    "atomics": (40, 110),
    "tiles": (30, 100),
    "prefix": (20, 60),
    "generation": (40, 150),
    "memory": (60, 170),
    "e2e": (90, 300),
    "server": (20, 200),
}


def run_section(name: str, out: Path, tmp: Path, deadline: float, dry: bool, triton_ok: bool) -> dict:
    need, cap = SECTIONS[name]
    left = deadline - time.time()
    if left < need:
        return {"skipped": f"{left:.0f} s left of the suite's {BUDGET_S} s; it needs {need} s"}
    end = time.time() + min(cap, left)
    path = tmp / f"{name}.json"
    cmd = [sys.executable, "-m", "bench.gpu_sections", name, str(path), str(end), str(out)]
    cmd += ["--dry-run"] if dry else []
    cmd += [] if triton_ok else ["--no-triton"]
    t0 = time.time()
    print(f"== {name} (at most {end - t0:.0f} s)", flush=True)
    try:
        proc = subprocess.run(cmd, timeout=end - t0 + 5, stderr=subprocess.PIPE, text=True)
        error = None if proc.returncode == 0 else (proc.stderr.strip()[-3000:] or f"exit {proc.returncode}")
        sys.stderr.write(proc.stderr[-3000:])
    except subprocess.TimeoutExpired:
        error = f"stopped at its limit ({end - t0:.0f} s); rows so far kept"
    result = json.loads(path.read_text()) if path.is_file() else {"rows": []}
    result["seconds"] = round(time.time() - t0, 1)
    if error:
        result["error"] = error
    print(f"== {name}: {result['seconds']} s{', ERROR' if error else ''}", flush=True)
    return result


def _cell(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return "-" if v is None else str(v).replace("|", "/").replace("\n", " ")


def report_md(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"# GPU suite{' (dry run, CPU)' if result['dry_run'] else ''}",
        "",
        f"Machine: {m.get('gpu', m['cpu'])}; torch {m['versions']['torch']}, "
        f"triton {m['versions']['triton']}, transformers {m['versions']['transformers']}, "
        f"trl {m['versions']['trl']}, liger-kernel "
        f"{m['versions']['liger_kernel']}, Python {m['python']}; commit {m['git_commit']}. "
        f"Total {result.get('seconds', 0):.0f} s of {BUDGET_S} s.",
    ]
    for name in SECTIONS:
        sec = result["sections"].get(name)
        if sec is None:
            continue
        lines += ["", f"## {name}", ""]
        if "skipped" in sec:
            lines.append(f"Skipped: {sec['skipped']}.")
            continue
        doc = _section_doc(name)
        if doc:
            lines += [doc, ""]
        lines += [f"- {n}" for n in sec.get("notes", [])]
        lines.append(f"- {sec['seconds']} s")
        cols = sec.get("columns") or []
        if sec.get("rows") and cols:
            used = [c for c in cols if any(c[0] in r for r in sec["rows"])]
            lines += ["", "| " + " | ".join(t for _, t in used) + " |", "|" + "---|" * len(used)]
            lines += ["| " + " | ".join(_cell(r.get(k)) for k, _ in used) + " |" for r in sec["rows"]]
        if "error" in sec:
            lines += ["", "**Error:**", "", "```", sec["error"], "```"]
    return "\n".join(lines) + "\n"


def _section_doc(name: str) -> str:
    from bench import gpu_sections

    doc = getattr(gpu_sections, f"section_{name}").__doc__ or ""
    return " ".join(doc.split())


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    dry = "--dry-run" in argv
    chosen = list(SECTIONS)
    if "--sections" in argv:
        i = argv.index("--sections")
        chosen = argv[i + 1].split(",") if i + 1 < len(argv) else []
        argv = argv[:i] + argv[i + 2 :]
        unknown = [s for s in chosen if s not in SECTIONS]
        if unknown or not chosen:
            raise SystemExit(
                f"--sections: expected a comma-separated subset of {', '.join(SECTIONS)}, got {unknown}"
            )
    args = [a for a in argv if not a.startswith("--")]
    out = Path(args[0] if args else "bench/results/h200")
    out.mkdir(parents=True, exist_ok=True)
    import torch

    if not dry and not torch.cuda.is_available():
        raise SystemExit("gpu_suite: no CUDA device (use --dry-run for the CPU smoke run)")
    from bench._utils import machine_info

    start = time.time()
    deadline = start + BUDGET_S - RESERVE_S
    result = {"machine": machine_info(), "dry_run": dry, "budget_s": BUDGET_S, "sections": {}}
    triton_ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name in chosen:
            sec = run_section(name, out, Path(tmp), deadline, dry, triton_ok)
            if name == "compile" and "skipped" not in sec:
                triton_ok = sec.get("triton_ok", False) and "error" not in sec
            result["sections"][name] = sec
            result["seconds"] = time.time() - start
            result["errored"] = [n for n, s in result["sections"].items() if "error" in s]
            (out / "gpu_suite.json").write_text(json.dumps(result, indent=1, default=str))
            (out / "report.md").write_text(report_md(result))
    print(f"wrote {out}/gpu_suite.json and {out}/report.md in {time.time() - start:.0f} s")
    if result["errored"]:
        print(f"gpu_suite: sections with errors: {', '.join(result['errored'])}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
