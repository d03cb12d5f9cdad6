"""Isolation for untrusted code: a program in a bubblewrap sandbox, bounded, handed descriptors, ended whole.

What runs inside and how a verdict is reached is grpo_fast/rewards/judge.py's; this module only isolates. For
every sandbox (bubblewrap: Debian package `bubblewrap`, which `make setup` installs where it can):
- the trainer drops to an unprivileged uid/gid of its own (one per parallel slot and role, no supplementary
  groups, no capabilities: util-linux `setpriv`) before entering, so the sandbox's user is unprivileged
  outside too: root-only files stay unreadable when the trainer runs as root;
- new user, mount, PID, IPC, UTS, network and cgroup namespaces (`--unshare-all`): no network, no view of
  the host's processes; the program is PID 1 inside (orphans there are its own, ended with it);
- a read-only view of the system directories Python needs (/usr, /lib, /lib64, /bin) and nothing else of the
  host; /work (the working directory, also /tmp) is a size-capped tmpfs inside the sandbox: nothing the code
  writes lands on the host's disk, and the host never walks a tree the code made;
- `no_new_privs`, every capability dropped, a new session, a seccomp filter (libseccomp) refusing ptrace,
  process_vm_*, mount, unshare, setns, bpf, keyctl, io_uring, userfaultfd, perf_event_open, kernel modules...;
- limits: per process CPU seconds, address space, file size, open files; per slot, where the machine lets us
  make a cgroup (v2, or v1 `memory`, `pids`, `cpu`), the memory of all its processes together (tmpfs pages
  included), their number, and one core of CPU at an equal share, so no slot starves or crowds another;
  without one, processes per uid (the trainer's own threads not counted) and a note that this is weaker;
- the end: SIGKILL to the sandbox's own PID 1 (bubblewrap reports it on `--info-fd`), which ends its whole PID
  namespace, then bubblewrap itself is reaped: no zombie, no survivor, whether the trainer is root, an
  unprivileged user or a container's PID 1.

Where bubblewrap cannot run, code rewards refuse to start, naming the fix, unless the trainer is told
`--allow-unsandboxed-code` (then: a subprocess with the same per-process limits, dropped to an unprivileged
uid when root; no namespaces, no filesystem view, no seccomp, no cgroup).
"""

import atexit
import ctypes
import json
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

SANDBOX_UID_BASE = 61000  # uid / gid of slot k, role r: SANDBOX_UID_BASE + 2 k + r (no passwd entry needed)
ROLES = {"completion": 0, "judge": 1}
# processes a slot's two sandboxes hold themselves (bubblewrap, its init, the interpreter, each): a slot's
# cgroup allows SandboxLimits.processes beyond these
OWN_PROCESSES = 8
# GRPO_FAST_SANDBOX_DEBUG=1: the sandboxes' stderr goes to the trainer's (debugging only: the code writes it)
_STDERR = None if os.environ.get("GRPO_FAST_SANDBOX_DEBUG") else subprocess.DEVNULL
_SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin")
_DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot",
    "unshare", "setns", "bpf", "keyctl", "add_key", "request_key", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "userfaultfd", "perf_event_open", "init_module", "finit_module", "delete_module",
    "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff", "acct", "quotactl", "settimeofday",
    "clock_settime", "adjtimex", "syslog", "personality", "lookup_dcookie", "open_by_handle_at",
    "name_to_handle_at", "fanotify_init", "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig",
)  # fmt: skip


class SandboxUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float = 5.0  # the whole judgement of one completion (its sandbox and the judge's)
    cpu_seconds: int = 4  # per process
    memory_mb: int = 512  # per slot (cgroup; all its processes and its tmpfs), else per process
    file_mb: int = 16  # per file
    processes: int = 16  # started by the code: per slot (cgroup), else per uid
    tmpfs_mb: int = 64  # /work and /tmp together


def uid_of(slot: int, role: str) -> int:
    return SANDBOX_UID_BASE + 2 * slot + ROLES[role]


# ---------------------------------------------------------------------------------------------------------
# Per-slot cgroups
# ---------------------------------------------------------------------------------------------------------
_cgroups: dict = {}  # slot -> list of cgroup directories, or None (none could be made)
_cgroup_lock = threading.Lock()
_cgroup_note: list = []


def _own_cgroup(controller: str) -> str:
    """This process's cgroup path in the v1 hierarchy of `controller` ('' for v2), from /proc/self/cgroup."""
    for line in open("/proc/self/cgroup").read().splitlines():
        _, names, path = line.split(":", 2)
        if (controller and controller in names.split(",")) or (not controller and names == ""):
            return path
    raise OSError(f"no {controller or 'v2'} hierarchy")


def _make_slot_cgroups(slot: int, limits: SandboxLimits) -> list:
    """Directories of a new cgroup per controller for `slot`, limits written; OSError where not allowed."""
    tag = f"grpo-fast-{os.getpid()}/slot-{slot}"
    mem = limits.memory_mb * 2**20
    cpu_period = 100_000
    v2 = next((m for m in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
               if os.path.isfile(f"{m}/cgroup.controllers")), None)  # fmt: skip
    if v2 and {"memory", "pids", "cpu"} <= set(open(f"{v2}/cgroup.controllers").read().split()):
        parent = os.path.join(v2 + _own_cgroup(""), f"grpo-fast-{os.getpid()}")
        os.makedirs(parent, exist_ok=True)
        with open(f"{parent}/cgroup.subtree_control", "w") as f:
            f.write("+memory +pids +cpu")
        d = f"{parent}/slot-{slot}"
        os.makedirs(d, exist_ok=True)
        values = (("memory.max", mem), ("memory.swap.max", 0), ("pids.max", limits.processes + OWN_PROCESSES),
                  ("cpu.max", f"{cpu_period} {cpu_period}"), ("cpu.weight", 100))  # fmt: skip
        for name, value in values:
            if os.path.exists(f"{d}/{name}"):
                with open(f"{d}/{name}", "w") as f:
                    f.write(str(value))
        return [d]
    dirs = []
    settings = {
        "memory": (("memory.limit_in_bytes", mem), ("memory.memsw.limit_in_bytes", mem)),
        "pids": (("pids.max", limits.processes + OWN_PROCESSES),),
        "cpu": (("cpu.cfs_period_us", cpu_period), ("cpu.cfs_quota_us", cpu_period), ("cpu.shares", 1024)),
    }
    for controller, values in settings.items():
        d = os.path.join(f"/sys/fs/cgroup/{controller}" + _own_cgroup(controller), tag)
        os.makedirs(d, exist_ok=True)
        for name, value in values:
            if os.path.exists(f"{d}/{name}"):
                with open(f"{d}/{name}", "w") as f:
                    f.write(str(value))
        dirs.append(d)
    return dirs


def _remove_cgroups():
    """At exit: the slots' cgroups (empty by then: every sandbox was ended) and their parents."""
    for dirs in _cgroups.values():
        for d in dirs or []:
            for path in (d, os.path.dirname(d)):
                try:
                    os.rmdir(path)
                except OSError:
                    pass


atexit.register(_remove_cgroups)


def slot_cgroups(slot: int, limits: SandboxLimits) -> list | None:
    """The slot's cgroup directories (made once per process and limits), or None where none can be made."""
    with _cgroup_lock:
        if slot not in _cgroups:
            try:
                _cgroups[slot] = _make_slot_cgroups(slot, limits) if os.geteuid() == 0 else None
            except OSError as exc:
                _cgroups[slot] = None
                why = f"{type(exc).__name__}: {exc}"
            else:
                why = "not root" if _cgroups[slot] is None else None
            if _cgroups[slot] is None and not _cgroup_note:
                _cgroup_note.append(why)
                print(f"grpo-fast: no cgroup per sandbox slot ({why}): memory and process limits are per "
                      "process / per uid only, and slots share the CPU unbounded (weaker)",
                      flush=True)  # fmt: skip
    return _cgroups[slot]


def cgroup_processes(slot: int) -> list:
    """PIDs in the slot's cgroups (empty when it has none)."""
    pids = set()
    for d in _cgroups.get(slot) or []:
        try:
            pids.update(int(x) for x in open(f"{d}/cgroup.procs").read().split())
        except OSError:
            pass
    return sorted(pids)


# ---------------------------------------------------------------------------------------------------------
# Entering
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


def _statuses_of(uid: int):
    """(pid, /proc/PID/status fields) of every process whose real uid is `uid`."""
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
                if int(fields["Uid"].split()[0]) == uid:
                    yield int(p), fields
            except (OSError, ValueError, KeyError):
                pass


def _tasks_of(uid: int) -> int:
    """Threads of every process of `uid` (what RLIMIT_NPROC counts)."""
    return sum(int(fields.get("Threads", 1)) for _, fields in _statuses_of(uid))


def _limits_argv(limits: SandboxLimits, cgroups: list | None, nproc: int) -> list:
    """What runs before the sandbox's own program, exec'ing each into the next (no Python `preexec_fn`, so
    the trainer's process is never forked whole: subprocess spawns with vfork): `sh` joins the slot's cgroups
    (everything the sandbox starts is counted there), util-linux `prlimit` sets the per-process limits."""
    mem, cpu, fsize = limits.memory_mb * 2**20, limits.cpu_seconds, limits.file_mb * 2**20
    join = "".join(f"echo $$ > {shlex.quote(d + '/cgroup.procs')} && " for d in cgroups or [])
    argv = ["/bin/sh", "-c", join + 'exec "$@"', "sh"] if join else []
    return argv + ["prlimit", f"--as={mem}:{mem}", f"--cpu={cpu}:{cpu + 1}", f"--fsize={fsize}:{fsize}",
                   "--core=0:0", f"--nproc={nproc}:{nproc}", "--nofile=256:256", "--"]  # fmt: skip


def _bwrap_argv(python: str, limits: SandboxLimits, info_fd: int, seccomp_fd: int | None) -> list:
    # --as-pid-1: the program is the namespace's PID 1, bubblewrap's monitor its parent, which reaps it (with
    # bubblewrap's own init as PID 1 instead, the monitor exits on a status message and leaves PID 1 a zombie
    # for whatever reaps orphans: seconds here, never where the trainer is a container's PID 1)
    argv = ["bwrap", "--unshare-all", "--as-pid-1", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    argv += ["--clearenv"]
    argv += ["--info-fd", str(info_fd)]
    for d in _SYSTEM_DIRS:
        if os.path.isdir(d) and not os.path.islink(d):
            argv += ["--ro-bind", d, d]
        elif os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(1 << 20), "--tmpfs", "/dev/shm"]
    argv += ["--size", str(limits.tmpfs_mb * 2**20), "--tmpfs", "/work", "--dir", "/work/tmp"]
    argv += ["--symlink", "/work/tmp", "/tmp", "--chdir", "/work"]
    # the sandbox's own root and /dev are tmpfs without a size: read-only, so /work is the only place to write
    argv += ["--remount-ro", "/dev", "--remount-ro", "/"]
    # no user namespace inside (a raw clone(CLONE_NEWUSER) would give capabilities there, and with them the
    # kernel's namespaced attack surface: the seccomp filter refuses unshare, not clone's flags)
    argv += ["--unshare-user", "--disable-userns"]
    argv += ["--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/work"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    return argv + [python, "-I", "-S", "-c"]


class Sandbox:
    """One program (`python -I -S -c SOURCE ARGS...`) in its own sandbox, started at construction: `stdin`
    is written to it (then closed), `fds` are passed in under the same numbers. `end()` kills and reaps it."""

    def __init__(self, source: str, args: list, stdin: bytes, limits: SandboxLimits, slot: int, role: str,
                 sandboxed: bool, fds: tuple = ()):  # fmt: skip
        self.uid = uid_of(slot, role)
        self.root = os.geteuid() == 0  # only root can switch users: else the trainer's own uid
        self.sandboxed, self.pidfd = sandboxed, None
        drop = ["setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups", "--inh-caps=-all"]
        drop = drop + ["--"] if self.root else []
        cgroups = slot_cgroups(slot, limits) if sandboxed else None
        # per uid where no cgroup counts them; an unprivileged trainer's own threads are not the sandbox's
        own = limits.processes + OWN_PROCESSES
        nproc = 4096 if cgroups else own + (0 if self.root else _tasks_of(os.getuid()))
        passed, info_r, seccomp_fd = list(fds), None, None
        if sandboxed:
            info_r, info_w = os.pipe()
            passed.append(info_w)
            bpf = _seccomp_filter()
            if bpf:
                seccomp_fd = os.memfd_create("grpo-seccomp", 0)
                os.write(seccomp_fd, bpf)
                os.lseek(seccomp_fd, 0, os.SEEK_SET)
                passed.append(seccomp_fd)
            argv = drop + _bwrap_argv(sandbox_python(), limits, info_w, seccomp_fd) + [source, *args]
        else:
            argv = drop + [sandbox_python(), "-I", "-S", "-c", source, *args]
        argv = _limits_argv(limits, cgroups, nproc) + argv
        # unsandboxed: a fresh working directory on the host (the sandbox has its tmpfs /work)
        self.workdir = None if sandboxed else tempfile.mkdtemp(prefix="grpo-unsandboxed-")
        if self.workdir and self.root:
            os.chown(self.workdir, self.uid, self.uid)
        try:  # its own session and process group (no controlling terminal; one kill takes the group)
            self.proc = subprocess.Popen(
                argv, env={}, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=_STDERR,
                pass_fds=passed, start_new_session=True, cwd=self.workdir or "/",
            )  # fmt: skip
        finally:
            for fd in passed[len(fds) :]:
                os.close(fd)
        self._info_r = info_r  # read at the end: starting never waits for bubblewrap's setup
        self._writer = threading.Thread(target=self._write, args=(stdin,), daemon=True)
        self._writer.start()

    def _write(self, data: bytes):
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.close()
        except (BrokenPipeError, OSError, ValueError):
            pass

    def _open_pid1(self, info_r: int, deadline: float):
        """The sandbox's PID 1 as a pidfd, from bubblewrap's `--info-fd` ({"child-pid": N}), checked to be
        bubblewrap's own child (a pid reused in between is not ours)."""
        data = b""
        try:
            while len(data) < 4096 and time.monotonic() < deadline:
                chunk = os.read(info_r, 4096) if _ready(info_r, deadline) else b""
                if not chunk:
                    break
                data += chunk
                try:
                    pid = int(json.loads(data)["child-pid"])
                except (ValueError, KeyError, TypeError):
                    continue
                fd = os.pidfd_open(pid)
                if _parent_of(pid) == self.proc.pid:
                    self.pidfd = fd
                else:
                    os.close(fd)
                break
        except OSError:
            pass
        finally:
            os.close(info_r)

    def wait(self, deadline: float) -> bool:
        """True when the sandbox ended by itself before `deadline` (monotonic clock)."""
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            return True
        except subprocess.TimeoutExpired:
            return False

    def end(self):
        """Kill the sandbox's PID 1 (its whole PID namespace goes with it); bubblewrap, its parent, reaps it,
        exits and is reaped here. Only if bubblewrap hangs is it killed, and PID 1 then reaped here when it
        was orphaned to this trainer (a container's PID 1, a subreaper)."""
        if self._info_r is not None:
            self._open_pid1(self._info_r, time.monotonic() + 2)
            self._info_r = None
        if self.pidfd is not None:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except OSError:
                pass
        if not self.wait(time.monotonic() + 2):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # bubblewrap (or the unsandboxed program), its group
            except (ProcessLookupError, PermissionError):
                pass
            self.wait(time.monotonic() + 5)
        if self.pidfd is not None:
            _reap_if_ours(self.pidfd, time.monotonic() + 1)
            os.close(self.pidfd)
            self.pidfd = None
        if not self.sandboxed and self.root:  # no PID namespace: whatever runs as the slot's uid
            _kill_uid(self.uid)
        if self.workdir:  # unsandboxed only (weaker: a tree too deep to remove stays behind)
            try:
                shutil.rmtree(self.workdir, ignore_errors=True)
            except Exception:  # noqa: BLE001 - RecursionError on a deep tree: never the trainer's failure
                pass
        try:
            self.proc.stdin.close()
        except (OSError, ValueError):
            pass


def _reap_if_ours(pidfd: int, deadline: float):
    """Reap the process behind `pidfd` once it has exited, if it became this process's child (orphans come
    to a container's PID 1 or a subreaper); elsewhere the system's init reaps it."""
    while time.monotonic() < deadline:
        try:
            if os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG) is not None:
                return
        except ChildProcessError:
            return
        time.sleep(0.002)


def _parent_of(pid: int) -> int | None:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("PPid:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _kill_uid(uid: int):
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
    """PIDs of live processes (zombies excluded) whose real uid is `uid`: a scan of /proc."""
    return [pid for pid, fields in _statuses_of(uid) if not fields.get("State", "").strip().startswith("Z")]


def _ready(fd: int, deadline: float) -> bool:
    """`fd` readable (or closed) before `deadline`: poll takes any descriptor number (select: < 1024)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(max(0, int((deadline - time.monotonic()) * 1000) + 1)))


def read_bounded(fd: int, cap: int, deadline: float) -> tuple[bytes, bool]:
    """Bytes from `fd` until EOF, more than `cap` bytes, or `deadline` (monotonic clock); (data, reached EOF).
    Never blocks past the deadline, never holds more than `cap` + 64 KiB."""
    chunks, got = [], 0
    while got <= cap:
        if time.monotonic() >= deadline:
            return b"".join(chunks), False
        if not _ready(fd, deadline):
            continue
        try:
            b = os.read(fd, 65536)
        except OSError:
            return b"".join(chunks), False
        if not b:
            return b"".join(chunks), True
        chunks.append(b)
        got += len(b)
    return b"".join(chunks), False


def check_available(allow_unsandboxed: bool = False) -> str:
    """ "bwrap" when the OS sandbox works here, "unsandboxed" when it does not and that is allowed; else
    SandboxUnavailable naming the fix. Probed once per process."""
    with _probe_lock:
        if "kind" not in _probe:
            why = None
            for tool in ("bwrap", "setpriv"):
                if shutil.which(tool) is None:
                    why = f"`{tool}` is not installed (apt-get install bubblewrap util-linux)"
            if why is None and not _probe_runs():
                why = (
                    "bubblewrap could not start a sandbox here (unprivileged user namespaces off?, or "
                    f"{sandbox_python()} not runnable by an unprivileged user: set GRPO_FAST_SANDBOX_PYTHON)"
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


def _probe_runs() -> bool:
    r, w = os.pipe()
    box = Sandbox("import os, sys; os.write(int(sys.argv[1]), b'ok')", [str(w)], b"", SandboxLimits(), 0,
                  "completion", True, (w,))  # fmt: skip
    os.close(w)
    data, _ = read_bounded(r, 16, time.monotonic() + 10)
    box.end()
    os.close(r)
    return data == b"ok"
