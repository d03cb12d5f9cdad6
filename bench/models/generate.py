"""Rollout speed: completion tokens/s and peak memory of G samples per prompt, per engine, each in its own
process.

    python -m bench.models.generate [--quick] [--workloads bench,real,demo] [--repeats 2]

Providers (same prompts, same sampling: T=1, no top-k / top-p, EOS ends a sample):
  hf          HF `model.generate(num_return_sequences=G, do_sample=True)`: every prompt repeated G times
  reference   `generate_groups(engine="reference")`: our previous path (shared prompt KV, eager, per token)
  native      `generate_groups(engine="native")`: static KV cache, packed weights, no per-token host sync
  native_<dtype>   the native engine with its decode step's linear layers in a low-precision copy
              (`rollout_dtype` bf16, fp16, int8 or fp8: see `generate_groups`); every native and vLLM row
              also reports the mismatch of its samples' log-probs to the fp32 training forward (mean k3,
              max ratio)
  native_compiled   the same with the decode step compiled (demo workload only on a CPU: compiling a 10- or
              30-layer step takes minutes here; it is the default on CUDA)
  vllm        `generate_groups(engine="vllm")`: vLLM in the worker's process (its own environment, `make
              setup-vllm`), prefix caching, n=G per prompt; the policy's weights pushed once (first call)
  vllm_1t     the same with vLLM's OpenMP threads at 1 during generation (on a shared 2-core CPU)
  vllm_<dtype>   vLLM with `rollout_dtype` bf16 / fp16 (its weights in that dtype) or fp8 (GPU)
Workloads:
  bench   the end-to-end bench model (random-init ~45M Qwen2 shape), 2 prompts of P=512, G=8, C=128
  real    SmolLM2-135M-Instruct (grpo_fast.tasks.smollm2), chat prompts of different lengths, G=8, C=256;
          2 and 8 prompts
  demo    the embedded demo model and task, 16 prompts, G=8, C=20 (the demo's own settings)
  tools   multi-turn (grpo_fast.rollout.trajectories): SmolLM2-135M-Instruct, 8 chat prompts, greedy, up
          to 256 tokens per trajectory; a `lookup` tool whose answer is the next call, three tool turns
          each (the model copies a call it is shown). Providers: hf = TRL's way, HF `generate` over the
          conversations so far at every turn (ids concatenated, not re-tokenized); native = our engine,
          each row's KV cache kept across turns; native_resubmit = our engine called afresh at every turn;
          reference; vllm = a new request per turn whose prefix vLLM's cache holds. Tokens: the model's
          (tool turns not counted); the tools' code is the same for every provider
Each measurement: one short warm-up call, then `repeats` calls with seeds 0.. (different samples per seed,
the same seeds for every provider); tokens/s = completion tokens / seconds over those calls. Sampled lengths
differ between providers (another random stream), so a run's tokens/s, not its seconds, is compared.
Peak = resident-set high-water mark above the process after warm-up: vLLM's KV pool (kv_cache_gb, allocated
when it starts) is not in it, the native engine's per-call KV cache is.


"""

import argparse
import sys
import time

import torch

from bench._utils import (
    NO_VLLM,
    baseline_mib,
    cpu_line,
    machine_info,
    markdown_table,
    run_worker,
    vllm_python,
    worker_main,
    write_results,
)
from grpo_fast.rollout.dtypes import LINEAR_FORMATS
from grpo_fast.trainer.memory import peak_mib

PROVIDERS = ["hf", "reference", "native", "native_compiled", "vllm"]
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning, my friend' into Spanish.",
    "What is 17 times 23? Show your work.",
    "Give me a short tip for learning to play the guitar.",
    "Name a famous painting by Vincent van Gogh and describe it briefly.",
]
WORKLOADS = {
    "bench": dict(prompts=2, G=8, C=128, P=512),
    "real": dict(prompts=2, G=8, C=256),
    "real8": dict(prompts=8, G=8, C=256),
    "demo": dict(prompts=16, G=8, C=20),
    "tools": dict(prompts=8, G=1, C=256),
}
TOOLS_ONLY = ("native_resubmit",)  # providers of the tools workload alone
TOOLS_TOO = ("hf", "native", "reference", "vllm")  # and of it too
TOOL_KEYS = ["apple", "river", "stone", "cloud", "maple", "flint", "ember", "coral"]
TOOL_ROUNDS = 3


def tool_call_text(key: str) -> str:
    return '<tool_call>\n{"name": "lookup", "arguments": {"key": "%s"}}\n</tool_call>' % key


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: the key
    """
    step = int(key[-1]) if key[-1:].isdigit() else TOOL_ROUNDS
    return "The value is 42." if step >= TOOL_ROUNDS else tool_call_text(key[:-1] + str(step + 1))


def _tool_prompts(n):
    return [[{"role": "user", "content": "Repeat exactly, and nothing else: " + tool_call_text(k + "1")}]
            for k in TOOL_KEYS[:n]]  # fmt: skip


def _hf_tools(model, tok, prompts, C):
    """TRL's multi-turn loop with HF generate: every turn one batched greedy `generate` over the rows still
    going, from their whole token sequence so far; returns the model's tokens."""
    from grpo_fast.rollout import tools as T

    template, box = T.tool_chat_template(tok), T.Toolbox([lookup])
    seqs = [tok(T.render(tok, p, box.schemas, template), add_special_tokens=False).input_ids for p in prompts]
    used, rounds = [0] * len(seqs), [0] * len(seqs)
    active, model_tokens, eos = list(range(len(seqs))), 0, tok.eos_token_id
    while active:
        P = max(len(seqs[i]) for i in active)
        ids = torch.tensor([[eos] * (P - len(seqs[i])) + seqs[i] for i in active])
        mask = torch.tensor([[0] * (P - len(seqs[i])) + [1] * len(seqs[i]) for i in active])
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, eos_token_id=eos, pad_token_id=eos,
            max_new_tokens=max(C - used[i] for i in active),
        )[:, P:].tolist()  # fmt: skip
        nxt = []
        for i, new in zip(active, out):
            new = new[: new.index(eos) + 1] if eos in new else new
            new = new[: C - used[i]]
            seqs[i] += new
            used[i] += len(new)
            model_tokens += len(new)
            _, calls = T.parse_tool_calls(tok.decode(new, skip_special_tokens=True))
            if not calls or not new or new[-1] != eos or rounds[i] >= TOOL_ROUNDS or used[i] >= C:
                continue
            res = T.run_tool_calls([(box, calls)], 10.0)[0]
            msgs = [{"role": "tool", "name": r.name, "content": r.content} for r in res]
            turn = T.tool_turn_ids(tok, template, msgs, {eos})
            rounds[i] += 1
            if used[i] + len(turn) < C:
                seqs[i] += turn
                used[i] += len(turn)
                nxt.append(i)
        active = nxt
    return model_tokens, sum(rounds) / len(seqs)


def measure_tools(a: dict) -> dict:
    """The multi-turn workload: model tokens/s of each provider (see the module docstring)."""
    from grpo_fast.rollout.trajectories import generate_trajectories

    model, tok = _smollm2()
    prompts, C, p = _tool_prompts(a["prompts"]), a["C"], a["provider"]

    def call(c):
        if p == "hf":
            return _hf_tools(model, tok, prompts, c)
        engine = p.split("_")[0]
        tr = generate_trajectories(
            model, tok, prompts, 1, c, tools=[lookup], temperature=0.0, engine=engine,
            max_tool_calling_iterations=TOOL_ROUNDS, carry_kv=p != "native_resubmit", compile=False,
            **({"vllm_options": {"max_model_len": 1024, "kv_cache_gb": 4}} if engine == "vllm" else {}),
        )  # fmt: skip
        return int((tr.completion_mask * tr.tool_mask).sum()), sum(tr.tool_calls) / len(prompts)

    with torch.no_grad():
        t0 = time.perf_counter()
        call(C)  # warm-up (and vLLM's start)
        warm = time.perf_counter() - t0
        base = baseline_mib(torch.device("cpu"))
        tokens, secs, rounds = 0, 0.0, 0.0
        for _ in range(a["repeats"]):
            t0 = time.perf_counter()
            n, rounds = call(C)
            secs += time.perf_counter() - t0
            tokens += n
        peak = peak_mib("cpu") - base
    env = _environment(p)
    return dict(
        tokens=tokens, seconds=secs, tokens_per_s=tokens / secs, peak_mem_mb=peak, warmup_s=warm, env=env,
        tool_rounds=rounds,
    )  # fmt: skip


MIN_CALLS = {"demo": 10}  # a demo call lasts ~60 ms: one call is noise
QUICK = {"bench": dict(prompts=2, G=4, C=8, P=24), "demo": dict(prompts=4, G=4, C=8)}


def _smollm2():
    """(model, tokenizer): SmolLM2-135M-Instruct in fp32, built offline (grpo_fast.tasks.smollm2)."""
    from transformers import AutoModelForCausalLM

    from grpo_fast.tasks.smollm2 import build
    from grpo_fast.trainer.modeling import load_tokenizer

    path = build()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), load_tokenizer(str(path))


def _environment(provider: str) -> str:
    """The library versions a row ran with."""
    import transformers

    env = f"transformers {transformers.__version__}"
    if provider.startswith("vllm"):
        import vllm

        env += f", vllm {vllm.__version__}"
    return env


def _work(name: str, a: dict):
    """(model, prompt ids, prompt mask, eos id) for a workload."""
    if name == "bench":
        from bench.models.prefix import make_model

        model = make_model("tiny" if a["quick"] else "50m").eval()
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(2, model.config.vocab_size, (a["prompts"], a["P"]), generator=g)
        return model, ids, torch.ones_like(ids), 1
    if name.startswith("real"):
        model, tok = _smollm2()
        texts = [
            tok.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            )
            for q in QUESTIONS[: a["prompts"]]
        ]
        tok.padding_side = "left"
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        return model, enc.input_ids, enc.attention_mask, tok.eos_token_id
    from grpo_fast.tasks import default_task
    from grpo_fast.trainer.config import parse_config
    from grpo_fast.trainer.data import train_and_eval_rows
    from grpo_fast.trainer.modeling import load_model_and_tokenizer
    from grpo_fast.trainer.train import encode_prompts

    cfg = parse_config([])
    model, tok, _ = load_model_and_tokenizer(cfg, torch.device("cpu"))
    rows = train_and_eval_rows(cfg)[0][: a["prompts"]]
    _, ids, mask = encode_prompts(rows, tok, cfg.max_prompt_length, "cpu")
    assert default_task.ASSET_DIR
    return model.eval(), ids, mask, tok.eos_token_id


def _hf(model, ids, mask, G, C, eos, seed):
    torch.manual_seed(seed)
    out = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
        max_new_tokens=C, num_return_sequences=G, eos_token_id=eos, pad_token_id=eos,
    )[:, ids.shape[1] :]  # fmt: skip
    ended = (out == eos).long().cumsum(1)
    return int(((ended == 0) | ((ended == 1) & (out == eos))).sum())  # tokens up to and including EOS


def measure_one(a: dict) -> dict:
    from grpo_fast.rollout import generate_groups

    if a["workload"] == "tools":
        return measure_tools(a)
    torch.set_num_threads(torch.get_num_threads())
    model, ids, mask, eos = _work(a["workload"], a)
    eos = None if a.get("no_eos") else eos  # every row runs C tokens (profile_decode's fixed-length calls)
    G, C, p = a["G"], a["C"], a["provider"]

    def call(c, seed):
        if p == "hf":
            return _hf(model, ids, mask, G, c, eos, seed)
        engine = p.split("_")[0] if p.startswith(("reference", "vllm")) else "native"
        vllm = {"max_model_len": ids.shape[1] + C, "kv_cache_gb": 4, "threads": 1 if p == "vllm_1t" else None}
        dtype = p.split("_")[-1]  # native_bf16, vllm_bf16, ...
        kw = {"rollout_dtype": dtype} if dtype in LINEAR_FORMATS else {}
        out = generate_groups(
            model, ids, mask, G, c, temperature=1.0, eos_token_id=eos, engine=engine,
            compile=True if p == "native_compiled" else False, generator=torch.Generator().manual_seed(seed),
            vllm_options=vllm if engine == "vllm" else None, return_logprobs=engine != "reference", **kw,
        )  # fmt: skip
        samples.append(out)
        return int(out[1].sum())

    samples = []

    with torch.no_grad():
        t0 = time.perf_counter()
        call(min(C, 8), 99)  # warm-up: allocator, kernels; compiling, starting vLLM and its weight push
        warm = time.perf_counter() - t0
        if p == "native_compiled":
            call(C, 98)  # the full-length shapes compile too
            warm = time.perf_counter() - t0
        base = baseline_mib(torch.device("cpu"))
        tokens, secs = 0, 0.0
        for seed in range(max(a["repeats"], MIN_CALLS.get(a["workload"], 1))):
            t0 = time.perf_counter()
            tokens += call(C, seed)
            secs += time.perf_counter() - t0
        peak = peak_mib("cpu") - base
    mismatch = _mismatch(model, ids, mask, samples[-1]) if p.startswith(("native", "vllm")) else {}
    env = _environment(p)
    return dict(
        tokens=tokens, seconds=secs, tokens_per_s=tokens / secs, peak_mem_mb=peak, warmup_s=warm, env=env,
        **mismatch,
    )  # fmt: skip


def _mismatch(model, ids, mask, sample):
    """The engine's log-probs of its samples vs the fp32 training forward's (what the correction sees)."""
    from grpo_fast.kernels import fused_linear_logprobs

    from grpo_fast.models.model_parts import lm_head_of
    from grpo_fast.models.shared_prefix import shared_prefix_forward

    c_ids, c_mask, logp = sample
    hidden = shared_prefix_forward(model, ids, mask, c_ids, c_mask)
    train = fused_linear_logprobs(hidden, lm_head_of(model).weight, c_ids, bias=lm_head_of(model).bias)
    d = (train - logp)[c_mask.bool()]
    return {"mismatch_k3": float((d.exp() - d - 1).mean()), "ratio_max": float(d.exp().max())}


COLUMNS = [
    ("workload", "workload"),
    ("shape", "prompts x G, C"),
    ("provider", "provider"),
    ("tokens", "completion tokens"),
    ("seconds", "seconds"),
    ("tokens_per_s", "tokens/s"),
    ("vs_hf", "vs HF generate"),
    ("peak_mem_mb", "peak MiB"),
    ("mismatch_k3", "mismatch to fp32 trainer (mean k3)"),
    ("ratio_max", "max ratio"),
    ("warmup_s", "warm-up s (compile, start)"),
    ("tool_rounds", "tool turns per trajectory"),
    ("env", "environment"),
    ("error", "note"),
]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run)")
    ap.add_argument("--workloads", default="bench,real,real8,demo")
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--name", default="bench_generate", help="results file name")
    args = ap.parse_args(argv)
    rows = []
    for w in args.workloads.split(","):
        shape = dict(WORKLOADS[w], **(QUICK.get(w, {}) if args.quick else {}))
        if args.quick and w not in QUICK:
            continue
        for p in args.providers.split(","):
            if p == "native_compiled" and w != "demo" and not torch.cuda.is_available():
                continue
            if (p in TOOLS_ONLY) != (w == "tools") and p not in TOOLS_TOO:
                continue
            job = dict(shape, workload=w, provider=p, quick=args.quick, repeats=args.repeats)
            t0 = time.time()
            python = vllm_python() if p.startswith("vllm") else None
            if p.startswith("vllm") and python is None:
                res = {"error": NO_VLLM}
            else:
                res = run_worker("models.generate", job, timeout=1800, python=python)
            row = dict(job, shape=f"{shape['prompts']} x {shape['G']}, {shape['C']}", **res)
            rows.append(row)
            shown = res.get("error") or f"{res['tokens_per_s']:.0f} tok/s, peak {res['peak_mem_mb']:.0f} MiB"
            print(f"  {w:<6} {p:<16} {shown}   ({time.time() - t0:.0f}s)", flush=True)
    for r in rows:
        hf = next((x for x in rows if x["workload"] == r["workload"] and x["provider"] == "hf"), None)
        if hf and "tokens_per_s" in hf and "tokens_per_s" in r:
            r["vs_hf"] = r["tokens_per_s"] / hf["tokens_per_s"]
    info = machine_info()
    md = (
        "# Rollout engines: completion tokens/s (T=1, EOS ends a sample)\n\n"
        f"Machine: {cpu_line(info)}, torch {info['versions']['torch']}, transformers "
        f"{info['versions']['transformers']}, commit {info['git_commit']}; {args.repeats} timed call(s) per "
        "row after a warm-up call, each provider in its own process.\n\n"
        + markdown_table(rows, COLUMNS)
        + "\n"
    )
    name = args.name + ("_quick" if args.quick else "")
    out = write_results(name, {"machine": info, "rows": rows, "repeats": args.repeats}, md)
    print(md)
    print(f"wrote {out}/{name}.{{json,md}}")


if __name__ == "__main__":
    if not worker_main(measure_one):
        main(sys.argv[1:])
