"""A stand-in for a vLLM server with grpo-fast's worker extension, on loopback, for the server engine's tests
where vLLM is not installed: the endpoints the trainer calls (/health, /version, /v1/models, /tokenize,
/pause, /resume, /reset_prefix_cache, /collective_rpc, /v1/completions with prompt log-probs and sampling),
answered by a transformers model in the server's dtype. The worker methods that own the server and count its
loads are the real ones (grpo_fast.rollout.vllm_worker.WeightReceiver); only `reload_weights` and the info
are the stand-in's. Faults to order: `noop_load` (the transport loads nothing), `fail` (path -> HTTP status),
`nan` (answers NaN log-probs)."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from grpo_fast.rollout.vllm_worker import WeightReceiver


class Worker(WeightReceiver):
    def __init__(self, model, dtype: str):
        self.model, self.dtype = model, dtype
        self.noop_load = False
        self.hold = threading.Event()  # set: a load waits until it is cleared (a slow push)
        self.loading = threading.Event()  # set once a held load has started

    def grpo_fast_info(self) -> dict:
        import os
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

    def __init__(self, model, dtype: str = "float32", max_model_len: int = 64, port: int = 0):
        import copy

        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        self.model = copy.deepcopy(model).to(torch_dtype).eval()
        self.worker = Worker(self.model, dtype)
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
                data = json.dumps(out).encode()
                self.send_response(status or 200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
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
            return {"data": [{"id": "fake", "max_model_len": self.max_model_len}]}
        if path == "/tokenize":
            return {"tokens": []}
        if path == "/collective_rpc":
            return {"results": [getattr(self.worker, body["method"])(*body.get("args", []))]}
        if path == "/v1/completions":
            return self.completions(body)
        raise KeyError(path)

    @torch.no_grad()
    def completions(self, body) -> dict:
        with self.lock:
            if body.get("prompt_logprobs") is not None:
                ids = body["prompt"]
                logits = self.model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
                lp = logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
                if self.nan:
                    lp = lp * float("nan")
                rows = [None] + [
                    {str(t): {"logprob": float(v)}} for t, v in zip(ids[1:], lp.tolist(), strict=True)
                ]
                return {"choices": [{"index": 0, "prompt_logprobs": rows}]}
            prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]] * body["n"]
            g = torch.Generator().manual_seed(body.get("seed") or 0)
            choices = []
            for k, prompt in enumerate(prompts):
                ids, logps = list(prompt), []
                for _ in range(body["max_tokens"]):
                    logits = self.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
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
