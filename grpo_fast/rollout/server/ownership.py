"""A run owns its servers: `claim` makes a run the owner of a server (refused while another live run holds
it: its process, on the server's host, else a call within its lease), the engine renews the lease on a thread
(`keep_lease`) and checks after every generation that nothing but its pushes loaded weights there
(ServerEngine.check_owned); `release` at the run's end. The run's name is the trainer's run id (agreed by its
ranks, kept by --resume: grpo_fast.trainer.checkpoint.run_id), or `this_run` for a bare engine."""

import json
import os
import socket
import threading

from .client import CHECK_TIMEOUT_S, Server, ServerError


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


def keep_lease(engine_ref, leaving: threading.Event, every_s: float) -> None:
    """The lease thread: `renew` every `every_s` until the engine is released or gone."""
    while not leaving.wait(every_s):
        engine = engine_ref()
        if engine is None:
            return
        engine.renew()
        del engine  # not held across the wait: the engine may be collected
