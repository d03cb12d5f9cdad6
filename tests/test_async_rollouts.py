"""Asynchronous GRPO's rollout source (grpo_fast.trainer.rollouts.Ahead) with a stand-in producer and push:
the staleness of every trained batch, the bound, the drop counts, the order of versions and rows, errors.

The producer records the version the weights had while it generated (read under the same lock the push takes),
so the staleness the source reports is checked against what actually happened, not against its own counter."""

import json
import threading
import time

import pytest

from grpo_fast.trainer.rollouts import Ahead


class World:
    """Weights that a push changes; a producer that records under which weights each batch was generated."""

    def __init__(self, gen_s=0.0, fail_at=None):
        self.weights = 0  # the version the "server" holds
        self.generated = {}  # step j -> weights version it was generated under
        self.gen_s, self.fail_at = gen_s, fail_at
        self.pushes = []

    def produce(self, j):
        if j == self.fail_at:
            raise RuntimeError(f"server died generating batch {j}")
        seen = self.weights
        time.sleep(self.gen_s)
        assert self.weights == seen, "a push ran during a generation"
        self.generated[j] = seen
        return [f"row{j}"], f"rollout{j}", {"pos": j + 1}

    def push(self, step):
        self.weights += 1  # the version the source will report: batches trained
        self.pushes.append(step)
        return {"sync/seconds": 0.0}


def train(source, world, steps, start=0, train_s=0.0):
    got = []
    for step in range(start, start + steps):
        rows, ro, m = source.next()
        got.append((rows, ro, m["async/staleness"], m["async/dropped_groups"]))
        time.sleep(train_s)
        source.after_update(step + 1)
    source.close()
    return got


@pytest.mark.parametrize("S", [0, 1, 2])
def test_staleness_exact_and_bounded(S):
    world = World(gen_s=0.01)
    source = Ahead(world.produce, world.push, version=0, max_staleness=S, groups_per_batch=4)
    got = train(source, world, 8, train_s=0.02)
    # every step trains its own batch, in order, each once
    assert [g[0] for g in got] == [[f"row{j}"] for j in range(8)]
    assert [g[1] for g in got] == [f"rollout{j}" for j in range(8)]
    # staleness = the trainer's version at step j (= j) minus the weights the batch was generated under
    for j, g in enumerate(got):
        assert g[2] == j - world.generated[j]
        assert 0 <= g[2] <= S
    assert all(g[3] == 0 for g in got)
    assert world.pushes == list(range(1, 9))
    if S == 0:
        assert all(g[2] == 0 for g in got)  # synchronous: the batch of step j sees the weights of step j


def test_generation_runs_ahead_when_allowed():
    # S=1, generation slower than training: the batch of step j+1 is generated while step j trains, so after
    # the first step every batch is one version old
    world = World(gen_s=0.03)
    source = Ahead(world.produce, world.push, version=0, max_staleness=1, groups_per_batch=1)
    got = train(source, world, 6, train_s=0.03)
    assert [g[2] for g in got] == [0, 1, 1, 1, 1, 1]


def test_stale_batches_dropped_and_counted():
    world = World()
    source = Ahead(world.produce, world.push, version=0, max_staleness=1, groups_per_batch=4)
    deadline = time.monotonic() + 5
    while len(source.ready) < 2 and time.monotonic() < deadline:  # batches 0 and 1 generated at version 0
        time.sleep(0.01)
    source.after_update(1)
    source.after_update(2)  # versions moved twice without training: batches 0 and 1 are now 2 versions old
    rows, _, m = source.next()
    assert world.generated[0] == world.generated[1] == 0
    assert m["async/dropped_groups"] == 8 and source.dropped_batches == 2
    assert rows == ["row2"] and m["async/staleness"] <= 1
    source.close()


def test_resume_position_is_the_trained_batch():
    world = World()
    source = Ahead(world.produce, world.push, version=3, max_staleness=2, groups_per_batch=1)
    rows, _, _ = source.next()
    assert rows == ["row3"]
    time.sleep(0.05)  # the thread draws ahead
    assert source.sampler_state() == {"pos": 4}  # not the position of what was drawn ahead
    source.close()


def test_producer_error_reaches_the_trainer():
    world = World(fail_at=1)
    source = Ahead(world.produce, world.push, version=0, max_staleness=1, groups_per_batch=1)
    source.next()
    source.after_update(1)
    with pytest.raises(RuntimeError, match="server died generating batch 1"):
        source.next()
    source.close()
    assert not source.thread.is_alive()


def test_close_stops_the_thread():
    world = World()
    source = Ahead(world.produce, world.push, version=0, max_staleness=1, groups_per_batch=1)
    source.close()
    assert not source.thread.is_alive()
    assert not any(t.name == "grpo-fast-rollouts" and t.is_alive() for t in threading.enumerate())


def test_no_batch_past_the_last_and_versions_count_batches():
    world = World()
    closed = []
    source = Ahead(world.produce, world.push, version=0, max_staleness=2, groups_per_batch=1, last=4,
                   on_close=lambda: closed.append(True))  # fmt: skip
    for k in range(4):
        source.next()
        source.after_update(2 * (k + 1))  # num_iterations 2: two optimizer steps per batch, one version
    source.thread.join(timeout=5)
    assert not source.thread.is_alive() and sorted(world.generated) == [0, 1, 2, 3]
    assert source.version == 4 and world.pushes == [2, 4, 6, 8]
    source.close()
    assert closed == [True]


COLOCATED = [
    ("model", "shop", False),
    ("bf16", "shop", False),
    ("model", "shop-tools", False),
    ("model", "shop", True),
]


@pytest.mark.parametrize("rollout_dtype,task,budget", COLOCATED)
def test_colocated_samples_come_from_the_version_they_report(
    tmp_path, monkeypatch, rollout_dtype, task, budget
):
    """--max-staleness 1 with the native engine in this process: each step trains samples that the
    generation thread drew from its own copy of the weights. The engine's log-probs of every sampled token
    equal, to fp32 rounding, those transformers computes here under the weights of the version the step
    reports (the initial model or that step's checkpoint), and not those of the next version; the
    rollout-mismatch correction is on (the samples may be off-policy). With --rollout-dtype bf16 the thread
    decodes a bf16 copy of its copy: transformers' forward of the version's weights in bf16 is the reference,
    to bf16 rounding, and still tells the versions apart. shop-tools: multi-turn trajectories with the
    calculator tool, made whole on the thread; transformers reads each one (tool turns included) and the
    model's tokens are compared, the tool's are out of the loss. budget: under --max-memory-gb, planned with
    the thread's copy of the weights and its rollout counted (tests/test_estimate.py checks that estimate)."""
    import torch
    from versions import assert_sampled_by, assert_tools_ran, train_recording, version_argv

    from grpo_fast.tasks import default_task, tools_task
    from grpo_fast.trainer.config import parse_config

    tools = task == "shop-tools"
    # a high temperature: the embedded model's groups are often one answer 4 times (the tools model: one that
    # still writes well-formed calls)
    G, steps, T_ = 4, 4, 1.5 if tools else 3.0
    argv = version_argv(tmp_path, G, steps, T_) + [
        "--task", task, "--max-completion-length", "48" if tools else "10", "--max-staleness", "1",
        "--rollout-dtype", rollout_dtype,
    ]  # fmt: skip
    if budget:  # room for the process growing during a test session
        from grpo_fast.trainer.estimate import PLAN_MARGIN, Estimator

        peak = Estimator(parse_config(argv)).estimate()["peak"]
        argv += ["--max-memory-gb", f"{(peak + 2**29) / PLAN_MARGIN / 2**30:.3f}"]
    records, made = train_recording(monkeypatch, argv)
    out = tmp_path / "run"
    if budget:
        plan = json.loads((out / "config.json").read_text())["resolved"]["memory_plan"]
        assert plan["estimated_peak_mib"] > 0
    assert all("loss/is_ratio_mean" in r for r in records)  # corrected
    if tools:
        assert_tools_ran(records, made)
    staleness = [r["async/staleness"] for r in records]
    assert set(staleness) <= {0, 1} and 1 in staleness, staleness

    # (bound on the error against the reported version, floor on the largest against the next one): fp32
    # rounding, or bf16 rounding (measured: at most 0.04, while the next version is 1.3-3.3 away)
    same, apart = {"model": (1e-4, 1e-2), "bf16": (0.15, 0.5)}[rollout_dtype]
    base = tools_task.ASSET_DIR if tools else default_task.ASSET_DIR
    dtype = torch.bfloat16 if rollout_dtype == "bf16" else torch.float32
    versions = [step - 1 - st for step, st in enumerate(staleness, start=1)]  # batches trained before
    assert_sampled_by(made, versions, base, out, G, T_, same, apart, dtype)


def test_every_rank_raises_the_same_kind():
    """What each rank raises once the ranks have told each other their failures (`raise_agreed`): server
    faults only -> ServerError on every rank (each saves); any other fault -> RuntimeError on every rank, the
    failing rank its own exception where it is of that kind."""
    from grpo_fast.rollout.server import ServerError
    from grpo_fast.trainer.rollouts import raise_agreed

    raise_agreed(None, [None, None])  # nobody failed: nothing raised
    down = ServerError("vLLM server http://b: generation failed")
    with pytest.raises(ServerError) as own:
        raise_agreed(down, [None, (True, str(down))])
    assert own.value is down
    with pytest.raises(ServerError, match="rank 1: vLLM server http://b"):
        raise_agreed(None, [None, (True, str(down))])
    oom = MemoryError("out of memory")
    for err, said in ((None, [None, (False, "out of memory")]), (down, [(True, str(down)), (False, "oom")])):
        with pytest.raises(RuntimeError, match="rank 1: o"):
            raise_agreed(err, said)
    with pytest.raises(MemoryError):
        raise_agreed(oom, [None, (False, str(oom))])


def test_async_settings_checked():
    from grpo_fast.trainer.config import collective_timeout_s, parse_config

    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        parse_config(["--max-staleness", "-1"])
    parse_config(["--max-staleness", "1", "--max-memory-gb", "8"])  # planned with the thread's copy counted
    with pytest.raises(ValueError, match="vllm-mode server"):
        parse_config(["--max-staleness", "1", "--rollout", "vllm"])
    server = ["--rollout", "vllm", "--vllm-mode", "server", "--vllm-server-base-url", "http://a:1,http://b:2"]
    # a rank may wait for another's requests retried on both servers: the collectives wait longer
    assert collective_timeout_s(parse_config([*server, "--vllm-request-timeout-s", "100"])) == 600
    assert collective_timeout_s(parse_config([*server, "--vllm-request-timeout-s", "300"])) == 960
    assert collective_timeout_s(parse_config(["--dist-timeout-s", "30"])) == 30


def test_a_rank_only_failure_does_not_skip_prompts_on_resume(monkeypatch):
    """Under torchrun, rank 0 generates its batch while rank 1 fails: no rank trains it, so the sampler
    position a checkpoint saves must stay before it ({'pos': 1} after one trained batch, not 2)."""
    import grpo_fast.trainer.rollouts as R
    from grpo_fast.rollout.server import ServerError

    calls = []

    def all_gather(said, mine):  # rank 1's answers: fine at the first batch, failed at the second
        calls.append(mine)
        said[:] = [mine, None if len(calls) == 1 else (True, "vLLM server http://b: generation failed")]

    monkeypatch.setattr(R.dist, "all_gather_object", all_gather)
    info = type("Info", (), {"on": True, "world": 2, "rank": 0})()
    world = World()
    source = R.Agreed(Ahead(world.produce, world.push, version=0, max_staleness=1, groups_per_batch=1), info)
    source.source.trained_state = {"pos": 0}
    source.next()
    source.source.after_update(1)
    assert source.sampler_state() == {"pos": 1}
    with pytest.raises(ServerError, match="rank 1"):
        source.next()
    assert source.sampler_state() == {"pos": 1}
    source.close()


def test_a_dropped_batch_is_replaced():
    """Batches dropped as too stale are generated again: the trainer gets a batch for each of its steps
    instead of waiting forever once the last planned batch was drawn."""
    world = World()
    source = Ahead(world.produce, world.push, version=0, max_staleness=1, groups_per_batch=1, last=2)
    deadline = time.monotonic() + 5
    while len(source.ready) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    source.after_update(1)
    source.after_update(2)  # both batches two versions old: dropped
    got = []
    t = threading.Thread(target=lambda: got.append(source.next()), daemon=True)
    t.start()
    t.join(timeout=10)
    assert got and got[0][0] == ["row2"] and source.dropped_batches == 2, (got, source.dropped_batches)
    source.close()


def test_a_batch_dropped_as_the_thread_ends_is_replaced(monkeypatch):
    """The last planned batches dropped while the generation thread, having decided to leave, has not ended
    yet (it stays alive 1.5 s past its loop): the trainer restarts generation (decided under the lock, not on
    `is_alive()`) and gets a fresh batch instead of waiting forever."""
    loop = Ahead._loop

    def lingering(self):
        loop(self)
        time.sleep(1.5)  # out of its loop, still alive

    monkeypatch.setattr(Ahead, "_loop", lingering)
    world = World()
    source = Ahead(world.produce, world.push, version=0, max_staleness=1, groups_per_batch=1, last=2)
    deadline = time.monotonic() + 5
    while len(source.ready) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    source.after_update(1)  # the thread wakes for batch 2 = last: it leaves its loop, and lingers
    deadline = time.monotonic() + 5
    while source.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert source.thread.is_alive() and not source.running
    source.after_update(2)  # both batches two versions old: dropped while the old thread is still alive
    got = []
    t = threading.Thread(target=lambda: got.append(source.next()), daemon=True)
    t.start()
    t.join(timeout=10)
    assert got and got[0][0] == ["row2"] and source.dropped_batches == 2, (got, source.dropped_batches)
    assert world.generated[2] == 2  # generated afresh under the pushed weights
    source.close()


def _signal_soon(sig, after_s=0.3):
    import os

    threading.Timer(after_s, lambda: os.kill(os.getpid(), sig)).start()


@pytest.mark.parametrize("where", ["next", "push"])
def test_a_stop_signal_cuts_the_waits_short(where):
    """SIGTERM while the trainer waits for a batch that takes minutes, or for the generation in flight
    before a push: `Stopping` within a second, not at the end of the wait."""
    import signal

    from grpo_fast.trainer.stopping import Signals, Stopping

    world = World()
    first = 0 if where == "next" else 1  # "push": batch 0 at once, batch 1 (generating) holds the weights

    def produce(j):
        if j >= first:
            time.sleep(30)
        return world.produce(j)

    signals = Signals()
    with signals.install():
        source = Ahead(produce, world.push, version=0, max_staleness=1, groups_per_batch=1,
                       abortable=signals.abortable)  # fmt: skip
        if where == "push":
            source.next()
            time.sleep(0.1)
        _signal_soon(signal.SIGTERM)
        t0 = time.monotonic()
        with pytest.raises(Stopping):
            source.next() if where == "next" else source.after_update(1)
        assert time.monotonic() - t0 < 2.0
        assert signals.stop
        with pytest.raises(Stopping):  # entered after the signal: at once
            source.next()
    source.closed = True


def test_an_interrupted_inline_rollout_keeps_the_sampler_before_its_prompts():
    """A stop during a colocated (synchronous) generation: the checkpoint's sampler position is the one
    before the prompts that generation drew, so --resume trains them."""
    import os
    import signal
    import types

    from grpo_fast.trainer.config import GRPOConfig
    from grpo_fast.trainer.data import PromptSampler
    from grpo_fast.trainer.rollouts import Inline
    from grpo_fast.trainer.stopping import Signals, Stopping

    sampler = PromptSampler([{"prompt": f"p{i}"} for i in range(8)], batch=2, seed=0)
    run = types.SimpleNamespace(
        sampler=sampler, signals=Signals(), cfg=GRPOConfig(prompts_per_step=2),
        dist=types.SimpleNamespace(world=1, rank=0),
    )  # fmt: skip

    def make(run, rows):
        if len(made) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        made.append(rows)
        return "rollout"

    made = []
    source = Inline(run, make)
    with run.signals.install():
        source.next()
        after_one = source.sampler_state()
        t0 = time.monotonic()
        with pytest.raises(Stopping):
            source.next()
        assert time.monotonic() - t0 < 2.0
    assert source.sampler_state() == after_one != sampler.state_dict()


def test_max_staleness_help_counts_batches():
    """--max-staleness bounds policy versions (a batch each), which with num_iterations k are k optimizer
    steps: the help says so."""
    import dataclasses

    from grpo_fast.trainer.config import GRPOConfig

    text = {f.name: f.metadata["help"] for f in dataclasses.fields(GRPOConfig)}["max_staleness"]
    assert "num_iterations" in text and "optimizer steps older" not in text


def test_every_rank_stops_together():
    """A stop signal on one rank (SIGTERM while it waited) makes every rank stop: a `Stopping` everywhere,
    unless another rank failed, whose failure wins."""
    from grpo_fast.rollout.server import ServerError
    from grpo_fast.trainer.rollouts import raise_agreed
    from grpo_fast.trainer.stopping import Stopping

    with pytest.raises(Stopping, match="rank 1"):
        raise_agreed(None, [None, ("stop", "SIGTERM while waiting")])
    with pytest.raises(ServerError):
        raise_agreed(Stopping("x"), [("stop", "x"), (True, "vLLM server http://b: down")])
    with pytest.raises(RuntimeError, match="rank 1: boom"):
        raise_agreed(None, [("stop", "x"), (False, "boom")])
