"""`grpo-fast serve`'s launcher (grpo_fast/rollout/server/serve.py): it never adopts a server it did not start
(a busy port refused before starting, a per-launch token checked after /health), and it leaves nothing of its
server running however it ends: a second Ctrl-C during stop()'s grace, or the launcher killed by SIGKILL (the
watchdog). Most tests run a stand-in for vLLM's API server (a small HTTP server that launch() starts in place
of `python -m vllm...`, whose "engine" children may ignore SIGTERM); one test starts a real vLLM CPU
server."""

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from grpo_fast.rollout.server import TOKEN_ENV, Server, ServerError, serve

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "grpo_fast" / "tasks" / "assets" / "shop-base"
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")

# Run by launch() as its "python" (argv: -m vllm.entrypoints.openai.api_server ... --host H --port P ...):
# answers /health and the worker extension's grpo_fast_info with the launch token of its environment.
# FAKE_MARK: a file it creates when it starts; FAKE_DELAY_S: seconds before it binds its port;
# FAKE_IGNORE_TERM: it and its two "engine" children (sleep, in its process group) ignore SIGTERM.
FAKE_VLLM = """
import json, os, signal, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

if os.environ.get("FAKE_MARK"):
    open(os.environ["FAKE_MARK"], "w").close()
if os.environ.get("FAKE_IGNORE_TERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the children: only SIGKILL stops them
    for _ in range(2):
        subprocess.Popen(["sleep", "600"])
time.sleep(float(os.environ.get("FAKE_DELAY_S", "0")))
host, port = sys.argv[sys.argv.index("--host") + 1], int(sys.argv[sys.argv.index("--port") + 1])


class Handler(BaseHTTPRequestHandler):
    def answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.answer({})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.answer({"results": [{"launch_token": os.environ.get("GRPO_FAST_LAUNCH_TOKEN")}]})

    def log_message(self, *args):
        pass


try:
    server = HTTPServer((host, port), Handler)
except OSError as exc:
    sys.exit(f"fake vLLM: {exc}")
server.serve_forever()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake_python(tmp_path):
    """An executable that launch() runs in place of vLLM's interpreter."""
    path = tmp_path / "python"
    path.write_text(f"#!{sys.executable}\n{FAKE_VLLM}")
    path.chmod(0o755)
    return str(path)


def foreign_server(port: int, token: str | None):
    """Another server on loopback:`port`, answering /health; /collective_rpc with launch token `token`, or
    HTTP 404 when `token` is None (a server without grpo-fast's worker extension)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if token is None:
                self.send_error(404)
                return
            data = json.dumps({"results": [{"launch_token": token}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return _state(pid) not in ("Z", None)  # a zombie is dead, waiting to be reaped


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def group(pgid: int) -> list[int]:
    """The live processes of the process group `pgid`."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(d.name))
    return out


def gone(pgid: int, wait_s: float) -> float | None:
    """Seconds until no live process of the group `pgid` is left; None when some still is after `wait_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < wait_s:
        if not group(pgid):
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


def stubborn_group() -> subprocess.Popen:
    """A process group of three processes (a shell and two sleeps) that ignore SIGTERM."""
    proc = subprocess.Popen(
        ["bash", "-c", "trap '' TERM; sleep 600 & sleep 600 & wait"], start_new_session=True
    )
    deadline = time.monotonic() + 10
    while len(group(proc.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(group(proc.pid)) == 3
    return proc


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# 1. a server it did not start is never adopted


@pytest.mark.parametrize("answers_health", [True, False])
def test_a_busy_port_is_refused_before_anything_starts(fake_python, tmp_path, monkeypatch, answers_health):
    port, mark = free_port(), tmp_path / "started"
    monkeypatch.setenv("FAKE_MARK", str(mark))
    if answers_health:
        other = foreign_server(port, "theirs")
        expected = rf"already running at http://127.0.0.1:{port}.*--port"
    else:  # something listens there and does not speak HTTP
        other = socket.socket()
        other.bind(("127.0.0.1", port))
        other.listen()
        expected = rf"port {port} on 127.0.0.1 is in use.*--port"
    t0 = time.monotonic()
    try:
        with pytest.raises(ServerError, match=expected):
            with serve.launch("model", port=port, python=fake_python, cpu=True, wait_s=20):
                pass
    finally:
        other.shutdown() if answers_health else other.close()
    assert time.monotonic() - t0 < 10
    assert not mark.exists()  # refused before starting anything


@pytest.mark.parametrize("their_token, delay_s", [("theirs", 5), (None, 5), ("theirs", 0)])
def test_a_server_that_took_the_port_meanwhile_is_not_adopted(fake_python, monkeypatch, their_token, delay_s):
    """Another server comes up on the port between the check and our server's start (emulated: the check
    skipped): it answers /health at once, while our server has not bound yet (delay 5 s; its launch token
    is not ours, or it has no worker extension at all) or exits on "address in use" (delay 0): refused, and
    our own server stopped."""
    port = free_port()
    monkeypatch.setattr(serve, "refuse_busy_port", lambda *a: None, raising=False)
    monkeypatch.setenv("FAKE_DELAY_S", str(delay_s))
    started = []
    real_popen = subprocess.Popen

    def popen(cmd, **kw):
        started.append(real_popen(cmd, **kw))
        return started[-1]

    monkeypatch.setattr(serve.subprocess, "Popen", popen)
    httpd = foreign_server(port, their_token)
    try:
        with pytest.raises(ServerError, match=f"http://127.0.0.1:{port}.*not the server this launch started"):
            with serve.launch("model", port=port, python=fake_python, cpu=True, wait_s=20):
                pass
    finally:
        httpd.shutdown()
    ours = started[0]
    assert ours.poll() is not None  # stopped
    assert gone(ours.pid, 5) is not None


def test_launch_yields_its_url_and_token_through_an_http_proxy_setting(fake_python, monkeypatch):
    """`with launch(...) as url`: url is the server's URL (a str) carrying the launch's token, which the
    server reports; $http_proxy (pointing nowhere) does not reach the launcher's calls to a loopback
    server."""
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    port = free_port()
    with serve.launch("model", port=port, python=fake_python, cpu=True, wait_s=20) as url:
        assert isinstance(url, str) and url == f"http://127.0.0.1:{port}"
        assert len(url.token) >= 32
        assert Server(url, timeout=5).rpc("grpo_fast_info")[0]["launch_token"] == url.token
        pgid = url.pid
    assert gone(pgid, 5) is not None


def test_serve_prints_the_token_and_serve_train_passes_it(fake_python, monkeypatch):
    """Standalone `grpo-fast serve` tells how to train against its server, token included; `--train` hands
    the token to the trainer it starts ($GRPO_FAST_SERVER_TOKEN: the trainer checks that every server carries
    it)."""
    port = free_port()
    cmd = [sys.executable, "-m", "grpo_fast.rollout.server.serve", "model", "--python", fake_python,
           "--port", str(port), "--wait-s", "20"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        for line in proc.stdout:
            if line.startswith("train against it"):
                break
        token = Server(f"http://127.0.0.1:{port}", timeout=5).rpc("grpo_fast_info")[0]["launch_token"]
        assert f"{TOKEN_ENV}={token} grpo-fast train " in line, line
        proc.send_signal(signal.SIGTERM)
        assert "grpo-fast serve: stopped" in proc.communicate(timeout=30)[0]
    finally:
        proc.kill()

    seen = {}

    class Trainer:
        def __init__(self, cmd, env):
            seen.update(cmd=cmd, env=env)

        def wait(self):
            return 0

    monkeypatch.setattr(serve.subprocess, "Popen", Trainer)
    assert serve.train_against("http://127.0.0.1:1", ["--max-steps", "1"], None, "abc") == 0
    assert seen["env"][TOKEN_ENV] == "abc" and seen["cmd"][-2:] == ["--max-steps", "1"]


@pytest.mark.parametrize("argv,rank", [(["--train", "--lora-r", "4"], "8"), (["--lora-rank", "16"], "16"),
                                       (["--train", "--lora-r=0"], None)])  # fmt: skip
def test_serve_for_a_lora_run_loads_adapters_at_run_time(monkeypatch, capsys, argv, rank):
    """A server for a LoRA run (--train's --lora-r, or --lora-rank) takes adapters at run time, of the rank
    vLLM accepts at or above the adapter's; without LoRA, none of that."""

    def launch(*args, **kwargs):
        raise ServerError("not started in this test")

    monkeypatch.setattr(serve, "launch", launch)
    with pytest.raises(SystemExit):
        serve.main(["model", *argv])
    said = capsys.readouterr().out
    if rank is None:
        assert "--enable-lora" not in said and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in said
    else:
        assert f"--enable-lora --max-lora-rank {rank} --max-loras 2" in said, said
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in said


# 2. a second Ctrl-C during stop()'s grace still kills the group


def test_stop_kills_a_stubborn_group_even_when_interrupted_during_its_grace():
    proc = stubborn_group()
    # Ctrl-C raises KeyboardInterrupt here whatever handler an earlier test in this process left installed
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))  # the second Ctrl-C
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            serve.stop(proc, grace_s=30)
        assert time.monotonic() - t0 < 5
        took = gone(proc.pid, 5)
        assert took is not None, group(proc.pid)
        print(f"stop() interrupted at 0.5 s: group gone {time.monotonic() - t0:.2f}s after stop() began")
    finally:
        signal.signal(signal.SIGINT, old)
        timer.cancel()
        kill_group(proc.pid)


def test_stop_kills_a_stubborn_group_after_its_grace():
    proc = stubborn_group()
    try:
        t0 = time.monotonic()
        serve.stop(proc, grace_s=1.0)
        took = time.monotonic() - t0
        assert gone(proc.pid, 5) is not None and took < 4, took
        print(f"stop(grace_s=1) of a SIGTERM-ignoring group: {took:.2f}s")
    finally:
        kill_group(proc.pid)


# 3. the watchdog: the launcher's death, however it comes, stops its server


def _launcher(code: str, env=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env or os.environ
    )


def _launched(launcher: subprocess.Popen) -> str:
    """The launcher's line that starts with URL ('' when it exited without one)."""
    for line in launcher.stdout:
        if line.startswith("URL"):
            return line
    return ""


def test_a_killed_launcher_leaves_nothing_of_a_stubborn_server(fake_python):
    """launch() in a process killed by SIGKILL (no `finally` runs), its server's processes ignoring SIGTERM:
    the watchdog kills the whole group after the grace."""
    port, grace = free_port(), 2.0
    code = (
        "import time\nfrom grpo_fast.rollout.server import serve\n"
        f"cm = serve.launch('model', port={port}, python={fake_python!r}, cpu=True, grace_s={grace})\n"
        "url = cm.__enter__()\nprint('URL', url, url.pid, flush=True)\ntime.sleep(600)\n"
    )
    launcher = _launcher(code, {**os.environ, "FAKE_IGNORE_TERM": "1"})
    pgid = None
    try:
        line = _launched(launcher)
        assert line, "the launcher exited"
        pgid = int(line.split()[2])
        assert len(group(pgid)) == 3  # the "API server" and its two "engine" processes
        launcher.kill()
        launcher.wait(timeout=10)
        took = gone(pgid, grace + 5)
        assert took is not None, group(pgid)
        print(f"launcher SIGKILLed: its SIGTERM-ignoring server group gone in {took:.2f}s (grace {grace}s)")
    finally:
        launcher.kill()
        if pgid:
            kill_group(pgid)


def test_the_watchdog_stands_down_or_leaves_when_its_group_is_gone():
    """Released (the launcher stopped the server itself), the watchdog exits and touches nothing; when the
    group is gone first, it exits on its own; it ignores SIGINT (a Ctrl-C reaches the launcher, which stops
    the server itself)."""
    proc = stubborn_group()
    try:
        dog = serve.Watchdog(proc.pid, grace_s=1.0)
        time.sleep(0.5)
        dog.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert dog.proc.poll() is None
        dog.release()
        assert dog.proc.returncode == 0
        time.sleep(0.5)
        assert len(group(proc.pid)) == 3  # left alone
        dog = serve.Watchdog(proc.pid, grace_s=1.0)
        kill_group(proc.pid)
        proc.wait()
        dog.proc.wait(timeout=5)
        dog.release()  # its pipe closed already: nothing raised
    finally:
        kill_group(proc.pid)


# 4. every vLLM process dies with its parent (our vLLM plugin), and the launcher with any of them

# a group leader (the "API server") starting a child that loads the plugin as vLLM would, which then forks
# a grandchild (vLLM forks its engine and workers where it can); prints the child's and grandchild's pids
TIED_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=sys.stdout)
sys.exit(child.wait())  # a child that fails to start ends the test at once
"""
TIED_CHILD = """
import os, time
from grpo_fast.rollout.server import vllm_worker
vllm_worker.tie_to_parent()
pid = os.fork()
if pid == 0:
    time.sleep(600)
    os._exit(0)
print("PIDS", os.getpid(), pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("launched", [True, False])
def test_the_plugin_ties_each_process_and_its_forks_to_its_parent(launched):
    """tie_to_parent in a process below its group's leader, which then forks: the leader SIGKILLed, the child
    and the forked grandchild die with it (in a server grpo-fast launched: the launch token set); in any
    other vLLM the plugin does nothing and both live on."""
    env = {k: v for k, v in os.environ.items() if k != "GRPO_FAST_LAUNCH_TOKEN"}
    if launched:
        env["GRPO_FAST_LAUNCH_TOKEN"] = "t"
    leader = subprocess.Popen([sys.executable, "-c", TIED_PARENT, TIED_CHILD], stdout=subprocess.PIPE,
                              text=True, cwd=ROOT, env=env, start_new_session=True)  # fmt: skip
    try:
        line = leader.stdout.readline()
        assert line.startswith("PIDS"), line
        child, grandchild = map(int, line.split()[1:])
        assert alive(child) and alive(grandchild)
        leader.kill()
        leader.wait()
        deadline = time.monotonic() + 5
        while (alive(child) or alive(grandchild)) and time.monotonic() < deadline:
            time.sleep(0.05)
        if launched:
            assert not alive(child) and not alive(grandchild)
        else:
            time.sleep(0.5)
            assert alive(child) and alive(grandchild)
    finally:
        kill_group(leader.pid)


def test_a_server_runs_vllms_engine_in_processes_of_its_own(fake_python, monkeypatch):
    """The in-process vLLM engine sets VLLM_ENABLE_V1_MULTIPROCESSING=0 in its process: a server launched from
    that process must not inherit it (its engine core and workers would run inside the API server, and a
    killed worker could not be told apart)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with serve.launch("model", port=free_port(), python=fake_python, cpu=True, wait_s=20) as url:
        env = Path(f"/proc/{url.pid}/environ").read_bytes().split(b"\0")
        assert b"GRPO_FAST_LAUNCH_TOKEN=" + url.token.encode() in env
        assert not [e for e in env if e.startswith(b"VLLM_ENABLE_V1_MULTIPROCESSING=")]


def test_the_launcher_watch_returns_non_zero_when_a_server_process_dies(fake_python, monkeypatch):
    """launch() records the server's processes once it answers; one of them killed, `watch` says which and
    returns 1 within seconds, interrupting a trainer still running first."""
    monkeypatch.setenv("FAKE_IGNORE_TERM", "1")
    with serve.launch("model", port=free_port(), python=fake_python, cpu=True, wait_s=20, grace_s=1) as url:
        assert len(url.members) == 3, url.members  # the "API server" and its two "engine" processes
        assert url.lost() is None
        # the stand-in trainer takes SIGINT as a trainer does, also where SIGINT is ignored here (a background
        # job of a non-interactive shell: `sleep` would inherit that and outlive watch's 60 s wait)
        dfl = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
        trainer = subprocess.Popen(["sleep", "600"], preexec_fn=dfl)
        engine = next(pid for pid in url.members if pid != url.pid)
        os.kill(engine, signal.SIGKILL)
        t0 = time.monotonic()
        assert serve.watch(url, trainer, every_s=0.1) == 1
        assert time.monotonic() - t0 < 5
        assert trainer.poll() is not None  # interrupted (SIGINT) before the launcher leaves
        assert f"pid {engine}" in url.lost()


# the real server: token, busy port and a killed launcher


@needs_vllm
def test_a_real_server_carries_its_token_and_dies_with_its_killed_launcher(tmp_path, monkeypatch):
    """A real vLLM CPU server started by launch() in a launcher process whose environment sets $http_proxy:
    its worker reports the launch token (vLLM's engine and worker processes inherit the API server's
    environment); a second launch on its port is refused at once; the launcher killed by SIGKILL, every
    process of the server's group (the API server, the engine core) is gone within the grace + a few s."""
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    port, grace = free_port(), 5.0
    code = (
        "import sys, time\nfrom grpo_fast.rollout.server import serve\n"
        f"log = open({str(tmp_path / 'server.log')!r}, 'w')\n"
        f"cm = serve.launch({str(MODEL)!r}, port={port}, python=sys.executable, max_model_len=64, log=log, "
        f"grace_s={grace})\n"
        "url = cm.__enter__()\nprint('URL', url, url.token, url.pid, flush=True)\ntime.sleep(600)\n"
    )
    launcher = _launcher(code)
    pgid = None
    try:
        line = _launched(launcher)
        assert line, (tmp_path / "server.log").read_text()[-3000:]
        url, token, pgid = line.split()[1], line.split()[2], int(line.split()[3])
        assert Server(url, timeout=30).rpc("grpo_fast_info")[0]["launch_token"] == token
        t0 = time.monotonic()
        with pytest.raises(ServerError, match=f"already running at {url}"):
            with serve.launch(str(MODEL), port=port, python=sys.executable, max_model_len=64):
                pass
        assert time.monotonic() - t0 < 10
        members = group(pgid)
        assert len(members) >= 2, members  # the API server and its engine core at least
        launcher.kill()
        launcher.wait(timeout=10)
        took = gone(pgid, grace + 10)
        assert took is not None, group(pgid)
        assert not [p for p in members if alive(p)]
        print(f"launcher SIGKILLed: vLLM's {len(members)} processes gone in {took:.2f}s (grace {grace}s)")
    finally:
        launcher.kill()
        if pgid:
            kill_group(pgid)


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
    return out


@needs_vllm
def test_a_real_server_leaves_nothing_when_its_launcher_and_watchdog_die_at_once(tmp_path):
    """A real vLLM CPU server (API server, engine core, worker): SIGKILL to the launcher and to its direct
    children (the API server and the watchdog) at once: 10 s later no process of the server is left (the
    engine core and the worker die with their parents: grpo-fast's vLLM plugin, loaded in each)."""
    port = free_port()
    code = (
        "import sys, time\nfrom grpo_fast.rollout.server import serve\n"
        f"log = open({str(tmp_path / 'server.log')!r}, 'w')\n"
        f"cm = serve.launch({str(MODEL)!r}, port={port}, python=sys.executable, max_model_len=64, log=log)\n"
        "url = cm.__enter__()\nprint('URL', url, url.pid, flush=True)\ntime.sleep(600)\n"
    )
    launcher = _launcher(code)
    pgid = None
    try:
        line = _launched(launcher)
        assert line, (tmp_path / "server.log").read_text()[-3000:]
        pgid = int(line.split()[2])
        assert Server(line.split()[1], timeout=30).rpc("grpo_fast_info")[0]["tied_to_parent"]
        members = group(pgid)
        assert len(members) >= 3, members  # the API server, its engine core, its worker
        direct = _children(launcher.pid)
        assert pgid in direct and len(direct) >= 2, direct  # the API server and the watchdog
        for pid in [launcher.pid, *direct]:
            os.kill(pid, signal.SIGKILL)
        launcher.wait(timeout=10)
        time.sleep(10)
        assert not [p for p in members if alive(p)], [(p, _state(p)) for p in members if alive(p)]
        print(f"launcher + its {len(direct)} direct children SIGKILLed: the server's {len(members)} "
              "processes gone 10 s later")  # fmt: skip
    finally:
        launcher.kill()
        if pgid:
            kill_group(pgid)


@needs_vllm
def test_a_real_servers_killed_worker_stops_grpo_fast_serve_non_zero(tmp_path):
    """`grpo-fast serve` on a real vLLM CPU server: SIGKILL to its worker process makes the launcher say so
    and exit non-zero within 10 s, leaving nothing of the server."""
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    cmd = [sys.executable, "-m", "grpo_fast.rollout.server.serve", str(MODEL), "--port", str(port)]
    cmd += ["--max-model-len", "64"]
    launcher = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    pgid = None
    try:
        deadline = time.monotonic() + 300
        said = tmp_path / "serve.log"
        while "vLLM up at" not in said.read_text():
            assert launcher.poll() is None and time.monotonic() < deadline, said.read_text()
            time.sleep(0.5)
        api = [p for p in _children(launcher.pid) if b"api_server" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(api) == 1, api  # the API server (the launcher's other child is the watchdog)
        pgid = api[0]
        workers = [p for p in group(pgid) if "Worker" in Path(f"/proc/{p}/comm").read_text()]
        assert len(workers) == 1, workers
        members = group(pgid)
        os.kill(workers[0], signal.SIGKILL)
        t0 = time.monotonic()
        code = launcher.wait(timeout=10)
        took = time.monotonic() - t0
        assert code != 0
        assert f"died: pid {workers[0]}" in said.read_text()
        assert gone(pgid, 10) is not None and not [p for p in members if alive(p)]
        print(f"worker SIGKILLed: grpo-fast serve exited {code} in {took:.1f}s")
    finally:
        launcher.kill()
        if pgid:
            kill_group(pgid)
