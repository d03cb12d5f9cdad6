"""The code grpo-fast adds to a stock vLLM server's workers (`--worker-extension-cls
grpo_fast.rollout.vllm_worker.WeightReceiver`, which `grpo-fast serve` passes): what the trainer calls through
the server's `/collective_rpc` endpoint, whose arguments are strings only.

Imported inside vLLM's worker processes; it imports nothing of grpo-fast's beyond this file, and vLLM, torch
and safetensors only inside the methods."""

import os
import socket


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
        }

    def grpo_fast_load(self, path: str) -> dict:
        """Load the checkpoint-format tensors of the safetensors file at `path` into the running model (in
        place, repacked for the device's kernels as vLLM's own reload does); returns what it loaded."""
        from safetensors.torch import load_file

        weights = load_file(path, device="cpu")
        self.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
        return {"tensors": len(weights), "bytes": sum(t.numel() * t.element_size() for t in weights.values())}
