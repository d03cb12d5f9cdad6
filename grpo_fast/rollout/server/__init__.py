"""Rollouts on stock vLLM OpenAI-compatible servers (`vllm serve`, or `grpo-fast serve`, which starts one the
way the installed build allows), the policy's weights pushed to them after every optimizer step and verified
before any sample is drawn from them. One module a concern:

- client.py: `Server` (one server's HTTP calls, loopback without proxies), `ServerError`, the time-outs;
- connect.py: the checks at connect (vLLM version, worker extension, launch token, model, dtype, context,
  tokenizer, placement);
- ownership.py: a run owns its servers (claim, lease, the lease thread);
- push.py: the weight push (changed tensors, the files transport, pause / load / reset / resume);
- verify.py: the probe that verifies every push (tolerance, movement);
- adapters.py: LoRA adapters pushed alone (versions, unloads retried and counted);
- engine.py: `ServerEngine`, which generates through them (fan-out, retries, the ownership check);
- serve.py: the launcher (`grpo-fast serve`), its watchdog, its watch over the server's processes;
- vllm_worker.py: what runs inside vLLM (the worker extension, the plugin that ties its processes to their
  parents).

The server must be started with the worker extension and vLLM's development endpoints
(`VLLM_SERVER_DEV_MODE=1`): bind it to a private address; those endpoints run code the caller names. Every
failure raises `ServerError` naming the server and what failed."""

from .client import TOKEN_ENV, Server, ServerError
from .connect import EXTENSION
from .engine import ServerEngine, engine_for
from .ownership import claim
from .push import sweep_weight_files

__all__ = ["EXTENSION", "TOKEN_ENV", "Server", "ServerEngine", "ServerError", "claim", "engine_for",
           "sweep_weight_files"]  # fmt: skip
