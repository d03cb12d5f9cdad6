"""LoRA adapters pushed alone to vLLM servers: the base weights go once, then each push writes the adapter
(PEFT's `lora_A` / `lora_B` tensors and its config, the layout vLLM's LoRA loader reads) as a new directory,
loaded under a new versioned name (`/v1/load_lora_adapter`), and every request names that version. A new
name per version, never an in-place reload: vLLM keys its prefix cache on the adapter's name, so a reload in
place would serve KV computed under the previous adapter.

What a plain vLLM LoRA adapter cannot carry (DoRA, trained biases, fully trained modules, the LM head or the
embeddings, several active adapters) is pushed merged instead; `unservable` says why. A server set up too
small for the adapter (its rank) is an error, not a silent fallback to pushes a hundred times larger."""

import contextlib
import json
import os
import shutil

ADAPTER = "lora:"  # prefix of an adapter tensor's entry among checkpoint_weights(adapters_apart=True)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM 0.32 accepts
NAME_PREFIX = "grpo-fast-"  # the served names of grpo-fast's adapters: a new owner unloads its predecessors'


def adapter_parameters(name: str, layer) -> dict:
    """The adapter tensors of the PEFT LoRA layer `name` (relative to the causal LM): {ADAPTER + the name
    PEFT saves it under: parameter}."""
    (active,) = [a for a in layer.active_adapters if a in layer.lora_A]
    return {f"{ADAPTER}base_model.model.{name}.{part}.weight": getattr(layer, part)[active].weight
            for part in ("lora_A", "lora_B")}  # fmt: skip


def lora_config(model):
    """The active LoRA config of the PEFT model under `model`, or None without PEFT."""
    try:
        from peft.tuners.lora import LoraModel
    except ImportError:
        return None
    for m in model.modules():
        if isinstance(m, LoraModel):
            active = m.active_adapters
            return m.peft_config[active[0]] if len(active) == 1 else active
    return None


def unservable(config) -> str | None:
    """Why vLLM cannot serve this LoRA config as an adapter (the push then merges it), or None."""
    if isinstance(config, list):
        return f"{len(config)} adapters are active ({config}); vLLM serves one per request"
    if config.use_dora:
        return "DoRA's magnitude vectors have no place in a vLLM LoRA adapter"
    if config.bias != "none":
        return f"lora bias={config.bias!r} trains biases, which a vLLM LoRA adapter does not carry"
    if config.modules_to_save:
        return f"modules_to_save={sorted(config.modules_to_save)} are trained whole, not as a low-rank delta"
    if getattr(config, "target_parameters", None):
        return "target_parameters (LoRA on parameters, not modules) is not loaded by vLLM's LoRA manager"
    targets = config.target_modules or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    if any("lm_head" in t or "embed_tokens" in t for t in targets):
        return (
            "the adapter targets the LM head or the embeddings, which vLLM's prompt log-probs leave out (the "
            "push's probe could not check them)"
        )
    if config.rank_pattern or config.alpha_pattern:
        return "rank_pattern / alpha_pattern (per-module ranks) are not what this push was tested with"
    return None


def served_rank(r: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds rank `r`."""
    return next((v for v in VLLM_LORA_RANKS if v >= r), r)


def server_refusal(info: dict, url: str, config) -> str | None:
    """Why the server `url` (its worker extension's info) takes no adapter pushes (the push then merges),
    or None; ValueError when it takes them but is set up too small for this adapter."""
    lora = info.get("lora")
    if not lora:
        rank = served_rank(config.r)
        return (
            f"the vLLM server {url} was started without LoRA (grpo-fast serve --lora-rank {rank}, or vllm "
            f"serve --enable-lora --max-lora-rank {rank} with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, push the "
            "adapter alone)"
        )
    if not info.get("runtime_lora_updating"):
        return (
            f"the vLLM server {url} does not load adapters at run time (start it with "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1; grpo-fast serve sets it)"
        )
    if int(info.get("data_parallel_size") or 1) > 1:
        return f"the vLLM server {url} runs data-parallel replicas, and an adapter load reaches only one"
    if int(lora["max_lora_rank"]) < config.r:
        raise ValueError(
            f"lora_r={config.r}: the vLLM server {url} serves LoRA ranks up to {lora['max_lora_rank']}; "
            f"restart it with --max-lora-rank {served_rank(config.r)} (grpo-fast serve --lora-rank "
            f"{config.r})"
        )
    return None


def write_adapter(directory: str, tensors: dict, config) -> int:
    """Write the adapter `tensors` ({ADAPTER + saved name: CPU tensor}) and `config` as a PEFT adapter
    directory at `directory` (made whole under a temporary name, then renamed: a server never reads half of
    one); returns the bytes of its tensors."""
    from safetensors.torch import save_file

    tmp = directory + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        save_file({n[len(ADAPTER) :]: t.contiguous() for n, t in tensors.items()},
                  os.path.join(tmp, "adapter_model.safetensors"))  # fmt: skip
        with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
            json.dump(_config_dict(config), f)
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _config_dict(config) -> dict:
    """The adapter_config.json of `config` (PEFT's own dict, its sets as lists)."""
    out = {}
    for k, v in config.to_dict().items():
        if isinstance(v, set):
            v = sorted(v)
        with contextlib.suppress(TypeError, ValueError):
            json.dumps(v)
            out[k] = v
    return out


@contextlib.contextmanager
def without_adapters(model):
    """A context in which `model` (a PEFT model somewhere under it) runs its base weights alone."""
    from peft.tuners.lora import LoraModel

    lora = next(m for m in model.modules() if isinstance(m, LoraModel))
    lora.disable_adapter_layers()
    try:
        yield
    finally:
        lora.enable_adapter_layers()
