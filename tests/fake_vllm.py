"""A stand-in for a vLLM server with grpo-fast's worker extension, on loopback, for the server engine's tests
where vLLM is not installed: the endpoints the trainer calls (/health, /version, /v1/models, /tokenize,
/pause, /resume, /reset_prefix_cache, /collective_rpc, /v1/completions with prompt log-probs and sampling, and
with `lora_rank` vLLM's run-time LoRA endpoints /v1/load_lora_adapter and /v1/unload_lora_adapter), answered
by a transformers model in the server's dtype; a request naming a loaded adapter is answered by a copy of the
model with W + (alpha / r) B A merged in, read from the adapter's files here. The worker methods that own the
server and count its loads are the real ones (grpo_fast.rollout.server.vllm_worker.WeightReceiver); only
`reload_weights` and the info are the stand-in's. Faults to order: `noop_load` (the transport loads nothing),
`noop_adapter` (an adapter load registers the new name but serves the adapter loaded before it), `fail` (path
-> HTTP status), `nan` (answers NaN log-probs)."""

import copy
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from grpo_fast.rollout.server.vllm_worker import WeightReceiver


class Worker(WeightReceiver):
    def __init__(self, model, dtype: str, lora_rank: int = 0):
        self.model, self.dtype, self.lora_rank = model, dtype, lora_rank
        self.noop_load = False
        self.hold = threading.Event()  # set: a load waits until it is cleared (a slow push)
        self.loading = threading.Event()  # set once a held load has started

    def grpo_fast_info(self) -> dict:
        import socket

        cfg = self.model.config
        return {
            "vllm": "0.32.0",
            "dtype": self.dtype,
            "logprobs_mode": "processed_logprobs",
            "architectures": [type(self.model).__name__],
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "tie_word_embeddings": False,
            "device": "cpu",
            "gpu_uuid": None,
            "host": socket.gethostname(),
            "cpus": [],
            "launch_token": os.environ.get("GRPO_FAST_LAUNCH_TOKEN"),
            "lora": {"max_lora_rank": self.lora_rank, "max_loras": 2} if self.lora_rank else None,
            "runtime_lora_updating": bool(self.lora_rank),
            "data_parallel_size": 1,
        }

    def reload_weights(self, weights_iterator, is_checkpoint_format=True):
        if self.hold.is_set():
            self.loading.set()
            deadline = time.monotonic() + 60
            while self.hold.is_set() and time.monotonic() < deadline:
                time.sleep(0.05)
        if self.noop_load:
            return
        state = {k: v.to(self.model.dtype) for k, v in weights_iterator}
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        assert not unexpected, unexpected


class FakeServer:
    """`with FakeServer(model, dtype) as url:`: the model (copied, cast to `dtype`) served at `url`."""

    def __init__(self, model, dtype: str = "float32", max_model_len: int = 64, port: int = 0, lora_rank=0):
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        self.model = copy.deepcopy(model).to(torch_dtype).eval()
        head = self.model.get_output_embeddings()
        if head.weight is self.model.get_input_embeddings().weight:  # untied, as grpo-fast serve's servers
            head.weight = torch.nn.Parameter(head.weight.detach().clone())
            self.model.config.tie_word_embeddings = False
        self.worker = Worker(self.model, dtype, lora_rank)
        self.adapters: dict = {}  # served name -> (path, the model with that adapter merged in)
        self.sampled_from: list = []  # the model name of every generation request
        self.noop_adapter = False
        self.max_model_len, self.port = max_model_len, port
        self.fail: dict = {}
        self.nan = False
        self.paused = False
        self.frozen = threading.Event()  # set: every request waits until it is cleared (a SIGSTOPped server)
        self.calls: list = []
        self.lock = threading.Lock()  # one forward at a time, as one engine would

    def __enter__(self) -> str:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._answer(None)

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                self._answer(json.loads(self.rfile.read(n) or b"{}"))

            def _answer(self, body):
                path = self.path.split("?")[0]
                deadline = time.monotonic() + 120
                while fake.frozen.is_set() and time.monotonic() < deadline:
                    time.sleep(0.05)
                fake.calls.append(path)
                status = fake.fail.get(path)
                try:
                    out = {} if status else fake.route(path, body)
                except Exception as exc:  # as vLLM's server: an error answer
                    status, out = 500, {"error": repr(exc)}
                text = isinstance(out, str)  # vLLM's LoRA endpoints answer in plain text
                data = out.encode() if text else json.dumps(out).encode()
                self.send_response(status or 200)
                self.send_header("Content-Type", "text/plain" if text else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        class Listener(ThreadingHTTPServer):
            request_queue_size = 256  # the trainer's bursts of concurrent requests (5 by default: resets)

        self.httpd = Listener(("127.0.0.1", self.port), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    def route(self, path: str, body):
        if path in ("/health", "/reset_prefix_cache"):
            return {}
        if path == "/pause":
            self.paused = True
            return {}
        if path == "/resume":
            self.paused = False
            return {}
        if path == "/version":
            return {"version": "0.32.0"}
        if path == "/v1/models":
            adapters = [{"id": k, "root": v[0], "parent": "fake"} for k, v in self.adapters.items()]
            return {"data": [{"id": "fake", "max_model_len": self.max_model_len}, *adapters]}
        if path == "/v1/load_lora_adapter" and self.worker.lora_rank:
            if self.noop_adapter:  # the name answers with what was loaded before
                last = list(self.adapters.values())[-1][1] if self.adapters else self.model
                self.adapters[body["lora_name"]] = (body["lora_path"], last)
            else:
                self.adapters[body["lora_name"]] = (body["lora_path"], self.merged(body["lora_path"]))
            return f"Success: LoRA adapter '{body['lora_name']}' added successfully."
        if path == "/v1/unload_lora_adapter" and self.worker.lora_rank:
            del self.adapters[body["lora_name"]]
            return f"Success: LoRA adapter '{body['lora_name']}' removed successfully."
        if path == "/tokenize":
            return {"tokens": []}
        if path == "/collective_rpc":
            return {"results": [getattr(self.worker, body["method"])(*body.get("args", []))]}
        if path == "/v1/completions":
            return self.completions(body)
        raise KeyError(path)

    @torch.no_grad()
    def merged(self, path: str):
        """A copy of the served model with the PEFT adapter at `path` merged in: W + (alpha / r) B A."""
        from safetensors.torch import load_file

        cfg = json.load(open(os.path.join(path, "adapter_config.json")))
        scale = cfg["lora_alpha"] / (cfg["r"] ** 0.5 if cfg.get("use_rslora") else cfg["r"])
        tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
        model = copy.deepcopy(self.model)
        weights = dict(model.named_parameters())
        for name, a in tensors.items():
            if ".lora_A." in name:
                b = tensors[name.replace(".lora_A.", ".lora_B.")]
                target = weights[name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")]
                target += (scale * b.double() @ a.double()).to(target.dtype)
        return model

    def served(self, name: str):
        if name in self.adapters:
            return self.adapters[name][1]
        if name != "fake":
            raise KeyError(f"the model {name!r} does not exist")
        return self.model

    @torch.no_grad()
    def completions(self, body) -> dict:
        with self.lock:
            model = self.served(body.get("model", "fake"))
            if body.get("prompt_logprobs") is not None:
                ids = body["prompt"]
                logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
                lp = logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
                if self.nan:
                    lp = lp * float("nan")
                rows = [None] + [
                    {str(t): {"logprob": float(v)}} for t, v in zip(ids[1:], lp.tolist(), strict=True)
                ]
                return {"choices": [{"index": 0, "prompt_logprobs": rows}]}
            self.sampled_from.append(body.get("model", "fake"))
            prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]] * body["n"]
            g = torch.Generator().manual_seed(body.get("seed") or 0)
            choices = []
            for k, prompt in enumerate(prompts):
                ids, logps = list(prompt), []
                for _ in range(body["max_tokens"]):
                    logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
                    p = (logits / max(body.get("temperature") or 1.0, 1e-3)).log_softmax(-1)
                    t = int(torch.multinomial(p.exp(), 1, generator=g))
                    ids.append(t)
                    logps.append(float(p[t]))
                    if t in body.get("stop_token_ids", []):
                        break
                n = len(ids) - len(prompt)
                choices.append({"index": k, "token_ids": ids[len(prompt) :],
                                "logprobs": {"token_logprobs": logps[:n]}})  # fmt: skip
            return {"choices": choices}
