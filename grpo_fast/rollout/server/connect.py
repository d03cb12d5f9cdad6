"""The checks a server passes before a run trusts it, at connect: a vLLM this client knows, the worker
extension, the launch token of `grpo-fast serve --train`, this policy's model in a dtype a push can fill, an
untied LM head, a context long enough, the trainer's tokenizer, and a place of its own (not the trainer's GPU;
a warning when it shares the trainer's CPU cores)."""

import os

import torch

from ...models.model_parts import causal_lm
from .client import CHECK_TIMEOUT_S, MIN_VLLM, PROBE_LEN, TOKEN_ENV, Server, ServerError, _version_tuple

EXTENSION = "grpo_fast.rollout.server.vllm_worker.WeightReceiver"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def expected_info(model) -> dict:
    """What a server must run for this policy (compared with the worker extension's `grpo_fast_info`)."""
    cfg = causal_lm(model).config
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "architectures": [type(causal_lm(model)).__name__],
    }


def check_server(server: Server, model, tokenizer=None, context: int | None = None) -> None:
    """ServerError unless `server` runs a vLLM this client knows, the worker extension and this model, in a
    dtype a push can fill, with a context of at least `context` tokens (the longest prompt + completion), and
    (when $GRPO_FAST_SERVER_TOKEN is set: `grpo-fast serve --train`) is the server that launch started."""
    version = server.call("/version", what="version", timeout=CHECK_TIMEOUT_S).get("version", "?")
    if _version_tuple(version) < MIN_VLLM:
        raise ServerError(
            f"vLLM server {server.url} runs vLLM {version}; this client needs >= {MIN_VLLM[0]}.{MIN_VLLM[1]}"
        )
    try:
        infos = server.rpc("grpo_fast_info", what="the worker extension's info", timeout=CHECK_TIMEOUT_S)
    except ServerError as exc:
        if "HTTP" not in str(exc):  # no answer at all: said as it is
            raise
        raise ServerError(
            f"{exc}\nvLLM server {server.url} (vLLM {version}) does not serve grpo-fast's weight endpoints: "
            f"start it with VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls {EXTENSION} (grpo-fast serve "
            "does both)"
        ) from None
    server.info = infos[0]
    token = os.environ.get(TOKEN_ENV)
    if token and server.info.get("launch_token") != token:
        raise ServerError(
            f"vLLM server {server.url} is not the server `grpo-fast serve` started for this run (its launch "
            f"token differs from ${TOKEN_ENV}): another server answers on that port"
        )
    if server.info.get("dtype") not in TORCH_DTYPES:
        raise ServerError(
            f"vLLM server {server.url} runs dtype {server.info.get('dtype')!r}; weight pushes fill "
            f"{', '.join(TORCH_DTYPES)}: start it with --dtype float32 or bfloat16"
        )
    want = expected_info(model)
    wrong = {k: (server.info.get(k), v) for k, v in want.items() if server.info.get(k) != v}
    if wrong:
        said = ", ".join(f"{k} {got!r} (expected {exp!r})" for k, (got, exp) in wrong.items())
        raise ServerError(f"vLLM server {server.url} runs another model than this policy: {said}")
    if server.info.get("tie_word_embeddings"):
        raise ServerError(
            f"vLLM server {server.url} ties the LM head to the embedding: a weight push would update one and "
            "not the other; start it with --hf-overrides '{\"tie_word_embeddings\": false}' "
            "(grpo-fast serve does)"
        )
    check_placement(server, model)
    models = server.call("/v1/models", what="model list", timeout=CHECK_TIMEOUT_S).get("data", [])
    server.model_name = models[0]["id"] if models else ""
    server.max_model_len = int(models[0].get("max_model_len") or PROBE_LEN + 1) if models else PROBE_LEN + 1
    if context and server.max_model_len < context:
        raise ServerError(
            f"vLLM server {server.url} serves at most {server.max_model_len} tokens (its max_model_len), "
            f"this run needs {context} (max_prompt_length + max_completion_length): restart it with "
            f"--max-model-len {context}, or lower those"
        )
    if tokenizer is not None:
        check_tokenizer(server, tokenizer)


def tokenizer_probe(tokenizer) -> str:
    """A text made of the tokenizer's own vocabulary (32 ids spread over it, decoded), so that any tokenizer,
    word-level ones included, splits it into known tokens; two copies of one tokenizer agree on it."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    n = len(tokenizer)
    ids = [i for i in range(7, n, max(1, n // 32)) if i not in special][:32]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if len(tokenizer(text, add_special_tokens=False)["input_ids"]) < len(ids) // 2:  # no decoder (word-level)
        text = " ".join(tokenizer.convert_ids_to_tokens(ids))
    return text


def check_tokenizer(server: Server, tokenizer) -> None:
    """ServerError unless the server's tokenizer splits a probe text as the trainer's does (token ids the
    trainer encodes are what the server decodes and stops on)."""
    text = tokenizer_probe(tokenizer)
    body = {"model": server.model_name, "prompt": text, "add_special_tokens": False}
    out = server.call("/tokenize", body, what="tokenizer check", timeout=CHECK_TIMEOUT_S)
    mine = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not out.get("tokens") and mine:  # it cannot read its own tokenizer files; ids go both ways, so no harm
        print(f"grpo-fast: vLLM server {server.url} tokenizes a probe text to nothing (its tokenizer files "
              "are not what transformers reads here); prompts and samples travel as token ids, so training "
              "is unaffected", flush=True)  # fmt: skip
    elif out.get("tokens") != mine:
        raise ServerError(
            f"vLLM server {server.url} tokenizes differently from the trainer's tokenizer (a probe text "
            f"{text!r}: {out.get('tokens')} there, {mine} here): start it with the trainer's model directory"
        )


def check_placement(server: Server, model) -> None:
    """ServerError when the server runs on the trainer's own GPU (both would fight for its memory and time);
    a warning when, on this host, its CPU cores overlap the trainer's (`grpo-fast serve --cores` splits
    them)."""
    import socket

    from .vllm_worker import _gpu_uuid

    device = next(causal_lm(model).parameters()).device
    mine = _gpu_uuid(device)
    if mine is not None and mine == server.info.get("gpu_uuid"):
        raise ServerError(
            f"vLLM server {server.url} runs on the trainer's own GPU ({device}, {mine}): give it a GPU of "
            "its own (CUDA_VISIBLE_DEVICES when starting it), or use --vllm-mode colocate"
        )
    if (
        device.type == "cpu"
        and server.info.get("host") == socket.gethostname()
        and hasattr(os, "sched_getaffinity")
    ):
        shared = set(server.info.get("cpus", [])) & os.sched_getaffinity(0)
        if shared and server.url not in _warned:
            _warned.add(server.url)
            print(
                f"grpo-fast: vLLM server {server.url} shares CPU cores {sorted(shared)} with this trainer; "
                "`grpo-fast serve --cores` and taskset give each its own",
                flush=True,
            )


_warned: set = set()
