"""Run untrusted completion code against tests, in a sandbox; return the fraction of tests passed.

Layers, each cheap and each covering what another may miss:
- its own process (a fresh `python -I`), killed with its whole process group at a wall-clock limit;
- resource limits: CPU seconds, address space (memory), file size, no core dumps;
- a fresh temporary working directory, deleted afterwards, and an empty environment (no secrets to read);
- no network: a new network namespace when the kernel allows it (root or user namespaces), and in any case
  a Python audit hook, installed before the untrusted code runs and impossible to remove from Python, that
  refuses sockets, new processes (fork, exec, spawn, subprocess, os.system), ctypes, writes outside the
  working directory and reads of /proc/*/environ;
- a result the code cannot forge: it is printed behind a per-run nonce that lives only in a runner frame,
  and the hook refuses what reaches frames (sys._getframe, tracebacks' tb_frame, f_back, gc's object walks).
"""

import ctypes
import json
import os
import resource
import secrets
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

_CLONE_NEWNET, _CLONE_NEWUSER = 0x40000000, 0x10000000


@dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float = 5.0
    cpu_seconds: int = 4
    memory_mb: int = 512
    file_mb: int = 16


_RUNNER = r"""
import sys, os, json
_root = os.path.realpath(os.getcwd())
_BLOCKED = ("socket.", "subprocess.Popen", "os.system", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn",
            "os.exec", "ctypes.", "pty.spawn", "os.kill", "signal.pthread_kill", "sys._getframe",
            "sys._current_frames", "gc.get_objects", "gc.get_referrers", "gc.get_referents")
_FRAME_ATTRS = ("tb_frame", "f_back", "f_locals", "f_globals", "gi_frame", "cr_frame", "ag_frame")

def _inside(path):
    try:
        p = os.path.realpath(os.fsdecode(path) if not isinstance(path, int) else "")
    except Exception:
        return False
    return p == _root or p.startswith(_root + os.sep)

def _hook(event, args):
    if event == "object.__getattr__" and args[1] in _FRAME_ATTRS:
        raise PermissionError("sandbox: frame access is not allowed")
    if event.startswith(_BLOCKED):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = args
        if isinstance(path, (str, bytes)) and os.fsdecode(path).endswith("/environ"):
            raise PermissionError("sandbox: reading process environments is not allowed")
        write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT
        writing = (mode and any(c in mode for c in "wax+")) or (flags or 0) & write_flags
        if writing and not _inside(path):
            raise PermissionError("sandbox: writing outside the working directory is not allowed")
    if event in ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.symlink", "os.link",
                 "shutil.rmtree", "os.truncate", "os.chown", "os.utime"):
        if args and isinstance(args[0], (str, bytes, os.PathLike)) and not _inside(args[0]):
            raise PermissionError(f"sandbox: {event} outside the working directory is not allowed")

def _main():
    payload = json.loads(sys.stdin.read())
    nonce = payload["nonce"]
    ns = {"__name__": "__main__"}
    sys.addaudithook(_hook)
    passed = 0
    try:
        exec(compile(payload["code"], "<completion>", "exec"), ns)
        ok = True
    except BaseException:
        ok = False
    if ok:
        for t in payload["tests"]:
            try:
                exec(compile(t, "<test>", "exec"), ns)
                passed += 1
            except BaseException:
                pass
    sys.stdout.write("\n@@" + nonce + "@@" + json.dumps({"passed": passed}) + "\n")
    sys.stdout.flush()
    os._exit(0)

_main()
"""


def _limit(limits: SandboxLimits):
    def preexec():
        os.setsid()  # own process group: the wall-clock kill takes every descendant
        mem = limits.memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb * 2**20, limits.file_mb * 2**20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))  # not enforced for root: the audit hook is
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(_CLONE_NEWNET) != 0:  # no network interfaces at all, loopback down
            libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET)

    return preexec


def run_tests(code: str, tests: list[str], limits: SandboxLimits = SandboxLimits()) -> float:
    """Fraction of `tests` (Python snippets) that pass after executing `code`; 0.0 when the tests contain no
    `assert` (a test that cannot fail pays nothing), when the code fails or when a limit is hit."""
    if not tests or not any("assert" in t for t in tests):
        return 0.0
    nonce = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="grpo-sandbox-") as work:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _RUNNER],
            cwd=work,
            env={},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            preexec_fn=_limit(limits),
        )
        try:
            out, _ = proc.communicate(
                json.dumps({"code": code, "tests": tests, "nonce": nonce}).encode(),
                timeout=limits.wall_seconds,
            )
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()
            return 0.0
    marker = f"@@{nonce}@@"
    text = out.decode(errors="replace")
    if marker not in text:
        return 0.0
    passed = json.loads(text.rsplit(marker, 1)[1].strip().splitlines()[0])["passed"]
    return min(passed, len(tests)) / len(tests)
