"""LoRA adapters pushed alone: the base weights once, then only the adapter, loaded under a new name per
version (`grpo-fast-<tag>-v<N>`: vLLM keys its prefix cache on the name), verified through that name, the
previous version then unloaded. A failed unload is counted and retried at every push; the adapters each
server holds are read back after each push (`adapters_loaded`) and more than allowed is a warning naming the
server. Mixed into ServerEngine."""

import os
import shutil
import socket

from .. import lora_adapters
from .client import CHECK_TIMEOUT_S, Server, ServerError
from .push import WEIGHT_FILE


class Adapters:
    """ServerEngine's adapter bookkeeping (its servers, lora, adapter, adapter_version, unloads and stats)."""

    def _adapters_servable(self) -> bool:
        """Whether every server takes this run's LoRA adapter alone; if not, says why once (the pushes then
        merge it), and a server set up too small for it is an error. Adapters a previous owner left loaded
        are unloaded (this run owns the servers now)."""
        reason = lora_adapters.unservable(self.lora)
        for s in self.servers:
            reason = reason or lora_adapters.server_refusal(s.info, s.url, self.lora)
        if reason:
            print(f"grpo-fast: LoRA pushed merged into the vLLM servers' weights: {reason}", flush=True)
            return False
        for s in self.servers:
            for name in self._adapters_on(s):
                self._unload(s, name)
        print(f"grpo-fast: LoRA adapter (rank {self.lora.r}) pushed alone to the vLLM servers, the base once",
              flush=True)  # fmt: skip
        return True

    def served_name(self, server: "Server") -> str:
        """The model name requests to `server` carry: the adapter of the last push, else the base model."""
        return self.adapter[0] if self.adapter else server.model_name

    def _adapters_on(self, s: "Server") -> list:
        """The names of the grpo-fast adapters `s` serves (any run's: this run owns the server now)."""
        models = s.call("/v1/models", what="model list", timeout=CHECK_TIMEOUT_S).get("data", [])
        return [m["id"] for m in models if str(m.get("id", "")).startswith(lora_adapters.NAME_PREFIX)]

    def _unload(self, s: "Server", name: str) -> bool:
        """Unload adapter `name` from `s`; a failure is counted and the name kept for the next push's retry
        (an adapter the server no longer knows counts as unloaded)."""
        pending = self.unloads.setdefault(s.url, [])
        try:
            s.call("/v1/unload_lora_adapter", {"lora_name": name}, what=f"unload of adapter {name}",
                   timeout=CHECK_TIMEOUT_S, text=True)  # fmt: skip
        except ServerError as exc:
            if exc.status != 404:
                self.stats["failed_unloads"] += 1
                if name not in pending:
                    pending.append(name)
                return False
        if name in pending:
            pending.remove(name)
        return True

    def _account_adapters(self) -> None:
        """Retry the failed unloads, then count the adapters each server holds (`adapters_loaded`: the most
        on any); more than `adapters_allowed` on a server is a warning naming it, said again when it grows."""
        most = 0
        for s in self.alive:
            for name in list(self.unloads.get(s.url, [])):
                self._unload(s, name)
            held = len(self._adapters_on(s))
            most = max(most, held)
            if held > self.adapters_allowed and held > self._warned_adapters.get(s.url, 0):
                self._warned_adapters[s.url] = held
                print(f"grpo-fast: warning: vLLM server {s.url} holds {held} LoRA adapters of this run, more "
                      f"than the {self.adapters_allowed} allowed: {self.stats['failed_unloads']} unloads "
                      "failed (each retried at the next push); its memory for adapters fills",
                      flush=True)  # fmt: skip
        self.stats["adapters_loaded"] = most

    def _load_adapter(self, tensors: dict, step, at: str) -> None:
        """Write the adapter `tensors` as a new version and load it on every live server under its own
        name; the requests that follow name it."""
        self.adapter_version += 1
        name = f"{lora_adapters.NAME_PREFIX}{self.adapter_tag}-v{self.adapter_version}"
        # the engine's random tag, not id(self): a collected engine's id comes back, its directories linger
        mine = WEIGHT_FILE.format(host=socket.gethostname()) + f"{os.getpid()}-{self.adapter_tag}"
        directory = os.path.join(self.weight_dir, f"{mine}-adapter-v{self.adapter_version}")
        try:
            lora_adapters.write_adapter(directory, tensors, self.lora)
        except (OSError, RuntimeError) as exc:
            raise ServerError(f"adapter push{at}: could not write it into vllm_weight_dir={self.weight_dir}: "
                              f"{exc}") from exc  # fmt: skip
        try:
            for s in self.alive:
                s.call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": directory},
                       what=f"adapter load{at}", timeout=CHECK_TIMEOUT_S, text=True)  # fmt: skip
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        self.adapter = (name, directory)

    def _retire(self, adapter: tuple) -> None:
        """Unload a superseded adapter version from the servers (a failed unload is counted and retried at
        the next push) and remove its files (a loaded adapter does not read them again)."""
        for s in self.alive:
            self._unload(s, adapter[0])
        shutil.rmtree(adapter[1], ignore_errors=True)
