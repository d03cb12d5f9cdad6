"""The GPU suite's plan (`SECTIONS`: tier, the seconds a section needs to be worth starting, the seconds
planned for it) and its rolling result: OUTDIR/gpu_suite.json and OUTDIR/report.md, rewritten atomically by
whichever process is measuring (`publish`), so that a kill at any moment keeps every finished row."""

import json
import math
import os
import time
from pathlib import Path

# name: (tier, seconds it needs to be worth starting, seconds planned on an H200 = its cap); tier 1 sums to
# 465 s of the default 480, tier 2 to 360 s (it gets what a second call's --budget gives, in this order: a
# 15-minute loan's second call has ~420 s). Sized by runs 5 and 6 (bench/results/h200/README.md): tier 1's
# sections spent 26-83 s each, generation ran out first; memory's configurations take ~40 s each; decode
# (tier 3) had no row in three loans, 2 layers included, so it waits for a loan of its own.
SECTIONS = {
    "correctness": (1, 30, 45),
    "speed": (1, 30, 65),
    "backward": (1, 30, 80),
    "precision": (1, 40, 75),
    "generation": (1, 30, 100),
    "e2e": (1, 60, 100),
    "atomics": (2, 20, 40),
    "tiles": (2, 20, 40),
    "prefix": (2, 15, 40),
    "memory": (2, 40, 240),
    "decode": (3, 30, 105),
    "backward_shapes": (3, 30, 80),
    "server": (3, 20, 200),
}


# ---------------------------------------------------------------------------------------------------------
def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # a reader (or a kill) sees the old file or the new one, never half of one


def publish(out: Path, result: dict | None = None, name: str | None = None, section: dict | None = None):
    """Write `result` (or the one on disk, with `section`'s keys merged into section `name`) as
    OUTDIR/gpu_suite.json and OUTDIR/report.md; return it."""
    path = out / "gpu_suite.json"
    if result is None:
        result = json.loads(path.read_text())
    if name is not None:
        result["sections"][name] = {**result["sections"].get(name, {}), **(section or {})}
    _write(path, json.dumps(result, indent=1, default=str))
    _write(out / "report.md", report_md(result))
    return result


def _cell(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return "-" if v is None else str(v).replace("|", "/").replace("\n", " ")


def _status(sec: dict) -> str:
    if "skipped" in sec:
        return "skipped"
    if "error" in sec:
        return "killed" if sec["error"].startswith("killed") else "error"
    return sec.get("status", "done")


def timeline(result: dict) -> list[str]:
    """The plan against what happened: a Markdown table, one line per section."""
    lines = ["| section | tier | planned s | spent s | rows | status |", "|---|---|---|---|---|---|"]
    for name, sec in result["sections"].items():
        spent = sec.get("seconds", round(time.time() - sec["started"], 1) if "started" in sec else None)
        lines.append(
            f"| {name} | {SECTIONS[name][0]} | {_cell(sec.get('planned_s'))} | {_cell(spent)} | "
            f"{len(sec.get('rows', []))} | {_status(sec)} |"
        )
    return lines


def report_md(result: dict) -> str:
    m, v = result["machine"], result["machine"]["versions"]
    lines = [
        f"# GPU suite{' (dry run, CPU)' if result['dry_run'] else ''}",
        "",
        f"Machine: {m.get('gpu', m['cpu'])}; torch {v['torch']}, triton {v['triton']}, transformers "
        f"{v['transformers']}, trl {v['trl']}, liger-kernel {v['liger_kernel']}, Python {m['python']}; "
        f"commit {m['git_commit']}. {_cell(result.get('seconds', 0.0))} s of the {result['budget_s']} s "
        f"budget. {result.get('cache', '')}",
        "",
        *timeline(result),
    ]
    for name, sec in result["sections"].items():
        lines += ["", f"## {name}", ""]
        if "skipped" in sec:
            lines.append(f"Skipped: {sec['skipped']}.")
            continue
        doc = sec.get("doc", "")  # the section's docstring, written by its process (bench.gpu.sections)
        lines += [doc, ""] if doc else []
        lines += [f"- {n}" for n in sec.get("notes", [])]
        cols = sec.get("columns") or []
        if sec.get("rows") and cols:
            used = [c for c in cols if any(c[0] in r for r in sec["rows"])]
            lines += ["", "| " + " | ".join(t for _, t in used) + " |", "|" + "---|" * len(used)]
            lines += ["| " + " | ".join(_cell(r.get(k)) for k, _ in used) + " |" for r in sec["rows"]]
        if "error" in sec:
            lines += ["", "**Error:**", "", "```", sec["error"], "```"]
    return "\n".join(lines) + "\n"
