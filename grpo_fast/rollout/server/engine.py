"""The vLLM server engine: rollouts on one or several stock vLLM OpenAI-compatible servers, the policy's
weights pushed to them after every optimizer step (push.py) and verified (verify.py) before any sample is
drawn; LoRA adapters pushed alone where the servers take them (adapters.py); each server owned by the run
(ownership.py) after the checks at connect (connect.py).

Generation: `/v1/completions` with the prompt's token ids, `n = G` (vLLM's prefix cache shares the prompt),
the sampled tokens' ids and log-probs back (`return_token_ids`, `logprobs: 0`: softmax(logits / T) on a server
started with `--logprobs-mode processed_logprobs`, the trainer's distribution); one request per prompt, the
prompts routed across the servers, a time-out on every request. With several servers a failed request is
retried on another, and a server that failed is not used again in this run."""

import contextlib
import os
import queue
import secrets
import shutil
import tempfile
import threading
import time
import weakref

import torch

from ...models.model_parts import causal_lm
from .. import lora_adapters
from ..sampling import Sampling, eos_and_pad
from ..vllm_engine import check_logprobs_mode, pad_rows
from .adapters import Adapters
from .client import CHECK_TIMEOUT_S, LEAVING_TIMEOUT_S, Server, ServerError
from .connect import TORCH_DTYPES, check_server
from .ownership import claim, keep_lease, this_run
from .push import Pushes, sweep_weight_files
from .verify import Verification


class ServerEngine(Pushes, Verification, Adapters):
    """The policy's rollouts on `urls` (vLLM servers), its weights pushed through `weight_dir` ("files"
    transport; default: /dev/shm when every server is on this host). `tokenizer`: the trainer's, checked
    against the server's; `auto_push`: push before each generation (False: the caller pushes); `run`: this
    run's name (the trainer: its host and output directory): each server is claimed for it, refused while
    another live run holds it, and checked after every generation to have loaded no weights but this
    engine's; `context`: the longest prompt + completion, which every server must hold; `push_adapters`: a
    LoRA policy's adapter pushed alone (True), merged into the weights (False), or alone where every server
    takes it (None, the default; lora_adapters says when it cannot); `adapters_allowed`: how many adapters a
    server may hold before a warning (the trainer: its staleness + 1; a failed unload is retried at each
    push); `lease_s`: how long a server keeps this run's claim without hearing from it (default 2 x
    `timeout` + 60 s) where the server cannot see the run's process (another host): a thread renews it every
    quarter of that while the engine lives, so a long evaluation or save does not lose the servers."""

    def __init__(
        self, model, urls, *, wait_s=240.0, timeout=600.0, weight_dir=None, auto_push=True, tokenizer=None,
        run=None, context=None, push_adapters=None, adapters_allowed=1, lease_s=None,
    ):  # fmt: skip
        self.servers = [Server(u, timeout) for u in urls]
        if not self.servers:
            raise ValueError("vllm_server_base_url: no server given")
        self.auto_push = auto_push  # False: the caller pushes (asynchronous training, from its own thread)
        self.lock = threading.Lock()  # a push waits for the generation in flight, and the reverse
        self.run = run or this_run()
        self.loads: dict = {}  # url -> the server's weight-load count after this engine's last load
        self.lease_s = lease_s or 2 * timeout + 60
        t0 = time.monotonic()
        for s in self.servers:
            s.wait_up(wait_s)
            check_server(s, model, tokenizer, context)
            self.loads[s.url] = claim(s, self.run, lease_s=self.lease_s)
        self.connect_s = time.monotonic() - t0
        self.leaving = threading.Event()  # set by `release`: the lease is no longer renewed
        threading.Thread(target=keep_lease, args=(weakref.ref(self), self.leaving, self.lease_s / 4),
                         name="grpo-fast-lease", daemon=True).start()  # fmt: skip
        if weight_dir is None:
            if not all(s.local for s in self.servers):
                raise ValueError(
                    "vllm_weight_dir: a server is on another host; give a directory both sides see "
                    "(the files "
                    "transport), e.g. on a shared file system"
                )
            weight_dir = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self.weight_dir = weight_dir
        sweep_weight_files(weight_dir)
        dtypes = {s.info["dtype"] for s in self.servers}
        if len(dtypes) > 1:
            raise ServerError(f"the vLLM servers run different dtypes {sorted(dtypes)}: start them alike")
        self.dtype = dtypes.pop()
        self.logprobs_mode = self.servers[0].info.get("logprobs_mode", "")
        self.vocab = causal_lm(model).config.vocab_size
        self.versions: dict = {}  # checkpoint name -> version key at the last push
        self.anchor = None  # (the trainer's probe log-probs, {url: the server's}) at the last telling check
        self.noise = 0.0  # |server - trainer| on the probe after the first push (the same weights both sides)
        self.sent: dict = {}  # checkpoint name -> a checksum of the bytes last pushed
        self.last_probe = None  # (the trainer's probe log-probs, {url: the server's}) at the last push
        self.stats = {
            "pushes": 0,
            "pushed_tensors": 0,
            "calls": 0,
            "sync_s": 0.0,
            "sync_bytes": 0,
            "probe_error": 0.0,
            "probe_moved": 0.0,
            "failed_servers": 0,
            "adapters_loaded": 0,  # the most adapters any server holds after the last push
            "failed_unloads": 0,  # unload calls that failed (each is retried at the next push)
        }
        self.unloads: dict = {}  # url -> adapter names whose unload failed there, retried at each push
        self.adapters_allowed, self._warned_adapters = adapters_allowed, {}
        self._next = 0
        self.closed = False  # set by `close`: requests not yet sent are cancelled
        # LoRA: the adapter pushed alone (a new served name per version) where every server can take it
        self.lora = lora_adapters.lora_config(model)
        self.adapters = self.lora is not None and push_adapters is not False and self._adapters_servable()
        if push_adapters and not self.adapters:
            raise ValueError("push_adapters=True: the LoRA adapter cannot be pushed alone (said above)")
        self.adapter_tag = secrets.token_hex(4)  # this engine's served names: grpo-fast-<tag>-v<N>
        self.adapter_version = 0
        self.adapter = None  # (served name, directory) of the adapter loaded at the last push
        self.stats["push"] = "adapter" if self.adapters else "merged" if self.lora is not None else "full"

    def close(self) -> None:
        """Cancel the requests not yet sent (a stopping run does not wait for a whole batch), and give the
        servers up (`release`)."""
        self.closed = True
        self.release()

    def release(self) -> None:
        """Give this run's servers up, so that the next run claims them at once (best effort: a server that
        does not answer within seconds is left to the claim's liveness rule)."""
        self.leaving.set()
        for s in self.servers:
            if s.alive:
                with contextlib.suppress(ServerError):
                    s.rpc("grpo_fast_release", self.run, what="release", timeout=LEAVING_TIMEOUT_S)
        if self.adapter:  # the next owner unloads it; its files go now
            shutil.rmtree(self.adapter[1], ignore_errors=True)

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES.get(self.dtype, torch.float32)

    @property
    def alive(self) -> list:
        live = [s for s in self.servers if s.alive]
        if not live:
            raise ServerError("every vLLM server failed: " + ", ".join(s.url for s in self.servers))
        return live

    def renew(self) -> None:
        """Renew this run's claim on every live server (the ownership check renews it; best effort: a
        server that does not answer now fails at the run's next request)."""
        for s in self.servers:
            if s.alive:
                with contextlib.suppress(ServerError):
                    s.rpc("grpo_fast_state", self.run, what="lease renewal", timeout=CHECK_TIMEOUT_S)

    def check_owned(self, servers) -> None:
        """ServerError unless each of `servers` is still this run's, with no weights loaded but this engine's
        since its last push (another writer, or a server restarted under the same address): checked after
        every generation, before its samples are used."""
        for s in servers:
            said = s.rpc("grpo_fast_state", self.run, what="ownership check", timeout=CHECK_TIMEOUT_S)
            state = said[0] if said and isinstance(said[0], dict) else {}
            owner = (state.get("owner") or {}).get("run")
            if owner != self.run or state.get("loads") != self.loads.get(s.url):
                raise ServerError(
                    f"vLLM server {s.url}: its weights changed under this run: owned by {owner!r} (this run "
                    "is "
                    f"{self.run!r}), {state.get('loads')} weight loads where this run's last push left "
                    f"{self.loads.get(s.url)} (another run pushed to it, or it restarted): its samples are "
                    "not this policy's"
                )
            if self.adapter:
                name, directory = self.adapter
                models = s.call("/v1/models", what="adapter check", timeout=CHECK_TIMEOUT_S).get("data", [])
                if not any(m.get("id") == name and m.get("root") == directory for m in models):
                    served = [m.get("id") for m in models]
                    raise ServerError(
                        f"vLLM server {s.url}: the adapter {name} this run loaded is gone or was replaced "
                        f"(served: {served}): its samples are not this policy's"
                    )

    # ---- generation -------------------------------------------------------------------------------------
    def generate(self, model, prompt_ids, prompt_mask, num_generations, max_new_tokens, **options):
        """`generate_groups` on the servers (`options`: rollout.sampling.Sampling's): G completions of each
        prompt, pushed first when `auto_push`, the servers checked to be this run's before they are used."""
        o = Sampling(**options)
        temperature, top_p, top_k, return_logprobs = o.temperature, o.top_p, o.top_k, o.return_logprobs
        if return_logprobs and temperature != 0:
            check_logprobs_mode(self.logprobs_mode, temperature, top_p, top_k, o.min_p, o.repetition_penalty)
        if self.auto_push:
            self.push(model)
        n, G, C = prompt_ids.shape[0], num_generations, max_new_tokens
        eos, pad = eos_and_pad(o.eos_token_id)
        greedy = temperature == 0
        seeds = [None] * n
        if o.generator is not None and self.servers[0].info.get("device", "cpu") != "cpu":
            # per-request seeds; not on a CPU server: vLLM 0.32's CPU runner crashes its engine on a seeded
            # request whose prefill is chunked (`CPU Generator does not use offset`), so there the server's
            # own seed (--seed 0) drives sampling and a run is not reproducible sample for sample
            seeds = torch.randint(2**31 - 1, (n,), generator=o.generator).tolist()
        base = {
            "max_tokens": C,
            "temperature": 0.0 if greedy else float(temperature),
            "top_p": 1.0 if greedy else float(top_p),
            "top_k": 0 if greedy else int(top_k or 0),
            "min_p": 0.0 if greedy else float(o.min_p or 0.0),
            "repetition_penalty": float(o.repetition_penalty),
            "stop_token_ids": list(eos),
            "ignore_eos": True,  # only `eos_token_id` ends a sample (not the model's own EOS too)
            "return_token_ids": True,
            "logprobs": 0 if return_logprobs else None,
            "skip_special_tokens": False,
        }
        prompts = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        with self.lock:
            live = self.alive
            start, self._next = self._next, self._next + n
            jobs = [(prompts[i], seeds[i], live[(start + i) % len(live)]) for i in range(n)]
            outs = self._map(lambda job: self._one(job, base, G, greedy), jobs)
            self.check_owned([s for s in self.servers if s.alive])
        self.stats["calls"] += 1
        return pad_rows([r for out in outs for r in out], pad, prompt_ids.device, return_logprobs)

    def _map(self, fn, jobs: list, workers: int = 32) -> list:
        """[fn(job) for job in jobs] on up to `workers` daemon threads. The first error is raised at once, and
        so is a `close` (the run stopping): requests in flight are left behind, not waited for (a daemon
        thread never holds up the process's exit), those not yet sent are dropped."""
        todo, done = queue.SimpleQueue(), queue.SimpleQueue()
        for i, job in enumerate(jobs):
            todo.put((i, job))
        failed = threading.Event()

        def work():
            while not (failed.is_set() or self.closed):
                try:
                    i, job = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    done.put((i, fn(job), None))
                except BaseException as exc:
                    done.put((i, None, exc))

        for _ in range(min(workers, len(jobs))):
            threading.Thread(target=work, name="grpo-fast-vllm", daemon=True).start()
        out = [None] * len(jobs)
        try:
            for _ in jobs:
                while True:
                    if self.closed:
                        raise ServerError("the run is stopping: generation cancelled")
                    try:
                        i, res, exc = done.get(timeout=0.1)
                        break
                    except queue.Empty:
                        continue
                if exc is not None:
                    raise exc
                out[i] = res
        finally:
            failed.set()
        return out

    def _one(self, job, base, G, greedy) -> list:
        """One prompt's G completions [(token ids, log-probs)], retried on another server if its own fails."""
        prompt, seed, server = job
        body = {**base, "prompt": [prompt] * G if greedy else prompt, "n": 1 if greedy else G, "seed": seed}
        while True:
            if self.closed:
                raise ServerError("the run is stopping: generation cancelled")
            if not server.alive:
                server = self.alive[0]
            try:
                out = server.call("/v1/completions", {**body, "model": self.served_name(server)},
                                  what="generation")  # fmt: skip
                return _choices(out, server, G, base["logprobs"] is not None)
            except ServerError as exc:
                if exc.bad_request:  # the request's fault (too long a prompt, ...): no server does better
                    raise
                server.alive = False
                self.stats["failed_servers"] = sum(not s.alive for s in self.servers)
                others = [s for s in self.servers if s.alive]
                if not others:
                    raise
                server = others[0]


def _choices(out: dict, server: Server, G: int, with_logprobs: bool) -> list:
    """[(token ids, log-probs)] of a completions answer, or ServerError when it lacks them."""
    try:
        choices = sorted(out["choices"], key=lambda c: c["index"])
        rows = [(list(c["token_ids"]), (c.get("logprobs") or {}).get("token_logprobs")) for c in choices]
        if len(rows) != G or (with_logprobs and any(lp is None or len(lp) != len(t) for t, lp in rows)):
            raise ValueError(f"{len(rows)} choices, expected {G}, with their log-probs")
        return rows
    except (KeyError, TypeError, ValueError) as exc:
        raise ServerError(f"vLLM server {server.url}: generation: a malformed answer ({exc!r})") from exc


_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def engine_for(model, urls=None, **options) -> ServerEngine:
    """This model's server engine, connected on first use to `urls` with `options` (ServerEngine's); later
    calls take it as it is."""
    lm = causal_lm(model)
    eng = _ENGINES.get(lm)
    if eng is None:
        if not urls:
            raise ValueError("vllm_mode='server' needs vllm_server_base_url (or host and port)")
        eng = _ENGINES[lm] = ServerEngine(model, urls, **options)
    return eng
