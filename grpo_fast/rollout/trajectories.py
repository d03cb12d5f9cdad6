"""Multi-turn rollouts: G trajectories per prompt in which the model may call tools, behind one interface,
`generate_trajectories`, for every engine.

A trajectory is one token sequence after its prompt: model turns and tool turns interleaved. A model turn ends
at EOS; when its text holds tool calls (grpo_fast.rollout.tools), the calls of all trajectories run at once,
the tool's turn (the chat template's rendering of the results, through the next generation prompt) is
appended as tokens and the model goes on. A trajectory ends at EOS without a call, at the length limit
(`max_new_tokens`, counted over the whole trajectory, tool turns included: a tool turn that would not fit
ends it as it is) or after `max_tool_calling_iterations` tool rounds. Tokens are concatenated, never
re-tokenized: what the model sampled is what the trainer scores. `tool_mask` is 1 on the model's tokens, 0 on
the tools'.

The native engine keeps each row's KV cache across its turns: a row that ends a turn with a call waits while
its tools run (in a thread; the other rows decode on), the tool's turn is run onto the row's own KV cache
(the conversation is never prefilled again; the prompt KV stays shared by the group) and the row decodes on
in the same batch as rows at other turns. On the other engines (and the native one with carry_kv=False),
every turn after the first is one `generate_groups` call over the trajectories still going, each from its
whole conversation so far: the reference engine prefills it again, vLLM finds its prefix in its cache.
With an environment whose `reset` returns text (TRL: appended to the prompt's last message), the group's
prompts differ: the group keeps their common tokens as its prompt and each trajectory starts with the rest of
its own (tool_mask 0).
"""

import threading
from concurrent import futures
from dataclasses import dataclass

import torch

from . import native
from . import tools as tools_mod
from .sampling import check_counts


@dataclass
class Trajectories:
    prompt_ids: torch.Tensor  # (n, P) left-padded: each group's common prompt tokens
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor  # (n * G, C') every token after the prompt, model's and tools'
    completion_mask: torch.Tensor  # 1 on every real token (attended)
    tool_mask: torch.Tensor  # 1 on the model's tokens, 0 on the tools' (and the prompts' own tails)
    logprobs: torch.Tensor  # (n * G, C') fp32, the engine's log-probs of the model's tokens, 0 elsewhere
    messages: list  # per trajectory: the assistant and tool messages after the prompt
    prompts: list  # per trajectory: the prompt's messages (with an environment's reset text)
    texts: list  # per prompt: the rendered prompt (chat template, tools)
    environments: list | None  # per trajectory, with environment_factory
    tool_calls: list  # per trajectory: calls made
    tool_failures: list  # per trajectory: calls that ended in an error
    turns: list  # per trajectory: model turns


def _as_messages(prompt):
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def _left_pad(seqs, pad_id, device):
    P = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), P), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), P, dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, P - len(s) :] = torch.tensor(s)
            mask[i, P - len(s) :] = 1
    return ids.to(device), mask.to(device)


def _common_prefix(seqs):
    n = min(len(s) for s in seqs)
    for k in range(n):
        if any(s[k] != seqs[0][k] for s in seqs[1:]):
            return k
    return n


def _parse_turn(tokenizer, ids, prefix, schemas) -> tuple[str, list]:
    """(content, calls) of one model turn: transformers' parser when the tokenizer has a response template,
    else grpo_fast.rollout.tools' formats."""
    if getattr(tokenizer, "response_template", None) is not None:
        try:
            msg = tokenizer.parse_response(ids, prefix=prefix, tools=schemas or None)
            calls = [tools_mod._one_call(c.get("function", c)) for c in (msg.get("tool_calls") or [])]
            return msg.get("content") or "", calls
        except Exception:  # a malformed call: read it as text with our parser, which names the error
            pass
    return tools_mod.parse_tool_calls(tokenizer.decode(ids, skip_special_tokens=True))


class _Turns:
    """The trajectories' state between turns, whatever engine decodes them: each trajectory's tokens after
    its prompt, model-token flags, log-probs, messages and counts. Also the native engine's turn hook
    (`start` / `finish`, see NativeEngine.generate): tools run in a thread while the other rows decode."""

    def __init__(self, tokenizer, boxes, template, eos_ids, C, limit, timeout_s, template_kwargs=None):
        self.tok, self.boxes, self.template, self.eos_ids = tokenizer, boxes, template, eos_ids
        self.template_kwargs = template_kwargs or {}
        self.C, self.limit, self.timeout_s = C, limit, timeout_s
        N = len(boxes)
        self.messages = [[] for _ in range(N)]
        self.calls, self.fails, self.turns = [0] * N, [0] * N, [0] * N

    def model_turn(self, t, new, logps) -> list:
        """Record trajectory t's model turn (tokens `new`); returns the calls to run now ([]: none)."""
        content, calls = _parse_turn(self.tok, new, self.prefix[t] + self.comp[t], self.boxes[t].schemas)
        self.comp[t] += new
        self.tmask[t] += [1] * len(new)
        self.logps[t] += logps
        self.turns[t] += 1
        self.turn_at[t] = len(self.comp[t])
        msg = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = tools_mod.calls_as_messages(calls)
        self.messages[t].append(msg)
        ended = bool(new) and new[-1] in self.eos_ids
        if calls and ended and self.turns[t] - 1 < self.limit and len(self.comp[t]) < self.C:
            self.calls[t] += len(calls)
            return calls
        return []

    def tool_turn(self, t, results) -> list | None:
        """Trajectory t's tool turn from the results: its tokens, or None when the model would have no room
        left to answer (the trajectory ends as it is)."""
        self.fails[t] += sum(r.failed for r in results)
        tool_msgs = [{"role": "tool", "name": r.name, "content": r.content} for r in results]
        turn = tools_mod.tool_turn_ids(self.tok, self.template, tool_msgs, self.eos_ids, self.template_kwargs)
        if len(self.comp[t]) + len(turn) >= self.C:
            return None
        self.comp[t] += turn
        self.tmask[t] += [0] * len(turn)
        self.logps[t] += [0.0] * len(turn)
        self.turn_at[t] = len(self.comp[t])
        self.messages[t] += tool_msgs
        return turn

    # ---- the native engine's hook: rows keep their KV cache; a row's tools run while the others decode
    def start(self, t, tokens):
        calls = self.model_turn(t, tokens[self.turn_at[t] :], [])  # log-probs: from the engine at the end
        if not calls:
            return None
        fut = futures.Future()
        box, timeout = self.boxes[t], self.timeout_s

        def run():
            fut.set_result(tools_mod.run_tool_calls([(box, calls)], timeout)[0])

        threading.Thread(target=run, daemon=True, name=f"tools-{t}").start()
        return fut

    def finish(self, t, fut):
        return self.tool_turn(t, fut.result())

    def finish_native(self, ids, mask, logp):
        """The engine's rows: a last turn it did not report (cut at the length limit), the log-probs."""
        for t in range(len(self.comp)):
            row = ids[t][mask[t].bool()].tolist()
            if len(row) > len(self.comp[t]):
                self.model_turn(t, row[len(self.comp[t]) :], [])
            self.logps[t] = logp[t][: len(self.comp[t])].tolist()


def _resubmitting_turns(st, model, prompt_ids, prompt_mask, G, eos, engine, generator, pad, device, opts):
    """Every engine: each turn one `generate_groups` call over the trajectories still going, each from its
    whole conversation so far (the group's shared prompt on the first)."""
    from . import generate_groups

    active = list(range(len(st.comp)))
    first = True
    while active:
        budget = {t: st.C - len(st.comp[t]) for t in active}
        if first and not any(st.comp):  # the group shares its prompt
            out = generate_groups(
                model, prompt_ids, prompt_mask, G, st.C, eos_token_id=eos, engine=engine,
                generator=generator, return_logprobs=True, **opts,
            )  # fmt: skip
        else:
            ids, mask = _left_pad([st.prefix[t] + st.comp[t] for t in active], pad, device)
            out = generate_groups(
                model, ids, mask, 1, max(budget.values()), eos_token_id=eos, engine=engine,
                generator=generator, return_logprobs=True, **{**opts, "share_prefix": False},
            )  # fmt: skip
        first = False
        c_ids, c_mask, c_logp = (x.cpu() for x in out)
        pending = []
        for k, t in enumerate(active):
            m = c_mask[k].bool()
            new = c_ids[k][m].tolist()[: budget[t]]
            calls = st.model_turn(t, new, c_logp[k][m].tolist()[: len(new)])
            if calls:
                pending.append((t, calls))
        results = tools_mod.run_tool_calls([(st.boxes[t], calls) for t, calls in pending], st.timeout_s)
        active = [t for (t, _), res in zip(pending, results) if st.tool_turn(t, res) is not None]


@torch.no_grad()
def generate_trajectories(
    model,
    tokenizer,
    prompts,
    num_generations,
    max_new_tokens,
    *,
    tools=None,
    environment_factory=None,
    rows=None,
    max_tool_calling_iterations=None,
    tool_timeout_s=10.0,
    chat_template=None,
    chat_template_kwargs=None,
    max_prompt_length=None,
    eos_token_id=None,
    engine="auto",
    generator=None,
    carry_kv=True,
    **generate_options,
) -> Trajectories:
    """G multi-turn trajectories per prompt; trajectory s belongs to prompt s // G.

    Args:
        model, tokenizer: a Hugging Face causal LM and its tokenizer.
        prompts: n conversations (lists of messages) or strings (one user message each).
        num_generations: G. max_new_tokens: C, the longest trajectory after its prompt, tool turns included.
        tools: callables with type hints and docstrings (TRL's `tools=`), shared by every trajectory.
        environment_factory: callable returning one environment per trajectory (TRL's): `reset(**row)` gets
            the dataset row (and may return text appended to the prompt's last message), its public methods
            are tools.
        rows: the n dataset rows (for `reset`); default {"prompt": prompt}.
        max_tool_calling_iterations: tool rounds per trajectory (None: until the length limit).
        tool_timeout_s: seconds each tool call may run.
        chat_template: a template that renders tools (default: the tokenizer's when it does, else ChatML's).
        chat_template_kwargs: extra keyword arguments of the chat template (TRL's), every rendering.
        max_prompt_length: rendered prompts are cut to their last this many tokens.
        eos_token_id: int or list of ints ending a model turn (default: the tokenizer's).
        carry_kv: native engine: each row keeps its KV cache across its turns (True), or every turn is a new
            call from the whole conversation (False: what the other engines do; for comparison).
        engine, generator, **generate_options: as `generate_groups` (temperature, top_p, top_k, compile,
            rollout_dtype, vllm_options, share_prefix, all_done).
    """
    from . import resolve_engine

    if max_tool_calling_iterations is not None and (
        isinstance(max_tool_calling_iterations, bool) or not isinstance(max_tool_calling_iterations, int)
        or max_tool_calling_iterations < 0
    ):  # fmt: skip
        raise ValueError(
            f"max_tool_calling_iterations must be None or an int >= 0, got {max_tool_calling_iterations!r}"
        )
    if environment_factory is not None and not callable(environment_factory):
        raise TypeError(f"environment_factory must be callable, got {type(environment_factory).__name__}")
    check_counts(num_generations, max_new_tokens)
    G, C = num_generations, max_new_tokens
    n = len(prompts)
    rows = rows if rows is not None else [{"prompt": p} for p in prompts]
    if len(rows) != n:
        raise ValueError(f"rows must hold one dataset row per prompt ({n}), got {len(rows)}")
    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos])
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos_ids))
    limit = float("inf") if max_tool_calling_iterations is None else max_tool_calling_iterations

    # 1. environments, toolboxes, prompts
    envs = [environment_factory() for _ in range(n * G)] if environment_factory else None
    boxes, convs = [], []
    for t in range(n * G):
        own = list(tools or ())
        conv = _as_messages(prompts[t // G])
        if envs:
            env = envs[t]
            if not callable(getattr(env, "reset", None)):
                raise TypeError(f"environment_factory made a {type(env).__name__} without a reset() method")
            obs = env.reset(**rows[t // G])
            if obs is not None:
                if not isinstance(obs, str):
                    raise TypeError(f"{type(env).__name__}.reset() must return None or text, got {type(obs)}")
                conv = conv[:-1] + [{**conv[-1], "content": conv[-1]["content"] + obs}]
            own += tools_mod.environment_tools(env)
        boxes.append(tools_mod.Toolbox(own))
        convs.append(conv)
    any_tools = any(boxes)
    template = tools_mod.tool_chat_template(tokenizer, chat_template) if any_tools else chat_template
    enc = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    full = []  # per trajectory: its prompt tokens
    rendered = {}
    for t in range(n * G):
        key = (t // G, repr(convs[t]))
        if key not in rendered:
            if template or getattr(tokenizer, "chat_template", None):
                text = tools_mod.render(
                    tokenizer, convs[t], boxes[t].schemas, template, **(chat_template_kwargs or {})
                )
            else:
                text = convs[t][-1]["content"]
            ids = enc(text)
            rendered[key] = (text, ids[-max_prompt_length:] if max_prompt_length else ids)
        full.append(rendered[key][1])
    common = [_common_prefix(full[g * G : (g + 1) * G]) for g in range(n)]
    prompt_ids, prompt_mask = _left_pad([full[g * G][: common[g]] for g in range(n)], pad, device)
    texts = [rendered[(g, repr(convs[g * G]))][0] for g in range(n)]

    st = _Turns(tokenizer, boxes, template, eos_ids, C, limit, tool_timeout_s, chat_template_kwargs)
    st.comp = [list(full[t][common[t // G] :]) for t in range(n * G)]  # a prompt's own tail: not the model's
    st.tmask = [[0] * len(c) for c in st.comp]
    st.logps = [[0.0] * len(c) for c in st.comp]
    st.prefix = [full[t][: common[t // G]] for t in range(n * G)]
    st.turn_at = [len(c) for c in st.comp]  # where each trajectory's current model turn starts

    # 2. turns
    kind, _ = resolve_engine(model, engine)
    tails = any(st.comp)
    if kind == "native" and carry_kv and not tails:  # each row's KV cache carried across its turns
        out = native.engine_for(model).generate(
            prompt_ids, prompt_mask, G, C, eos_token_id=eos, generator=generator, return_logprobs=True,
            turn_hook=st, **{"top_p": 1.0, "top_k": 0, "temperature": 1.0, "share_prefix": True,
                             "all_done": None, **generate_options},
        )  # fmt: skip
        st.finish_native(*(x.cpu() for x in out))
    else:
        _resubmitting_turns(st, model, prompt_ids, prompt_mask, G, eos, engine, generator, pad, device,
                            generate_options)  # fmt: skip
    comp, tmask, logps, messages = st.comp, st.tmask, st.logps, st.messages
    calls_n, fails_n, turns = st.calls, st.fails, st.turns

    # 3. (n * G, C') tensors, right-padded
    width = max(1, max(len(c) for c in comp))
    out_ids = torch.full((n * G, width), pad, dtype=torch.long)
    out_mask = torch.zeros(n * G, width, dtype=torch.long)
    out_tool = torch.zeros(n * G, width, dtype=torch.long)
    out_lp = torch.zeros(n * G, width, dtype=torch.float32)
    for t in range(n * G):
        L = len(comp[t])
        if L:
            out_ids[t, :L] = torch.tensor(comp[t])
            out_mask[t, :L] = 1
            out_tool[t, :L] = torch.tensor(tmask[t])
            out_lp[t, :L] = torch.tensor(logps[t])
    return Trajectories(
        prompt_ids, prompt_mask, out_ids.to(device), out_mask.to(device), out_tool.to(device),
        out_lp.to(device), messages, convs, texts, envs, calls_n, fails_n, turns,
    )  # fmt: skip
