"""What runs inside the sandboxes of grpo_fast/rewards/judge.py (its source is passed to `python -I -S -c`;
stdlib only; the trainer imports it only for its constants and source). One of three roles, the first
argument:

  serve FD_IN FD_OUT   the completion's sandbox: exec the completion (from stdin), then answer the judge's
                       requests (a name, an attribute, a call, ...) with plain data or opaque handles
  judge FD_IN FD_OUT FD_VERDICT
                       the judge's sandbox: run each test (from stdin) in a namespace whose missing names are
                       the completion's, forwarded; one verdict byte per test on FD_VERDICT
  io FD_RESULT         the completion's sandbox for stdin/stdout cases: the program once per case, as a
                       process of its own (any way of reading stdin works); one frame per case on FD_RESULT

Frames between the sandboxes: 4-byte big-endian length, then `marshal` data (builtin: no import, exact
types, big ints, NaN, complex, bytes and sets as they are), at most MAX_FRAME bytes, walked and validated on
receipt. Values cross as plain data of exact types (None, bool, int, float, complex, str, bytes, list, tuple,
dict, set, frozenset), bounded in depth and element count; anything else stays in the completion's sandbox
as a handle, sent as the marker (Ellipsis, number). Malformed data from the completion can at worst end the
judge's sandbox, which fails the completion's tests.
"""

import builtins
import importlib
import marshal
import os
import struct
import sys

MAX_FRAME = 1 << 20
MAX_NODES = 100_000
MAX_DEPTH = 64
MAX_OUTPUT = 1 << 20  # a stdin/stdout case's output, bytes
_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_CONTAINERS = (list, tuple, set, frozenset)


# ---------------------------------------------------------------------------------------------------------
# Frames and values
# ---------------------------------------------------------------------------------------------------------
def send(fd, obj):
    data = marshal.dumps(obj, 4)
    if len(data) > MAX_FRAME:
        raise ValueError("frame too large")
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(fd, data) :]


def _read_exact(fd, n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def recv(fd):
    (n,) = struct.unpack(">I", _read_exact(fd, 4))
    if n > MAX_FRAME:
        raise ValueError("frame too large")
    return marshal.loads(_read_exact(fd, n))


def enc(v, to_handle, budget, depth=0):
    """A value with what is not plain data of exact types replaced by handle markers, `to_handle(v)` giving
    the number (None: refuse)."""
    budget[0] -= 1
    if budget[0] < 0 or depth > MAX_DEPTH:
        raise ValueError("value too large or too deep")
    t = type(v)
    if t in _SCALARS:
        return v
    if t in _CONTAINERS:
        return t(enc(x, to_handle, budget, depth + 1) for x in v)
    if t is dict:
        return {
            enc(k, to_handle, budget, depth + 1): enc(x, to_handle, budget, depth + 1) for k, x in v.items()
        }
    if to_handle is None:
        raise TypeError("not plain data: " + t.__name__)
    return (Ellipsis, to_handle(v))


def dec(x, from_handle, budget, depth=0):
    """Received data checked to be of exact plain types, handle markers turned into `from_handle(number)`;
    anything else raises ValueError."""
    budget[0] -= 1
    if budget[0] < 0 or depth > MAX_DEPTH:
        raise ValueError("value too large or too deep")
    t = type(x)
    if t in _SCALARS:
        return x
    if t is tuple and len(x) == 2 and x[0] is Ellipsis:
        if type(x[1]) is not int or from_handle is None:
            raise ValueError("malformed handle")
        return from_handle(x[1])
    if t in _CONTAINERS:
        return t(dec(e, from_handle, budget, depth + 1) for e in x)
    if t is dict:
        return {
            dec(k, from_handle, budget, depth + 1): dec(e, from_handle, budget, depth + 1)
            for k, e in x.items()
        }
    raise ValueError("malformed value")


# ---------------------------------------------------------------------------------------------------------
# serve: the completion's side
# ---------------------------------------------------------------------------------------------------------
_BINARY = {"add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and_", "or_", "xor", "lshift",
           "rshift"}  # fmt: skip
_UNARY = {"neg": lambda a: -a, "pos": lambda a: +a, "abs": abs, "invert": lambda a: ~a}
# the object's own value as a number (`float(obj)`): that answers for the object, not for a comparison
_CONVERSIONS = {"int": lambda a: int(a), "float": lambda a: float(a), "index": lambda a: a.__index__()}
_PLAIN_TYPES = {*_SCALARS, *_CONTAINERS, dict}


def serve(fd_in, fd_out):
    import operator

    code = sys.stdin.read()
    sys.stdin.close()
    ns = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(code, "<completion>", "exec"), ns)
        broken = None
    except BaseException as exc:  # noqa: BLE001 - the completion's own failure fails every test that uses it
        broken = type(exc).__name__
    objects = []

    def to_handle(v):
        objects.append(v)
        return len(objects) - 1

    def from_handle(i):
        return objects[i]

    def arg(x):
        return dec(x, from_handle, [MAX_NODES])

    def answer(value):
        return {"r": enc(value, to_handle, [MAX_NODES])}

    def answer_object(value):
        """An operator's result on the completion's objects: only ever another of its objects, never plain
        data, so no operator (`obj - expected`) can produce a value that answers the test's comparison."""
        if type(value) in _PLAIN_TYPES:
            raise TypeError("an operator on a completion's object gave plain data")
        return {"r": (Ellipsis, to_handle(value))}

    while True:
        try:
            req = recv(fd_in)
        except (EOFError, OSError, ValueError):
            os._exit(0)
        try:
            op = req["op"]
            if broken is not None:
                raise RuntimeError(broken)
            if op == "get":
                if req["name"] not in ns or req["name"].startswith("__"):
                    send(fd_out, {"missing": True})
                    continue
                reply = answer(ns[req["name"]])
            else:
                target = arg(req["a"])
                if op == "attr":
                    reply = answer(getattr(target, req["name"]))
                elif op == "setattr":
                    setattr(target, req["name"], arg(req["b"]))
                    reply = answer(None)
                elif op == "call":
                    kwargs = {k: arg(v) for k, v in req["k"]}
                    reply = answer(target(*[arg(x) for x in req["args"]], **kwargs))
                elif op == "getitem":
                    reply = answer(target[arg(req["b"])])
                elif op == "setitem":
                    target[arg(req["b"])] = arg(req["c"])
                    reply = answer(None)
                elif op == "delitem":
                    del target[arg(req["b"])]
                    reply = answer(None)
                elif op == "len":
                    reply = answer(int(len(target)))
                elif op == "list":  # iteration, materialized (bounded by the frame)
                    items = []
                    for x in target:
                        items.append(x)
                        if len(items) > MAX_NODES:
                            raise ValueError("too many items")
                    reply = answer(items)
                elif op == "bool":
                    reply = answer(bool(target))
                elif op in ("str", "repr"):
                    reply = answer((str if op == "str" else repr)(target)[:MAX_OUTPUT])
                elif op == "binop" and req["name"] in _BINARY:
                    reply = answer_object(getattr(operator, req["name"])(target, arg(req["b"])))
                elif op == "unop" and req["name"] in _CONVERSIONS:
                    reply = answer(_CONVERSIONS[req["name"]](target))
                elif op == "unop":
                    reply = answer_object(_UNARY[req["name"]](target))
                else:
                    raise ValueError("unknown op")
        except BaseException as exc:  # noqa: BLE001 - raised by the completion: the test sees its type
            reply = {"e": type(exc).__name__[:100]}
        try:
            send(fd_out, reply)
        except (ValueError, TypeError, OSError):
            try:
                send(fd_out, {"e": "ValueError"})
            except OSError:
                os._exit(0)


# ---------------------------------------------------------------------------------------------------------
# judge: the tests' side
# ---------------------------------------------------------------------------------------------------------
class RemoteError(Exception):
    """An exception of the completion's that is not a builtin exception type."""


_NOT_FORWARDED = {"SystemExit", "KeyboardInterrupt", "GeneratorExit", "StopIteration", "StopAsyncIteration"}


def _holds_handle(v, handle_type) -> bool:
    stack = [v]
    while stack:
        x = stack.pop()
        t = type(x)
        if t is handle_type:
            return True
        if t in (list, tuple, set, frozenset):
            stack.extend(x)
        elif t is dict:
            stack.extend(x.keys())
            stack.extend(x.values())
    return False


def judge(fd_in, fd_out, fd_verdict):
    job = marshal.loads(sys.stdin.buffer.read())  # the trainer's
    sys.stdin.close()
    tests, names = job["tests"], job["names"]  # names: the only ones forwarded (None: any the test lacks)
    used = [0]

    def remote(req):
        """One request to the completion's sandbox; its value, or its exception raised here."""
        used[0] += 1
        send(fd_out, req)
        reply = recv(fd_in)
        if type(reply) is not dict or len(reply) != 1:
            raise RemoteError("malformed reply")
        if "e" in reply:
            name = reply["e"]
            cls = getattr(builtins, name, None) if type(name) is str and name not in _NOT_FORWARDED else None
            if isinstance(cls, type) and issubclass(cls, Exception):
                raise cls("raised by the completion")
            raise RemoteError(str(name)[:100])
        if "missing" in reply:
            raise KeyError
        if "r" not in reply:
            raise RemoteError("malformed reply")
        return dec(reply["r"], Handle, [MAX_NODES])

    def handle_id(v):  # what a test sends that is not plain data: only the completion's own objects
        if type(v) is not Handle:
            raise TypeError("only plain data and the completion's objects can be passed to it")
        return object.__getattribute__(v, "_id")

    def h(v):
        return enc(v, handle_id, [MAX_NODES])

    def typed(value, t):
        if type(value) is not t:
            raise RemoteError("reply of the wrong type")
        return value

    class Handle:
        """An object of the completion's that is not plain data: its uses are forwarded; it never compares
        equal to anything and cannot be hashed. A call gives plain data only, unless the handle is a name
        the test spelled capitalized (a class: `Stack()` gives an instance): so no function or method can hand
        back an object whose own methods (`.startswith(expected)`) or conversions answer for it."""

        __slots__ = ("_id", "_constructs")

        def __init__(self, i, constructs=False):
            object.__setattr__(self, "_id", i)
            object.__setattr__(self, "_constructs", constructs)

        def __getattr__(self, name):
            return remote({"op": "attr", "a": h(self), "name": name})

        def __setattr__(self, name, value):
            remote({"op": "setattr", "a": h(self), "name": name, "b": h(value)})

        def __call__(self, *args, **kwargs):
            value = remote({"op": "call", "a": h(self), "args": [h(x) for x in args],
                            "k": [[k, h(v)] for k, v in kwargs.items()]})  # fmt: skip
            if object.__getattribute__(self, "_constructs") or not _holds_handle(value, Handle):
                return value
            if type(value) is Handle:  # an iterator, a generator: its items only, each plain data
                return Items(value)
            raise TypeError("a function or method of the completion's returned an object, not plain data")

        def __getitem__(self, key):
            return remote({"op": "getitem", "a": h(self), "b": h(key)})

        def __setitem__(self, key, value):
            remote({"op": "setitem", "a": h(self), "b": h(key), "c": h(value)})

        def __delitem__(self, key):
            remote({"op": "delitem", "a": h(self), "b": h(key)})

        def __len__(self):
            n = typed(remote({"op": "len", "a": h(self)}), int)
            if n < 0:
                raise RemoteError("negative length")
            return n

        def __iter__(self):
            return iter(typed(remote({"op": "list", "a": h(self)}), list))

        def __contains__(self, x):  # decided here over its items: no `__contains__` of its own says yes
            return any(x == item for item in self)

        def __bool__(self):
            return typed(remote({"op": "bool", "a": h(self)}), bool)

        def __str__(self):
            return typed(remote({"op": "str", "a": h(self)}), str)

        def __repr__(self):
            return typed(remote({"op": "repr", "a": h(self)}), str)

        def __eq__(self, other):
            return False

        def __ne__(self, other):
            return True

        __hash__ = None

        def __lt__(self, other):
            raise TypeError("a completion's object is not ordered here")

        __le__ = __gt__ = __ge__ = __lt__

    class Items:
        """What a function of the completion's returned that is not plain data (a generator): it can only be
        iterated, its items crossing as plain data (compared here); no method, operator, truth or length."""

        __slots__ = ("_handle",)

        def __init__(self, handle):
            object.__setattr__(self, "_handle", handle)

        def __iter__(self):
            items = typed(remote({"op": "list", "a": h(object.__getattribute__(self, "_handle"))}), list)
            if _holds_handle(items, Handle):
                raise TypeError("an item of the completion's iterator is not plain data")
            return iter(items)

        def __bool__(self):
            raise TypeError("the truth of a completion's iterator is not decided")

        def __eq__(self, other):
            return False

        def __ne__(self, other):
            return True

        __hash__ = None

    def binop(name, swap=False):
        def f(self, other):
            """Between two of the completion's objects only (`V(1) + V(2)`): an operand of the test's (an
            expected value) never reaches the completion, and the result is another handle."""
            if type(other) is not Handle:
                return NotImplemented
            a, b = (other, self) if swap else (self, other)
            return remote({"op": "binop", "name": name, "a": h(a), "b": h(b)})

        return f

    for name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
                 "lshift", "rshift"):  # fmt: skip
        dunder = "and_" if name == "and" else "or_" if name == "or" else name
        setattr(Handle, f"__{name}__", binop(dunder))
        setattr(Handle, f"__r{name}__", binop(dunder, swap=True))
    for name in ("neg", "pos", "abs", "invert"):
        setattr(Handle, f"__{name}__", lambda self, n=name: remote({"op": "unop", "name": n, "a": h(self)}))
    Handle.__int__ = lambda self: typed(remote({"op": "unop", "name": "int", "a": h(self)}), int)
    Handle.__float__ = lambda self: typed(remote({"op": "unop", "name": "float", "a": h(self)}), float)
    Handle.__index__ = lambda self: typed(remote({"op": "unop", "name": "index", "a": h(self)}), int)

    class Namespace(dict):
        """A test's globals: its own names and the builtins first, the standard library's modules (a test
        that uses `math` without importing it gets the judge's, never a `math` the completion defines), then
        the completion's names (forwarded)."""

        def __missing__(self, name):
            if hasattr(builtins, name):
                raise KeyError(name)
            if name in sys.stdlib_module_names:
                value = importlib.import_module(name)
            elif names is not None and name not in names:
                raise KeyError(name)  # not one the sample forwards: a NameError, as for any undefined name
            else:
                value = remote({"op": "get", "name": name})
                if type(value) is Handle:
                    object.__setattr__(value, "_constructs", name[:1].isupper())
            self[name] = value
            return value

    for test in tests:
        before = used[0]
        try:
            ns = Namespace(__name__="__test__", __builtins__=builtins)
            exec(compile(test, "<test>", "exec"), ns)
            verdict = b"P" if used[0] > before else b"U"  # passed / passed without using the completion
        except BaseException:  # noqa: BLE001 - a failed assert, an error, anything: the test failed
            verdict = b"F"
        os.write(fd_verdict, verdict)


def _reap_orphans():
    """This runtime is its sandbox's PID 1: what the program's processes orphan is reaped here."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


# ---------------------------------------------------------------------------------------------------------
# io: stdin/stdout cases
# ---------------------------------------------------------------------------------------------------------
def io(fd_result):
    import ctypes
    import subprocess

    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: the program's processes cannot read ours
    job = marshal.loads(sys.stdin.buffer.read())  # the trainer's
    sys.stdin.close()
    os.set_inheritable(fd_result, False)  # the program's processes never hold the result channel
    os.makedirs("tmp", exist_ok=True)  # the working directory: /work in the sandbox, a fresh one without
    with open("prog.py", "w") as f:
        f.write(job["code"])
    for k, case in enumerate(job["inputs"]):
        path = f"tmp/.in{k}"
        with open(path, "w") as f:
            f.write(case)
        with open(path) as stdin:
            argv = [sys.executable, "-I", "-S", "prog.py"]
            proc = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            out = proc.stdout.read(MAX_OUTPUT + 1)
            if len(out) > MAX_OUTPUT:
                proc.kill()
            proc.stdout.close()
            status = proc.wait()
        _reap_orphans()
        ok = status == 0 and len(out) <= MAX_OUTPUT
        out = out[:MAX_OUTPUT]
        os.write(fd_result, (b"0" if ok else b"1") + struct.pack(">I", len(out)) + out)


if __name__ == "__main__":
    role, fds = sys.argv[1], [int(x) for x in sys.argv[2:]]
    {"serve": serve, "judge": judge, "io": io}[role](*fds)
