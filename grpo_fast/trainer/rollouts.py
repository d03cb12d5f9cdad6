"""Where a step's rollout comes from: made on the spot by the trainer (`Inline`: colocated engines), or by a
thread of its own that feeds rollouts made on vLLM servers (`Ahead`: --vllm-mode server), at most
`max_staleness` optimizer steps ahead of the policy that trains them (asynchronous GRPO; 0 = synchronous).

Versions: the policy's version is the number of batches it trained (optimizer steps / num_iterations). Batch j
(the rows of step j) is generated only once the version is >= j - S, under the lock the weight push takes, so
the version it was sampled under is exact and its staleness at training, version - its version, is at most S;
a batch staler than S (possible only when the versions move without it, e.g. a caller that pushes twice) is
dropped and counted. The push happens on the trainer's thread after each step (`after_update`): pause -> load
-> verify on the servers, waiting for the generation in flight; the generation thread never reads the model's
parameters (a server's rollout needs only the prompts). Checkpoints take the sampler's position after the last
*trained* batch, so `--resume` trains every step once whatever the thread had drawn ahead."""

import collections
import copy
import dataclasses
import threading
import time
from dataclasses import dataclass

import torch

from ..rollout import vllm_server


@dataclass
class Batch:
    step: int  # j: the step whose rows these are
    rows: list
    rollout: object  # step.Rollout
    version: int  # the policy version it was sampled under
    sampler_state: dict  # the prompt sampler's position after drawing `rows`
    generate_s: float


class Inline:
    """The trainer makes each rollout itself, just before it trains it (colocated engines)."""

    def __init__(self, run, make):
        self.run, self.make = run, make

    def next(self) -> tuple[list, object, dict]:
        run = self.run
        local = run.cfg.prompts_per_step // run.dist.world
        rows = run.sampler.next()[run.dist.rank * local : (run.dist.rank + 1) * local]
        return rows, self.make(run, rows), {}

    def after_update(self, step: int) -> dict:
        return {}

    def sampler_state(self) -> dict:
        return self.run.sampler.state_dict()

    def close(self) -> None:
        pass


class Ahead:
    """Rollouts made by `produce(j) -> (rows, rollout, sampler_state)` on a thread of its own, batch j under
    version >= j - max_staleness; `push(version)` sends the policy's weights after each optimizer step."""

    def __init__(self, produce, push, version: int, max_staleness: int, groups_per_batch: int, last=None,
                 on_close=None):  # fmt: skip
        self.produce, self.push, self.S = produce, push, max_staleness
        self.version = self.next_step = version
        self.last, self.on_close = last, on_close  # no batch from `last` on; on_close(): cancel requests
        self.groups = groups_per_batch
        self.ready: collections.deque = collections.deque()
        self.cond = threading.Condition()
        self.weights = threading.Lock()  # held while a batch generates and while a push runs
        self.push_pending = False
        self.closed = False
        self.error: BaseException | None = None
        self.dropped_groups = self.dropped_batches = 0
        self.idle_s = 0.0  # the generation thread waiting for the version gate, since the last `next`
        self.trained_state: dict | None = None
        self.thread = threading.Thread(target=self._loop, name="grpo-fast-rollouts", daemon=True)
        self.thread.start()

    # ---- the generation thread ------------------------------------------------------------------------
    def _loop(self):
        j = self.next_step
        try:
            while True:
                t0 = time.monotonic()
                with self.cond:
                    self.cond.wait_for(
                        lambda: self.closed or (self.version >= j - self.S and not self.push_pending)
                    )
                    if self.closed or (self.last is not None and j >= self.last):
                        return
                    self.idle_s += time.monotonic() - t0
                with self.weights:
                    version = self.version
                    t1 = time.monotonic()
                    rows, ro, state = self.produce(j)
                    batch = Batch(j, rows, ro, version, state, time.monotonic() - t1)
                with self.cond:
                    self.ready.append(batch)
                    self.cond.notify_all()
                j += 1
        except BaseException as exc:  # handed to the trainer, which raises it
            with self.cond:
                self.error = exc
                self.cond.notify_all()

    # ---- the trainer's side -----------------------------------------------------------------------------
    def next(self) -> tuple[list, object, dict]:
        """The next batch fresh enough to train (staler ones dropped), and its metrics."""
        t0 = time.monotonic()
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.ready or self.error is not None)
                if not self.ready:
                    raise self.error
                batch = self.ready.popleft()
                staleness = self.version - batch.version
                idle, self.idle_s = self.idle_s, 0.0
            if staleness > self.S:
                self.dropped_batches += 1
                self.dropped_groups += self.groups
                continue
            self.trained_state = batch.sampler_state
            return (
                batch.rows,
                batch.rollout,
                {
                    "async/staleness": staleness,
                    "async/dropped_groups": self.dropped_groups,
                    "async/trainer_wait_s": time.monotonic() - t0,
                    "async/generate_busy_s": batch.generate_s,
                    "async/generate_idle_s": idle,
                },
            )

    def after_update(self, step: int) -> dict:
        """Push the weights after the optimizer step `step` (waiting for the generation in flight), then let
        generation go on from them: the next version (versions count trained batches, whatever
        num_iterations)."""
        with self.cond:
            self.push_pending = True
        try:
            with self.weights:
                metrics = self.push(step) or {}
                with self.cond:
                    self.version += 1
        finally:
            with self.cond:
                self.push_pending = False
                self.cond.notify_all()
        return metrics

    def sampler_state(self) -> dict | None:
        return self.trained_state

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.on_close is not None:
            self.on_close()
        self.thread.join(timeout=1.0)


def for_run(run, make):
    """The rollout source of this run: `Ahead` on vLLM servers, else `Inline` (make(run, rows) -> Rollout)."""
    cfg = run.cfg
    if not (cfg.rollout == "vllm" and cfg.vllm_mode == "server"):
        return Inline(run, make)
    from .step import engine_options

    opts = {k: v for k, v in engine_options(cfg)["vllm_options"].items() if k != "mode"}
    engine = vllm_server.engine_for(run.model, **{**opts, "auto_push": False, "tokenizer": run.tokenizer})
    engine.push(run.model, run.step)  # everything, verified, before the first sample
    base_state = run.sampler.state_dict()
    # the thread's own view of the run: its own tokenizer (a fast tokenizer's padding state is not shared
    # between threads); it never touches the model's parameters
    mine = dataclasses.replace(run, tokenizer=copy.deepcopy(run.tokenizer))

    def produce(j):
        rows = run.sampler.next()
        generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + j)  # CPU: it draws request seeds
        return rows, make(mine, rows, generator), run.sampler.state_dict()

    def push(step):
        if not engine.push(run.model, step):
            return {"sync/seconds": 0.0, "sync/bytes": 0}
        s = engine.stats
        return {
            "sync/seconds": s["sync_s"],
            "sync/bytes": s["sync_bytes"],
            "sync/probe_error": s["probe_error"],
            "sync/failed_servers": s["failed_servers"],
        }

    k = cfg.num_iterations  # optimizer steps per batch
    last = -(-cfg.max_steps // k)
    source = Ahead(produce, push, run.step // k, cfg.max_staleness, cfg.prompts_per_step, last, engine.close)
    source.trained_state = base_state
    return source
