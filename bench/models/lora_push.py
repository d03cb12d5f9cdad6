"""LoRA weight pushes to a vLLM server: the adapter alone vs merged weights, bytes and seconds per push.

One `grpo-fast serve --lora-rank R` server per model shape (SmolLM2-135M-Instruct, and a 1B-class Llama shape:
SmolLM2's tokenizer, hidden 2048, 16 layers, intermediate 8192: 1.2B parameters, random weights), the trainer
in this process holding the same model with PEFT LoRA on every linear layer. For each push mode, a fresh
engine pushes once (the base or the merged weights: every tensor) and then after each of `--pushes` adapter
updates (every LoRA tensor moved, as an optimizer step moves it); a push is timed from the trainer's tensors
to a server verified through its probe. Runs in the vLLM environment (make setup-vllm):

    .venv-vllm/bin/python -m bench.models.lora_push   # -> bench/results/zen3/lora_push.{md,json}
"""

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench._utils import machine_info, markdown_table, write_results

SMOLLM2 = Path(os.environ.get("GRPO_FAST_SMOLLM2", Path.home() / ".cache/grpo-fast/SmolLM2-135M-Instruct"))
ONE_B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
         "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": False}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shape_dir(shape: str, tmp: Path) -> Path:
    """The model directory the server starts from (config and tokenizer; the server's weights are dummy)."""
    if shape == "smollm2-135m":
        return SMOLLM2
    out = tmp / shape
    out.mkdir()
    for f in SMOLLM2.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    config = json.loads((SMOLLM2 / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **ONE_B}))
    return out


def trainer_model(shape: str, directory: Path, rank: int):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    if shape == "smollm2-135m":
        base = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    else:
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=torch.float32)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")
    return get_peft_model(base.eval(), lora).eval()


def step(model, seed: int) -> None:
    """An optimizer step's worth of change to every adapter tensor."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.add_(torch.randn(p.shape, generator=g) * 1e-3)


def measure(shape: str, dtype: str, rank: int, pushes: int, cores: str | None) -> list[dict]:
    from grpo_fast.rollout.server import ServerEngine, serve

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = shape_dir(shape, Path(tmp))
        model = trainer_model(shape, directory, rank)
        params = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
        log = open(Path(tmp) / "server.log", "w")
        with serve.launch(str(directory), port=free_port(), dtype=dtype, max_model_len=256, lora_rank=rank,
                          kv_cache_gb=1, cores=cores, log=log) as url:  # fmt: skip
            for mode in ("adapter", "merged"):
                engine = ServerEngine(model, [url], auto_push=False, push_adapters=mode == "adapter",
                                      run=f"bench {mode}")  # fmt: skip
                t0 = time.perf_counter()
                engine.push(model, 0)
                first = {"s": time.perf_counter() - t0, "bytes": engine.stats["sync_bytes"]}
                seconds, sizes, phases = [], [], []
                for k in range(1, pushes + 1):
                    step(model, k)
                    t0 = time.perf_counter()
                    engine.push(model, k)
                    seconds.append(time.perf_counter() - t0)
                    sizes.append(engine.stats["sync_bytes"])
                    phases.append((engine.stats["sync_load_s"], engine.stats["sync_verify_s"]))
                engine.release()
                row = {"shape": shape, "params_b": params / 1e9, "server_dtype": dtype, "rank": rank,
                       "push": mode, "first_push_mib": first["bytes"] / 2**20, "first_push_s": first["s"],
                       "push_mib": statistics.median(sizes) / 2**20, "push_s": statistics.median(seconds),
                       "push_s_all": seconds,
                       "load_s": statistics.median(p[0] for p in phases),
                       "verify_s": statistics.median(p[1] for p in phases),
                       "probe_error": engine.stats["probe_error"]}  # fmt: skip
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="smollm2-135m,llama-1b-shape")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--pushes", type=int, default=3)
    p.add_argument("--cores", default=None, help="the server's cores (default: shared with this process)")
    args = p.parse_args(argv)
    dtypes = {"smollm2-135m": "float32", "llama-1b-shape": "bfloat16"}
    rows = []
    for shape in args.shapes.split(","):
        rows += measure(shape, dtypes[shape], args.rank, args.pushes, args.cores)
    for r in rows:
        merged = next(x for x in rows if x["shape"] == r["shape"] and x["push"] == "merged")
        r["bytes_vs_merged"] = r["push_mib"] / merged["push_mib"]
        r["speedup_vs_merged"] = merged["push_s"] / r["push_s"]
    columns = [("shape", "model"), ("params_b", "base params (B)"), ("server_dtype", "server dtype"),
               ("rank", "LoRA rank"), ("push", "push"), ("first_push_mib", "first push (MiB)"),
               ("first_push_s", "first push (s)"), ("push_mib", "per step (MiB)"), ("push_s", "per step (s)"),
               ("load_s", "of which written + loaded (s)"), ("verify_s", "of which probe checked (s)"),
               ("bytes_vs_merged", "bytes vs merged"), ("speedup_vs_merged", "speed-up vs merged"),
               ("probe_error", "probe |server - trainer|")]  # fmt: skip
    command = " ".join(["python -m bench.models.lora_push", *(argv if argv is not None else sys.argv[1:])])
    md = (
        "# LoRA pushes to a vLLM server: the adapter alone vs merged weights\n\n"
        f"`{command}`: one "
        f"`grpo-fast serve --lora-rank {args.rank}` server per shape, on the trainer's host (files through "
        "/dev/shm); LoRA on every linear layer. A push is timed from the trainer's tensors to the server "
        "verified through its probe (written, loaded, checked); per step: the median of "
        f"{args.pushes} pushes after adapter updates. The first push carries every weight in both modes "
        "(the base, or the merged model).\n\n" + markdown_table(rows, columns) + "\n"
    )
    write_results("lora_push", {"machine": machine_info(), "rows": rows}, md)
    print(md)


if __name__ == "__main__":
    main()
