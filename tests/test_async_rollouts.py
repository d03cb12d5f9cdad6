"""Asynchronous GRPO's rollout source (grpo_fast.trainer.rollouts.Ahead) with a stand-in producer and push:
the staleness of every trained batch, the bound, the drop counts, the order of versions and rows, errors.

The producer records the version the weights had while it generated (read under the same lock the push takes),
so the staleness the source reports is checked against what actually happened, not against its own counter."""

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
