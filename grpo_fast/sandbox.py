"""Untrusted completion code against tests, in an OS-level sandbox; the verdict is decided outside it.

Isolation (bubblewrap, Debian package `bubblewrap`, which `make setup` installs where it can), for every run:
- the trainer drops to an unprivileged uid/gid of its own (one per parallel slot, no supplementary groups, no
  capabilities: util-linux `setpriv`) before entering, so the sandbox's user is unprivileged outside too:
  root-only files stay unreadable when the trainer runs as root;
- new user, mount, PID, IPC, UTS, network and cgroup namespaces (`bwrap --unshare-all`): no network
  interface, no view of the host's processes; when the sandbox's first process ends or is killed, the kernel
  ends every process left in its PID namespace, so nothing outlives the run;
- a read-only view of the system directories Python needs (/usr, /lib, /lib64, /bin), nothing else of the
  host (no /home, /root, /etc, /tmp), and a fresh writable work directory (also its /tmp), deleted afterwards;
- `no_new_privs`, every capability dropped, a new session (no terminal injection), and a seccomp filter
  (libseccomp) refusing ptrace, process_vm_*, mount, unshare, setns, bpf, keyctl, io_uring, userfaultfd,
  perf_event_open, kernel modules, kexec, reboot...;
- limits: CPU seconds, address space, file size, processes (per uid, hence per slot), wall clock.

Verdict: the tests never enter the completion's process. An `assert ACTUAL OP EXPECTED` test sends only ACTUAL
(an expression) in; the process returns its value as plain data (None, bool, int, float, str, bytes, and
lists, tuples, dicts, sets of those, exact types only: no object with its own `__eq__` crosses); EXPECTED is a
literal or is computed by the test's own code in a second, clean sandbox; OP is applied here. `assert X`
compares the truth value of X's plain value. A value the process reports is thus only ever equivalent to
computing it. stdin/stdout cases ({"input", "output"}) run the program and compare its output here. A test
whose expected side needs the completion's own code cannot be decided outside and scores 0.

Where bubblewrap cannot run, code rewards refuse to start, naming the fix, unless the trainer is told
`--allow-unsandboxed-code` (then: a subprocess with the same limits, dropped to an unprivileged uid when root,
and the same outside verdict; no namespaces, no filesystem view, no seccomp).
"""

import ast
import base64
import concurrent.futures
import ctypes
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

SANDBOX_UID_BASE = 61000  # uid / gid of parallel slot k: SANDBOX_UID_BASE + k (no passwd entry needed)
_SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin")
_DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot",
    "unshare", "setns", "bpf", "keyctl", "add_key", "request_key", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "userfaultfd", "perf_event_open", "init_module", "finit_module", "delete_module",
    "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff", "acct", "quotactl", "settimeofday",
    "clock_settime", "adjtimex", "syslog", "personality", "lookup_dcookie", "open_by_handle_at",
    "name_to_handle_at", "fanotify_init", "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig",
)  # fmt: skip
MAX_RESULT_BYTES = 1 << 20


class SandboxUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float = 5.0
    cpu_seconds: int = 4
    memory_mb: int = 512
    file_mb: int = 16
    processes: int = 16


# ---------------------------------------------------------------------------------------------------------
# What runs inside: the completion, then the actual-side expressions, values back as tagged plain data
# ---------------------------------------------------------------------------------------------------------
_RUNNER = r"""
import io, json, os, sys, base64
PLAIN = {type(None), bool, int, float, str}

def enc(v, depth=0):
    t = type(v)
    if depth > 50:
        raise ValueError("too deep")
    if t in PLAIN:
        return v if t is not float or v == v else {"t": "nan"}
    if t is bytes:
        return {"t": "bytes", "v": base64.b64encode(v).decode()}
    if t in (list, tuple, set, frozenset):
        items = sorted(v, key=repr) if t in (set, frozenset) else v
        return {"t": t.__name__, "v": [enc(x, depth + 1) for x in items]}
    if t is dict:
        return {"t": "dict", "v": [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in v.items()]}
    raise TypeError("not plain data: " + t.__name__)

def main():
    job = json.loads(sys.stdin.read())
    out = os.fdopen(job["fd"], "w")
    if job["kind"] == "io":
        results = []
        for case in job["inputs"]:
            sys.stdin, buf = io.StringIO(case), io.StringIO()
            sys.stdout = buf
            try:
                exec(compile(job["code"], "<completion>", "exec"), {"__name__": "__main__"})
                results.append({"ok": True, "out": buf.getvalue()[:1000000]})
            except BaseException:
                results.append({"ok": False})
            sys.stdout = sys.__stdout__
        out.write(json.dumps(results))
        out.flush()
        os._exit(0)
    ns = {"__name__": "__main__"}
    try:
        exec(compile(job["code"], "<completion>", "exec"), ns)
    except BaseException:
        out.write("null")
        out.flush()
        os._exit(0)
    results = []
    for setup, expr in job["tests"]:
        try:
            exec(compile(setup, "<test>", "exec"), ns)
            results.append({"ok": True, "v": enc(eval(compile(expr, "<test>", "eval"), ns))})
        except BaseException:
            results.append({"ok": False})
    out.write(json.dumps(results))
    out.flush()
    os._exit(0)

main()
"""


def _decode(v):
    """Tagged plain data from the sandbox back into Python values (nothing else can come out)."""
    if v is None or type(v) in (bool, int, float, str):
        return v
    if type(v) is not dict or "t" not in v:
        raise ValueError("malformed value")
    t = v["t"]
    if t == "nan":
        return float("nan")
    if t == "bytes":
        return base64.b64decode(v["v"])
    if t in ("list", "tuple", "set", "frozenset"):
        items = [_decode(x) for x in v["v"]]
        return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[t](items)
    if t == "dict":
        return {_decode(k): _decode(x) for k, x in v["v"]}
    raise ValueError(f"unknown tag {t!r}")


# ---------------------------------------------------------------------------------------------------------
# Tests: split into what runs inside and what is decided here
# ---------------------------------------------------------------------------------------------------------
_OPS = {
    ast.Eq: lambda a, b: a == b,
    ast.NotEq: lambda a, b: a != b,
    ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b,
    ast.Gt: lambda a, b: a > b,
    ast.GtE: lambda a, b: a >= b,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
    ast.Is: lambda a, b: a is b if b is None or isinstance(b, bool) else a == b,
    ast.IsNot: lambda a, b: a is not b if b is None or isinstance(b, bool) else a != b,
}


@dataclass(frozen=True)
class _Check:
    setup: str  # statements before the assert (the test's own code), run inside
    actual: str  # the expression whose value the completion's process reports
    op: object  # an _OPS key, "truthy" or "falsy"
    expected: str | None  # the other side's source (None for truthiness)


def _parse_test(test: str) -> _Check | None:
    """An assert test as a _Check; None when it is not one we can decide outside."""
    try:
        tree = ast.parse(test)
    except SyntaxError:
        return None
    if not tree.body or not isinstance(tree.body[-1], ast.Assert):
        return None
    setup = ast.unparse(ast.Module(body=tree.body[:-1], type_ignores=[]))
    cond = tree.body[-1].test
    if isinstance(cond, ast.Compare) and len(cond.ops) == 1 and type(cond.ops[0]) in _OPS:
        return _Check(setup, ast.unparse(cond.left), type(cond.ops[0]), ast.unparse(cond.comparators[0]))
    if isinstance(cond, ast.UnaryOp) and isinstance(cond.op, ast.Not):
        return _Check(setup, ast.unparse(cond.operand), "falsy", None)
    return _Check(setup, ast.unparse(cond), "truthy", None)


def _verdict(check: _Check, actual, expected) -> bool:
    if not actual["ok"]:
        return False
    try:
        value = _decode(actual["v"])
        if check.op == "truthy":
            return bool(value)
        if check.op == "falsy":
            return not bool(value)
        return bool(_OPS[check.op](value, expected))
    except Exception:  # noqa: BLE001 - an uncomparable value fails its test
        return False


# ---------------------------------------------------------------------------------------------------------
# Entering the sandbox
# ---------------------------------------------------------------------------------------------------------
_seccomp_bpf = None
_probe: dict = {}
_probe_lock = threading.Lock()


def _seccomp_filter() -> bytes | None:
    """A BPF program (libseccomp) that makes the denied system calls fail with EPERM; None without it."""
    global _seccomp_bpf
    if _seccomp_bpf is not None:
        return _seccomp_bpf or None
    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError:
        _seccomp_bpf = b""
        return None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(0x7FFF0000)  # SCMP_ACT_ALLOW
    for name in _DENIED_SYSCALLS:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr >= 0:
            lib.seccomp_rule_add(ctx, 0x00050000 | 1, nr, 0)  # SCMP_ACT_ERRNO(EPERM)
    with tempfile.TemporaryFile() as f:
        ok = lib.seccomp_export_bpf(ctx, f.fileno()) == 0
        f.seek(0)
        _seccomp_bpf = f.read() if ok else b""
    lib.seccomp_release(ctx)
    return _seccomp_bpf or None


def sandbox_python() -> str:
    """An interpreter the unprivileged sandbox user can run from the read-only system directories."""
    env = os.environ.get("GRPO_FAST_SANDBOX_PYTHON")
    if env:
        return env
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"):
        if os.path.isfile(cand):
            return os.path.realpath(cand)
    return os.path.realpath(sys.executable)


def _preexec(limits: SandboxLimits):
    def run():
        os.setsid()  # own process group: the wall-clock kill takes every descendant
        mem = limits.memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb * 2**20,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    return run


def _bwrap_argv(work: str, python: str, seccomp_fd: int | None) -> list:
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--as-pid-1", "--cap-drop", "ALL"]
    argv += ["--clearenv"]
    for d in _SYSTEM_DIRS:
        if os.path.isdir(d) and not os.path.islink(d):
            argv += ["--ro-bind", d, d]
        elif os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
    argv += ["--proc", "/proc", "--dev", "/dev", "--bind", work, "/work", "--bind", work + "/tmp", "/tmp"]
    argv += ["--chdir", "/work", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/work"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    return argv + [python, "-I", "-S", "-c", _RUNNER]


def _run(job: dict, limits: SandboxLimits, slot: int, sandboxed: bool) -> list | None:
    """One process: `job` in on stdin, results out on fd 3 (JSON), None when it produced none."""
    uid = SANDBOX_UID_BASE + slot
    python = sandbox_python()
    # only root can switch users; an unprivileged trainer's sandbox runs as the trainer's own user
    root = os.geteuid() == 0
    drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--"]
    drop = drop if root else []
    with tempfile.TemporaryDirectory(prefix="grpo-sandbox-") as work:
        os.makedirs(work + "/tmp")
        if root:
            for d in (work, work + "/tmp"):
                os.chown(d, uid, uid)
        read_fd, write_fd = os.pipe()
        seccomp_fd = None
        fds = [write_fd]
        if sandboxed:
            bpf = _seccomp_filter()
            if bpf:
                seccomp_fd = os.memfd_create("grpo-seccomp", 0)
                os.write(seccomp_fd, bpf)
                os.lseek(seccomp_fd, 0, os.SEEK_SET)
                fds.append(seccomp_fd)
            argv = drop + _bwrap_argv(work, python, seccomp_fd)
        else:
            argv = drop + [python, "-I", "-S", "-c", _RUNNER]
        try:  # setpriv and bwrap keep inherited descriptors: the result pipe has the same number inside
            proc = subprocess.Popen(
                argv, cwd=work, env={}, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, pass_fds=fds, preexec_fn=_preexec(limits),
            )  # fmt: skip
        finally:
            os.close(write_fd)
            if seccomp_fd is not None:
                os.close(seccomp_fd)
        job = dict(job, fd=write_fd)
        chunks, total = [], 0
        reader = threading.Thread(target=_read_all, args=(read_fd, chunks, MAX_RESULT_BYTES + 1))
        reader.start()
        try:
            proc.stdin.write(json.dumps(job).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            proc.wait(timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            pass
        _kill(proc, uid if root else None)
        reader.join(timeout=2)
        os.close(read_fd)
        data = b"".join(chunks)
        total = len(data)
    if total == 0 or total > MAX_RESULT_BYTES:
        return None
    try:
        out = json.loads(data)
    except ValueError:
        return None
    return out if isinstance(out, list) else None


def _read_all(fd, chunks, cap):
    got = 0
    while got < cap:
        try:
            b = os.read(fd, 65536)
        except OSError:
            return
        if not b:
            return
        chunks.append(b)
        got += len(b)


def _kill(proc, uid: int | None):
    """The run's process group, then (root: the slot's own uid) every process left under its uid, until none
    is: the PID namespace ends them when bwrap goes, but that teardown is asynchronous."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    if uid is None:
        return
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        left = processes_of(uid)
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)


def processes_of(uid: int) -> list:
    """PIDs of live processes (zombies, already dead and waiting for init to reap them, excluded) whose
    real uid is `uid`: a scan of /proc."""
    found = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
                if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
                    found.append(int(p))
            except (OSError, ValueError, KeyError):
                pass
    return found


def check_available(allow_unsandboxed: bool = False) -> str:
    """ "bwrap" when the OS sandbox works here, "unsandboxed" when it does not and that is allowed; else
    SandboxUnavailable naming the fix. Probed once per process."""
    with _probe_lock:
        if "kind" not in _probe:
            why = None
            for tool in ("bwrap", "setpriv"):
                if shutil.which(tool) is None:
                    why = f"`{tool}` is not installed (apt-get install bubblewrap util-linux)"
            if why is None:
                res = _run({"kind": "io", "code": "print('ok')", "inputs": [""]}, SandboxLimits(), 0, True)
                if not (res and res[0].get("ok") and res[0].get("out") == "ok\n"):
                    why = (
                        "bubblewrap could not start a sandbox here (unprivileged user namespaces off?, or "
                        f"{sandbox_python()} not runnable by an unprivileged user: set "
                        "GRPO_FAST_SANDBOX_PYTHON)"
                    )
            _probe["kind"], _probe["why"] = ("bwrap", None) if why is None else (None, why)
    if _probe["kind"]:
        return _probe["kind"]
    if allow_unsandboxed:
        return "unsandboxed"
    raise SandboxUnavailable(
        f"code rewards run untrusted code and need an OS sandbox, which is not available: {_probe['why']}. "
        "Install bubblewrap (`make setup` does where it can), or pass --allow-unsandboxed-code to run them "
        "with process limits only"
    )


# ---------------------------------------------------------------------------------------------------------
# The public functions
# ---------------------------------------------------------------------------------------------------------
_expected_cache: dict = {}


def _expected_values(checks, limits, slot, sandboxed):
    """EXPECTED sides: literals here; the rest computed by the test code alone in a clean sandbox."""
    values, need = {}, []
    for i, c in enumerate(checks):
        if c is None or c.expected is None:
            continue
        try:
            values[i] = ast.literal_eval(c.expected)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            key = (c.setup, c.expected)
            if key in _expected_cache:
                values[i] = _expected_cache[key]
            else:
                need.append((i, key))
    if need:
        res = _run({"kind": "asserts", "code": "", "tests": [k for _, k in need]}, limits, slot, sandboxed)
        for j, (i, key) in enumerate(need):
            if res and j < len(res) and res[j].get("ok"):
                try:
                    values[i] = _expected_cache[key] = _decode(res[j]["v"])
                except ValueError:
                    pass
    return values


def run_tests(code: str, tests: list, limits: SandboxLimits = SandboxLimits(), *, slot: int = 0,
              allow_unsandboxed: bool = False) -> float:  # fmt: skip
    """Fraction of `tests` the completion's `code` passes: assert snippets (strings), or stdin/stdout cases
    ({"input": str, "output": str}). 0.0 when no test can fail (no assert, no case), when the code fails, a
    limit is hit, or the tests cannot be decided outside the sandbox."""
    sandboxed = check_available(allow_unsandboxed) == "bwrap"
    cases = [t for t in tests if isinstance(t, dict)]
    if cases:
        if len(cases) != len(tests) or not all("input" in c and "output" in c for c in cases):
            return 0.0
        res = _run({"kind": "io", "code": code, "inputs": [str(c["input"]) for c in cases]}, limits, slot,
                   sandboxed)  # fmt: skip
        if not res or len(res) != len(cases):
            return 0.0
        norm = lambda s: "\n".join(line.rstrip() for line in str(s).strip().splitlines())  # noqa: E731
        passed = sum(
            bool(r.get("ok")) and norm(r.get("out", "")) == norm(c["output"]) for r, c in zip(res, cases)
        )
        return passed / len(cases)
    checks = [_parse_test(t) if isinstance(t, str) else None for t in tests]
    if not checks or all(c is None for c in checks):
        return 0.0
    expected = _expected_values(checks, limits, slot, sandboxed)
    job = [(c.setup, c.actual) if c is not None else ("", "None") for c in checks]
    res = _run({"kind": "asserts", "code": code, "tests": job}, limits, slot, sandboxed)
    if not res or len(res) != len(checks):
        return 0.0
    passed = 0
    for i, (c, r) in enumerate(zip(checks, res)):
        decidable = c is not None and (c.expected is None or i in expected)
        passed += decidable and _verdict(c, r, expected.get(i))
    return passed / len(tests)


def run_many(jobs: list, limits: SandboxLimits = SandboxLimits(), *, allow_unsandboxed: bool = False,
             workers: int | None = None) -> list:  # fmt: skip
    """`run_tests(code, tests)` for each (code, tests) in `jobs`, in parallel (one sandbox per core), each
    slot with its own uid (process limits are per uid)."""
    check_available(allow_unsandboxed)
    workers = workers or max(1, min(len(jobs), os.cpu_count() or 1))
    slots = list(range(workers))
    lock = threading.Lock()

    def one(job):
        with lock:
            slot = slots.pop()
        try:
            return run_tests(job[0], job[1], limits, slot=slot, allow_unsandboxed=allow_unsandboxed)
        finally:
            with lock:
                slots.append(slot)

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, jobs))
