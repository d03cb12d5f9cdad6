"""Tools for multi-turn rollouts, with TRL's interfaces: `tools=[callables]` (schemas from type hints and
docstrings, transformers' `get_json_schema`) and `environment_factory` (one object per trajectory,
`reset(**row)`, its public methods are its tools, optional `get_reward()`).

Everything the model writes is hostile: a malformed call, an unknown tool, wrong arguments, a tool that
raises, runs past its time or returns something that is not text each become an error message in the tool's
turn (the model can learn from it), never a crash. Tool calls of all trajectories run at once, each in its own
daemon thread bounded by `timeout_s` (a tool still running after it is abandoned; tools that run model-written
code belong in the code sandbox, `grpo_fast.rewards.sandbox`, which kills its process).

Tool-call formats parsed (`parse_tool_calls`): Hermes / Qwen / SmolLM2 `<tool_call>{json}</tool_call>` (one
object or a list per tag) and Llama 3 JSON (`{"name": ..., "parameters": ...}` as the whole message, after an
optional `<|python_tag|>`). Tokenizers with a `response_template` are parsed by transformers' own
`parse_response`.
"""

import inspect
import json
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

MAX_RESULT_CHARS = (
    4000  # a tool's answer longer than this is cut (the trajectory's length limit still applies)
)
RESERVED_METHODS = ("reset", "get_reward")  # an environment's methods that are not tools

# A ChatML template with tools (Hermes / Qwen 2.5 style: tool schemas in the system turn, calls in
# <tool_call> tags, results as <tool_response> in a user turn), for tokenizers whose own template ignores
# tools (SmolLM2's). Written for this project.
CHATML_TOOLS_TEMPLATE = (Path(__file__).resolve().parent / "chatml_tools.jinja").read_text()


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    error: str | None = None  # why the call could not be read (then it is not run)


@dataclass
class ToolResult:
    name: str
    content: str
    failed: bool


# --------------------------------------------------------------------------------------------------------
# Declaring tools
# --------------------------------------------------------------------------------------------------------
def tool_schema(fn) -> dict:
    """The OpenAI-style JSON schema of a function (transformers' `get_json_schema`: type hints and a
    Google-style docstring with an `Args:` section)."""
    from transformers.utils import get_json_schema

    if not callable(fn):
        raise TypeError(f"tools: expected a function, got {type(fn).__name__} {fn!r}")
    try:
        return get_json_schema(fn)
    except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException
        name = getattr(fn, "__name__", repr(fn))
        raise ValueError(
            f"tools: cannot read the schema of {name!r} ({e}); a tool needs type hints on every argument and "
            "a docstring with a description and an Args: section"
        ) from None


def environment_tools(env) -> list:
    """An environment's tools: its public methods but reset / get_reward, as bound methods."""
    out = []
    for name, member in inspect.getmembers(type(env), callable):
        if name.startswith("_") or name in RESERVED_METHODS:
            continue
        out.append(getattr(env, name))
    return out


class Toolbox:
    """The tools of one trajectory by name, with their schemas (what the chat template renders)."""

    def __init__(self, tools):
        self.functions, self.schemas = {}, []
        for fn in tools or ():
            schema = tool_schema(fn)
            name = schema["function"]["name"]
            if name in self.functions:
                raise ValueError(f"tools: two tools are named {name!r}")
            self.functions[name] = fn
            self.schemas.append(schema)

    def __bool__(self):
        return bool(self.functions)

    def call(self, call: ToolCall) -> ToolResult:
        """Run one call in this thread; every failure becomes its error text."""
        if call.error:
            return ToolResult(call.name or "unknown", f"error: {call.error}", True)
        fn = self.functions.get(call.name)
        if fn is None:
            known = ", ".join(sorted(self.functions)) or "none"
            return ToolResult(call.name, f"error: unknown tool {call.name!r} (tools: {known})", True)
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as e:
            return ToolResult(call.name, f"error: bad arguments for {call.name}: {e}", True)
        try:
            value = fn(**call.arguments)
        except Exception as e:  # the tool's own failure: the model sees it
            return ToolResult(call.name, f"error: {call.name} raised {type(e).__name__}: {e}", True)
        if isinstance(value, bool) or isinstance(value, (int, float)):
            value = str(value)  # a scalar has one text
        if not isinstance(value, str):
            return ToolResult(
                call.name, f"error: {call.name} returned {type(value).__name__}, expected text", True
            )
        return ToolResult(call.name, value[:MAX_RESULT_CHARS], False)


def run_tool_calls(jobs, timeout_s: float) -> list[list[ToolResult]]:
    """Run every (toolbox, calls) job's calls at once, each in a daemon thread given `timeout_s` seconds:
    the results per job in call order (a call past its time: an error result; its thread is abandoned)."""
    if timeout_s is None or not timeout_s > 0:
        raise ValueError(f"tool_timeout_s must be a positive number of seconds, got {timeout_s!r}")
    slots = [[None] * len(calls) for _, calls in jobs]
    threads = []
    for j, (box, calls) in enumerate(jobs):
        for k, call in enumerate(calls):

            def work(j=j, k=k, box=box, call=call):
                slots[j][k] = box.call(call)

            t = threading.Thread(target=work, daemon=True, name=f"tool-{call.name}")
            t.start()
            threads.append((t, j, k, call))
    deadline = time.monotonic() + timeout_s
    for t, j, k, call in threads:
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive() or slots[j][k] is None:
            slots[j][k] = ToolResult(call.name, f"error: {call.name} timed out after {timeout_s:g} s", True)
    return slots


# --------------------------------------------------------------------------------------------------------
# Reading calls from the model's text
# --------------------------------------------------------------------------------------------------------
_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _one_call(obj) -> ToolCall:
    if not isinstance(obj, dict):
        return ToolCall("unknown", error=f"a tool call must be a JSON object, got {json.dumps(obj)[:200]}")
    if "function" in obj and isinstance(obj["function"], dict):  # {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # OpenAI style: arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(name, str) or not name:
        return ToolCall("unknown", error='a tool call needs a "name" string')
    if not isinstance(args, dict):
        return ToolCall(name, error=f'the "arguments" of {name} must be a JSON object')
    return ToolCall(name, args)


def _json_calls(text: str) -> list[ToolCall]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return [ToolCall("unknown", error=f"the tool call is not valid JSON ({e.msg} at char {e.pos})")]
    return [_one_call(o) for o in obj] if isinstance(obj, list) else [_one_call(obj)]


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(the message's text without its calls, the calls) of one assistant turn. A turn with no call gives [];
    a call that cannot be read is a ToolCall with its error (the model is told)."""
    if "<tool_call>" in text:
        calls = [c for body in _HERMES.findall(text) for c in _json_calls(body.strip())]
        content = text[: text.index("<tool_call>")].rstrip()
        return content, calls
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>") :].strip()
    if body.startswith("{") and '"name"' in body:  # Llama 3: the whole message is the call
        calls = _json_calls(body)
        if not calls[0].error:
            return "", calls
    return text, []


def calls_as_messages(calls: list[ToolCall]) -> list[dict]:
    """The `tool_calls` field of an assistant message, as chat templates render it."""
    return [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


# --------------------------------------------------------------------------------------------------------
# Rendering: the chat template with tools, a tool turn's tokens
# --------------------------------------------------------------------------------------------------------
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe_tool",
        "description": "p",
        "parameters": {"type": "object", "properties": {}},
    },
}


def tool_chat_template(tokenizer, chat_template: str | None = None) -> str:
    """The chat template that renders tools: `chat_template` when given, the tokenizer's own when it renders
    them, else grpo-fast's ChatML one for ChatML tokenizers (SmolLM2's ignores tools)."""
    if chat_template:
        return chat_template
    own = getattr(tokenizer, "chat_template", None)
    if own:
        probe = [{"role": "user", "content": "hi"}]
        kw = dict(tokenize=False, add_generation_prompt=True, chat_template=own)
        if tokenizer.apply_chat_template(probe, tools=[_PROBE_TOOL], **kw) != tokenizer.apply_chat_template(
            probe, **kw
        ):
            return own
    if "<|im_start|>" in tokenizer.get_vocab():
        return CHATML_TOOLS_TEMPLATE
    raise ValueError(
        "tools: this tokenizer's chat template does not render tools and it is not a ChatML tokenizer; pass "
        "a chat template that does (chat_template=)"
    )


def render(tokenizer, messages, schemas, template, add_generation_prompt=True, **template_kwargs) -> str:
    """The conversation through the chat template (`template_kwargs`: TRL's chat_template_kwargs)."""
    return tokenizer.apply_chat_template(
        messages, tools=schemas or None, chat_template=template, tokenize=False,
        add_generation_prompt=add_generation_prompt, **template_kwargs,
    )  # fmt: skip


def tool_turn_ids(tokenizer, template, tool_messages, eos_ids, template_kwargs=None) -> list[int]:
    """The tokens of the tool's turn after the model's turn ended (at its EOS), through the next generation
    prompt: the template rendered with and without `tool_messages` after a short conversation, compared."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    head = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    enc = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    kw = template_kwargs or {}
    before = enc(render(tokenizer, head, None, template, add_generation_prompt=False, **kw))
    after = enc(render(tokenizer, head + tool_messages, None, template, **kw))
    ends = [i for i, t in enumerate(before) if t in eos_ids]
    if ends:  # the model's turn ends at its EOS; what the template writes after it belongs to the tool's turn
        before = before[: ends[-1] + 1]
    if after[: len(before)] != before:
        raise ValueError(
            "tools: the chat template does not render a tool's turn as a continuation of the conversation "
            "(the tokens before it change); pass one that does (chat_template=)"
        )
    return after[len(before) :]


# --------------------------------------------------------------------------------------------------------
# A tool that runs model-written code: in the code reward's sandbox
# --------------------------------------------------------------------------------------------------------
TOOL_SLOT0 = 64  # the code tool's sandbox slots (uids, cgroups) start here: never a reward judge's


def python_tool(limits=None, *, allow_unsandboxed: bool = False, slots: int | None = None):
    """A `python(code)` tool: the program runs in the code reward's sandbox (grpo_fast.rewards.sandbox:
    bubblewrap, no network, its own uid, bounded CPU / memory / processes / time, killed whole at the end)
    and its stdout comes back as the tool's answer (an error and its stderr-free reason when it fails or is
    stopped). Concurrent calls take distinct slots (one per core by default). Refuses to start where the
    sandbox cannot run, unless `allow_unsandboxed` (limits only)."""
    import os

    from ..rewards.judge import run_io
    from ..rewards.sandbox import SandboxLimits, check_available

    limits = limits or SandboxLimits()
    sandboxed = check_available(allow_unsandboxed) == "bwrap"
    free = list(range(TOOL_SLOT0, TOOL_SLOT0 + (slots or os.cpu_count() or 1)))
    ready = threading.Semaphore(len(free))
    lock = threading.Lock()

    def python(code: str) -> str:
        """Run a Python program and return what it prints.

        Args:
            code: the program's source
        """
        with ready:
            with lock:
                slot = free.pop()
            try:
                outputs, failure = run_io(code, [""], limits, slot, sandboxed)
            finally:
                with lock:
                    free.append(slot)
        if failure or not outputs:
            raise RuntimeError(f"the program stopped: {failure or 'no output'}")
        ok, out = outputs[0]
        if not ok:
            raise RuntimeError(f"the program failed; its output: {out[:500]}")
        return out

    return python
