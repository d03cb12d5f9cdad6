"""The code grpo-fast adds to a stock vLLM server's workers (`--worker-extension-cls
grpo_fast.rollout.server.vllm_worker.WeightReceiver`, which `grpo-fast serve` passes): what the trainer calls
through the server's `/collective_rpc` endpoint, whose arguments are strings only.

Also vLLM's general plugin `tie_to_parent` (an entry point of this package, loaded by vLLM in each of its
processes): in a server `grpo-fast serve` launched, every vLLM process dies with the process that started it.

Imported inside vLLM's worker processes; it imports nothing of grpo-fast's beyond this file, and vLLM, torch
and safetensors only inside the methods."""

import json
import os
import signal
import socket
import time

LAUNCH_TOKEN_ENV = "GRPO_FAST_LAUNCH_TOKEN"  # set by `grpo-fast serve` (launch()): the token of the launch
PR_SET_PDEATHSIG = 1


def _libc_prctl():
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the launcher's watchdog alone
        return None


# looked up at import: after a fork in a threaded process no library may load (the launcher's preexec_fn, the
# forked children of vLLM's processes)
PRCTL = _libc_prctl()
_tied = {"pid": None, "forks": False}  # the process last tied; whether its forks are tied too
_parent = {"pid": None}  # the forking process's pid, read by its child right after a fork


def tie_to_parent() -> None:
    """vLLM's general plugin (entry point `vllm.general_plugins`; vLLM loads it in its API server, engine
    core and worker processes): in a server started by `grpo-fast serve` (the launch token in the
    environment), each vLLM process below the API server is killed (SIGKILL) when its parent dies, however
    the parent dies, and so is every process one of them forks later; a process whose parent is gone already
    (it left the server's process group) kills itself. The API server itself gets SIGTERM from the launcher's
    death (set at its start), so that it stops its children; the launcher's watchdog is the last resort.
    Does nothing in a vLLM that grpo-fast did not launch."""
    if not os.environ.get(LAUNCH_TOKEN_ENV) or not hasattr(os, "register_at_fork") or PRCTL is None:
        return
    if not _tied["forks"]:  # vLLM forks its engine and workers where it can: a fork clears the setting
        os.register_at_fork(before=_remember_parent, after_in_child=_tie_forked)
        _tied["forks"] = True
    if os.getpid() != os.getpgrp() and _tied["pid"] != os.getpid():  # not the API server (the group leader)
        _tie(lambda: os.getpgid(os.getppid()) == os.getpgrp())


def _remember_parent() -> None:
    _parent["pid"] = os.getpid()


def _tie_forked() -> None:
    if os.getpid() != os.getpgrp():
        _tie(lambda: os.getppid() == _parent["pid"])


def _tie(parent_is_ours) -> None:
    """SIGKILL when the parent dies; at once if it died before the setting took (`parent_is_ours()` false)."""
    if PRCTL(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return
    _tied["pid"] = os.getpid()
    try:
        ours = parent_is_ours()
    except OSError:  # the parent is gone between the two calls
        ours = False
    if not ours:
        os.kill(os.getpid(), signal.SIGKILL)


def tied_to_parent() -> bool:
    """Whether this process was tied to its parent by `tie_to_parent` (reported in the server's info)."""
    return _tied["pid"] == os.getpid()


def _gpu_uuid(device) -> str | None:
    """The physical GPU's UUID (CUDA indices depend on CUDA_VISIBLE_DEVICES; UUIDs do not), else None."""
    import torch

    if device is None or torch.device(device).type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(torch.device(device)).uuid)


class WeightReceiver:
    """Mixed into vLLM's worker class: `self` is the worker."""

    def grpo_fast_info(self) -> dict:
        """What the trainer checks before it trusts this server: the vLLM build, the model's shape and dtype,
        which log-probs it reports."""
        import vllm

        mc = self.vllm_config.model_config
        hf = mc.hf_config
        lora = self.vllm_config.lora_config  # None unless started with --enable-lora
        if lora is not None:
            lora = {"max_lora_rank": int(lora.max_lora_rank), "max_loras": int(lora.max_loras)}
        parallel = self.vllm_config.parallel_config
        return {
            "vllm": vllm.__version__,
            "dtype": str(mc.dtype).removeprefix("torch."),
            "logprobs_mode": str(mc.logprobs_mode),
            "architectures": list(getattr(hf, "architectures", None) or []),
            "vocab_size": int(hf.vocab_size),
            "hidden_size": int(hf.hidden_size),
            "num_hidden_layers": int(hf.num_hidden_layers),
            "tie_word_embeddings": bool(getattr(hf, "tie_word_embeddings", False)),
            "device": str(getattr(self, "device", "cpu")),
            "gpu_uuid": _gpu_uuid(getattr(self, "device", None)),
            "host": socket.gethostname(),
            "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [],
            # which launch started this server (vLLM's processes inherit the API server's environment): the
            # launcher and `grpo-fast serve --train`'s trainer refuse a server answering on the port that is
            # not the one they started
            "launch_token": os.environ.get(LAUNCH_TOKEN_ENV),
            # this worker dies with its parent (the plugin loaded): `grpo-fast serve` warns where it did not
            "tied_to_parent": tied_to_parent(),
            # LoRA adapters pushed alone need these: adapters enabled, loaded at run time, one replica
            "lora": lora,
            "runtime_lora_updating": os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower()
            in ("1", "true"),
            "data_parallel_size": int(getattr(parallel, "data_parallel_size", 1) or 1),
        }

    def grpo_fast_claim(self, owner: str, lease_s: str) -> dict:
        """Make the run `owner` (JSON: run, host, pid) this server's owner, unless another run holds it and is
        alive (its process on this host, else a call from it within its own lease, `lease_s` seconds as it
        claimed): {"ok": False, "owner": theirs}. A run that claims again (its --resume, its other ranks, on
        any host) keeps it. Returns the load count: the trainer checks later that nobody else loaded weights
        here."""
        me, held = json.loads(owner), self._grpo_fast_owner()
        if held and held["run"] != me["run"] and _alive(held, held.get("lease_s", float(lease_s))):
            return {"ok": False, "owner": _shown(held)}
        self._grpo_fast_held = {**me, "lease_s": float(lease_s), "renewed": time.monotonic()}
        return {"ok": True, "previous": _shown(held) if held else None, "loads": self._grpo_fast_count()}

    def grpo_fast_release(self, run: str) -> bool:
        """`run` gives this server up (its end): the next run claims it at once."""
        held = self._grpo_fast_owner()
        if held and held["run"] == run:
            self._grpo_fast_held = None
            return True
        return False

    def grpo_fast_state(self, run: str) -> dict:
        """Who owns this server and how many weight loads it has had (renews `run`'s claim if it owns it)."""
        held = self._grpo_fast_owner()
        if held and held["run"] == run:
            held["renewed"] = time.monotonic()
        return {"owner": _shown(held) if held else None, "loads": self._grpo_fast_count()}

    def grpo_fast_load(self, path: str, run: str = "") -> dict:
        """Load the checkpoint-format tensors of the safetensors file at `path` into the running model (in
        place, repacked for the device's kernels as vLLM's own reload does); returns what it loaded and the
        load count. Refused when `run` is not the run that owns this server."""
        from safetensors.torch import load_file

        held = self._grpo_fast_owner()
        if held and run and held["run"] != run:
            raise RuntimeError(f"grpo-fast: this server is owned by run {held['run']!r}, not {run!r}")
        weights = load_file(path, device="cpu")
        self.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
        self._grpo_fast_loads = self._grpo_fast_count() + 1
        if held:
            held["renewed"] = time.monotonic()
        return {
            "tensors": len(weights),
            "bytes": sum(t.numel() * t.element_size() for t in weights.values()),
            "loads": self._grpo_fast_loads,
        }

    def _grpo_fast_owner(self) -> dict | None:
        return getattr(self, "_grpo_fast_held", None)

    def _grpo_fast_count(self) -> int:
        return getattr(self, "_grpo_fast_loads", 0)


def _alive(owner: dict, lease_s: float) -> bool:
    """Whether the run holding a server is still there: its process, when on this host; else it called
    within `lease_s`."""
    if owner.get("host") == socket.gethostname() and owner.get("pid"):
        try:
            os.kill(int(owner["pid"]), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return time.monotonic() - owner.get("renewed", 0.0) < lease_s


def _shown(owner: dict) -> dict:
    """An owner as the trainer is told it: run, host, pid, seconds since it last called."""
    return {
        **{k: v for k, v in owner.items() if k != "renewed"},
        "idle_s": time.monotonic() - owner["renewed"],
    }
