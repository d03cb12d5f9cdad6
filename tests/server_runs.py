"""`grpo-fast train` against vLLM servers as a subprocess, and what it trained: shared by the tests of server
mode against the stand-in server (test_server_engine.py) and real vLLM servers (test_vllm_server.py)."""

import json
import os
import subprocess
import sys


def server_trainer(out, url: str, flags: list, host: str | None = None) -> subprocess.Popen:
    """`grpo-fast train --rollout vllm --vllm-mode server` on `url` into `out`, with `flags`; stdout and
    stderr together, one thread (the server and the tests share the machine's cores); `host`: the host name
    the trainer's process sees (socket.gethostname), a host other than the server's."""
    run = ["-m", "grpo_fast.train"]
    if host is not None:
        run = ["-c", f"import runpy, socket; socket.gethostname = lambda: {host!r}; "
                     "runpy.run_module('grpo_fast.train', run_name='__main__', alter_sys=True)"]  # fmt: skip
    cmd = [sys.executable, *run, "--output-dir", str(out), "--rollout", "vllm",
           "--vllm-mode", "server", "--vllm-server-base-url", url, *flags]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def trained_steps(out) -> list:
    """The steps logged in `out`/metrics.jsonl, in order (evaluation records left out)."""
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(x)["step"] for x in lines if "reward_mean" in x]
