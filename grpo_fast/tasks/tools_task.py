"""The embedded multi-turn task (`make demo-tools`): the shop problems of grpo_fast.tasks.default_task with a
`calculator` tool.

    "A shop has 6 boxes of 8 items and sells 9 . How many items are left ?"  -> 39
    model:  <tool_call> {"name": "calculator", "arguments": {"expression": "6 * 8 - 9"}} </tool_call> <eos>
    tool:   <tool_response> 39 </tool_response>
    model:  <think> 39 </think> 39 <eos>

The base model (built by `scripts/build_base_model.py --task shop-tools`, shipped in
`grpo_fast/tasks/assets/shop-tools-base`) learned from a noisy teacher that calls the calculator 40% of the
time and otherwise answers in its head, where it cannot multiply (its product is off by 1 or 2); after the
tool's answer it reads it right 30% of the time, one too high 55%, and writes another number otherwise.
Sampling is right about an eighth of the time, greedy hardly ever: the tool is the only way to the answer,
and GRPO can learn to call it every time and to read it. Same problems and held-out split as the default
task.
"""

import ast
import operator
import random
from pathlib import Path

from grpo_fast.tasks import default_task as shop  # absolute: --tools loads this file by its path

ASSET_DIR = Path(__file__).resolve().parent / "assets" / "shop-tools-base"
TOOL_NAME = "calculator"
# A chat template for the word-level tokenizer: the tools' names, the user's question, assistant turns (a
# call as <tool_call> JSON </tool_call>) each ending in <eos>, a tool's answer as <tool_response>.
CHAT_TEMPLATE = (
    "{%- if tools %}<tools>{% for t in tools %} {{ t['function']['name'] }}{% endfor %} </tools> {% endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}{{ m['content'] }}"
    "{%- elif m['role'] == 'assistant' %} {% if m['content'] %}{{ m['content'] }} {% endif %}"
    "{%- for c in m.get('tool_calls') or [] %}<tool_call> {{ c['function'] | tojson }} </tool_call> "
    "{%- endfor %}<eos>"
    "{%- elif m['role'] == 'tool' %} <tool_response> {{ m['content'] }} </tool_response>"
    "{%- endif %}{%- endfor %}"
)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def _eval(node):
    if isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) < 10**6:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    raise ValueError("only integers and + - * // are allowed")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with + - * and //.

    Args:
        expression: the expression, e.g. "6 * 8 - 9"
    """
    if len(expression) > 64:
        raise ValueError("expression longer than 64 characters")
    return str(_eval(ast.parse(expression, mode="eval").body))


def call(a: int, b: int, c: int) -> dict:
    expression = f"{a} * {b} - {c}"
    return {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"expression": expression}}}


def think(result: int, final: int) -> str:
    return f"<think> {result} </think> {final}"


def noisy_conversation(p, rng: random.Random) -> list[dict]:
    """The noisy teacher's messages after the question (see the module docstring)."""
    a, b, c = p
    prod, res = a * b, a * b - c
    u = rng.random()
    if rng.random() < 0.6:  # no tool: in its head, where it cannot multiply (a product off by 1 or 2)
        wrong = prod + rng.choice([-2, -1, 1, 2])
        return [{"role": "assistant", "content": shop.completion_text(a, b, c, wrong, wrong - c, wrong - c)}]
    if u < 0.30:
        final = think(res, res)
    elif u < 0.85:  # reads the tool's answer one too high
        final = think(res + 1, res + 1)
    else:
        other = res + rng.choice([-2, -1, 2])
        final = think(other, other)
    return [
        {"role": "assistant", "content": "", "tool_calls": [call(a, b, c)]},
        {"role": "tool", "name": TOOL_NAME, "content": str(res)},
        {"role": "assistant", "content": final},
    ]


def dataset_rows(split: str) -> list[dict]:
    """The default task's rows (prompt text and answer), for multi-turn rollouts with the tool."""
    return shop.dataset_rows(split)


def vocabulary() -> list[str]:
    """The default task's words, the template's markers, and the JSON of every call as whitespace words:
    {"name": "calculator", "arguments": {"expression": "6 * 8 - 9"}}."""
    words = ["<tools>", "</tools>", TOOL_NAME, "<tool_call>", "</tool_call>", "<tool_response>"]
    words += ["</tool_response>", '{"name":', '"calculator",', '"arguments":', '{"expression":']
    words += [f'"{i}' for i in range(100)] + [f'{i}"}}}}' for i in range(100)]
    return shop.vocabulary() + words
