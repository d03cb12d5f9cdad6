"""Gather one machine's benchmark results into report.md and summary.json (the figures we quote).

    python -m bench.report [--dir bench/results/<machine>]

Reads bench_e2e.json, bench_e2e_real.json, bench_generate.json, bench_loss.json, bench_logprobs.json,
bench_prefix.json, bench_frontier.json, bench_memory[_mapped].json, bench_memory_creep_4gb.json and
learning_vs_trl.json (whichever exist), writes report.md (a table and a paragraph per benchmark, the plots
linked) and summary.json (headline ratios, the git commit, package versions and the machine).
"""

import argparse
import json
from pathlib import Path

from bench._utils import RESULTS, cpu_line, machine_info, machine_name, markdown_table
from bench.models.e2e import COLUMNS as E2E_COLUMNS
from bench.models.generate import COLUMNS as GENERATE_COLUMNS
from bench.models.prefix import COLUMNS as PREFIX_COLUMNS


def _load(d: Path, name: str):
    f = d / f"{name}.json"
    return json.loads(f.read_text()) if f.is_file() else None


def _row(rows, **match):
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items()) and "error" not in r), None)


def _pct(part, whole):
    return f"{100 * part / whole:.0f}%" if whole else "-"


def e2e_section(res, summary) -> str:
    rows, cfg = res["rows"], res["config"]
    trl, ours = _row(rows, provider="trl"), _row(rows, provider="grpo_fast")
    table = markdown_table(rows, E2E_COLUMNS)
    text = (
        f"## End to end: one GRPO step, grpo-fast vs TRL {res['machine']['versions'].get('trl')}\n\n"
        f"Measured at commit {res['machine'].get('git_commit')}. "
        f"Same work for every provider, each in its own process: a random-init Qwen2-shaped model of "
        f"{cfg.get('model_params', 0) / 1e6:.1f}M parameters, {cfg['prompts_per_step']} prompts of "
        f"P={cfg['P']} tokens per step, G={cfg['G']} completions of up to C={cfg['C']} tokens, beta 0, loss "
        f"dapo, fp32, no gradient checkpointing; {cfg['warmup']} warm-up step(s), then the mean of "
        f"{cfg['steps']}. Tokens/s counts prompt tokens x G + completion tokens (as if unshared); peak "
        "memory is above what each process held after importing the same libraries.\n\n"
        + table
        + "\n\n![time split and memory](bench_e2e.png)\n\n"
    )
    if trl and ours:
        speed, mem = ours["tokens_per_s"] / trl["tokens_per_s"], ours["peak_mem_mb"] / trl["peak_mem_mb"]
        summary.update(e2e_speedup_vs_trl=speed, e2e_peak_mem_ratio_vs_trl=mem)
        text += (
            f"What it shows: grpo-fast with prefix sharing processes {ours['tokens_per_s']:.0f} tokens/s "
            f"against TRL's {trl['tokens_per_s']:.0f} (**{speed:.2f}x**) at **{mem:.2f}x** TRL's peak memory "
            f"({ours['peak_mem_mb']:.0f} vs {trl['peak_mem_mb']:.0f} MiB). TRL spends "
            f"{_pct(trl['generate_s'], trl['step_s'])} of its {trl['step_s']:.1f} s step generating and "
            f"{_pct(trl['train_s'], trl['step_s'])} training; grpo-fast "
            f"{_pct(ours['generate_s'], ours['step_s'])} and {_pct(ours['train_s'], ours['step_s'])} of "
            f"{ours['step_s']:.1f} s. Scoring is negligible for both (a cheap reward).\n"
        )
        unshared = _row(rows, provider="grpo_fast_unshared")
        if unshared:
            summary["e2e_speedup_vs_trl_sharing_off"] = unshared["tokens_per_s"] / trl["tokens_per_s"]
            summary["e2e_peak_mem_ratio_vs_trl_sharing_off"] = unshared["peak_mem_mb"] / trl["peak_mem_mb"]
            text += (
                f"With sharing off, grpo-fast runs {summary['e2e_speedup_vs_trl_sharing_off']:.2f}x TRL's "
                f"tokens/s at {summary['e2e_peak_mem_ratio_vs_trl_sharing_off']:.2f}x its memory: the gap to "
                "the shared row is what prefilling and training each prompt once per group buys.\n"
            )
    sub = _row(rows, provider="trl_grpo_fast")
    if trl and sub:
        summary["trl_subclass_speedup_vs_trl"] = sub["tokens_per_s"] / trl["tokens_per_s"]
        summary["trl_subclass_peak_mem_ratio_vs_trl"] = sub["peak_mem_mb"] / trl["peak_mem_mb"]
        text += (
            f"TRL with our subclass (`grpo_fast.integrations.trl.GRPOTrainer`, one import changed) runs "
            f"{summary['trl_subclass_speedup_vs_trl']:.2f}x TRL's tokens/s at "
            f"{summary['trl_subclass_peak_mem_ratio_vs_trl']:.2f}x its peak memory; its generation is still "
            "TRL's (HF generate), so only the training share of the step moves.\n"
        )
    text += _vllm_e2e_line(rows, trl, ours, summary, "e2e_vllm_speedup_vs_trl")
    return text + _fastest_line(rows, summary, "e2e") + _not_measured(rows)


def _fastest_line(rows, summary, prefix) -> str:
    """The fastest of our rows (every one exact or corrected: a low-precision or stale rollout is corrected by
    the rollout-mismatch weights), against TRL in fp32 and, where measured, TRL at its default bf16.
    Measured rows only: a pipelined row with too few steps after its head start has its step modeled
    (bench.models.e2e's steady_figure), and the model assumes generation and training overlap for free
    (SmolLM2 on a 2-core Zen 3: modeled 11.8 s a step from 2 steps, measured 20.0 s over 5 with the CPU
    kernels holding the GIL, the synchronous step 19.1 s)."""
    ours = [r for r in rows if r["provider"].startswith("grpo_fast") and "step_s" in r]
    modeled = [r["provider"] for r in ours if r.get("steady", "").startswith("step model")]
    ours = [r for r in ours if r["provider"] not in modeled]
    trl, trl_bf16 = _row(rows, provider="trl"), _row(rows, provider="trl_bf16")
    if not (ours and trl):
        return ""
    best = max(ours, key=lambda r: r["tokens_per_s"])
    speed, mem = best["tokens_per_s"] / trl["tokens_per_s"], best["peak_mem_mb"] / trl["peak_mem_mb"]
    summary.update({f"{prefix}_fastest_provider": best["provider"], f"{prefix}_fastest_speedup_vs_trl": speed,
                    f"{prefix}_fastest_peak_mem_ratio_vs_trl": mem})  # fmt: skip
    text = (
        f"Our fastest row, `{best['provider']}` ({best['label']}): **{speed:.2f}x** TRL's fp32 tokens/s at "
        f"{mem:.2f}x its peak memory (`{prefix}_fastest_speedup_vs_trl`); step {best['step_s']:.1f} s, "
        + (
            f"the trainer waiting {best['generate_s']:.2f} s for rollouts"
            if best.get("max_staleness")
            else f"generating {best['generate_s']:.1f} s"
        )
        + f", training {best['train_s']:.1f} s"
    )
    if best.get("max_staleness") and best.get("sync_s"):
        text += f", syncing {best['sync_s']:.2f} s (the push, and its wait for the generation in flight)"
    if trl_bf16:
        vs = best["tokens_per_s"] / trl_bf16["tokens_per_s"]
        summary[f"{prefix}_fastest_speedup_vs_trl_bf16"] = vs
        text += f"; {vs:.2f}x TRL at its default `bf16=True`"
    if modeled:
        text += f" (left out, their steps modeled rather than measured at steady state: {', '.join(modeled)})"
    return text + ".\n"


def _not_measured(rows) -> str:
    return "".join(f"\n{r['label']}: not measured ({r['skipped']}).\n" for r in rows if r.get("skipped"))


def _vllm_e2e_line(rows, trl, ours, summary, key) -> str:
    vllm = _row(rows, provider="grpo_fast_vllm")
    if not (trl and ours and vllm):
        return ""
    summary[key] = vllm["tokens_per_s"] / trl["tokens_per_s"]
    return (
        f"With `--rollout vllm` (vLLM in the trainer's process, weights pushed every step) grpo-fast runs "
        f"{summary[key]:.2f}x TRL's tokens/s ({vllm['tokens_per_s'] / ours['tokens_per_s']:.2f}x its native "
        f"engine's) at {vllm['peak_mem_mb'] / trl['peak_mem_mb']:.2f}x TRL's peak memory (vLLM's KV pool "
        f"included); generation {vllm['generate_s']:.1f} s of its {vllm['step_s']:.1f} s step.\n"
    )


def e2e_real_section(res, summary) -> str:
    rows, cfg = res["rows"], res["config"]
    trl, ours = _row(rows, provider="trl"), _row(rows, provider="grpo_fast")
    text = (
        "## End to end on a real model: SmolLM2-135M-Instruct, chat prompts with answers\n\n"
        f"Measured at commit {res['machine'].get('git_commit')}. {cfg['prompts_per_step']} arithmetic "
        f"questions per step as chat prompts, G={cfg['G']} completions of up to C={cfg['C']} tokens ending "
        f"at EOS at whatever length the model chooses, an accuracy reward, T=1, beta 0, dapo, fp32; "
        f"{cfg['warmup']} warm-up step(s), then the mean of {cfg['steps']}.\n\n"
        + markdown_table(rows, E2E_COLUMNS)
        + "\n\n![time split and memory](bench_e2e_real.png)\n\n"
    )
    if trl and ours:
        speed, mem = ours["tokens_per_s"] / trl["tokens_per_s"], ours["peak_mem_mb"] / trl["peak_mem_mb"]
        summary.update(e2e_real_speedup_vs_trl=speed, e2e_real_peak_mem_ratio_vs_trl=mem)
        text += (
            f"What it shows: on the real workload grpo-fast runs **{speed:.2f}x** TRL's tokens/s at "
            f"{mem:.2f}x its peak memory; TRL spends {_pct(trl['generate_s'], trl['step_s'])} of its "
            f"{trl['step_s']:.1f} s step generating, grpo-fast {_pct(ours['generate_s'], ours['step_s'])} of "
            f"{ours['step_s']:.1f} s.\n"
        )
    text += _vllm_e2e_line(rows, trl, ours, summary, "e2e_real_vllm_speedup_vs_trl")
    for provider, key, how in (
        ("grpo_fast_bf16", "e2e_real_lowprec_speedup_vs_trl",
         "a bf16 copy of the policy (`--rollout-dtype bf16`)"),
        ("grpo_fast_vllm_bf16", "e2e_real_vllm_lowprec_speedup_vs_trl", "vLLM in bf16 (`--rollout vllm "
         "--rollout-dtype bf16`)"),
    ):  # fmt: skip
        low = _row(rows, provider=provider)
        if trl and low:
            speed = low["tokens_per_s"] / trl["tokens_per_s"]
            summary[key] = speed
            text += (
                f"With the rollout in {how}, mismatch corrected: **{speed:.2f}x** TRL's tokens/s (generation "
                f"{low['generate_s']:.1f} s of a {low['step_s']:.1f} s step).\n"
            )
    text += _default_precision_line(res, rows, summary)
    return text + _fastest_line(rows, summary, "e2e_real") + _not_measured(rows)


def _default_precision_line(res, rows, summary) -> str:
    """Each at its default precision: ours (fp32, or --bf16 where grpo_fast/trainer/precision.py measured it
    faster on this machine) against TRL's bf16=True, which autocasts to bf16 on fp32 master weights."""
    trl_bf16 = _row(rows, provider="trl_bf16")
    ours = _row(rows, provider=res.get("our_default", "grpo_fast"))
    if not (trl_bf16 and ours):
        return ""
    speed = ours["tokens_per_s"] / trl_bf16["tokens_per_s"]
    summary["e2e_real_speedup_vs_trl_bf16"] = speed
    trl = _row(rows, provider="trl")
    than_fp32 = ""
    if trl:
        than_fp32 = f" (TRL's own bf16 runs {trl_bf16['tokens_per_s'] / trl['tokens_per_s']:.2f}x its fp32)"
    return (
        f"Each at its default precision, ours `{ours['provider']}` against TRL's `bf16=True`{than_fp32}: "
        f"**{speed:.2f}x** (`e2e_real_speedup_vs_trl_bf16`; `e2e_real_speedup_vs_trl` compares both in "
        f"fp32); "
        f"training phase {ours['train_s']:.1f} s vs {trl_bf16['train_s']:.1f} s.\n"
    )


def generate_section(res, summary) -> str:
    rows = res["rows"]
    text = (
        "## Rollout engines: completion tokens/s\n\n"
        f"Measured at commit {res['machine'].get('git_commit')} (`python -m bench.models.generate`), "
        f"{res.get('repeats', 2)} timed calls per row, T=1, EOS ends a sample, each provider in its own "
        "process.\n\n" + markdown_table(rows, GENERATE_COLUMNS) + "\n\n"
    )
    ratios = {}
    for key, workload in (("bench", "bench"), ("real", "real"), ("demo", "demo")):
        r = _row(rows, workload=workload, provider="native")
        if r and "vs_hf" in r:
            ratios[key] = r["vs_hf"]
    if ratios:
        summary["generate_speedup_vs_hf"] = ratios
        text += (
            "What it shows: the native engine's completion tokens/s against HF "
            "`generate(num_return_sequences=G)` on the same prompts: "
            + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
            + ". Per-step cost on this CPU is the small-M matrix products (16 rows): packing the weights for "
            "oneDNN and dropping HF's per-token overhead are what the engine gains here; on a GPU the "
            "compiled step with CUDA graphs removes the launch cost instead (bench/gpu/suite.sh).\n"
        )
    vllm = {}
    for w in ("bench", "real", "demo"):
        r, native = _row(rows, workload=w, provider="vllm"), _row(rows, workload=w, provider="native")
        if r and native and "tokens_per_s" in r and "tokens_per_s" in native:
            vllm[w] = r["tokens_per_s"] / native["tokens_per_s"]
    if vllm:
        summary["generate_vllm_vs_native"] = vllm
        text += (
            'vLLM (`engine="vllm"`, its own environment) against the native engine: '
            + ", ".join(f"{k} {v:.2f}x" for k, v in vllm.items())
            + " (its tokens/s over ours; its start-up and first weight push are in the warm-up column).\n"
        )
    return text


def kernel_section(res, name, title, summary) -> str:
    rows, cfg = res["rows"], res["config"]
    N = max(r["N"] for r in rows)
    cols = [
        ("mode", "mode"),
        ("provider", "provider"),
        ("median_ms", "median ms"),
        ("time_vs_naive", "time / naive"),
        ("peak_mem_mb", "peak MiB above inputs"),
        ("peak_above_grads_mb", "peak MiB above inputs+grads"),
        ("mem_vs_naive", "memory / naive"),
        ("error", "error"),
    ]
    at_n = [r for r in rows if r["N"] == N]
    text = (
        f"## {title} (N={N} tokens, H={cfg['H']}, V={cfg['V']}, fp32)\n\n"
        f"Measured at commit {res['machine'].get('git_commit')}.\n\n"
        + markdown_table(at_n, cols)
        + f"\n\nAll sizes: [{name}.md]({name}.md). ![{name}]({name}.png)\n\n"
    )
    ours, naive = (
        _row(at_n, provider="grpo_fast", mode="fwd_bwd"),
        _row(at_n, provider="naive", mode="fwd_bwd"),
    )
    if ours and naive:
        t, m = (
            ours["median_ms"] / naive["median_ms"],
            ours["peak_above_grads_mb"] / naive["peak_above_grads_mb"],
        )
        summary[f"{name}_fwd_bwd_time_vs_naive"] = t
        summary[f"{name}_fwd_bwd_mem_above_grads_vs_naive"] = m
        text += (
            f"What it shows: forward+backward at N={N}, grpo-fast takes {t:.2f}x the time of the naive "
            f"full-logits PyTorch code and {100 * m:.1f}% of its memory once the weight gradient every "
            "provider returns is set aside: the (N x V) logits are never whole.\n"
        )
    return text


def prefix_section(res, summary) -> str:
    rows = res["rows"]
    train = [r for r in rows if r["kind"] == "train" and r.get("shared") and "speedup" in r]
    gen = _row(rows, kind="generate", shared=True)
    text = (
        "## Shared prefix vs unshared (~50M Qwen2-shaped model, fp32, one prompt per group)\n\n"
        f"Measured at commit {res['machine'].get('git_commit')}.\n\n"
        + markdown_table(rows, PREFIX_COLUMNS)
        + "\n\n![bench_prefix](bench_prefix.png)\n\n"
    )
    if train:
        best = max(train, key=lambda r: r["speedup"])
        summary["prefix_train_speedup_max"] = best["speedup"]
        text += (
            f"What it shows: the training forward+backward with each prompt run once per group is up to "
            f"{best['speedup']:.2f}x faster (P={best['P']}, C={best['C']}, G={best['G']}; the token ratio "
            f"G(P+C)/(P+GC) is {best['theory']:.2f}) at {best['mem_ratio']:.2f}x the memory."
        )
    if gen:
        summary["prefix_generate_speedup"] = gen["speedup"]
        text += (
            f" Generation with the prompt prefilled once: {gen['speedup']:.2f}x the tokens/s, the prompt's "
            f"KV cache {gen['prompt_kv_bytes'] / 2**20:.1f} MiB instead of G times that."
        )
    return text + "\n"


def frontier_section(res, summary) -> str:
    from bench.models.frontier import report

    summary["frontier_completion_ratio_vs_trl"] = res["frontier_completion_ratio_vs_trl"]
    summary["frontier_budget_gb_above_baseline"] = res["budget_gb"]
    summary["frontier_largest_completion_length"] = res["largest_completion_length"]
    summary["frontier_time_per_token_ratio_vs_trl"] = res["worst_time_per_token_ratio_vs_trl"]
    text = report(res).replace("# Memory frontier", "## Memory frontier", 1)
    return text + "\n![frontier](bench_frontier.png)\n"


def memory_section(res, summary) -> str:
    from bench._utils import markdown_table
    from bench.models.memory import COLUMNS

    errors = [abs(r["error_pct"]) for r in res["rows"] if "error_pct" in r]
    if errors:
        summary["estimate_max_abs_error_pct"] = max(errors)
    mapped = res.get("map_large") and res["device"] == "cpu"
    flag = " --map-large" if mapped else ""
    return (
        f"## Memory estimate vs measured peak ({res['device']})\n\n`python -m bench.models.memory --layers "
        f"{res['layers']}{flag}`: SmolLM2-135M's shape with {res['layers']} layers, "
        "one process per configuration, peak of the last step against `grpo-fast estimate` for the same flags"
        + ("; the allocator held as under `--max-memory-gb`" if mapped else "")
        + ".\n\n"
        + markdown_table(res["rows"], COLUMNS)
        + "\n"
    )


def creep_section(res, summary) -> str:
    """The peak per step over a real-model run (bench_memory --creep), as a range against step 3."""
    lo, hi = res["change_after_step3"]
    budget = res.get("max_memory_gb") or 0
    summary["memory_creep_after_step3_pct"] = [round(100 * lo, 1), round(100 * hi, 1)]
    summary["memory_creep_budget_gb"] = budget
    peaks = res["peaks"]
    return (
        f"## Peak memory over {res['steps']} steps (SmolLM2-135M-Instruct, chat prompts)\n\n"
        f"`python -m bench.models.memory --creep {res['steps']}"
        + (f" --max-memory-gb {budget:g}`" if budget else "`")
        + f": per-step peak {min(peaks):.0f}-{max(peaks):.0f} MiB; after step 3 from {100 * lo:+.1f}% to "
        f"{100 * hi:+.1f}% of step 3's ({peaks[2]:.0f} MiB), completion lengths varying from "
        f"{min(res['completion_len_mean']):.0f} to {max(res['completion_len_mean']):.0f} tokens on average "
        "per step.\n"
    )


def profile_train_section(res: dict, summary: dict) -> str:
    s = res["summary"]
    summary["train_phase_gemm_fraction"] = s["train_phase_gemm_fraction"]
    top = ", ".join(f"{o['op']} {100 * o['share']:.0f}%" for o in res["ops"][:5])
    return (
        "## Training phase vs the machine's GEMM rate (SmolLM2-135M-Instruct)\n\n"
        f"`python -m bench.profiles.train`: one phase {s['phase_s']:.1f} s ({s['precision']}, --optim "
        f"{s['optim']}), {s['gemm_tflop']:.2f} TFLOP of GEMMs at {s['achieved_gflops']:.0f} GFLOP/s against "
        f"{s['gemm_rate_gflops']:.0f} GFLOP/s for fp32 GEMMs at the model's shapes: "
        f"**`train_phase_gemm_fraction` {s['train_phase_gemm_fraction']:.2f}**. Largest self-time operators: "
        f"{top} ([profile_train.md](profile_train.md)).\n"
    )


def profile_decode_section(res: dict, summary: dict) -> str:
    """The rollout's decode against the floor (bench.profiles.decode): its summary keys, one line per row."""
    summary.update(res["summary"])
    lines = []
    for r in res["rows"]:
        if "ms_per_step" not in r:
            continue
        lines.append(
            f"- {r['engine']} {r['dtype']}: {r['ms_per_step']:.1f} ms per token step against a floor of "
            f"{r['floor_ms_per_step']:.1f} ms ({r['bound']}-bound): `decode_bandwidth_fraction` "
            f"{r['bandwidth_fraction']:.2f}, roofline fraction {r['roofline_fraction']:.2f}"
            + (  # the most the machine allows (absent from results before it was measured)
                f", bandwidth fraction ceiling {r['bandwidth_fraction_ceiling']:.2f}"
                if "bandwidth_fraction_ceiling" in r
                else ""
            )
        )
    return (
        f"## The rollout against the machine's floor (SmolLM2-135M-Instruct, {res['rows_n']} rows, "
        f"C={res['C']})\n\n`python -m bench.profiles.decode` ([profile_decode.md](profile_decode.md)):\n\n"
        + "\n".join(lines)
        + "\n"
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", default=None, help="results folder (default bench/results/<this machine>)")
    args = ap.parse_args(argv)
    d = Path(args.dir) if args.dir else RESULTS / machine_name()
    names = ("bench_e2e", "bench_e2e_real", "bench_generate", "bench_loss", "bench_logprobs", "bench_prefix",
             "bench_frontier", "bench_memory", "bench_memory_mapped", "bench_memory_creep_4gb",
             "profile_train", "profile_decode")  # fmt: skip
    results = {n: _load(d, n) for n in names}
    # the machine, versions and commit the measurements were taken with (not those of this process)
    info = next((r["machine"] for r in results.values() if r), None) or machine_info()
    summary = {"git_commit": info["git_commit"], "versions": info["versions"], "machine": info}
    parts = [
        f"# grpo-fast benchmarks on {info.get('gpu', info['cpu'])}\n\n"
        f"{cpu_line(info)}, Python {info['python']}, "
        + ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v)
        + f"; commit {info['git_commit']}. Produced by `make bench` (`python -m bench.report`).\n"
    ]
    e2e = results["bench_e2e"]
    if e2e:
        parts.append(e2e_section(e2e, summary))
    if results["bench_e2e_real"]:
        parts.append(e2e_real_section(results["bench_e2e_real"], summary))
    if results["bench_generate"]:
        parts.append(generate_section(results["bench_generate"], summary))
    for name, title in (("bench_loss", "Fused GRPO loss"), ("bench_logprobs", "Fused log-probs")):
        if results[name]:
            parts.append(kernel_section(results[name], name, title, summary))
    prefix = results["bench_prefix"]
    if prefix:
        parts.append(prefix_section(prefix, summary))
    if results["bench_frontier"]:
        parts.append(frontier_section(results["bench_frontier"], summary))
    memory = results["bench_memory_mapped"] or results["bench_memory"]
    if memory:
        parts.append(memory_section(memory, summary))
    if results["bench_memory_creep_4gb"]:
        parts.append(creep_section(results["bench_memory_creep_4gb"], summary))
    if results["profile_train"]:
        parts.append(profile_train_section(results["profile_train"], summary))
    if results["profile_decode"] and "summary" in results["profile_decode"]:
        parts.append(profile_decode_section(results["profile_decode"], summary))
    learning = _load(d, "learning_vs_trl")  # python -m bench.learning.vs_trl (not part of make bench: ~1 h)
    if learning:
        summary.update(learning["summary"])
        parts.append(
            "## Learning against TRL\n\nSmolLM2-135M-Instruct on the real-model task, 3 seeds each, same "
            "everything: [learning_vs_trl.md](learning_vs_trl.md) (`" + learning["command"] + "`).\n"
        )
    if (d / "full-sweep").is_dir():
        parts.append(
            "Whole grids (N = 512, 1024, 2048; more shared-prefix points), from the full sweeps on an "
            "earlier commit: [full-sweep/](full-sweep/).\n"
        )
    head = {k: summary[k] for k in ("e2e_speedup_vs_trl", "e2e_peak_mem_ratio_vs_trl") if k in summary}
    if head:
        real = ""
        if "e2e_real_speedup_vs_trl" in summary:
            real = (
                f" On SmolLM2-135M-Instruct with chat prompts: {summary['e2e_real_speedup_vs_trl']:.2f}x at "
                f"{summary['e2e_real_peak_mem_ratio_vs_trl']:.2f}x."
            )
        parts.insert(
            1,
            f"**Headline:** grpo-fast (prefix sharing on) = {head.get('e2e_speedup_vs_trl', 0):.2f}x TRL's "
            f"tokens/s at {head.get('e2e_peak_mem_ratio_vs_trl', 0):.2f}x its peak memory, same run, same "
            f"machine.{real}\n",
        )
    (d / "report.md").write_text("\n".join(parts))
    (d / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"wrote {d}/report.md and {d}/summary.json")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("machine", "versions")}, indent=2))


if __name__ == "__main__":
    main()
