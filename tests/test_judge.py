"""The code reward's verdicts (grpo_fast/rewards/judge.py) against an attack suite, by class: the test
running where the completion can reach it, a trusted side that can be crashed or stalled, the host's disk,
slots that share resources, processes that outlive scoring, and honest programs that scored 0.

Every attack earns 0, leaves no file and no process, and returns within the wall clock; each attack's tests
are first passed by an honest solution, so a 0 says the exploit failed, not that the tests cannot pass.
"""

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from test_sandbox import FAST, _no_trace

from grpo_fast.rewards import load_reward, score
from grpo_fast.rewards.judge import judge, judge_many, run_many, run_tests
from grpo_fast.rewards.sandbox import SandboxLimits

ROOT = Path(__file__).resolve().parent.parent
SQ = "def sq(x):\n    return x * x\ndef squares(n):\n    return [i * i for i in range(n)]\n"  # honest

# ---------------------------------------------------------------------------------------------------------
# 1. the test ran inside the completion's process: now it runs in the judge, the completion answers uses
# ---------------------------------------------------------------------------------------------------------
ALWAYS_EQUAL = "class A:\n    def __eq__(s, o): return True\n    def __ne__(s, o): return False\n"
ORDERED = "class A:\n    def __lt__(s, o): return True\n    __le__ = __gt__ = __ge__ = __lt__\n"
ZERO_SUB = (
    "class A:\n    def __sub__(s, o): return 0\n"
    "    def __rsub__(s, o): return 0\n    def __abs__(s): return 0\n"
)
# (name, completion, tests): every test passes with SQ
TEST_CLASS = [
    (
        "and of two comparisons",
        ALWAYS_EQUAL + "def sq(x):\n    return A()",
        ["assert sq(2) == 4 and sq(3) == 9"],
    ),
    ("chained comparison", ORDERED + "def sq(x):\n    return A()", ["assert 3 < sq(2) < 5"]),
    ("not ... !=", ALWAYS_EQUAL + "def sq(x):\n    return A()", ["assert not sq(2) != 4"]),
    (
        "all(... for ...)",
        ALWAYS_EQUAL + "def sq(x):\n    return A()",
        ["assert all(sq(x) == x * x for x in range(5))"],
    ),
    (
        "abs(f(x) - y) < eps with its own __sub__",
        ZERO_SUB + "def sq(x):\n    return A()",
        ["assert abs(sq(1.5) - 2.25) < 1e-9"],
    ),
    (
        "patched builtins.abs",
        "import builtins\nbuiltins.abs = lambda v: 0\ndef sq(x):\n    return -1.0",
        ["assert abs(sq(1.5) - 2.25) < 1e-9"],
    ),
    (
        "patched math.isclose",
        "import math\nmath.isclose = lambda *a, **k: True\ndef sq(x):\n    return -1.0",
        ["import math\nassert math.isclose(sq(1.5), 2.25)"],
    ),
    (
        "patched compile and exec",
        "import builtins\nbuiltins.compile = lambda *a, **k: compile('pass', 't', 'exec')\n"
        "builtins.exec = lambda *a, **k: None\ndef sq(x):\n    return 0",
        ["assert sq(3) == 9"],
    ),
    (
        "the test's reference solution read from its frames",
        "import sys, gc\ndef sq(x):\n    for o in gc.get_objects():\n"
        "        if callable(o) and getattr(o, '__name__', '') "
        "== 'ref':\n            return o(x)\n    f = sys._getframe(1)\n"
        "    while f:\n        if 'ref' in f.f_globals:\n"
        "            return f.f_globals['ref'](x)\n        f = f.f_back\n    return None",
        ["def ref(x):\n    return x * x\nassert sq(7) == ref(7)"],
    ),
    (
        "setup variables of the test",
        "def sq(x):\n    import sys\n    f = sys._getframe(1)\n"
        "    return f.f_locals.get('want', f.f_globals.get('want'))",
        ["want = 49\nassert sq(7) == want"],
    ),
    (
        "an earlier assert patched away",
        "import builtins\nclass Never(Exception):\n    pass\n"
        "builtins.AssertionError = Never\ndef sq(x):\n    return 0",
        ["assert sq(2) == 4\nassert sq(3) == 9"],
    ),
    (
        "a builtin shadowed by the completion",
        "def all(it):\n    return True\ndef sq(x):\n    return 0",
        ["assert all(sq(x) == x * x for x in range(1, 4))"],
    ),
    (
        "int subclass equal to anything",
        "class I(int):\n    def __eq__(s, o): return True\n    __hash__ = int.__hash__\n"
        "def sq(x):\n    return I(0)",
        ["assert sq(3) == 9"],
    ),
    (
        "handles compared with each other",
        "class A:\n    pass\nINSTANCE = A()\ndef sq(x):\n    return INSTANCE",
        ["assert sq(3) == sq(3) and sq(3) is not None and sq(2) == sq(2)\nassert sq(2) == 4"],
    ),
    (
        "a module of its own for a test that forgot to import it",
        "class math:\n    @staticmethod\n    def isclose(*a, **k):\n        return True\n"
        "def sq(x):\n    return 0",
        ["assert math.isclose(sq(1.5), 2.25)"],
    ),
    (
        "a container of its own that contains everything",
        "class A:\n    def __contains__(s, v): return True\n    def __iter__(s): return iter([])\n"
        "def squares(n):\n    return A()",
        ["assert 9 in squares(4) and 4 in squares(3)"],
    ),
    (
        "a handle hashed into the expected set",
        "class A:\n    def __hash__(s): return hash(9)\n"
        "    def __eq__(s, o): return True\ndef sq(x):\n    return A()",
        ["assert sq(3) in {9}"],
    ),
    ("an exception type that stops the judge", "def sq(x):\n    raise SystemExit(0)", ["assert sq(3) == 9"]),
    (
        "KeyboardInterrupt to abort the test loop",
        "def sq(x):\n    raise KeyboardInterrupt",
        ["assert sq(3) == 9"],
    ),
    ("a test that cannot fail", "def sq(x):\n    return 0", ["assert 1 == 1", "sq(3)"]),
]

# found by a red-team pass over the first judge: objects whose operators, conversions or methods answer
ZERO_EVERYTHING = (
    "class Z:\n    def _z(self, *a):\n        return self\n"
    "    __sub__ = __rsub__ = __add__ = __radd__ = __mul__ = __rmul__ = __pow__ = __abs__ = __neg__ = _z\n"
    "    __xor__ = __rxor__ = _z\n    def __float__(self):\n        return 0.0\n"
    "    def __int__(self):\n        return 0\n    def __bool__(self):\n        return False\n"
    "    def __len__(self):\n        return 0\n"
)
RED_TEAM = [
    (
        "an operator result's float",
        ZERO_EVERYTHING + "def sq(x):\n    return Z()",
        [
            "import math\nassert math.fabs(sq(1.5) - 2.25) < 1e-9",
            "assert float(sq(1.5) - 2.25) < 1e-9",
            "assert int(sq(3) - 9) == 0",
            "assert not (sq(3) - 9)",
            "assert round(sq(1.5) - 2.25, 9) == 0",
            "import math\nassert math.sqrt((sq(3) - 9) ** 2) < 1e-9",
        ],
    ),
    (
        "expected values learned from operators, replayed",
        "SEEN = {}\nclass R:\n    def __init__(self, x):\n"
        "        self.x = x\n    def __sub__(self, y):\n        SEEN[self.x] = y\n        return 0\n"
        "def sq(x):\n    return SEEN.get(x, R(x))",
        [
            "assert abs(sq(1.5) - 2.25) < 1e-6",
            "assert sq(1.5) == 2.25",
            "import math\nassert math.isclose(sq(1.5), 2.25)",
        ],
    ),
    (
        "a str subclass whose methods say yes",
        "class S(str):\n    def startswith(self, *a):\n        return True\n"
        "    def isupper(self):\n        return True\ndef shout(s):\n    return S('nope')",
        ["assert shout('hi').startswith('HI') and shout('x').isupper()"],
    ),
    (
        "a method returning such an object",
        "class S(str):\n    def endswith(self, *a):\n        return True\n"
        "class Greeter:\n    def greet(self, n):\n        return S('nope')",
        ["assert Greeter().greet('Bob').endswith('Bob!')"],
    ),
    (
        "a set subclass that is a subset of anything",
        "class St(set):\n    def issubset(self, o):\n        return True\ndef squares(n):\n    return St()",
        ["assert squares(3) == [0, 1, 4] or squares(3).issubset({0, 1, 4})"],
    ),
    (
        "an operand of the test's sent to the completion",
        "class V:\n    def __eq__(s, o):\n        return True\n"
        "    def __add__(s, o):\n        return o\ndef sq(x):\n    return V()",
        ["assert sq(3) + 0 == 9"],
    ),
    (
        "the root and /dev writable past the tmpfs cap",
        "import os\nok = 0\nfor d in ('/', '/dev', '/dev/shm'):\n"
        "    try:\n        with open(d.rstrip('/') + '/fill', 'wb') as f:\n"
        "            f.write(b'0' * (8 << 20))\n"
        "        ok += 1\n    except OSError:\n        pass\ndef sq(x):\n    return x * x if ok else 0",
        ["assert sq(3) == 9"],
    ),
    (
        "a user namespace by raw clone",
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "pid = libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)\nif pid == 0:\n    os._exit(0)\nif pid > 0:\n"
        "    os.waitpid(pid, 0)\ndef sq(x):\n    return x * x if pid > 0 else 0",
        ["assert sq(3) == 9"],
    ),
]


# ---------------------------------------------------------------------------------------------------------
# 2. what comes back can crash or stall the trusted side: now it reaches only the judge, and is bounded
# ---------------------------------------------------------------------------------------------------------
DEEP = "def sq(x):\n    v = []\n    for _ in range(100000):\n        v = [v]\n    return v"
HASH_FLOOD = (
    "def sq(x):\n    M = (1 << 61) - 1\n    return {i * M for i in range(1, 60000)}"  # one hash bucket
)
TRUSTED_CLASS = [
    ("deeply nested result", DEEP, ["assert sq(3) == 9"]),
    ("hash-colliding set", HASH_FLOOD, ["assert sq(3) == 9"]),
    ("huge result", "def sq(x):\n    return list(range(10 ** 6))", ["assert sq(3) == 9"]),
    ("huge int", "def sq(x):\n    return 10 ** 300000", ["assert sq(3) == 9"]),
    (
        "garbage frames on every descriptor",
        "import os\nfor fd in range(3, 64):\n    try:\n"
        "        os.write(fd, b'\\x00\\x00\\x00\\x05PPPPP' + b'\\xff' * 100)\n"
        "    except OSError:\n        pass\n"
        "def sq(x):\n    return 0",
        ["assert sq(3) == 9"],
    ),
    (
        "a reply before any request",
        "import os, json, struct\nm = json.dumps({'r': 9}).encode()\n"
        "for fd in range(3, 64):\n    try:\n"
        "        os.write(fd, struct.pack('>I', len(m)) + m)\n    except OSError:\n"
        "        pass\ndef sq(x):\n    return 0",
        ["assert sq(3) == 9", "assert sq(2) == 4"],
    ),
    (
        "a frame over the size cap",
        "import os, struct\nfor fd in range(3, 64):\n    try:\n"
        "        os.write(fd, struct.pack('>I', 1 << 30))\n"
        "    except OSError:\n        pass\ndef sq(x):\n    return 0",
        ["assert sq(3) == 9"],
    ),
    ("never answers", "import time\ndef sq(x):\n    time.sleep(60)", ["assert sq(3) == 9"]),
]
IO_TRUSTED = [
    ("output past the cap", "import sys\nsys.stdout.write('9' * (4 << 20))", [{"input": "3", "output": "9"}]),
    (
        "forged result frames",
        "import os, struct\nfor fd in range(3, 64):\n    try:\n"
        "        os.write(fd, b'0' + struct.pack('>I', 1) + b'9')\n    except OSError:\n        pass",
        [{"input": "3", "output": "9"}],
    ),
    (
        "kills the case runner, then forges its frames",
        "import os, signal, struct\nos.kill(os.getppid(), signal.SIGKILL)\n"
        "for fd in range(3, 64):\n    try:\n        os.write(fd, b'0' + struct.pack('>I', 1) + b'9')\n"
        "    except OSError:\n        pass\nprint(-1)",
        [{"input": "3", "output": "9"}],
    ),
    (
        "a daemon holding stdout",
        "import os, time\nif os.fork() == 0:\n    time.sleep(60)\nprint(int(input()) ** 2)",
        [{"input": "3", "output": "9"}],
    ),
]

# ---------------------------------------------------------------------------------------------------------
# 3. the host's disk: the work directory and /tmp are a size-capped tmpfs inside the sandbox
# ---------------------------------------------------------------------------------------------------------
DISK_CLASS = [
    (
        "a deep directory tree",
        "import os\nfor i in range(3000):\n    os.mkdir('d')\n    os.chdir('d')\ndef sq(x):\n    return 0",
        ["assert sq(3) == 9"],
    ),
    (
        "a symlink to the host for the cleanup to follow",
        "import os\nos.symlink('/usr/bin', 'link')\nos.symlink('/', '/tmp/root')\ndef sq(x):\n    return 0",
        ["assert sq(3) == 9"],
    ),
    (
        "tmpfs exhaustion",
        "for d in ('/work', '/tmp'):\n    try:\n        with open(d + '/fill', 'wb') as f:\n"
        "            for _ in range(256):\n"
        "                f.write(b'0' * (1 << 20))\n    except OSError:\n        pass\n"
        "def sq(x):\n    return 0",
        ["assert sq(3) == 9"],
    ),
]


def _attack_cases():
    for group in (TEST_CLASS, RED_TEAM, TRUSTED_CLASS, DISK_CLASS, IO_TRUSTED):
        for name, code, tests in group:
            yield pytest.param(code, tests, id=name)


def test_the_attacks_tests_pass_with_honest_code():
    """Each attack's tests are passable: an honest solution earns all of them (the cannot-fail ones none)."""
    honest = SQ + "def shout(s):\n    return s.upper()\nclass Greeter:\n    def greet(self, n):\n"
    honest += "        return 'Hello, ' + n + '!'\n"
    for group in (TEST_CLASS, RED_TEAM, TRUSTED_CLASS, DISK_CLASS):
        for name, _, tests in group:
            want = 0.0 if name == "a test that cannot fail" else 1.0
            assert run_tests(honest, tests, FAST) == want, name
    honest_io = "print(int(input()) ** 2)"
    for name, _, cases in IO_TRUSTED:
        assert run_tests(honest_io, cases, FAST) == 1.0, name


@pytest.mark.parametrize("code,tests", list(_attack_cases()))
def test_attack_earns_zero_within_the_wall_and_leaves_no_trace(code, tests):
    t0 = time.monotonic()
    verdict = judge(code, tests, FAST)
    took = time.monotonic() - t0
    assert verdict.passed == 0, verdict
    assert took < FAST.wall_seconds + 3, f"the trainer waited {took:.1f} s"
    _no_trace()


def test_the_trusted_side_stays_responsive_while_a_judge_is_flooded():
    """While hash-flooded and deep results are judged, the trainer's own thread keeps running (nothing it
    reads is hashed or decoded recursively): a ticker thread's longest gap stays far under the wall."""
    gaps, stop = [], threading.Event()

    def tick():
        last = time.monotonic()
        while not stop.is_set():
            time.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    t = threading.Thread(target=tick)
    t.start()
    try:
        res = run_many([(HASH_FLOOD, ["assert sq(3) == 9"]), (DEEP, ["assert sq(3) == 9"])], FAST)
    finally:
        stop.set()
        t.join()
    assert res == [0.0, 0.0]
    assert max(gaps) < 0.5, max(gaps)


# ---------------------------------------------------------------------------------------------------------
# 4. slots: memory, processes and CPU of all of a slot's processes together
# ---------------------------------------------------------------------------------------------------------
def _cgroups_here() -> bool:
    from grpo_fast.rewards.sandbox import slot_cgroups

    return slot_cgroups(0, FAST) is not None


def test_memory_is_bounded_across_a_slots_processes():
    """8 processes of 200 MiB each (over 3x the slot's 256 MiB, each under the per-process limit): the
    slot's cgroup ends them; without a cgroup the per-process limit alone would let them through."""
    if not _cgroups_here():
        pytest.skip("no cgroup can be made here: per-process limits only (documented)")
    hog = (
        "import os, time\nkids = []\nfor _ in range(8):\n    pid = os.fork()\n    if pid == 0:\n"
        "        b = bytearray(200 << 20)\n        for i in range(0, len(b), 4096):\n            b[i] = 1\n"
        "        time.sleep(1)\n        os._exit(0)\n    kids.append(pid)\n"
        "ok = all(os.waitpid(p, 0)[1] == 0 for p in kids)\n"
        "def sq(x):\n    return x * x if ok else 0"
    )
    assert run_tests(hog, ["assert sq(3) == 9"], FAST) == 0.0
    _no_trace()


def test_a_cpu_hog_does_not_starve_a_sibling_slot():
    """A completion whose processes spin in new sessions, beside an honest one that needs ~1 s of CPU: each
    slot gets its core (cgroup CPU quota), so the honest one finishes within its wall clock."""
    if not _cgroups_here():
        pytest.skip("no cgroup can be made here: slots share the CPU (documented)")
    hog = (
        "import os\nfor _ in range(12):\n    if os.fork() == 0:\n        os.setsid()\n        while True:\n"
        "            pass\nwhile True:\n    pass"
    )
    busy = "def sq(x):\n    n = 0\n    for i in range(6_000_000):\n        n += 1\n    return x * x\n"
    limits = SandboxLimits(wall_seconds=4.0, cpu_seconds=3, memory_mb=256, processes=16)
    res = run_many([(hog, ["assert sq(3) == 9"]), (busy, ["assert sq(3) == 9"])], limits, workers=2)
    assert res == [0.0, 1.0]
    _no_trace()


# ---------------------------------------------------------------------------------------------------------
# 5. lifetime: PID 1 of the sandbox killed, everything reaped, for a root, unprivileged or PID-1 trainer
# ---------------------------------------------------------------------------------------------------------
ORPHANS = (
    "import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n        if os.fork() == 0:\n"
    "            os.setsid()\n            time.sleep(60)\n        os._exit(0)\ntime.sleep(60)"
)
PDEATH_CLEARED = (
    "import ctypes, os, time\nif os.fork() == 0:\n"
    "    ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)\n    os.setsid()\n"
    "    time.sleep(60)\n    open('/tmp/survived', 'w')\ntime.sleep(60)"
)


def _trainer_process(script: str, uid: int | None = None, timeout: float = 120) -> dict:
    """`script` (Python, prints one JSON line last) in a fresh trainer process: as `uid` when given."""
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "HOME": "/tmp"}
    drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"] if uid is not None else []
    out = subprocess.run(drop + [sys.executable, "-c", textwrap.dedent(script)], env=env, cwd="/tmp",
                         capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_container_pid1_trainer_is_left_no_zombies():
    """The trainer as a subreaper that never reaps orphans (what a container's PID 1 is): after judging
    completions that orphan and daemonize processes, it has no zombie and no live descendant."""
    res = _trainer_process(f"""
        import ctypes, json, os
        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come here
        from grpo_fast.rewards.judge import run_many
        from grpo_fast.rewards.sandbox import SandboxLimits
        L = SandboxLimits(wall_seconds=2.0, cpu_seconds=2, memory_mb=256)
        jobs = [({ORPHANS!r}, ["assert sq(3) == 9"]), ({PDEATH_CLEARED!r}, ["assert sq(3) == 9"])]
        scores = run_many(jobs * 2, L)
        me, kids = os.getpid(), []
        for p in os.listdir("/proc"):
            if p.isdigit():
                try:
                    st = dict(l.split(":", 1) for l in open(f"/proc/{{p}}/status") if ":" in l)
                except OSError:
                    continue
                if int(st["PPid"]) == me:
                    kids.append((int(p), st["State"].strip()))
        print(json.dumps({{"scores": scores, "children": kids}}))
    """)
    assert res["scores"] == [0.0] * 4
    assert res["children"] == [], res["children"]  # neither zombies nor survivors
    _no_trace()


def test_an_unprivileged_trainer_with_many_threads():
    """The trainer as an unprivileged user (its sandboxes run as that user) holding 40 threads: honest code
    still passes (the trainer's threads are not counted against the sandbox's processes), an attack that
    clears its parent-death signal and daemonizes leaves nothing alive after scoring."""
    uid = 65534
    res = _trainer_process(
        f"""
        import json, os, threading, time
        stop = threading.Event()
        threads = [threading.Thread(target=stop.wait) for _ in range(40)]
        for t in threads:
            t.start()
        from grpo_fast.rewards.judge import run_many
        from grpo_fast.rewards.sandbox import SandboxLimits, processes_of
        L = SandboxLimits(wall_seconds=3.0, cpu_seconds=2, memory_mb=256, processes=8)
        honest = "import os\\nfor _ in range(4):\\n    pid = os.fork()\\n    if pid == 0:\\n"
        honest += "        os._exit(0)\\n    os.waitpid(pid, 0)\\ndef sq(x):\\n    return x * x\\n"
        scores = run_many([(honest, ["assert sq(3) == 9"]), ({PDEATH_CLEARED!r}, ["assert sq(3) == 9"])], L)
        stop.set()
        time.sleep(0.5)
        left = [p for p in processes_of(os.getuid()) if p != os.getpid()]
        print(json.dumps({{"scores": scores, "left": left}}))
    """,
        uid=uid,
    )
    assert res["scores"] == [1.0, 0.0]
    assert res["left"] == [], res["left"]


# ---------------------------------------------------------------------------------------------------------
# 6. honest programs of every common shape
# ---------------------------------------------------------------------------------------------------------
HONEST_IO = [
    ("input() and print", "print(int(input()) ** 2)"),
    ("sys.exit(0) at the end", "import sys\nprint(int(input()) ** 2)\nsys.exit(0)"),
    (
        "sys.exit() inside main",
        "import sys\ndef main():\n    print(int(sys.stdin.readline()) ** 2)\n    sys.exit()\n"
        "if __name__ == '__main__':\n    main()",
    ),
    ("sys.stdin.buffer", "import sys\nprint(int(sys.stdin.buffer.read()) ** 2)"),
    ("open(0)", "print(int(open(0).read()) ** 2)"),
    ("os.read(0)", "import os\nprint(int(os.read(0, 100)) ** 2)"),
    ("sys.stdout.write", "import sys\nsys.stdout.write(str(int(input()) ** 2) + '\\n')"),
    ("for line in sys.stdin", "import sys\nfor line in sys.stdin:\n    print(int(line) ** 2)"),
]
HONEST_ASSERTS = [
    ("complex result", "def sq(x):\n    return x * x", ["assert sq(1j) == -1", "assert sq(1 + 1j) == 2j"]),
    (
        "a class under test",
        "class Stack:\n    def __init__(self):\n        self.items = []\n"
        "    def push(self, v):\n        self.items.append(v)\n"
        "    def pop(self):\n        return self.items.pop()\n"
        "    def __len__(self):\n        return len(self.items)\n"
        "    def __iter__(self):\n        return iter(self.items)",
        [
            "s = Stack()\ns.push(1)\ns.push(2)\nassert s.pop() == 2\nassert len(s) == 1 and list(s) == [1]",
            "s = Stack()\ntry:\n    s.pop()\n    assert False\nexcept IndexError:\n    pass",
        ],
    ),
    (
        "operators on the completion's objects",
        "class V:\n    def __init__(self, x):\n        self.x = x\n"
        "    def __add__(self, o):\n        return V(self.x + o.x)\n"
        "    def __mul__(self, o):\n        return V(self.x * o.x)",
        ["assert (V(1) + V(2)).x == 3", "assert (V(2) * V(3)).x == 6"],
    ),
    (
        "floats, math.isclose, helpers, loops",
        "def sq(x):\n    return x * x",
        [
            "import math\nassert math.isclose(sq(0.1), 0.01)",
            "assert abs(sq(1.5) - 2.25) < 1e-12",
            "def check(n):\n    return sq(n) == n ** 2\nassert all(check(i) for i in range(20))",
        ],
    ),
    (
        "a generator",
        "def squares(n):\n    for i in range(n):\n        yield i * i",
        ["assert list(squares(4)) == [0, 1, 4, 9]"],
    ),
    (
        "big ints, bytes, dicts, sets, nan",
        "import math\ndef f(n):\n    return math.factorial(n)\n"
        "def g():\n    return {'a': {1, 2}, b'k': (1.5, None), 3: [float('nan')]}",
        [
            "import math\nassert f(3000) == math.factorial(3000)",
            "v = g()\nassert v['a'] == {1, 2} and v[b'k'] == (1.5, None) and v[3][0] != v[3][0]",
        ],
    ),
    (
        "an exception the test expects",
        "def sq(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x * x",
        [
            "try:\n    sq(-1)\nexcept ValueError:\n"
            "    ok = True\nelse:\n    ok = False\nassert ok and sq(2) == 4"
        ],
    ),
    (
        "a constant and a keyword argument",
        "N = 7\ndef sq(x, *, times=1):\n    return x * x * times",
        ["assert N == 7 and sq(2, times=3) == 12"],
    ),
]


@pytest.mark.parametrize("name,prog", HONEST_IO)
def test_honest_stdin_stdout_programs_of_every_shape(name, prog):
    cases = [{"input": "3\n", "output": "9"}, {"input": "4", "output": "16\n"}]
    assert run_tests(prog, cases, FAST) == 1.0


@pytest.mark.parametrize("name,code,tests", HONEST_ASSERTS)
def test_honest_assert_solutions_of_every_shape(name, code, tests):
    assert run_tests(code, tests, FAST) == 1.0


def test_partial_credit_is_the_fraction_passed():
    tests = ["assert sq(2) == 4", "assert sq(3) == 9", "assert sq(-1) == 1", "assert sq(5) == 25"]
    assert run_tests("def sq(x):\n    return x * 2 if x != 3 else 9", tests, FAST) == 0.5
    cases = [{"input": str(i), "output": str(i * i)} for i in range(4)]
    assert run_tests("n = int(input())\nprint(n * n if n % 2 else -1)", cases, FAST) == 0.5


# ---------------------------------------------------------------------------------------------------------
# Throughput and training
# ---------------------------------------------------------------------------------------------------------
def test_sandbox_failures_are_scores_and_metrics_never_reward_errors():
    """A batch of attacks and honest code through the reward as the trainer calls it (on_error='raise'):
    no RewardError, attacks score 0, the reward function's metrics count where judging stopped early."""
    reward = load_reward("code")
    comps = [f"```python\n{c}\n```" for c in (SQ, DEEP, "import time\ndef sq(x):\n    time.sleep(60)")]
    tests = [["assert sq(3) == 9"]] * 3
    s = score([reward], [1.0], ["p"] * 3, comps, {"tests": tests}, on_error="raise")
    assert s.rewards.tolist() == [1.0, 0.0, 0.0] and not s.failed.any()
    assert reward.last_metrics["sandbox_failures"] >= 1 and reward.last_metrics["sandbox_timeout"] >= 1
    _no_trace()


def test_judge_many_reports_each_verdict():
    jobs = [(SQ, ["assert sq(3) == 9", "assert sq(2) == 5"]), ("def sq(x): return 0", ["assert sq(0) == 0"])]
    v = judge_many(jobs, FAST)
    assert [(x.passed, x.total) for x in v] == [(1, 2), (1, 1)] and all(x.failure is None for x in v)


@pytest.mark.slow
def test_a_grpo_run_on_the_code_task_trains_without_reward_errors(tmp_path):
    """SmolLM2-135M-Instruct on the shipped code task (assert and stdin/stdout problems) with the code
    reward, failures raising (the default): it trains, and every step's metrics count sandbox failures."""
    import math

    from grpo_fast.tasks.default_task import CODE_TASK
    from grpo_fast.tasks.smollm2 import build
    from grpo_fast.trainer.config import parse_config
    from grpo_fast.trainer.train import train

    argv = ["--model", str(build()), "--dataset", str(CODE_TASK), "--reward", "code",
            "--num-generations", "2", "--prompts-per-step", "2", "--max-completion-length", "48",
            "--max-steps", "2", "--save-steps", "0", "--eval-max-samples", "0",
            "--output-dir", str(tmp_path / "run")]  # fmt: skip
    train(parse_config(argv))
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if "loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert math.isfinite(r["loss"]) and 0.0 <= r["rewards/code_mean"] <= 1.0
        assert r["rewards/code/sandbox_failures"] >= 0 and "rewards/code/sandbox_timeout" in r
    _no_trace()


def test_a_malformed_test_list_is_the_datasets_error():
    """Not the completion's fault, so not a score: a reward error naming the sample (on_error='raise')."""
    from grpo_fast.rewards import RewardError

    reward = load_reward("code")
    comps = [f"```python\n{SQ}\n```"] * 2
    bad = [["assert sq(3) == 9"], ["assert sq(3) == 9", {"input": "3", "output": "9"}]]
    with pytest.raises(RewardError, match="on sample 1: raised ValueError: tests must be all assert"):
        score([reward], [1.0], ["p"] * 2, comps, {"tests": bad})
    with pytest.raises(ValueError, match="needs both 'input' and 'output'"):
        judge(SQ, [{"input": "3"}], FAST)


def test_entry_point_limits_the_names_forwarded():
    """With HumanEval's `entry_point` column only that name is the completion's: a helper the test expects
    from the prompt (`poly`), or a name the test imports from nowhere (`isclose`), cannot be redefined by the
    completion; without it they can (documented)."""
    cheat = "def poly(xs, x):\n    return 0.0\ndef find_zero(xs):\n    return 99.0\n"
    cheat += "isclose = lambda *a, **k: True"
    tests = ["def poly(xs, x):\n    return sum(c * x ** i for i, c in enumerate(xs))\n"
             "assert abs(poly([1, 1], find_zero([1, 1]))) < 1e-9",
             "assert isclose(find_zero([2, 1]), -2.0)"]  # fmt: skip
    honest = "def find_zero(xs):\n    return -xs[0] / xs[1]"
    assert run_tests(cheat, tests[:1], FAST) == 0.0  # the test's own poly wins over the completion's
    assert judge(cheat, tests[1:], FAST).passed == 1  # no entry_point: isclose is forwarded (the weakness)
    assert judge(cheat, tests[1:], FAST, entry_point="find_zero").passed == 0
    assert judge(honest, tests[:1], FAST, entry_point=["find_zero"]).passed == 1
    reward = load_reward("code")
    comps = [f"```python\n{c}\n```" for c in (cheat, honest)]
    cols = {"tests": [tests[1:], ["assert find_zero([2, 1]) == -2.0"]], "entry_point": ["find_zero"] * 2}
    assert score([reward], [1.0], ["p"] * 2, comps, cols).rewards.tolist() == [0.0, 1.0]


def test_many_open_descriptors_in_the_trainer():
    """A trainer holding over 1024 descriptors (select() cannot wait on those; poll can)."""
    held = [os.pipe() for _ in range(600)]
    try:
        assert run_tests(SQ, ["assert sq(3) == 9"], FAST) == 1.0
        assert run_tests("print(int(input()) ** 2)", [{"input": "3", "output": "9"}], FAST) == 1.0
    finally:
        for r, w in held:
            os.close(r)
            os.close(w)


def test_output_comparison_keeps_leading_spaces():
    pattern = "print('  *')\nprint(' ***')\nprint('*****')"
    cases = [{"input": "", "output": "  *\n ***\n*****\n"}]
    assert run_tests(pattern, cases, FAST) == 1.0
    assert run_tests("print('*')\nprint('***')\nprint('*****')", cases, FAST) == 0.0
