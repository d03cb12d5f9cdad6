"""Checkpoints written atomically: a temporary directory, fsynced, then renamed into place.

A kill at any moment leaves either the previous checkpoints or the new one complete, never a torn one:
`latest_checkpoint` only sees directories named `checkpoint-<step>` that hold `trainer_state.json`, which is
written last, inside the temporary directory.
"""

import json
import os
import random
import re
import secrets
import shutil
import socket
import tempfile
from pathlib import Path

import numpy as np
import torch

_NAME = re.compile(r"^checkpoint-(\d+)$")
# sync_ref_model: the moving reference's weights, in a folder of its own (loaders such as vLLM's read every
# *.safetensors beside the model's: one there would be served as the policy's)
REFERENCE = Path("reference") / "model.safetensors"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    out_dir: Path,
    step: int,
    model,
    tokenizer,
    optimizer_state: dict,
    scheduler,
    sampler_state: dict,
    generator: torch.Generator,
    extra: dict,
    keep: int,
    model_state: dict | None = None,
    scaler=None,
    reference_state: dict | None = None,
) -> Path:
    """checkpoint-<step>: the model as `save_pretrained` writes it (from `model_state` when given: FSDP's
    gathered full state), the optimizer's full name-keyed state (`distributed.full_optimizer_state`, loadable
    with any world size: 16-bit weights' fp32 masters or compensations are in it), scheduler, fp16's loss
    scaler, RNG states, sampler position, a moving reference's full state when given (sync_ref_model:
    reference/model.safetensors); trainer_state.json last."""
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / f"checkpoint-{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f".checkpoint-{step}-", dir=out_dir))
    try:
        if model_state is not None:
            model.save_pretrained(tmp, state_dict=model_state, safe_serialization=True)
        else:
            model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if reference_state is not None:
            from safetensors.torch import save_file

            (tmp / REFERENCE).parent.mkdir()
            save_file({k: v.detach().contiguous() for k, v in reference_state.items()}, tmp / REFERENCE)
        torch.save(
            {
                "optimizer": optimizer_state,
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else None,
            },
            tmp / "optimizer.pt",
        )
        torch.save(
            {
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "torch": torch.get_rng_state(),
                "generator": generator.get_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            },
            tmp / "rng.pt",
        )
        state = {"step": step, "sampler": sampler_state, **extra}
        (tmp / "trainer_state.json").write_text(
            json.dumps(state, indent=2)
        )  # last: marks the checkpoint whole
        for f in sorted(tmp.rglob("*"), reverse=True):  # files, then the folders that hold them
            if f.is_dir():
                _fsync_dir(f)
                continue
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(tmp)
        if final.exists():  # a re-save of the same step: move the old one aside first
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(out_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_reference(model, ckpt: Path) -> bool:
    """A moving reference's weights from checkpoint `ckpt` into `model` (False, nothing loaded, where the
    checkpoint holds none: a run that did not sync its reference)."""
    from safetensors.torch import load_file

    if not (ckpt / REFERENCE).is_file():
        return False
    missing, unexpected = model.load_state_dict(load_file(ckpt / REFERENCE), strict=False)
    if unexpected or set(missing) - _tied_heads(model):
        raise ValueError(f"{ckpt / REFERENCE}: not this model's weights (missing {missing}, unexpected "
                         f"{unexpected})")  # fmt: skip
    return True


def _tied_heads(model) -> set:
    """The LM head's weight name where it is tied to the embeddings (saved once, as save_pretrained does)."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return set()
    head = model.get_output_embeddings()
    return {f"{n}.weight" for n, m in model.named_modules() if m is head}


def list_checkpoints(out_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not out_dir.is_dir():
        return []
    found = []
    for p in out_dir.iterdir():
        m = _NAME.match(p.name)
        if m and (p / "trainer_state.json").is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def step_of(ckpt: Path | None) -> int:
    """The step a checkpoint directory holds, -1 for none."""
    return -1 if ckpt is None else int(_NAME.match(ckpt.name).group(1))


def torn_saves(out_dir: Path) -> list[Path]:
    """Temporary directories of saves that were killed before their rename (safe to delete at start)."""
    return sorted(out_dir.glob(".checkpoint-*")) if out_dir.is_dir() else []


def latest_checkpoint(out_dir: Path) -> Path | None:
    ckpts = list_checkpoints(out_dir)
    return ckpts[-1] if ckpts else None


def load_training_state(
    ckpt: Path, load_optimizer, scheduler, generator: torch.Generator | None, scaler=None
) -> dict:
    """Restore optimizer (`load_optimizer(full_state)`), scheduler, loss scaler and RNG states, and the
    sampling generator when given; return trainer_state.json (the model loads separately)."""
    opt = torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=False)
    load_optimizer(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    if scaler is not None and opt.get("scaler") is not None:
        scaler.load_state_dict(opt["scaler"])
    rng = torch.load(ckpt / "rng.pt", map_location="cpu", weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if generator is not None:
        generator.set_state(rng["generator"])
    if (
        rng["cuda"] is not None
        and torch.cuda.is_available()
        and len(rng["cuda"]) == torch.cuda.device_count()
    ):
        torch.cuda.set_rng_state_all(rng["cuda"])
    return trainer_state(ckpt)


RUN_ID = "run_id"  # in the output directory: the name vLLM servers know the run by


def run_id(out: Path, resume: bool) -> str:
    """The name this run's vLLM servers know it by (their owner): on --resume the one in `out`/run_id, so that
    the run resumed on another host is still the same run; else a new one, written there (a random id, with
    the host and output directory it started from). Rank 0 calls this; every rank takes its answer."""
    path = out / RUN_ID
    if resume and path.is_file():
        said = path.read_text().strip()
        if said:
            return said
    said = f"{secrets.token_hex(8)} ({socket.gethostname()}:{out.resolve()})"
    out.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{RUN_ID}.tmp")
    tmp.write_text(said + "\n")
    os.replace(tmp, path)
    return said


def trainer_state(ckpt: Path) -> dict:
    """A checkpoint's trainer_state.json: its step, sampler position and the run's resolved config."""
    return json.loads((ckpt / "trainer_state.json").read_text())
