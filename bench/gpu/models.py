"""The GPU suite's model sections: prefix (shared-prefix training), generation and decode (our engine against
HF generate), e2e (TRL against ours), server (vLLM servers), memory (bench_memory's configurations),
precision (the mixed-precision step against TRL's)."""

import tempfile
import time

import torch

from bench.gpu.section import Section, measure_row


def section_prefix(sec: Section) -> None:
    """Training step (hidden states forward+backward) with each prompt once per group (attention per segment,
    and through a 4D mask) vs repeated G times, on a random-init Qwen2.5-0.5B-shaped model in bf16."""
    from bench.models.prefix import make_model
    from grpo_fast.trainer.modeling import completion_hidden_states

    sec.result["columns"] = [["shared_prefix", "shared prefix"], ["P", "P"], ["C", "C"], ["G", "G"],
                             ["prompts", "prompts"], ["ms", "median ms"], ["peak_mib", "peak MiB"],
                             ["speedup", "speedup"], ["note", "note"]]  # fmt: skip
    P, C, G, n = (32, 8, 4, 1) if sec.dry else (512, 128, 8, 2)
    dtype = torch.float32 if sec.dry else torch.bfloat16
    model = make_model("tiny" if sec.dry else "0.5b").to(device=sec.device, dtype=dtype)
    V = model.config.vocab_size
    g = torch.Generator(device=sec.device).manual_seed(0)
    batch = (
        torch.randint(2, V, (n, P), device=sec.device, generator=g),
        torch.ones(n, P, dtype=torch.long, device=sec.device),
        torch.randint(2, V, (n * G, C), device=sec.device, generator=g),
        torch.ones(n * G, C, dtype=torch.long, device=sec.device),
    )
    from grpo_fast.models.shared_prefix import shared_prefix_forward

    # shared: the default layout (attention per segment); "shared, 4D mask": the same row through SDPA
    for name, shared, attention in (("unshared", False, None), ("shared", True, None),
                                    ("shared, 4D mask", True, "mask")):  # fmt: skip

        def step(shared=shared, attention=attention):
            if attention:
                h = shared_prefix_forward(model, *batch, attention=attention)
            else:
                h = completion_hidden_states(model, *batch, share_prefix=shared)
            h.float().square().mean().backward()
            model.zero_grad(set_to_none=True)

        note = {"note": "attention 'mask'"} if attention else {}
        measure_row(sec, name, step, 0, dict(shared_prefix=shared, P=P, C=C, G=G, prompts=n, **note), 5.0)
    rows = sec.result["rows"]
    for row in rows[1:]:
        if "ms" in row and "ms" in rows[0]:
            row["speedup"] = rows[0]["ms"] / row["ms"]
    sec.save()


GEN_COLUMNS = [["provider", "provider"], ["prompts", "prompts"], ["layers", "layers"], ["P", "P"], ["G", "G"],
               ["C", "C"], ["ms", "ms"], ["tokens_per_s", "completion tokens/s"], ["vs_hf", "vs HF generate"],
               ["peak_mib", "peak MiB"], ["warmup_s", "warm-up s"], ["graphs", "graphs compiled"],
               ["cuda_graphs", "CUDA graphs captured"], ["capture_s", "capture s"],
               ["note", "note"]]  # fmt: skip


def _generation_rows(sec: Section, plan, layers=None) -> None:
    """Rows of completion tokens/s for `plan` [(prompts, label, fn(model, ids, C, G) or a note)] on a
    random-init Qwen2.5-0.5B-shaped model in bf16 (`layers` of its 24), G=8, C=512, prompts of 128 tokens,
    no EOS (a random model: every sample runs C tokens). A warm-up (compiles, allocator; a provider marked
    `warm_full` warms up on the timed run's shapes: its CUDA graphs are captured there, and their capture
    seconds are the row's) and one timed run each; a failure, the warm-up's included, is that provider's row;
    the compiled graphs counted."""
    import torch._dynamo.utils as dynamo_utils
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from bench.models.prefix import QWEN2_SHAPES
    from grpo_fast.rollout import native

    P, G, C = (8, 4, 8) if sec.dry else (128, 8, 512)
    shape = dict(QWEN2_SHAPES["tiny" if sec.dry else "0.5b"])
    shape["num_hidden_layers"] = layers or shape["num_hidden_layers"]
    torch.manual_seed(0)
    cfg = Qwen2Config(**shape, max_position_embeddings=4096)
    cfg._attn_implementation = "sdpa"
    dtype = torch.float32 if sec.dry else torch.bfloat16
    model = Qwen2ForCausalLM(cfg).to(device=sec.device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    for n, label, fn in plan:
        if isinstance(fn, str):
            sec.add(dict(provider=label, prompts=n, note=fn))
            continue
        if sec.left() < 25:
            sec.add(dict(provider=label, prompts=n, note="skipped: section out of time"))
            continue
        g = torch.Generator(device=sec.device).manual_seed(0)
        ids = torch.randint(2, cfg.vocab_size, (n, P), device=sec.device, generator=g)
        t = {}

        def timed_run(fn=fn, ids=ids):
            t0 = time.perf_counter()
            fn(model, ids, C, G)
            sec.sync()
            t["ms"] = (time.perf_counter() - t0) * 1e3

        graphs = dynamo_utils.counters["stats"]["unique_graphs"]
        engine = native.engine_for(model)
        capture_s = engine.stats["capture_s"]
        try:
            t0 = time.perf_counter()
            fn(model, ids, 8, G)  # warm-up: kernels, allocator; a compiled engine compiles here
            fn(model, ids, C if getattr(fn, "warm_full", False) else min(C, 64), G)
            sec.sync()
            warm = time.perf_counter() - t0
            peak = sec.peak_mib(timed_run)  # one full run, timed and its peak taken
        except Exception as exc:  # noqa: BLE001 - a failing provider is a row, the next still runs
            sec.add(dict(provider=label, prompts=n, note=f"error: {type(exc).__name__}: {str(exc)[:160]}"))
            continue
        sec.add(dict(provider=label, prompts=n, layers=shape["num_hidden_layers"], P=P, G=G, C=C, ms=t["ms"],
                     warmup_s=warm, tokens_per_s=n * G * C / (t["ms"] / 1e3), peak_mib=peak,
                     graphs=dynamo_utils.counters["stats"]["unique_graphs"] - graphs,
                     **_graph_fields(fn, engine, capture_s)))  # fmt: skip
        sec.save_compile_cache()
    rows = sec.result["rows"]
    for r in rows:
        hf_row = next((x for x in rows if x["provider"] == "HF generate" and x["prompts"] == r["prompts"]
                       and x.get("layers") == r.get("layers")), None)  # fmt: skip
        if hf_row and "tokens_per_s" in hf_row and "tokens_per_s" in r:
            r["vs_hf"] = r["tokens_per_s"] / hf_row["tokens_per_s"]
    sec.save()


def _graph_fields(fn, engine, capture_s) -> dict:
    """The CUDA graphs a `warm_full` provider's calls captured, their capture seconds, and why none if so."""
    if not getattr(fn, "warm_full", False):
        return {}
    out = dict(cuda_graphs=engine.stats["graphs"], capture_s=engine.stats["capture_s"] - capture_s)
    return {**out, "note": engine.stats["graph_reason"]} if engine.stats["graph_reason"] else out


def _hf(model, ids, c, G):
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                       top_k=0, top_p=1.0, max_new_tokens=c, num_return_sequences=G)  # fmt: skip


def _ours(engine, compile, rollout_dtype="model"):
    from grpo_fast.rollout import generate_groups

    def run(model, ids, c, G):
        generate_groups(model, ids, torch.ones_like(ids), G, c, temperature=1.0, eos_token_id=None,
                        engine=engine, compile=compile, rollout_dtype=rollout_dtype)  # fmt: skip

    run.warm_full = compile == "graphs"
    return run


def section_generation(sec: Section) -> None:
    """Completion tokens/s of HF `generate(num_return_sequences=G)` and the native engine on CUDA graphs (its
    default on CUDA: one graph per batch bucket, capture seconds in the row) and eager, with the model's bf16
    layers and with its decode layers in fp8 (e4m3, per-channel x per-token scales, torch._scaled_mm) on a
    random-init Qwen2.5-0.5B-shaped model, G=8, C=512, 8 and 32 prompts of 128 tokens (64 and 256 rows).
    Goals: graphs >= 10x HF at 64 rows, >= 20,000 tokens/s at 256, capture <= 10 s. The Inductor-compiled
    engine is the decode section's."""
    sec.result["columns"] = GEN_COLUMNS
    graphs = _ours("native", "graphs")
    _generation_rows(sec, [  # the most telling first: the section's deadline cuts the tail
        (8, "native, CUDA graphs", graphs),
        (8, "HF generate", _hf),
        (32, "native, CUDA graphs", graphs),
        (8, "native, eager", _ours("native", False)),
        (32, "HF generate", _hf),
        (8, "native, CUDA graphs, rollout_dtype fp8", _ours("native", "graphs", "fp8")),
        (32, "native, eager", _ours("native", False)),
    ])  # fmt: skip


def section_decode(sec: Section) -> None:
    """The native engine's compiled decode (torch.compile, CUDA graphs), recompiles and graph breaks logged
    to the suite's log: on a 2-layer Qwen2.5-0.5B-shaped model first (its first compile never ended within
    170 s at 24 layers), then the 24 layers; the reference engine beside them. 8 prompts, G=8, C=512."""
    import torch._logging

    sec.result["columns"] = GEN_COLUMNS
    torch._logging.set_logs(recompiles=True, graph_breaks=True)
    compiled = "skipped: dry run (tests/test_rollout.py compiles the decode on a CPU)" if sec.dry else None
    compiled = compiled or _ours("native", True)
    eager = _ours("native", False)
    _generation_rows(sec, [(8, "native, compiled", compiled), (8, "native, eager", eager)], layers=2)
    _generation_rows(sec, [(8, "native, compiled", compiled), (8, "native, eager", eager),
                           (8, "reference engine", _ours("reference", "auto"))])  # fmt: skip


E2E_KEYS = ("provider", "step_s", "generate_s", "train_s", "tokens_per_s", "speedup_vs_trl", "peak_mem_mb",
            "mem_vs_trl", "skipped", "error")  # fmt: skip


def _e2e_rows(sec: Section, argv: list[str], keys=E2E_KEYS, extra=None) -> None:
    """bench_e2e with `argv`, each provider's row added as it ends (its own files in a temporary folder: the
    device returns 8 files), speed and memory against the TRL row before it, if any."""
    from bench.models import e2e as bench_e2e

    def on_row(r):
        rows = sec.result["rows"]
        trl = next((x for x in rows if x.get("provider") == "trl" and "tokens_per_s" in x), None)
        if trl and "tokens_per_s" in r:
            r = dict(r, speedup_vs_trl=r["tokens_per_s"] / trl["tokens_per_s"],
                     mem_vs_trl=r["peak_mem_mb"] / trl["peak_mem_mb"])  # fmt: skip
        sec.add({**(extra or {}), **{k: r[k] for k in keys if k in r}})

    with tempfile.TemporaryDirectory() as tmp:
        bench_e2e.main(["--out-dir", tmp, "--deadline", str(sec.deadline - 5), *argv], on_row=on_row)


def section_e2e(sec: Section) -> None:
    """bench_e2e's synthetic workload: TRL (fp32), grpo-fast at its default, grpo-fast fastest (colocated
    async --max-staleness 1 under --bf16), each provider's row as it ends."""
    sec.result["columns"] = [[k, k] for k in E2E_KEYS]
    providers = "trl,grpo_fast" if sec.dry else "trl,grpo_fast,grpo_fast_async_mp"
    _e2e_rows(sec, ["--providers", providers] + (["--quick"] if sec.dry else []))


def section_server(sec: Section) -> None:
    """Rollouts on a vLLM server of their own (bench_e2e's synthetic workload): colocated vs server vs server
    async (--max-staleness 1), the server on the last GPU and the trainer on cuda:0; sync seconds per step and
    the idle fractions. Needs vLLM (its interpreter: bench._utils.vllm_python) and two GPUs, else one row
    saying why."""
    from bench._utils import NO_VLLM, vllm_python

    why = NO_VLLM if vllm_python() is None else None
    if sec.dry:  # servers take ~40 s each to start on a CPU: tests/test_vllm_server.py covers them there
        why = "dry run: server mode runs in tests/test_vllm_server.py on a CPU"
    elif why is None and torch.cuda.device_count() < 2:
        why = f"needs two GPUs (one for the server, one for the trainer); {torch.cuda.device_count()} here"
    keys = ("provider", "step_s", "generate_s", "train_s", "sync_s", "push_s", "trainer_wait_s", "gen_idle_s",
            "tokens_per_s", "peak_mem_mb", "skipped", "error")  # fmt: skip
    sec.result["columns"] = [[k, k] for k in keys]
    if why:
        sec.add({"provider": "grpo_fast_server", "skipped": why})
        return
    _e2e_rows(sec, ["--providers", "grpo_fast,grpo_fast_server,grpo_fast_server_async", "--steps", "3"], keys)


# the memory section's configurations, those without a GPU measurement first (a loan's second call fits ~6
# at ~40 s each): full, full_beta_gc_unshared, lora_beta and lora_gc_unshared were measured in runs 4 and 6
GPU_MEMORY_ORDER = ["full_autocast_bf16", "full_bf16_master", "full_bf16_kahan", "full_async",
                    "full_bf16_beta_c512", "full_gc_g16_c512", "full_adamw_torch", "full_adamw_8bit",
                    "lora_beta", "lora_gc_unshared", "full", "full_beta_gc_unshared"]  # fmt: skip


def section_memory(sec: Section) -> None:
    """Peak memory (max_memory_allocated) of real `grpo-fast train` steps on a SmolLM2-135M-shaped model (30
    layers, random weights), one process per configuration (full / LoRA, beta 0 / 0.04, checkpointing off /
    on, sharing on / off, the precision recipes: bf16 weights with fp32 masters / Kahan, autocast, 8-bit
    AdamW; C up to 512, G up to 16), per step and phase, beside `grpo-fast estimate`'s prediction
    (bench/models/memory.py)."""
    import importlib.util

    from bench.models import memory as bench_memory

    sec.result["columns"] = [list(c) for c in bench_memory.COLUMNS]
    layers, steps = (2, 2) if sec.dry else (30, 3)
    # the dry run: one configuration, and one recipe at a short C (bf16 GEMMs crawl on CPUs without bf16)
    runs = [(["full_beta_gc_unshared"], None), (["full_bf16_master"], dict(C=8, G=2))] if sec.dry else [
        (list(GPU_MEMORY_ORDER), None)]  # fmt: skip
    for names, overrides in runs:
        for name in [n for n in names if bench_memory.CONFIGS[n].get("optim") == "adamw_8bit"]:
            if importlib.util.find_spec("bitsandbytes") is None:  # carried only on request: its wheel
                names.remove(name)  # (CUDA builds inside) and the compile cache overrun 64 MiB together
                sec.add(dict(config=name, note="skipped: no bitsandbytes (make gpu-wheels GPU_BNB=1)"))
        bench_memory.run(
            names, layers, steps, deadline=sec.deadline - 5, extra_flags=["--rollout-compile", "off"],
            on_row=lambda r: sec.add({k: v for k, v in r.items() if k != "flags"}), overrides=overrides,
        )  # fmt: skip
    sec.note(f"SmolLM2-135M shape, {layers} layers, {steps} steps each, native engine eager (compile off)")


def section_precision(sec: Section) -> None:
    """The mixed-precision step as TRL's users run it: end-to-end steps (bench_e2e's synthetic workload, 1
    warm-up + 1 measured) of TRL with bf16=True and ours with --bf16 (autocast on fp32 master weights, the
    rollout in bf16, corrected). The recipes' memory is the memory section's."""
    keys = ("provider", "step_s", "generate_s", "train_s", "tokens_per_s", "peak_mem_mb", "skipped", "error")
    sec.result["columns"] = [[k, k] for k in keys] + [["vs_trl_bf16", "tokens/s vs TRL bf16=True"]]
    argv = ["--providers", "trl_bf16,grpo_fast_mp", "--warmup", "1", "--steps", "1"]
    _e2e_rows(sec, argv + (["--quick"] if sec.dry else []), keys)
    rows = {r["provider"]: r for r in sec.result["rows"]}
    trl, ours = rows.get("trl_bf16", {}), rows.get("grpo_fast_mp", {})
    if "tokens_per_s" in trl and "tokens_per_s" in ours:
        ours["vs_trl_bf16"] = ours["tokens_per_s"] / trl["tokens_per_s"]
        sec.save()
