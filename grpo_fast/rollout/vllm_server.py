"""The vLLM server engine: rollouts on one or several stock vLLM OpenAI-compatible servers (`vllm serve`, or
`grpo-fast serve`, which starts one the way the installed build allows), the policy's weights pushed to them
after every optimizer step and verified before any sample is drawn from them.

Generation: `/v1/completions` with the prompt's token ids, `n = G` (vLLM's prefix cache shares the prompt),
the sampled tokens' ids and log-probs back (`return_token_ids`, `logprobs: 0`: softmax(logits / T) on a server
started with `--logprobs-mode processed_logprobs`, the trainer's distribution); one request per prompt, the
prompts routed across the servers, a time-out on every request.

Weights: the push sends the checkpoint-format tensors changed since the last push (parameter version counters,
widened to vLLM's fused q/k/v and gate/up layers; LoRA merged), in the server's dtype, through a transport:
"files", a safetensors file in a directory both sides see (on one host by default /dev/shm: shared memory,
nothing touches a disk), loaded by the worker extension (grpo_fast.rollout.vllm_worker) through the server's
`/collective_rpc`. A push is pause (in-flight requests finish) -> load -> prefix cache reset (its KV was the
old weights') -> resume -> verify, every call under a time-out. **Verify**: the server's log-probs of a fixed
probe sequence must equal the trainer's within the dtype's tolerance, and must have moved with the trainer's
when those moved beyond the noise floor measured at the first push: a transport that does nothing is an error,
never stale training. The server must be started with the worker extension and vLLM's development endpoints
(`VLLM_SERVER_DEV_MODE=1`): bind it to a private address; those endpoints run code the caller names.

Every failure raises `ServerError` naming the server and what failed; with several servers a failed request is
retried on another, and a server that failed is not used again in this run.
"""

import contextlib
import glob
import http.client
import json
import math
import os
import queue
import secrets
import shutil
import socket
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
import zlib

import torch

from ..models.model_parts import causal_lm
from . import lora_adapters
from .lora_adapters import ADAPTER
from .sampling import eos_and_pad
from .vllm_engine import _siblings, check_logprobs_mode, checkpoint_weights, pad_rows

EXTENSION = "grpo_fast.rollout.vllm_worker.WeightReceiver"
MIN_VLLM = (0, 32)  # the oldest build whose endpoints this client was tested against
PROBE_LEN = 48
CHECK_TIMEOUT_S = 30.0  # the questions asked of a server when connecting (not generation's time-out)
LEAVING_TIMEOUT_S = 2.0  # best-effort calls on the way out (a release, a resume after a stop signal)
# the largest |server - trainer| log-prob on the probe a push may leave, by the server's dtype (vLLM's kernels
# are not the trainer's: fp32 differs by rounding, 16-bit by its precision)
PROBE_TOLERANCE = {"float32": 2e-3, "bfloat16": 0.25, "float16": 0.05}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKEN_ENV = "GRPO_FAST_SERVER_TOKEN"  # set by `grpo-fast serve --train`: the servers must carry this token
WEIGHT_FILE = "grpo-fast-weights-{host}-"  # then the writer's pid: swept once that process is gone
# requests to this host never go through a proxy (urllib would send them to $http_proxy without no_proxy)
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ServerError(RuntimeError):
    """A vLLM server failed, timed out, or is not the server this trainer can use. `status`: the HTTP status
    when the server answered with an error (a 4xx other than 408 / 429 is the request's fault, not the
    server's: not retried elsewhere)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status

    @property
    def bad_request(self) -> bool:
        return self.status is not None and 400 <= self.status < 500 and self.status not in (408, 429)


def _version_tuple(text: str) -> tuple:
    parts = []
    for p in text.split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


class Server:
    """One vLLM server: its base URL, what it runs, whether it still answers."""

    def __init__(self, url: str, timeout: float):
        self.url = url.rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"vllm_server_base_url: expected http(s)://host:port, got {url!r}")
        self.timeout = timeout
        self.alive = True
        self.info: dict = {}
        self.model_name = ""
        self.max_model_len = PROBE_LEN + 1

    @property
    def local(self) -> bool:
        return urllib.parse.urlparse(self.url).hostname in ("localhost", "127.0.0.1", "::1")

    def call(self, path: str, payload=None, *, timeout=None, what: str = "", text: bool = False) -> dict:
        """POST `payload` as JSON (GET without one); the decoded answer, or ServerError naming this server.
        `text`: an endpoint that answers in plain text (vLLM's LoRA endpoints): {"text": the answer}."""
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method="GET" if data is None else "POST",
            headers={"Content-Type": "application/json"},
        )
        limit = self.timeout if timeout is None else timeout
        opener = _DIRECT if self.local else urllib.request.build_opener()
        try:
            with opener.open(req, timeout=limit) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise ServerError(
                f"vLLM server {self.url}: {what or path} failed: HTTP {exc.code}: {detail}", status=exc.code
            ) from exc
        except http.client.HTTPException as exc:  # a connection cut mid-answer
            raise ServerError(f"vLLM server {self.url}: {what or path} failed: {exc!r}") from exc
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            kind = "timed out" if "timed out" in str(reason) else "failed"
            raise ServerError(
                f"vLLM server {self.url}: {what or path} {kind} (time-out {limit:.0f}s): {reason}"
            ) from exc
        if text:
            return {"text": body.decode(errors="replace")}
        try:
            return json.loads(body) if body else {}
        except ValueError as exc:
            raise ServerError(
                f"vLLM server {self.url}: {what or path} answered with no JSON: {body[:200]!r}"
            ) from exc

    def rpc(self, method: str, *args: str, what: str = "", timeout=None) -> list:
        """A method of the worker extension on every worker of this server (string arguments only)."""
        limit = self.timeout if timeout is None else timeout
        out = self.call(
            "/collective_rpc",
            {"method": method, "args": list(args), "timeout": limit},
            timeout=limit,
            what=what or method,
        )
        return out.get("results", [])

    def wait_up(self, wait_s: float) -> float:
        """Seconds until `/health` answered; ServerError after `wait_s`."""
        t0 = time.monotonic()
        while True:
            try:
                self.call("/health", timeout=5, what="health check")
                return time.monotonic() - t0
            except ServerError as exc:
                if time.monotonic() - t0 > wait_s:
                    raise ServerError(
                        f"vLLM server {self.url} did not answer /health within "
                        f"vllm_server_timeout={wait_s:.0f}s "
                        f"(never started, or unreachable): {exc}"
                    ) from exc
                time.sleep(1.0)


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


def this_run() -> str:
    """The run name of a process that names none: this process."""
    return f"pid {os.getpid()} on {socket.gethostname()}"


def claim(server: Server, run: str, lease_s: float) -> int:
    """Make `run` the owner of `server` (ServerError when another live run owns it) and resume it (a run
    killed mid-push leaves it paused); returns its weight-load count."""
    owner = json.dumps({"run": run, "host": socket.gethostname(), "pid": os.getpid()})
    said = server.rpc("grpo_fast_claim", owner, str(lease_s), what="claim", timeout=CHECK_TIMEOUT_S)
    got = said[0] if said and isinstance(said[0], dict) else {}
    if not got.get("ok"):
        theirs = got.get("owner") or {}
        raise ServerError(
            f"vLLM server {server.url} serves another run: {theirs.get('run')!r} (pid {theirs.get('pid')} on "
            f"{theirs.get('host')}, last call {theirs.get('idle_s', 0):.0f}s ago); this run is {run!r}. Two "
            "runs on one server would sample each other's weights: stop that run, or start a server of this "
            "run's own (grpo-fast serve --port)"
        )
    server.call("/resume", {}, what="resume at connect", timeout=CHECK_TIMEOUT_S)
    return int(got.get("loads", 0))


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


class ServerEngine:
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
        threading.Thread(target=_keep_lease, args=(weakref.ref(self), self.leaving, self.lease_s / 4),
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

    # ---- weights ----------------------------------------------------------------------------------------
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

    def _load_adapter(self, tensors: dict, step, at: str) -> None:
        """Write the adapter `tensors` as a new version and load it on every live server under its own
        name; the requests that follow name it."""
        self.adapter_version += 1
        name = f"{lora_adapters.NAME_PREFIX}{self.adapter_tag}-v{self.adapter_version}"
        mine = WEIGHT_FILE.format(host=socket.gethostname()) + f"{os.getpid()}-{id(self)}"
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

    def _check_base(self, mine: torch.Tensor, at: str) -> None:
        """The servers' base model (adapters off) gives the trainer's base log-probs `mine` on the probe
        (the base weights, pushed once when LoRA adapters travel alone)."""
        tol = PROBE_TOLERANCE.get(self.dtype, 0.25)
        ids = self.probe_ids(self.vocab)
        for s in self.alive:
            theirs = self.server_logprobs(s, ids, f"verification probe{at}", model=s.model_name)
            err = float((theirs - mine).abs().max())
            if not math.isfinite(err) or not err <= tol:
                raise ServerError(
                    f"vLLM server {s.url}: base weight push{at} not verified: its base model's log-probs of "
                    f"the probe do not equal the trainer's base model's ({self.dtype}): max |server - "
                    f"trainer| {err:.3g} > {tol:g}"
                )

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

    def probe_ids(self, vocab: int) -> list:
        """PROBE_LEN fixed random tokens (fewer when a server's context is shorter)."""
        n = min([PROBE_LEN, *(s.max_model_len - 1 for s in self.servers)])
        g = torch.Generator().manual_seed(20_251_202)
        return torch.randint(vocab, (n,), generator=g).tolist()

    def server_logprobs(self, s: Server, ids: list, what: str, model: str | None = None) -> torch.Tensor:
        """The server's log-probs of ids[1:] given their prefix (temperature 1, whole vocabulary), from the
        served model `model` (default: what generation samples from, `served_name`)."""
        body = {"prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
        out = s.call("/v1/completions", {"model": model or self.served_name(s), **body}, what=what)
        try:
            rows = out["choices"][0]["prompt_logprobs"][1:]
            return torch.tensor([row[str(t)]["logprob"] for row, t in zip(rows, ids[1:], strict=True)],
                                dtype=torch.float64)  # fmt: skip
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise ServerError(
                f"vLLM server {s.url}: {what}: an answer without the probe's log-probs ({exc!r})"
            ) from exc

    def trainer_probe(self, model, names=()):
        """The trainer's log-probs of the probe (fp64, CPU), from `model`'s own forward in eval mode; when
        LoRA adapters are pushed alone and `names` (the push's) hold base weights, (those, the base
        model's)."""
        if self.adapters and any(not n.startswith(ADAPTER) for n in names):
            with lora_adapters.without_adapters(model):
                base = self._probe(model)
            return self._probe(model), base
        return self._probe(model)

    def _probe(self, model) -> torch.Tensor:
        lm = causal_lm(model)
        x = torch.tensor([self.probe_ids(self.vocab)], device=next(lm.parameters()).device)
        was_training = lm.training
        lm.eval()
        logits = lm(input_ids=x).logits[0, :-1].double()
        lm.train(was_training)
        return logits.log_softmax(-1).gather(-1, x[0, 1:, None].to(logits.device))[:, 0].cpu()

    def _verify(self, mine: torch.Tensor, at: str, bytes_changed: bool = True) -> None:
        """The server's probe log-probs are finite, equal the trainer's (`mine`) within the dtype's tolerance,
        and moved with them. Two movement checks, so that a transport that does nothing fails at the first
        push that changes anything, in fp32 and in 16 bits alike:

        - exact: when the pushed bytes changed and the trainer's probe moved, the server's must differ from
          what it answered after the previous push (the same weights and the same request give the same bits;
          a 16-bit step too small to move the probe beyond the noise still flips some bits);
        - by size: since the last push at which the trainer's moved by more than 16x the noise (the error of
          the first push, where both hold the same weights; at least 1% of the tolerance), the server's must
          have moved by at least half as much (a push that lands somewhere else)."""
        if not bool(torch.isfinite(mine).all()):
            raise RuntimeError(
                f"weight push{at}: the policy's own log-probs of the probe are not finite (the trained "
                "weights hold NaN or inf): training diverged"
            )
        ids = self.probe_ids(self.vocab)
        tol = PROBE_TOLERANCE.get(self.dtype, 0.25)
        anchored = self.anchor is not None
        moved = float((mine - self.anchor[0]).abs().max()) if anchored else 0.0
        telling = anchored and moved > 16 * max(self.noise, tol / 100)
        last = self.last_probe
        expect_change = bytes_changed and last is not None and not torch.equal(mine, last[0])
        errors, theirs_all = [], []
        for s in self.alive:
            theirs = self.server_logprobs(s, ids, f"verification probe{at}")
            err = float((theirs - mine).abs().max())
            theirs_moved = float((theirs - self.anchor[1][s.url]).abs().max()) if anchored else 0.0
            if not math.isfinite(err) or not err <= tol:  # a NaN or inf answer fails too
                why = f"max |server - trainer| {err:.3g} > {tol:g}"
            elif expect_change and s.url in last[1] and torch.equal(theirs, last[1][s.url]):
                why = (
                    "they are bit for bit what it answered before this push, though the pushed weights and "
                    "the trainer's log-probs changed: the push changed nothing there"
                )
            elif telling and theirs_moved < moved / 2:
                why = (
                    f"they did not move with the trainer's (the trainer's moved {moved:.3g} since the last "
                    f"check, the server's {theirs_moved:.3g}): the push changed nothing there"
                )
            else:
                errors.append(err)
                theirs_all.append((s.url, theirs))
                continue
            raise ServerError(
                f"vLLM server {s.url}: weight push{at} not verified: its log-probs of the probe do not equal "
                f"the trainer's ({self.dtype}): {why}"
            )
        if not anchored:
            self.noise = max(errors, default=0.0)
        self.stats["probe_error"] = max(errors, default=0.0)
        self.stats["probe_moved"] = moved
        if not anchored or telling:
            self.anchor = (mine, dict(theirs_all))
        self.last_probe = (mine, dict(theirs_all))

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
    def generate(
        self,
        model,
        prompt_ids,
        prompt_mask,
        num_generations,
        max_new_tokens,
        *,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        eos_token_id=None,
        generator=None,
        return_logprobs=False,
    ):
        if return_logprobs and temperature != 0:
            check_logprobs_mode(self.logprobs_mode, temperature, top_p, top_k)
        if self.auto_push:
            self.push(model)
        n, G, C = prompt_ids.shape[0], num_generations, max_new_tokens
        eos, pad = eos_and_pad(eos_token_id)
        greedy = temperature == 0
        seeds = [None] * n
        if generator is not None and self.servers[0].info.get("device", "cpu") != "cpu":
            # per-request seeds; not on a CPU server: vLLM 0.32's CPU runner crashes its engine on a seeded
            # request whose prefill is chunked (`CPU Generator does not use offset`), so there the server's
            # own seed (--seed 0) drives sampling and a run is not reproducible sample for sample
            seeds = torch.randint(2**31 - 1, (n,), generator=generator).tolist()
        base = {
            "max_tokens": C,
            "temperature": 0.0 if greedy else float(temperature),
            "top_p": 1.0 if greedy else float(top_p),
            "top_k": 0 if greedy else int(top_k or 0),
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


def _keep_lease(engine_ref, leaving: threading.Event, every_s: float) -> None:
    """The lease thread: `renew` every `every_s` until the engine is released or gone."""
    while not leaving.wait(every_s):
        engine = engine_ref()
        if engine is None:
            return
        engine.renew()
        del engine  # not held across the wait: the engine may be collected


def _checksum(t: torch.Tensor) -> int:
    """A checksum of a tensor's bytes (CRC-32: whether a pushed tensor changed since the last push)."""
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy())


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
