"""Multi-turn rollouts with tools (grpo_fast.rollout.tools, grpo_fast.rollout.trajectories).

Against independent references: greedy trajectories of SmolLM2-135M-Instruct equal a plain loop written here
(HF `generate` to the end of a turn, the tool run, the conversation re-rendered with the chat template,
generated again), for every engine; the tool mask is exactly the model's tokens; the engine's log-probs are
the training forward's. Every failure a model can cause (malformed call, unknown tool, bad arguments, a
tool that raises, hangs or returns something else than text) ends as an error message in the tool's turn.
"""

import json
import math
import threading

import pytest
import torch
from oracle import NEAR_TIE, assert_greedy_row_equal

from grpo_fast.rollout import tools as T
from grpo_fast.rollout.trajectories import generate_trajectories


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: what to upper-case
    """
    return text.upper()


# ---- parsing --------------------------------------------------------------------------------------------
CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 37, "b": 21}}\n</tool_call>'


def test_parse_hermes_qwen_smollm2_and_llama3_formats():
    assert T.parse_tool_calls("Let me see.\n" + CALL) == (
        "Let me see.",
        [T.ToolCall("multiply", {"a": 37, "b": 21})],
    )
    two = '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]</tool_call>'
    assert T.parse_tool_calls(two)[1] == [T.ToolCall("a", {}), T.ToolCall("b", {"x": 1})]
    llama = '<|python_tag|>{"name": "multiply", "parameters": {"a": 2, "b": 3}}'
    assert T.parse_tool_calls(llama) == ("", [T.ToolCall("multiply", {"a": 2, "b": 3})])
    openai = (
        '<tool_call>{"type": "function", "function": {"name": "f", "arguments": "{\\"k\\": 1}"}}</tool_call>'
    )
    assert T.parse_tool_calls(openai)[1] == [T.ToolCall("f", {"k": 1})]
    assert T.parse_tool_calls("The answer is 5.") == ("The answer is 5.", [])


@pytest.mark.parametrize(
    "text, error",
    [
        ('<tool_call>{"name": "multiply", "arguments": {"a": 1</tool_call>', "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'needs a "name"'),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ("<tool_call>[1, 2]</tool_call>", "must be a JSON object"),
        ('<tool_call>{"name": "f", "arguments": {}}', None),  # cut at the length limit: still read
    ],
)
def test_malformed_calls_carry_their_error(text, error):
    _, calls = T.parse_tool_calls(text)
    assert calls and (error is None and calls[0].error is None or error in (calls[0].error or ""))


# ---- running ----------------------------------------------------------------------------------------------
def boom(x: int) -> str:
    """Fail.

    Args:
        x: anything
    """
    raise RuntimeError(f"no {x}")


def nothing() -> str:
    """Return None."""
    return None


def _run(calls, tools=(multiply, shout, boom, nothing), timeout=5.0):
    return T.run_tool_calls([(T.Toolbox(list(tools)), calls)], timeout)[0]


def test_tool_failures_become_error_messages():
    res = _run(
        [
            T.ToolCall("multiply", {"a": 6, "b": 7}),
            T.ToolCall("divide", {"a": 1}),
            T.ToolCall("multiply", {"a": 6}),
            T.ToolCall("multiply", {"a": 6, "b": 7, "c": 1}),
            T.ToolCall("boom", {"x": 3}),
            T.ToolCall("nothing", {}),
            T.ToolCall("unknown", error="the tool call is not valid JSON"),
            T.ToolCall("shout", {"text": "ok"}),
        ]
    )
    assert [(r.content, r.failed) for r in res[:1] + res[-1:]] == [("42", False), ("OK", False)]
    assert all(r.failed and r.content.startswith("error: ") for r in res[1:-1])
    assert "unknown tool 'divide'" in res[1].content and "multiply" in res[1].content
    assert "bad arguments" in res[2].content and "bad arguments" in res[3].content
    assert "RuntimeError: no 3" in res[4].content
    assert "returned NoneType, expected text" in res[5].content
    assert "not valid JSON" in res[6].content


def test_tool_calls_run_in_parallel_and_a_hung_tool_times_out():
    barrier = threading.Barrier(3, timeout=10)  # passes only when three calls run at once
    release = threading.Event()

    def meet(k: int) -> str:
        """Wait for the others.

        Args:
            k: which
        """
        barrier.wait()
        return str(k)

    def hang() -> str:
        """Never answer."""
        release.wait(30)
        return "late"

    box = T.Toolbox([meet, hang])
    jobs = [
        (box, [T.ToolCall("meet", {"k": 1}), T.ToolCall("hang", {})]),
        (box, [T.ToolCall("meet", {"k": 2})]),
    ]
    jobs.append((box, [T.ToolCall("meet", {"k": 3})]))
    try:
        res = T.run_tool_calls(jobs, timeout_s=3.0)
    finally:
        release.set()
    assert [r.content for r in (res[0][0], res[1][0], res[2][0])] == ["1", "2", "3"]
    assert res[0][1].failed and "timed out after 3 s" in res[0][1].content
    with pytest.raises(ValueError, match="tool_timeout_s"):
        T.run_tool_calls(jobs[:1], timeout_s=0)


def test_bad_tool_declarations_are_named():
    def undocumented(a: int):
        return a

    with pytest.raises(ValueError, match="'undocumented'.*docstring"):
        T.Toolbox([undocumented])
    with pytest.raises(TypeError, match="expected a function"):
        T.Toolbox(["multiply"])
    with pytest.raises(ValueError, match="two tools are named 'multiply'"):
        T.Toolbox([multiply, multiply])


def test_environment_tools_are_its_public_methods():
    class Env:
        def reset(self, **row):
            return None

        def get_reward(self):
            return 1.0

        def _private(self):
            pass

        def look(self) -> str:
            """Look around."""
            return "a room"

    names = sorted(f.__name__ for f in T.environment_tools(Env()))
    assert names == ["look"]


# ---- SmolLM2: trajectories against a plain re-render loop ---------------------------------------------


# SmolLM2-135M-Instruct copies a call it is shown; it then answers after the tool's turn
QUESTIONS = [
    "Repeat exactly, and nothing else: " + CALL,
    "Copy this text exactly:\n" + CALL.replace("37", "12").replace("21", "4"),
]


def plain_loop(model, tok, question, tools, max_new, max_rounds, repetition_penalty=1.0):
    """TRL's way with HF generate, written out: generate a turn, run its calls, re-render the whole
    conversation with the chat template, generate again (under a repetition penalty every token of it is
    context). Returns (full token ids, model-token flags)."""
    template = T.tool_chat_template(tok)
    schemas = [T.tool_schema(f) for f in tools]
    by_name = {f.__name__: f for f in tools}
    conv = [{"role": "user", "content": question}]
    prompt = tok(T.render(tok, conv, schemas, template), add_special_tokens=False).input_ids
    ids, model_tok = list(prompt), [0] * len(prompt)
    for rounds in range(max_rounds + 1):
        budget = max_new - (len(ids) - len(prompt))
        out = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
            max_new_tokens=budget, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
            repetition_penalty=repetition_penalty,
        )[0, len(ids):].tolist()  # fmt: skip
        if tok.eos_token_id in out:
            out = out[: out.index(tok.eos_token_id) + 1]
        ids += out
        model_tok += [1] * len(out)
        text = tok.decode(out, skip_special_tokens=True)
        if "<tool_call>" not in text or out[-1] != tok.eos_token_id or rounds == max_rounds:
            break
        call = json.loads(text.split("<tool_call>")[1].split("</tool_call>")[0])
        conv.append(
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}
        )
        conv.append(
            {"role": "tool", "name": call["name"], "content": str(by_name[call["name"]](**call["arguments"]))}
        )
        again = tok(T.render(tok, conv, schemas, template), add_special_tokens=False).input_ids
        assert again[: len(ids)] == ids, "the re-rendered conversation does not extend the tokens so far"
        if len(again) - len(prompt) >= max_new:
            break
        model_tok += [0] * (len(again) - len(ids))
        ids = again
    return ids, model_tok


def assert_like_plain_loop(
    model, tok, tr, questions, tools, C, rounds, near_tie_ok=False, penalty=1.0, tie=NEAR_TIE
):
    """Trajectory i of `tr` equals `plain_loop` on questions[i] (under repetition penalty `penalty`), token
    for token, and its tool_mask flags exactly the model's tokens; with near_tie_ok a first difference may be
    a near-tie of the model's two best tokens, within `tie` (another engine's summation order, a bf16
    rollout's rounding: oracle.assert_greedy_row_equal)."""
    for i, q in enumerate(questions):
        want, want_model = plain_loop(model, tok, q, tools, C, rounds, penalty)
        m = tr.completion_mask[i].bool()
        p = tr.prompt_ids[i][tr.prompt_mask[i].bool()].tolist()
        got = p + tr.completion_ids[i][m].tolist()
        if near_tie_ok and got != want:
            n = len(p)
            assert_greedy_row_equal(
                model,
                torch.tensor(p),
                torch.tensor(got[n:]),
                torch.tensor(want[n:]),
                tie=tie,
                repetition_penalty=penalty,
            )
            continue
        assert got == want, f"question {i}:\n{tok.decode(got)!r}\nvs\n{tok.decode(want)!r}"
        assert [0] * len(p) + tr.tool_mask[i][m].tolist() == want_model


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["native", "reference"])
def test_greedy_trajectories_equal_the_plain_loop(smollm2, engine):
    model, tok = smollm2
    tr = generate_trajectories(
        model, tok, [[{"role": "user", "content": q}] for q in QUESTIONS], 1, 90, tools=[multiply],
        temperature=0.0, engine=engine, max_tool_calling_iterations=2,
    )  # fmt: skip
    assert_like_plain_loop(model, tok, tr, QUESTIONS, [multiply], 90, 2)
    for i in range(len(QUESTIONS)):
        m = tr.completion_mask[i].bool()
        p = tr.prompt_ids[i][tr.prompt_mask[i].bool()].tolist()
        got = p + tr.completion_ids[i][m].tolist()
        assert tr.tool_calls[i] == 1 and tr.tool_failures[i] == 0 and tr.turns[i] == 2
        assert tr.messages[i][1] == {
            "role": "tool",
            "name": "multiply",
            "content": str(37 * 21 if i == 0 else 48),
        }
        # the engine's log-probs of the model's tokens are the training forward's (greedy: T = 1)
        with torch.no_grad():
            logits = model(torch.tensor([got])).logits[0, len(p) - 1 : -1].double()
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(got[len(p) :])[:, None]).squeeze(1)
        on = tr.tool_mask[i][m].bool()
        torch.testing.assert_close(tr.logprobs[i][m][on].double(), ref[on], atol=2e-4, rtol=0)
        assert (tr.logprobs[i][m][~on] == 0).all()


@pytest.mark.slow
def test_a_trajectory_that_keeps_calling_ends_at_the_limits(smollm2):
    model, tok = smollm2
    calls = []

    def multiply(a: int, b: int) -> str:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        calls.append((a, b))
        return "call me again with the same arguments: " + CALL  # a loop the model may follow

    prompt = [[{"role": "user", "content": QUESTIONS[0]}]]
    tr = generate_trajectories(
        model, tok, prompt, 1, 400, tools=[multiply], temperature=0.0, engine="reference",
        max_tool_calling_iterations=0,
    )  # fmt: skip
    assert tr.tool_calls == [0] and tr.turns == [1] and tr.tool_mask[0].all()  # the call is never run
    tr = generate_trajectories(
        model, tok, prompt, 1, 60, tools=[multiply], temperature=0.0, engine="reference",
        max_tool_calling_iterations=5,
    )  # fmt: skip
    assert int(tr.completion_mask.sum()) <= 60  # the length limit counts the tool's turns too
    with pytest.raises(ValueError, match="max_tool_calling_iterations"):
        generate_trajectories(model, tok, prompt, 1, 8, tools=[multiply], max_tool_calling_iterations=-1)


@pytest.mark.slow
def test_environments_one_per_trajectory(smollm2):
    model, tok = smollm2
    made = []

    class Counter:
        def __init__(self):
            self.calls, self.row = 0, None
            made.append(self)

        def reset(self, **row):
            self.row = row
            return " (from the environment)" if row["tag"] == "obs" else None

        def multiply(self, a: int, b: int) -> int:
            """Multiply two integers.

            Args:
                a: the first factor
                b: the second factor
            """
            self.calls += 1
            return a * b

    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS]
    rows = [{"prompt": prompts[0], "tag": "plain"}, {"prompt": prompts[1], "tag": "obs"}]
    tr = generate_trajectories(
        model, tok, prompts, 2, 80, environment_factory=Counter, rows=rows, temperature=0.0,
        engine="reference", max_tool_calling_iterations=1,
    )  # fmt: skip
    assert len(made) == 4 and tr.environments == made
    assert [e.row["tag"] for e in made] == ["plain", "plain", "obs", "obs"]
    assert [e.calls for e in made] == tr.tool_calls
    assert tr.prompts[2][-1]["content"].endswith("(from the environment)")
    assert "(from the environment)" in tr.texts[1]


# ---- the trainer: --tools / --environment ----------------------------------------------------------------
TOOLS_FILE = '''
import json
import math

def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


class Shop:
    """One per rollout: counts its calls, pays 1 when the model called the tool."""

    def reset(self, **row):
        self.calls = 0

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        self.calls += 1
        return a * b

    def get_reward(self):
        return float(self.calls > 0)


def seen(prompts, completions, environments=None, **kw):
    with open(LOG, "a") as f:
        f.write(json.dumps({"completions": completions, "envs": environments is not None}) + "\\n")
    return [float(any(m["role"] == "tool" for m in c)) for c in completions]
'''


@pytest.mark.slow
@pytest.mark.parametrize("how", ["tools", "environment"])
def test_train_multi_turn_trains_on_the_model_tokens_only(smollm2, tmp_path, monkeypatch, how):
    import grpo_fast.trainer.step as step_mod
    from grpo_fast.tasks.smollm2 import build
    from grpo_fast.trainer.config import parse_config
    from grpo_fast.trainer.train import train

    log = tmp_path / "log.jsonl"
    tools = tmp_path / "shop_tools.py"
    tools.write_text(f"LOG = {str(log)!r}\n" + TOOLS_FILE)
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": [{"role": "user", "content": q}]}) for q in QUESTIONS))
    seen_masks = []
    real_loss = step_mod.policy_loss

    def spy(model, batch, loss_mask, *args):
        seen_masks.append((batch[3].clone(), loss_mask.clone()))
        return real_loss(model, batch, loss_mask, *args)

    monkeypatch.setattr(step_mod, "policy_loss", spy)
    rollouts = []
    real_rollout = step_mod.multi_turn_rollout
    monkeypatch.setattr(
        step_mod,
        "multi_turn_rollout",
        lambda run, rows, generator=None: rollouts.append(real_rollout(run, rows, generator)) or rollouts[-1],
    )
    which = ["--tools", f"{tools}:multiply"] if how == "tools" else ["--environment", f"{tools}:Shop"]
    argv = [
        "--model", str(build()), "--dataset", str(data), "--reward", f"{tools}:seen", *which,
        "--output-dir", str(tmp_path / "run"), "--num-generations", "2", "--prompts-per-step", "1",
        "--max-completion-length", "128", "--max-steps", "1", "--save-steps", "0", "--temperature", "0.3",
        "--max-tool-calling-iterations", "1", "--eval-max-samples", "0", "--learning-rate", "1e-6",
        "--no-skip-zero-advantage-groups",  # both samples may call the tool (equal rewards): trained anyway
    ]  # fmt: skip
    train(parse_config(argv))
    assert seen_masks, "the loss never ran"
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 1 and all(math.isfinite(r["loss"]) for r in steps)
    assert all(
        r["tools/call_frequency"] > 0 and r["turns_mean"] > 1 and r["tool_tokens_mean"] > 0 for r in steps
    )
    # the loss sees the model's tokens only; the tools' are attended (in the completion mask)
    for (attended, loss_mask), ro in zip(seen_masks, rollouts):
        torch.testing.assert_close(attended, ro.completion_mask)
        torch.testing.assert_close(loss_mask, ro.completion_mask * ro.tool_mask)
        assert (ro.completion_mask * (1 - ro.tool_mask)).sum() > 0
        model_tokens = float((ro.completion_mask * ro.tool_mask).sum()) / len(ro.tool_mask)
    assert steps[-1]["completion_len_mean"] == pytest.approx(model_tokens)
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    assert all(
        isinstance(c, list) and c[0]["role"] == "assistant" for call in calls for c in call["completions"]
    )
    assert all(call["envs"] == (how == "environment") for call in calls)
    if how == "environment":
        assert "rewards/Shop_mean" in steps[0]


def test_bad_tools_and_environment_flags_are_named(tmp_path):
    from grpo_fast.trainer.config import parse_config
    from grpo_fast.trainer.setup import load_tools

    f = tmp_path / "t.py"
    f.write_text("def nodoc(a: int):\n    return a\n\nclass NoReset:\n    pass\n")
    with pytest.raises(ValueError, match="--tools .*no function 'missing'"):
        load_tools(parse_config(["--tools", f"{f}:missing"]))
    with pytest.raises(ValueError, match="'nodoc'.*docstring"):
        load_tools(parse_config(["--tools", f"{f}:nodoc"]))
    with pytest.raises(ValueError, match="--environment .*NoReset has no reset"):
        load_tools(parse_config(["--environment", f"{f}:NoReset"]))
    with pytest.raises(ValueError, match="max_tool_calling_iterations"):
        parse_config(["--max-tool-calling-iterations", "-1"])
    with pytest.raises(ValueError, match="tool_timeout_s"):
        parse_config(["--tool-timeout-s", "0"])


@pytest.mark.slow
def test_native_rows_keep_their_kv_cache_across_turns(smollm2, monkeypatch):
    """Sampled (T = 1), G = 3, one tool slower than the other so rows run at different turns in one batch:
    the model's forward runs once (the prompts' prefill; every later token, tool turns included, goes onto
    the rows' own KV caches), and every model token's log-prob is the training forward's."""
    import time

    model, tok = smollm2

    def multiply(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        time.sleep(0.5 if a == 12 else 0.0)
        return a * b

    forwards = []
    real_forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: forwards.append(1) or real_forward(*a, **k))
    g = torch.Generator().manual_seed(3)
    tr = generate_trajectories(
        model, tok, [[{"role": "user", "content": q}] for q in QUESTIONS], 3, 80, tools=[multiply],
        temperature=1.0, engine="native", generator=g, max_tool_calling_iterations=2,
    )  # fmt: skip
    assert len(forwards) == 1
    assert sum(tr.tool_calls) >= 2 and max(tr.turns) >= 2
    monkeypatch.setattr(model, "forward", real_forward)
    for i in range(6):
        m = tr.completion_mask[i].bool()
        p = tr.prompt_ids[i // 3][tr.prompt_mask[i // 3].bool()].tolist()
        seq = p + tr.completion_ids[i][m].tolist()
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0, len(p) - 1 : -1].double()
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(seq[len(p) :])[:, None]).squeeze(1)
        on = tr.tool_mask[i][m].bool()
        torch.testing.assert_close(tr.logprobs[i][m][on].double(), ref[on], atol=5e-4, rtol=0)
        # each tool turn is exactly the template's rendering of that call's result
        spans = (on[1:] != on[:-1]).nonzero().squeeze(1).tolist()
        assert len(spans) == 2 * sum(msg["role"] == "tool" for msg in tr.messages[i])


# ---- the embedded multi-turn task (make demo-tools) -------------------------------------------------------
def test_calculator_refuses_what_is_not_arithmetic():
    from grpo_fast.tasks.tools_task import calculator

    assert calculator("6 * 8 - 9") == "39" and calculator("-(2 + 3) * 4 // 3") == "-7"
    for bad in ["2 ** 99999", "__import__('os').system('true')", "1e9", "(1, 2)", "x + 1", "9" * 80, "1 / 2"]:
        with pytest.raises((ValueError, SyntaxError)):
            calculator(bad)
    res = T.run_tool_calls(
        [(T.Toolbox([calculator]), [T.ToolCall("calculator", {"expression": "2 ** 9"})])], 5
    )
    assert res[0][0].failed and "only integers" in res[0][0].content


def test_embedded_tools_task_base_model_calls_the_tool_and_trains(tmp_path):
    import random

    from grpo_fast.tasks import default_task, tools_task
    from grpo_fast.trainer.config import parse_config
    from grpo_fast.trainer.modeling import load_tokenizer
    from grpo_fast.trainer.train import train

    # the teacher's conversations, rendered by the shipped tokenizer's template, are what rollouts produce
    tok = load_tokenizer(str(tools_task.ASSET_DIR))
    rng = random.Random(0)
    msgs = next(m for m in (tools_task.noisy_conversation((6, 8, 9), rng) for _ in range(50)) if len(m) == 3)
    question = {"role": "user", "content": default_task.prompt_text((6, 8, 9))}
    text = T.render(tok, [question, *msgs], [T.tool_schema(tools_task.calculator)], None, False)
    assert tok.unk_token_id not in tok(text, add_special_tokens=False).input_ids
    turn = text.split("?", 1)[1].split("<eos>")[0]
    assert T.parse_tool_calls(turn)[1] == [T.ToolCall("calculator", {"expression": "6 * 8 - 9"})]
    argv = [
        "--task", "shop-tools", "--output-dir", str(tmp_path / "run"), "--max-steps", "3",
        "--save-steps", "0", "--eval-steps", "0", "--eval-max-samples", "16", "--prompts-per-step", "4",
        "--num-generations-eval", "2",
    ]  # fmt: skip
    train(parse_config(argv))
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 3 and sum(r["tools/call_frequency"] for r in steps) > 0
    evals = [r for r in records if "eval_accuracy" in r]
    assert len(evals) == 2 and all(0 <= r["eval_accuracy"] <= 1 for r in evals)
    # sampled multi-turn trajectories, two a prompt: a prompt with a paid sample counts once in pass@2
    assert all(0 <= r["eval_sampled_accuracy"] <= r["eval_pass_at_n"] <= 1 for r in evals)


@pytest.fixture(scope="module")
def tiny_tool_model():
    """The demo's tiny base model, taught for a few dozen steps to always call the calculator: a small
    Llama that calls a tool greedily."""
    import random

    from transformers import AutoModelForCausalLM

    from grpo_fast.tasks import default_task, tools_task
    from grpo_fast.trainer.modeling import load_tokenizer

    torch.manual_seed(0)
    tok = load_tokenizer(str(tools_task.ASSET_DIR))
    model = AutoModelForCausalLM.from_pretrained(tools_task.ASSET_DIR, dtype=torch.float32)
    rng, problems = random.Random(0), default_task.split_problems()["train"]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(40):
        texts = []
        for p in rng.sample(problems, 32):
            conv = [
                {"role": "user", "content": default_task.prompt_text(p)},
                {"role": "assistant", "content": "", "tool_calls": [tools_task.call(*p)]},
                {"role": "tool", "name": "calculator", "content": str(default_task.answer(*p))},
                {
                    "role": "assistant",
                    "content": tools_task.think(default_task.answer(*p), default_task.answer(*p)),
                },
            ]
            texts.append(T.render(tok, conv, [T.tool_schema(tools_task.calculator)], None, False))
        tok.padding_side = "left"
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        pos = (enc.attention_mask.cumsum(-1) - 1).clamp(min=0)
        labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
        loss = model(
            input_ids=enc.input_ids, attention_mask=enc.attention_mask, position_ids=pos, labels=labels
        ).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), tok


@pytest.mark.parametrize("engine", ["native", "reference"])
def test_tiny_model_greedy_trajectories_equal_the_plain_loop(tiny_tool_model, engine):
    from grpo_fast.tasks import default_task, tools_task

    model, tok = tiny_tool_model
    problems = default_task.split_problems()["eval"][:6]
    questions = [default_task.prompt_text(p, k % 2) for k, p in enumerate(problems)]
    tr = generate_trajectories(
        model, tok, questions, 1, 40, tools=[tools_task.calculator], temperature=0.0, engine=engine,
        max_tool_calling_iterations=2,
    )  # fmt: skip
    assert sum(tr.tool_calls) == len(questions)  # every one called the tool
    assert_like_plain_loop(model, tok, tr, questions, [tools_task.calculator], 40, 2)


def test_tiny_model_bf16_trajectories_carry_their_bf16_kv_across_turns(tiny_tool_model, monkeypatch):
    """A bf16 rollout's rows keep their bf16 KV across tool turns (each turn's tokens run onto it): greedy
    trajectories equal HF's plain loop in fp32 where bf16's margin allows (oracle: 0.03 of the top logit)."""
    from grpo_fast.rollout import native
    from grpo_fast.tasks import default_task, tools_task

    model, tok = tiny_tool_model
    problems = default_task.split_problems()["eval"][:6]
    questions = [default_task.prompt_text(p, k % 2) for k, p in enumerate(problems)]
    extended, extend = [], native.NativeEngine._extend
    monkeypatch.setattr(
        native.NativeEngine,
        "_extend",
        lambda self, b, *a: extended.append(b.comp_k[0].dtype) or extend(self, b, *a),
    )
    tr = generate_trajectories(
        model, tok, questions, 1, 40, tools=[tools_task.calculator], temperature=0.0, engine="native",
        max_tool_calling_iterations=2, rollout_dtype="bf16",
    )  # fmt: skip
    assert sum(tr.tool_calls) == len(questions)
    assert len(extended) >= len(questions) and set(extended) == {torch.bfloat16}  # turns onto bf16 KV
    assert_like_plain_loop(
        model, tok, tr, questions, [tools_task.calculator], 40, 2, near_tie_ok=True, tie=0.03
    )


@pytest.mark.parametrize("engine", ["native", "reference"])
def test_tiny_model_greedy_trajectories_under_a_repetition_penalty_equal_the_plain_loop(
    tiny_tool_model, engine
):
    """Under a repetition penalty the tool's turns are context too: the native engine (each row's KV and
    seen tokens carried across its turns) and the reference one (each turn resubmitted) equal HF `generate`
    on the re-rendered conversation, whose input holds every token so far."""
    from grpo_fast.tasks import default_task, tools_task

    model, tok = tiny_tool_model
    problems = default_task.split_problems()["eval"][:6]
    questions = [default_task.prompt_text(p, k % 2) for k, p in enumerate(problems)]
    kw = dict(tools=[tools_task.calculator], temperature=0.0, engine=engine, max_tool_calling_iterations=2)
    tr = generate_trajectories(model, tok, questions, 1, 40, repetition_penalty=2.0, **kw)
    assert sum(tr.tool_calls) >= len(questions) // 2  # the penalty leaves it calling the tool
    assert_like_plain_loop(model, tok, tr, questions, [tools_task.calculator], 40, 2, penalty=2.0)
    plain = generate_trajectories(model, tok, questions, 1, 40, **kw)
    assert not torch.equal(plain.completion_ids, tr.completion_ids)  # the penalty acted


def test_chat_template_kwargs_reach_every_rendering_of_a_trajectory(tiny_tool_model, monkeypatch):
    """chat_template_kwargs (TRL's; e.g. Qwen3's enable_thinking): the prompt and each tool turn rendered
    with them. A template that writes a marker where `mark` is set: after the generation prompt, so the
    prompt ends with it and so does a tool's turn (rendered with and without the tool message, compared);
    and a trajectory whose model calls its tool hands the kwargs to every tool turn it renders."""
    from transformers import AutoModelForCausalLM

    from grpo_fast.tasks import default_task, tools_task
    from grpo_fast.trainer.modeling import load_tokenizer

    tok = load_tokenizer(str(tools_task.ASSET_DIR))
    model = AutoModelForCausalLM.from_pretrained(tools_task.ASSET_DIR, dtype=torch.float32).eval()
    template = T.CHATML_TOOLS_TEMPLATE + "{% if mark and add_generation_prompt %}MARKED{% endif %}"
    prompt = [[{"role": "user", "content": "What is 6 times 7?"}]]
    texts = {}
    for kw in (None, {"mark": True}):
        tr = generate_trajectories(
            model, tok, prompt, 2, 8, tools=[multiply], chat_template=template, chat_template_kwargs=kw,
            temperature=0.0, engine="reference",
        )  # fmt: skip
        texts[bool(kw)] = tr.texts[0]
    assert texts[True] == texts[False] + "MARKED"
    tool = [{"role": "tool", "name": "multiply", "content": "42"}]
    plain = T.tool_turn_ids(tok, template, tool, [tok.eos_token_id])
    marked = T.tool_turn_ids(tok, template, tool, [tok.eos_token_id], {"mark": True})
    assert len(marked) > len(plain) and marked[: len(plain)] == plain  # the marker's tokens after the turn
    # the tool turns of a real trajectory: the kwargs reach each (a kwarg its template ignores, so the tiny
    # model calls its calculator as trained)
    seen, real = [], T.tool_turn_ids
    monkeypatch.setattr(T, "tool_turn_ids", lambda *a: seen.append(a[4]) or real(*a))
    tool_model, tool_tok = tiny_tool_model
    question = default_task.prompt_text(default_task.split_problems()["eval"][0], 0)
    tr = generate_trajectories(
        tool_model, tool_tok, [question], 1, 40, tools=[tools_task.calculator], temperature=0.0,
        chat_template_kwargs={"unused": True}, max_tool_calling_iterations=1,
    )  # fmt: skip
    assert tr.tool_calls[0] == 1 and seen == [{"unused": True}]
