"""The code reward's OS sandbox against an attack suite on isolation: every attack earns 0 and leaves no trace
(no file outside, no process alive after scoring), honest code earns its fraction, scoring goes on after each.
The verdicts' own attack suite (the judge) is tests/test_judge.py.

Each attack defines the function under test only when its exploit worked, so its score says whether it did.
"""

import os
import shutil
import stat
import tempfile

import pytest

from grpo_fast.rewards import code_reward, score
from grpo_fast.rewards.judge import run_many, run_tests
from grpo_fast.rewards.sandbox import SANDBOX_UID_BASE, SandboxLimits, cgroup_processes, processes_of

if shutil.which("bwrap") is None or shutil.which("setpriv") is None:
    if os.environ.get("GRPO_FAST_REQUIRE_SANDBOX"):  # make test: the sandbox must be there, never skipped
        raise RuntimeError("bubblewrap / setpriv are not installed: `make setup` installs bubblewrap as root")
    pytest.skip("bubblewrap is not installed", allow_module_level=True)

TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]
ADD = "\ndef add(a, b):\n    return a + b\n"
FAST = SandboxLimits(wall_seconds=3.0, cpu_seconds=2, memory_mb=256, processes=16)
SECRET_FILE = "/root/.grpo_fast_test_secret" if os.geteuid() == 0 else None
# host paths an escape would write (the sandbox's own /tmp and /work are a tmpfs inside it)
OUTSIDE = ["/root/grpo_escape", "/usr/grpo_escape", "/etc/grpo_escape", os.path.abspath("grpo_escape")]


def _if(cond: str, indent="") -> str:
    """`add` defined only when `cond` holds (the exploit worked)."""
    return f"\n{indent}if {cond}:\n{indent}    def add(a, b):\n{indent}        return a + b\n"


# attacks scored against TESTS (asserts): name -> code
ATTACKS = {
    "infinite loop": "while True:\n    pass" + ADD,
    "sleep past the wall clock": "import time\ntime.sleep(60)" + ADD,
    "fork bomb": "import os\nwhile True:\n    os.fork()" + ADD,
    "thread bomb": "import threading, time\nfor _ in range(100000):\n"
    "    threading.Thread(target=time.sleep, args=(60,)).start()" + ADD,
    "memory hog": "x = bytearray(2 * 1024 ** 3)" + ADD,
    "file bigger than the limit": "open('big', 'wb').write(b'0' * (64 * 1024 ** 2))" + ADD,
    "result too large to return": "def add(a, b):\n    return list(range(10 ** 7))",
    "network connection": "import socket\nok = False\ntry:\n"
    "    socket.create_connection(('1.1.1.1', 53), timeout=1); ok = True\nexcept OSError:\n    pass"
    + _if("ok"),
    "shell writes outside": "import subprocess\nfor p in " + repr(OUTSIDE) + ":\n"
    "    subprocess.run(['sh', '-c', f'echo x > {p}'])\nimport os"
    + _if("any(os.path.exists(p) for p in " + repr(OUTSIDE) + ")"),
    "python writes outside": "import os\nok = False\nfor p in " + repr(OUTSIDE) + ":\n    try:\n"
    "        open(p, 'w').write('x'); ok = True\n    except OSError:\n        pass" + _if("ok"),
    "low-level process creation (ctypes fork + execve)": "import ctypes, os\nlibc = ctypes.CDLL(None)\n"
    "pid = libc.fork()\nif pid == 0:\n    libc.execv(b'/bin/sh', (ctypes.c_char_p * 4)(b'sh', b'-c', "
    "b'echo x > /usr/grpo_escape', None))\n    os._exit(1)\nos.waitpid(pid, 0)"
    + _if("os.path.exists('/usr/grpo_escape')"),
    "posix_spawn a shell": "import os\ntry:\n    pid = os.posix_spawn('/bin/sh', ['sh', '-c', "
    "'echo x > /usr/grpo_escape_spawn'], {})\n    os.waitpid(pid, 0)\nexcept OSError:\n    pass"
    + _if("os.path.exists('/usr/grpo_escape_spawn')"),
    "signal the parent and everyone": "import os, signal\nok = True\ntry:\n    os.kill(os.getppid(), "
    "signal.SIGKILL)\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n    ok = False" + _if("ok"),
    "signal the trainer by pid": "import os, signal\nok = False\ntry:\n    os.kill(TRAINER_PID, "
    "signal.SIGTERM); ok = True\nexcept OSError:\n    pass" + _if("ok"),
    "ptrace the parent": "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "ok = libc.ptrace(16, os.getppid(), 0, 0) == 0" + _if("ok"),
    "new user namespace (unshare)": "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "ok = libc.unshare(0x10000000) == 0" + _if("ok"),
    "mount a filesystem": "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "ok = libc.mount(b'none', b'/work', b'tmpfs', 0, None) == 0" + _if("ok"),
    "special file outside (mknod, mkfifo)": "import os, stat\nok = False\nfor f in (lambda: os.mknod('"
    "/dev/grpo_escape', stat.S_IFCHR | 0o666, os.makedev(1, 3)), lambda: os.mkfifo('/usr/grpo_escape')):\n"
    "    try:\n        f(); ok = True\n    except OSError:\n        pass" + _if("ok"),
    "symlink to a system file": "import os\nok = False\ntry:\n    os.symlink('/etc/passwd', 'p')\n"
    "    open('p', 'a').write('evil::0:0::/:/bin/sh')\n    ok = True\nexcept OSError:\n    pass" + _if("ok"),
    "/proc of the host": "import os\nok = os.path.exists('/proc/1/root/root') or any(\n"
    "    os.path.exists(f'/proc/{p}/environ') and 'GRPO_FAST_SECRET' in open(f'/proc/{p}/environ').read()\n"
    "    for p in os.listdir('/proc') if p.isdigit())" + _if("ok"),
    "inherited descriptors": "import os\nok = False\nfor fd in range(3, 256):\n    try:\n"
    "        target = os.readlink(f'/proc/self/fd/{fd}')\n    except OSError:\n        continue\n"
    "    if target.startswith('/') and not target.startswith(('/work', '/tmp', '/proc', '/dev', '/memfd')):\n"
    "        ok = True" + _if("ok"),
    "forge the result channel": "import os, json\nfor fd in range(3, 64):\n    try:\n"
    "        os.write(fd, json.dumps([{'ok': True, 'v': 999}, {'ok': True, 'v': 999}]).encode())\n"
    "    except OSError:\n        pass\nos._exit(0)",
    "claim passes without values": "import os\nfor fd in range(3, 64):\n    try:\n"
    '        os.write(fd, b\'[{"ok": true}, {"ok": true}]\')\n    except OSError:\n        pass\nos._exit(0)',
    "forge a result line on stdout": 'import sys, os\nsys.stdout.write(\'[{"ok": true, "v": 3}]\\n\')\n'
    "sys.stdout.flush()\nos._exit(0)",
    "object equal to anything": "class Any:\n    def __eq__(self, other):\n        return True\n"
    "def add(a, b):\n    return Any()",
    "int subclass with its own __eq__": "class I(int):\n    def __eq__(self, other):\n        return True\n"
    "    __hash__ = int.__hash__\ndef add(a, b):\n    return I(0)",
    "walk frames and objects for the expected values": "import gc, sys\n"
    "needle = '=' * 2 + ' ' + str(1 + 2)  # the text of an expected side, built so this source lacks it\n"
    "def strs(o):\n    if isinstance(o, dict):\n        o = list(o.keys()) + list(o.values())\n"
    "    return [s for s in o if isinstance(s, str)] if isinstance(o, (list, tuple)) else []\n"
    "objs = gc.get_objects()\nf = sys._getframe()\nwhile f:\n    objs.append(f.f_locals)\n    f = f.f_back\n"
    "ok = any(needle in s and s != needle for o in objs for s in strs(o))" + _if("ok"),
    "patch the harness": "import builtins, json\nbuiltins.AssertionError = type('Never', (Exception,), {})\n"
    'json.dumps = lambda *a, **k: \'[{"ok": true, "v": 42}, {"ok": true, "v": 42}]\'\n'
    "def add(a, b):\n    return 0",
    "daemon that outlives the run": "import os, time\nif os.fork() == 0:\n    os.setsid()\n"
    "    if os.fork() == 0:\n        time.sleep(60)\n        open('/tmp/grpo_escape_daemon', 'w')\n"
    "    os._exit(0)\n",
    "terminal injection (TIOCSTI)": "import fcntl, termios\nok = False\nfor fd in (0, 1, 2):\n    try:\n"
    "        fcntl.ioctl(fd, termios.TIOCSTI, b'x'); ok = True\n    except OSError:\n        pass"
    + _if("ok"),
}
# attacks scored against stdin/stdout cases whose expected output is a secret of the trainer's machine
SECRET_ATTACKS = {
    "environment secret": "import os\nprint(os.environ.get('GRPO_FAST_SECRET', ''))",
    "root-only file": f"print(open({SECRET_FILE!r}).read().strip())",
    "/etc/shadow": "print(open('/etc/shadow').read().split(':')[0])",
    "parent's environment through /proc": "import os\n"
    "print(open(f'/proc/{os.getppid()}/environ').read().split('GRPO_FAST_SECRET=')[1].split('\\0')[0])",
}


@pytest.fixture(autouse=True)
def _secrets(monkeypatch):
    monkeypatch.setenv("GRPO_FAST_SECRET", "hunter2")
    if SECRET_FILE:
        with open(SECRET_FILE, "w") as f:
            f.write("root-only-secret\n")
        os.chmod(SECRET_FILE, stat.S_IRUSR | stat.S_IWUSR)
    yield
    if SECRET_FILE and os.path.exists(SECRET_FILE):
        os.remove(SECRET_FILE)


def _sandbox_processes() -> list:
    """Live processes running as any sandbox slot's uid (both roles), or in any slot's cgroup."""
    uids = [pid for k in range(128) for pid in processes_of(SANDBOX_UID_BASE + k)]
    return uids + [pid for slot in range(64) for pid in cgroup_processes(slot)]


def _no_trace():
    for p in OUTSIDE + [
        "/tmp/grpo_escape",
        "/usr/grpo_escape_spawn",
        "/tmp/grpo_escape_daemon",
        "/dev/grpo_escape",
    ]:
        assert not os.path.exists(p), p
    assert _sandbox_processes() == []


def test_honest_code_earns_its_fraction():
    assert run_tests(ADD, TESTS, FAST) == 1.0
    assert run_tests("def add(a, b):\n    return 3", TESTS, FAST) == 0.5  # one of two right
    assert run_tests("open('scratch.txt', 'w').write('ok')" + ADD, TESTS, FAST) == 1.0  # its own directory
    # other comparison forms, and an expected value computed by the test's own code
    more = [
        "assert add(1, 1) != 3",
        "assert add(2, 3) in [5, 6]",
        "assert not add(0, 0)",
        "assert add(1, 0)",
        "r = sorted([3, 1, 2])\nassert add(r[0], r[2]) == r[0] + r[2]",
        "assert add((1,), (2,)) == (1, 2)",
    ]
    assert run_tests(ADD, more, FAST) == 1.0
    # both sides of a comparison may use the completion: the judge forwards each use, compares in its own
    assert run_tests(ADD, ["assert add(1, 2) == add(2, 1)", TESTS[0]], FAST) == 1.0
    assert run_tests(ADD, ["add(1, 2)"], FAST) == 0.0  # nothing that can fail pays nothing


def test_stdin_stdout_cases_compared_outside():
    prog = "n = int(input())\nprint(n * 2)"
    cases = [{"input": "3\n", "output": "6"}, {"input": "5", "output": "10\n"}, {"input": "1", "output": "3"}]
    assert run_tests(prog, cases, FAST) == pytest.approx(2 / 3)
    assert run_tests("print(input()[::-1])", [{"input": "abc", "output": "cba"}], FAST) == 1.0


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_earns_zero_and_leaves_no_trace(name):
    code = ATTACKS[name].replace("TRAINER_PID", str(os.getpid()))
    assert run_tests(code, TESTS, FAST) == 0.0
    _no_trace()


@pytest.mark.parametrize("name", list(SECRET_ATTACKS))
def test_secrets_stay_unread(name):
    if name == "root-only file" and not SECRET_FILE:
        pytest.skip("needs root to plant a root-only file")
    expected = {"environment secret": "hunter2", "root-only file": "root-only-secret", "/etc/shadow": "root"}
    case = [{"input": "", "output": expected.get(name, "hunter2")}]
    assert run_tests(SECRET_ATTACKS[name], case, FAST) == 0.0
    _no_trace()


def test_scoring_goes_on_after_attacks_in_parallel():
    comps = [f"```python\n{c}\n```" for c in list(ATTACKS.values())[:8]] + [f"```python\n{ADD}\n```"]
    s = score([code_reward], [1.0], ["p"] * len(comps), comps, {"tests": [TESTS] * len(comps)})
    assert s.rewards.tolist() == [0.0] * 8 + [1.0]
    _no_trace()


def test_sandbox_user_is_unprivileged_and_sees_no_host_files():
    # were it root (inside or outside) or saw /root, /etc or /home, these would print what the cases expect
    probes = [
        ("import os\nprint(os.getuid(), os.getgid())", "0 0"),
        ("import os\nprint(all(os.path.exists(p) for p in ('/root', '/etc', '/home')))", "True"),
        ("import os\nprint(len([p for p in os.listdir('/proc') if p.isdigit()]) > 5)", "True"),
    ]
    res = run_many([(prog, [{"input": "", "output": out}]) for prog, out in probes], FAST)
    assert res == [0.0, 0.0, 0.0]
    _no_trace()


def test_without_bubblewrap_code_rewards_refuse_unless_allowed(monkeypatch):
    import grpo_fast.rewards.sandbox as sb
    from grpo_fast.rewards import load_reward

    monkeypatch.setattr(sb.shutil, "which", lambda tool: None)
    monkeypatch.setattr(sb, "_probe", {})
    with pytest.raises(
        ValueError, match="--reward code: code rewards run untrusted code and need an OS sandbox"
    ):
        load_reward("code")
    with pytest.raises(sb.SandboxUnavailable, match="--allow-unsandboxed-code"):
        run_tests(ADD, TESTS, FAST)
    # allowed: limits and the outside verdict still hold, the namespaces do not
    reward = load_reward("code", allow_unsandboxed_code=True)
    assert reward(["p"], [f"```python\n{ADD}\n```"], [TESTS]) == [1.0]
    assert run_tests(ATTACKS["object equal to anything"], TESTS, FAST, allow_unsandboxed=True) == 0.0
    assert run_tests(ATTACKS["infinite loop"], TESTS, FAST, allow_unsandboxed=True) == 0.0
    # stdin/stdout cases work there too (a fresh working directory on the host, removed afterwards)
    before = set(os.listdir(tempfile.gettempdir()))
    case = [{"input": "3", "output": "6"}]
    assert run_tests("print(int(input()) * 2)", case, FAST, allow_unsandboxed=True) == 1.0
    assert {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("grpo-unsandboxed-")} <= before
    assert _sandbox_processes() == []


def test_python_tool_runs_model_code_in_the_sandbox():
    """grpo_fast.rollout.tools.python_tool: a multi-turn tool that runs model-written code, in this sandbox;
    every way the code can fail is an error message for the model (through run_tool_calls), calls in
    parallel."""
    from grpo_fast.rollout import tools as T

    python = T.python_tool(FAST)
    assert python("print(6 * 7)") == "42\n"
    assert python("import os; print(os.path.exists('/root'), os.getuid() == 0)") == "False False\n"
    box = T.Toolbox([python])
    calls = [
        T.ToolCall("python", {"code": "while True: pass"}),
        T.ToolCall("python", {"code": "raise SystemExit(3)"}),
        T.ToolCall("python", {"code": "import sys; print('a' * 10, 1 / 0)"}),
        T.ToolCall("python", {"code": "print(sum(range(10)))"}),
    ]
    res = T.run_tool_calls([(box, [c]) for c in calls], timeout_s=30)
    assert [r[0].failed for r in res] == [True, True, True, False] and res[3][0].content == "45\n"
    assert all(r[0].content.startswith("error: python raised RuntimeError") for r in res[:3])
