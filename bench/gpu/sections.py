"""Runs one GPU suite section in a process of its own (bench/gpu/suite.py starts it):

    python -m bench.gpu.sections NAME OUTDIR DEADLINE_EPOCH_S [--dry-run] [--no-triton]

A section merges its result ({"rows": [...], "columns": [...], "notes": [...], "doc": its docstring}) into
OUTDIR/gpu_suite.json and rewrites OUTDIR/report.md after every row (bench.gpu.results.publish), so that a
section stopped or killed at any moment still reports what it measured. torch.compiler's artifacts of earlier
sections and loans are loaded first and this section's saved at its end (GRPO_FAST_SUITE_CACHE). --dry-run:
tiny shapes on the CPU (Triton through its interpreter). --no-triton: the JIT pass failed, so Triton rows are
skipped."""

import sys
from pathlib import Path

from bench.gpu import kernels, models
from bench.gpu.section import Section

SECTIONS = {name.removeprefix("section_"): fn for mod in (kernels, models) for name, fn in vars(mod).items()
            if name.startswith("section_") and callable(fn)}  # fmt: skip


def main(argv) -> None:
    name, out, deadline = argv[0], Path(argv[1]), float(argv[2])
    sec = Section(name, out, deadline, "--dry-run" in argv, "--no-triton" not in argv)
    run = SECTIONS[name]
    sec.result["doc"] = " ".join((run.__doc__ or "").split())
    sec.save()
    sec.load_compile_cache()
    try:
        run(sec)
    finally:
        sec.save_compile_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
