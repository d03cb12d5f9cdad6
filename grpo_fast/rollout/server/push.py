"""The weight push: the checkpoint-format tensors changed since the last push (parameter version counters,
widened to vLLM's fused q/k/v and gate/up layers; LoRA merged unless its adapter travels alone), in the
server's dtype, through the "files" transport: a safetensors file in a directory both sides see (on one host
/dev/shm), loaded by the worker extension through `/collective_rpc`. A push is pause (in-flight requests
finish) -> load -> prefix cache reset -> resume -> verify (verify.py), every call under a time-out; files of
writers that died are swept at the next connect. Mixed into ServerEngine (engine.py), whose state it uses."""

import contextlib
import glob
import os
import shutil
import socket
import time
import zlib

import torch

from ..lora_adapters import ADAPTER
from ..vllm_engine import _siblings, checkpoint_weights
from .client import CHECK_TIMEOUT_S, LEAVING_TIMEOUT_S, Server, ServerError

WEIGHT_FILE = "grpo-fast-weights-{host}-"  # then the writer's pid: swept once that process is gone


def sweep_weight_files(directory: str) -> None:
    """Remove the push files that writers on this host left when they died mid-push (SIGKILL, OOM kill)."""
    prefix = WEIGHT_FILE.format(host=socket.gethostname())
    for path in glob.glob(os.path.join(glob.escape(directory), glob.escape(prefix) + "*")):
        pid = os.path.basename(path)[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            if os.path.isdir(path):  # a LoRA adapter's directory
                shutil.rmtree(path, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.unlink(path)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Pushes:
    """ServerEngine's weight pushes (its servers, lock, versions, loads, weight_dir and stats)."""

    @torch.no_grad()
    def push(self, model, step: int | None = None) -> int:
        """Send the weights changed since the last push, then verify them on every server; returns how many
        tensors went. ServerError (naming the server and the step) on any failure or a failed check."""
        with self.lock:
            return self._push(model, step)

    def weights(self, model) -> dict:
        """What a push draws from: checkpoint_weights, the LoRA adapter apart when it is pushed alone."""
        return checkpoint_weights(model, adapters_apart=self.adapters)

    def _push(self, model, step):
        entries = self.weights(model)
        names = self.to_send(entries)
        if not names:
            return 0
        t0 = time.monotonic()
        # one tensor at a time on the device (LoRA: each merged weight made, then moved off)
        tensors = {n: entries[n][1]().to("cpu", self.torch_dtype) for n in names}
        self.send(tensors, {n: entries[n][0] for n in names}, self.trainer_probe(model, names), step, t0)
        return len(names)

    def changed(self, entries: dict) -> set:
        """The names of `entries` (checkpoint_weights) whose version changed since the last push."""
        return {n for n, (key, _) in entries.items() if self.versions.get(n) != key}

    def to_send(self, entries: dict, changed=None) -> list:
        """The names to push: those changed since the last push (or `changed`), with the rest of their fused
        layers (vLLM loads q/k/v and gate/up as one), and the whole adapter when any of it changed (it loads
        as one)."""
        changed = self.changed(entries) if changed is None else set(changed)
        if any(n.startswith(ADAPTER) for n in changed):
            changed |= {n for n in entries if n.startswith(ADAPTER)}
        return sorted({s for n in changed for s in _siblings(n) if s in entries} | changed)

    def send(self, tensors: dict, keys: dict, mine, step, t0: float) -> None:
        """Load `tensors` (whole, by checkpoint name, on the CPU in `torch_dtype`: the callers cast them one
        at a time) on every live server and verify against `mine`, the trainer's probe log-probs under the
        same weights (`trainer_probe`); `keys`: their version keys, remembered once they are loaded. The
        adapter's tensors (LoRA pushed alone) go as an adapter under a new name, checked through it; base
        weights sent with them are checked against the trainer's base model."""
        mine, base = mine if isinstance(mine, tuple) else (mine, None)
        adapter = {n: t for n, t in tensors.items() if n.startswith(ADAPTER)}
        out, seen = {}, set()
        for n, t in tensors.items():
            if n in adapter:
                continue
            t = t.contiguous()
            if t.data_ptr() in seen:  # a tied tensor twice: safetensors stores each storage once
                t = t.clone()
            seen.add(t.data_ptr())
            out[n] = t
        sums = {n: _checksum(t) for n, t in {**out, **adapter}.items()}
        bytes_changed = any(self.sent.get(n) != c for n, c in sums.items())
        at = f" at step {step}" if step is not None else ""
        t_load = time.monotonic()
        if out:
            path = self._write(out, step)
            try:
                for s in self.alive:
                    self._load(s, path, at)
            finally:
                os.unlink(path)
            if base is not None:
                self._check_base(base, at)
        previous = self.adapter
        if adapter:
            self._load_adapter(adapter, step, at)
        self.versions.update(keys)
        self.sent.update(sums)
        t_verify = time.monotonic()
        self._verify(mine, at, bytes_changed)
        self.stats["sync_load_s"] = t_verify - t_load  # written, loaded (the servers' time included)
        self.stats["sync_verify_s"] = time.monotonic() - t_verify
        if adapter and previous:  # nothing names it any more: generation holds the lock a push takes
            self._retire(previous)
        if adapter:
            self._account_adapters()
        self.stats["pushes"] += 1
        self.stats["pushed_tensors"] += len(out) + len(adapter)
        sent = [*out.values(), *adapter.values()]
        self.stats["sync_bytes"] = sum(t.numel() * t.element_size() for t in sent)
        self.stats["sync_s"] = time.monotonic() - t0

    def _write(self, tensors: dict, step) -> str:
        from safetensors.torch import save_file

        name = WEIGHT_FILE.format(host=socket.gethostname())
        name += f"{os.getpid()}-{id(self)}-{step if step is not None else 'x'}.safetensors"
        path = os.path.join(self.weight_dir, name)
        try:
            save_file(tensors, path + ".tmp")
            os.replace(path + ".tmp", path)  # a worker never reads half a file
        except (OSError, RuntimeError) as exc:  # safetensors reports a full disk as either
            with contextlib.suppress(OSError):
                os.unlink(path + ".tmp")
            need = sum(t.numel() * t.element_size() for t in tensors.values())
            free = shutil.disk_usage(self.weight_dir).free if os.path.isdir(self.weight_dir) else 0
            raise ServerError(
                f"weight push: could not write {need / 2**20:.0f} MiB into vllm_weight_dir={self.weight_dir} "
                f"({free / 2**20:.0f} MiB free there): {exc}"
            ) from exc
        return path

    def _load(self, s: Server, path: str, at: str) -> None:
        what = f"resume after the weight push{at}"
        try:
            s.call("/pause?mode=wait", {}, what=f"pause before the weight push{at}")
            loaded = s.rpc("grpo_fast_load", path, self.run, what=f"weight push{at}")
            s.call("/reset_prefix_cache", {}, what=f"prefix cache reset{at}", timeout=CHECK_TIMEOUT_S)
        except BaseException as exc:  # the first error is the one said: a failing resume after it is not
            # a stop signal (not the server's error) leaves at once: a hung server would hold it for the
            # whole time-out, and the next run resumes the server at connect anyway
            leaving = not isinstance(exc, ServerError)
            try:
                s.call("/resume", {}, what=what, timeout=LEAVING_TIMEOUT_S if leaving else CHECK_TIMEOUT_S)
            except ServerError:
                if leaving:  # silent on the way out: not waited for again (`release`)
                    s.alive = False
            raise
        s.call("/resume", {}, what=what, timeout=CHECK_TIMEOUT_S)
        if not loaded or not isinstance(loaded[0], dict):
            raise ServerError(f"vLLM server {s.url}: weight push{at} returned {loaded!r}, not what it loaded")
        self.loads[s.url] = int(loaded[0].get("loads", 0))


def _checksum(t: torch.Tensor) -> int:
    """A checksum of a tensor's bytes (CRC-32: whether a pushed tensor changed since the last push)."""
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy())
