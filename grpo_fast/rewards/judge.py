"""The code reward's verdicts: a judge that never runs completion code, and a trusted side nothing can crash.

Assert tests (strings of Python: asserts, helpers, loops, `math.isclose`, anything) run in a sandbox of their
own, the judge's, which never holds completion code. The completion runs alone in a second sandbox. Every name
a test uses that neither the test, Python's builtins nor the standard library's modules define (or, with an
`entry_point`, only those names) is the completion's: its uses are forwarded to the completion's sandbox,
arguments and results crossing as plain data of exact types (None, bool, int, float, complex, str, bytes,
list, tuple, dict, set, frozenset; bounded size, depth and element count). A function's or method's result
must be plain data (an iterator it returns can only be iterated); a class (a name the test spells
capitalized) gives an opaque handle to an instance, whose methods the test may call; a handle never compares
equal to anything, cannot be hashed, and operators act only between handles. So the test's comparisons, its
reference values and its imports live where the completion cannot reach them, and no object of the
completion's answers for a comparison: the judge compares plain data only (judge_runtime.py).

The judge writes one byte per test to the trainer: P (passed, having used the completion), U (passed without
using it: a test that cannot fail pays nothing), F (failed). The trainer reads at most one byte per test
before the wall clock, accepts only those three, and counts P for tests that contain an `assert`. Anything
else (a crash of either sandbox, a timeout, a malformed byte, a limit) fails the tests not yet judged for
that completion: it scores 0 and is never a reward error, so crashing can never beat answering wrong.

stdin/stdout cases ({"input", "output"}) run the program as a process of its own per case inside the
completion's sandbox; the trainer reads length-prefixed frames (status, at most MAX_OUTPUT bytes), bounded
and validated, and compares the outputs line by line. Decoding on the trusted side is linear in its input and
hashes nothing it read. Isolation (namespaces, uids, seccomp, tmpfs, cgroups, ending) is
grpo_fast/rewards/sandbox.py.
"""

import ast
import concurrent.futures
import marshal
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import judge_runtime
from .judge_runtime import MAX_OUTPUT
from .sandbox import Sandbox, SandboxLimits, check_available, read_bounded

RUNTIME = Path(judge_runtime.__file__).read_text()  # its source runs inside the sandboxes
MAX_IO_BYTES = 8 << 20  # all cases' frames together
_VERDICTS = {ord("P"): True, ord("U"): False, ord("F"): False}


@dataclass(frozen=True)
class Verdict:
    passed: int  # tests passed that can fail
    total: int
    failure: str | None = None  # why judging stopped early: "timeout", "crashed", "malformed"; None if not

    @property
    def score(self) -> float:
        return self.passed / self.total if self.total else 0.0


def _has_assert(test: str) -> bool:
    try:
        return any(isinstance(n, ast.Assert) for n in ast.walk(ast.parse(test)))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False


def _stopped(eof: bool) -> str:
    return "crashed" if eof else "timeout"


def judge_asserts(code: str, tests: list, countable: list, limits: SandboxLimits, slot: int, sandboxed: bool,
                  names: list | None = None) -> Verdict:  # fmt: skip
    """The completion's `code` against assert `tests`, in two sandboxes joined by two pipes; `countable`:
    which tests hold an assert (only those pay); `names`: the only names of the completion's the tests may
    use (None: any name the test does not define)."""
    deadline = time.monotonic() + limits.wall_seconds
    req_r, req_w = os.pipe()  # judge -> completion
    rep_r, rep_w = os.pipe()  # completion -> judge
    ver_r, ver_w = os.pipe()  # judge -> trainer
    boxes = []
    try:
        boxes.append(Sandbox(RUNTIME, ["serve", str(req_r), str(rep_w)], code.encode(), limits, slot,
                             "completion", sandboxed, (req_r, rep_w)))  # fmt: skip
        job = marshal.dumps({"tests": tests, "names": names})
        boxes.append(Sandbox(RUNTIME, ["judge", str(rep_r), str(req_w), str(ver_w)], job, limits, slot,
                             "judge", sandboxed, (rep_r, req_w, ver_w)))  # fmt: skip
    except BaseException:  # a sandbox that could not start (our setup, not the completion): end the other
        for box in boxes:
            box.end()
        raise
    finally:
        for fd in (req_r, rep_w, rep_r, req_w, ver_w):
            os.close(fd)
    try:
        data, eof = read_bounded(ver_r, len(tests), deadline)
    finally:
        os.close(ver_r)
        for box in boxes:
            box.end()
    passed, failure = 0, None
    for i, test in enumerate(tests):
        if i >= len(data):
            failure = _stopped(eof)
            break
        if data[i] not in _VERDICTS:
            failure = "malformed"
            break
        passed += _VERDICTS[data[i]] and countable[i]
    if len(data) > len(tests):
        passed, failure = 0, "malformed"
    return Verdict(passed, len(tests), failure)


def _norm(text: str) -> str:
    """Lines without trailing whitespace, blank lines at the ends dropped (leading spaces kept: a pattern's
    indentation is part of the answer)."""
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return "\n".join(lines)


def run_io(code: str, inputs: list, limits: SandboxLimits, slot: int, sandboxed: bool) -> tuple[list, str]:
    """The program `code` on each stdin of `inputs`, each a process of its own in the completion's sandbox:
    ([(exited cleanly, stdout text)] for the inputs it got through, why it stopped early or None)."""
    deadline = time.monotonic() + limits.wall_seconds
    res_r, res_w = os.pipe()
    job = marshal.dumps({"code": code, "inputs": [str(x) for x in inputs]})
    try:
        box = Sandbox(RUNTIME, ["io", str(res_w)], job, limits, slot, "completion", sandboxed, (res_w,))
    finally:
        os.close(res_w)
    try:
        data, eof = read_bounded(res_r, min(MAX_IO_BYTES, len(inputs) * (5 + MAX_OUTPUT)), deadline)
    finally:
        os.close(res_r)
        box.end()
    outputs, pos = [], 0
    for _ in inputs:
        if pos + 5 > len(data):
            return outputs, _stopped(eof)
        status, (n,) = data[pos], struct.unpack(">I", data[pos + 1 : pos + 5])
        if status not in b"01" or n > MAX_OUTPUT or pos + 5 + n > len(data):
            return outputs, "malformed" if status not in b"01" or n > MAX_OUTPUT else _stopped(eof)
        outputs.append((status == ord("0"), data[pos + 5 : pos + 5 + n].decode("utf-8", errors="replace")))
        pos += 5 + n
    return outputs, None


def judge_io(code: str, cases: list, limits: SandboxLimits, slot: int, sandboxed: bool) -> Verdict:
    """The program `code` on stdin/stdout `cases` (`run_io`)."""
    outputs, failure = run_io(code, [c["input"] for c in cases], limits, slot, sandboxed)
    passed = sum(ok and _norm(out) == _norm(str(c["output"])) for (ok, out), c in zip(outputs, cases))
    return Verdict(passed, len(cases), failure)


def judge(code: str, tests: list, limits: SandboxLimits = SandboxLimits(), *, slot: int = 0,
          allow_unsandboxed: bool = False, entry_point=None) -> Verdict:  # fmt: skip
    """The completion's `code` against `tests`: assert snippets (strings), or stdin/stdout cases
    ({"input": str, "output": str}). A test list with nothing that can fail scores 0. A list that is neither
    (a mix, a case without both keys) is the dataset's error, not the completion's: a ValueError.
    `entry_point` (a name or a list of names, HumanEval's column): the only names of the completion's that
    assert tests may use; without it, any name a test uses and does not define (a helper the test expects
    from the prompt too, which the completion can then redefine)."""
    sandboxed = check_available(allow_unsandboxed) == "bwrap"
    if not tests:
        return Verdict(0, 0)
    if all(isinstance(t, dict) for t in tests):
        if not all("input" in c and "output" in c for c in tests):
            raise ValueError("tests: a stdin/stdout case needs both 'input' and 'output'")
        return judge_io(code, tests, limits, slot, sandboxed)
    if not all(isinstance(t, str) for t in tests):
        kinds = sorted({type(t).__name__ for t in tests})
        raise ValueError(
            f"tests must be all assert snippets (str) or all stdin/stdout cases (dict), got a mix of {kinds}"
        )
    countable = [_has_assert(t) for t in tests]
    if not any(countable):
        return Verdict(0, len(tests))
    names = [entry_point] if isinstance(entry_point, str) else entry_point
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise ValueError(f"entry_point must be a name or a list of names, got {entry_point!r}")
    return judge_asserts(code, tests, countable, limits, slot, sandboxed, names)


def run_tests(code: str, tests: list, limits: SandboxLimits = SandboxLimits(), *, slot: int = 0,
              allow_unsandboxed: bool = False) -> float:  # fmt: skip
    """Fraction of `tests` the completion's `code` passes (see `judge`)."""
    return judge(code, tests, limits, slot=slot, allow_unsandboxed=allow_unsandboxed).score


def judge_many(jobs: list, limits: SandboxLimits = SandboxLimits(), *, allow_unsandboxed: bool = False,
               workers: int | None = None) -> list:  # fmt: skip
    """`judge(code, tests[, entry_point])` for each tuple in `jobs`, in parallel (one slot per core: its own
    uids and cgroup)."""
    check_available(allow_unsandboxed)
    workers = workers or max(1, min(len(jobs), os.cpu_count() or 1))
    slots = list(range(workers))
    lock = threading.Lock()

    def one(job):
        with lock:
            slot = slots.pop()
        try:
            return judge(*job[:2], limits, slot=slot, allow_unsandboxed=allow_unsandboxed,
                         entry_point=job[2] if len(job) > 2 else None)  # fmt: skip
        finally:
            with lock:
                slots.append(slot)

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, jobs))


def run_many(jobs: list, limits: SandboxLimits = SandboxLimits(), *, allow_unsandboxed: bool = False,
             workers: int | None = None) -> list:  # fmt: skip
    """Scores of `judge_many`."""
    return [v.score for v in judge_many(jobs, limits, allow_unsandboxed=allow_unsandboxed, workers=workers)]
