"""Where a step's rollout comes from: made on the spot by the trainer (`Inline`: colocated engines,
synchronous), or by a thread of its own (`Ahead`: asynchronous GRPO, `max_staleness` S) that feeds rollouts
made on vLLM servers (--vllm-mode server; S = 0 too) or by a colocated engine over the thread's own copy of
the weights (`WeightCopy`), at most S optimizer steps ahead of the policy that trains them.

Versions: the policy's version is the number of batches it trained (optimizer steps / steps_per_rollout).
Batch j (the rows of rollout j, one or more optimizer steps) is generated only once the version is >= j - S,
under the lock the weight push takes, so the version it was sampled under is exact and its staleness at
training, version - its version, is at most S;
a batch staler than S (possible only when the versions move without it, e.g. a caller that pushes twice) is
dropped and counted. The push happens on the trainer's thread after each step (`after_update`): pause -> load
-> verify on the servers, or a copy of the changed parameters into the thread's copy, waiting for the
generation in flight; the generation thread never reads the trained model's parameters. Checkpoints take the
sampler's position after the last *trained* batch, so `--resume` trains every step once whatever the thread
had drawn ahead.

Under torchrun every rank runs its own generation thread for its share of the prompts, against the same
servers or on its own copy of the weights; the push is a collective (`push_weights`: rank 0 sends whole
tensors and verifies, every rank gets the verdict; `WeightCopy.push`: every rank gathers the changed
tensors whole) and a failure on any rank stops every rank at the same point (`agree`), so none is left
waiting in a collective. The generation thread itself never runs a collective."""

import collections
import copy
import dataclasses
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..rollout import server
from ..rollout.server import ServerError
from ..rollout.vllm_engine import version_of
from .config import generation_steps, prompts_per_rollout, steps_per_rollout
from .distributed import DistInfo, Policy, device_of, full_tensor
from .stopping import NEVER, Stopping


@dataclass
class Batch:
    step: int  # j: the step whose rows these are
    rows: list
    rollout: object  # step.Rollout
    version: int  # the policy version it was sampled under
    sampler_state: dict  # the prompt sampler's position after drawing `rows`
    generate_s: float


class Inline:
    """The trainer makes each rollout itself, just before it trains it (colocated engines). A stop signal
    during the generation cuts it short (one process only: under torchrun it may hold collectives); the
    sampler's position then stays before the prompts it drew."""

    def __init__(self, run, make):
        self.run, self.make = run, make
        self.trained_state = run.sampler.state_dict()
        self.abortable = run.signals.abortable if run.dist.world == 1 else NEVER

    def next(self) -> tuple[list, object, dict]:
        run = self.run
        with self.abortable():
            rows = rank_rows(run.sampler.next(), run.cfg, run.dist)
            rollout = self.make(run, rows)
        self.trained_state = run.sampler.state_dict()
        return rows, rollout, {}

    def after_update(self, step: int) -> dict:
        return {}

    def sampler_state(self) -> dict:
        return self.trained_state

    def close(self) -> None:
        pass


class Ahead:
    """Rollouts made by `produce(j) -> (rows, rollout, sampler_state)` on a thread of its own, batch j under
    version >= j - max_staleness; `push(step)` hands the policy's weights to the generator after each
    optimizer step. `abortable`: the waits a stop signal may cut short (grpo_fast.trainer.stopping): waiting
    for a batch, and the push when `push_abortable` (one process: under torchrun the push is a collective,
    which cuts only its rank-local part). `commit_on_next`: a batch counts as trained (the sampler position a
    checkpoint takes) once `next` returns it; False: once `commit()` says so (`Agreed`, after every rank got
    its batch)."""

    def __init__(self, produce, push, version: int, max_staleness: int, groups_per_batch: int, last=None,
                 on_close=None, abortable=NEVER, push_abortable=True, commit_on_next=True):  # fmt: skip
        self.produce, self.push, self.S = produce, push, max_staleness
        self.version = self.next_step = version
        self.last, self.on_close = last, on_close  # no batch from `last` on; on_close(): cancel requests
        self.abortable, self.push_abortable = abortable, push_abortable
        self.commit_on_next, self.taken = commit_on_next, None
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
        self._start()

    # ---- the generation thread ------------------------------------------------------------------------
    def _start(self):
        # `running` is what the trainer reads, under `cond`, to restart generation: a thread that has decided
        # to leave (past `last`, or failed) says so under the same lock, while `is_alive()` stays true until
        # it has returned (a restart decided on that could wait forever on a thread that is leaving)
        self.running = True
        self.thread = threading.Thread(target=self._loop, name="grpo-fast-rollouts", daemon=True)
        self.thread.start()

    def _loop(self):
        try:
            while True:
                t0 = time.monotonic()
                with self.cond:
                    j = self.next_step
                    self.cond.wait_for(
                        lambda: self.closed or (self.version >= j - self.S and not self.push_pending)
                    )
                    if self.closed or (self.last is not None and j >= self.last):
                        self.running = False
                        return
                    self.idle_s += time.monotonic() - t0
                with self.weights:
                    version = self.version
                    t1 = time.monotonic()
                    rows, ro, state = self.produce(j)
                    batch = Batch(j, rows, ro, version, state, time.monotonic() - t1)
                with self.cond:
                    self.ready.append(batch)
                    self.next_step = j + 1
                    self.cond.notify_all()
        except BaseException as exc:  # handed to the trainer, which raises it
            with self.cond:
                self.error = exc
                self.running = False
                self.cond.notify_all()

    # ---- the trainer's side -----------------------------------------------------------------------------
    def next(self) -> tuple[list, object, dict]:
        """The next batch fresh enough to train (staler ones dropped), and its metrics."""
        t0 = time.monotonic()
        while True:
            with self.abortable(), self.cond:
                self.cond.wait_for(lambda: self.ready or self.error is not None)
                if not self.ready:
                    raise self.error
                batch = self.ready.popleft()
                staleness = self.version - batch.version
                idle, self.idle_s = self.idle_s, 0.0
                if staleness > self.S:  # dropped: one more batch generated in its place
                    self.dropped_batches += 1
                    self.dropped_groups += self.groups
                    if self.last is not None:
                        self.last += 1
                        if not self.running and self.error is None and not self.closed:
                            self._start()
                    continue
            self.taken = batch.sampler_state
            if self.commit_on_next:
                self.commit()
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
            with self.abortable() if self.push_abortable else NEVER(), self.weights:
                metrics = self.push(step) or {}
                with self.cond:
                    self.version += 1
        finally:
            with self.cond:
                self.push_pending = False
                self.cond.notify_all()
        return metrics

    def commit(self) -> None:
        """The batch `next` returned is trained (its sampler position is the one to save)."""
        self.trained_state = self.taken

    def sampler_state(self) -> dict | None:
        return self.trained_state

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.on_close is not None:
            self.on_close()
        self.thread.join(timeout=1.0)


class Agreed:
    """A rollout source whose `next` every rank of a torchrun job passes or fails together (`agree`)."""

    def __init__(self, source, info):
        self.source, self.info = source, info
        source.commit_on_next = False  # a batch counts once every rank has its own (`next`)

    def next(self):
        out = agree(self.source.next, self.info)
        self.source.commit()  # every rank has its batch: it will be trained
        return out

    def after_update(self, step: int) -> dict:
        return self.source.after_update(step)  # `push_weights` hands every rank the verdict itself

    def sampler_state(self):
        return self.source.sampler_state()

    def close(self) -> None:
        self.source.close()


def agree(call, info):
    """call() on every rank; a failure on any rank raised on all of them at this point (one rank stopping
    alone would leave the others waiting in the step's next collective): a ServerError everywhere when every
    failure was a server's (each rank then saves its part of the last completed step), else a RuntimeError
    everywhere (no save: a rank may be broken)."""
    try:
        out, err = call(), None
    except Exception as exc:
        out, err = None, exc
    if info.on:
        said = [None] * info.world
        dist.all_gather_object(said, _said(err))
        raise_agreed(err, said)
    elif err is not None:
        raise err
    return out


def _said(err) -> tuple | None:
    if err is None:
        return None
    return ("stop" if isinstance(err, Stopping) else isinstance(err, ServerError), str(err))


_RAISED = {True: ServerError, False: RuntimeError, "stop": Stopping}


def raise_agreed(err, said: list) -> None:
    """Raise on this rank what every rank told (`said[r]`: None, or (kind, message); kind: True a server's
    fault, "stop" a stop signal, False anything else); `err`: this rank's own exception, raised itself where
    it decides the kind. Any other failure makes a RuntimeError everywhere, else any server's a ServerError,
    else a stop signal a `Stopping`."""
    failed = [(r, x) for r, x in enumerate(said) if x is not None]
    if not failed:
        return
    kinds = [x[0] for _, x in failed]
    kind = False if False in kinds else True if True in kinds else "stop"
    if err is not None and _said(err)[0] == kind:
        raise err
    r, (_, message) = next((r, x) for r, x in failed if x[0] == kind)  # one of the deciding kind
    raise _RAISED[kind](f"rank {r}: {message}") from err


@torch.no_grad()
def push_weights(engine, run, step) -> int:
    """The policy's weights changed since the last push, to the servers, verified; returns how many
    tensors went. Under torchrun a collective: the servers any rank saw fail are left out by every rank (so
    each server a rank samples got every push), the changed set is agreed (an all-reduce of per-tensor flags:
    any rank's step counts), each FSDP2 shard is gathered whole once, the probe's forward runs through the
    policy on every rank; rank 0 alone writes, loads and verifies, and broadcasts the verdict, so that a
    failed push stops every rank (each saves its part of the last completed step)."""
    info = run.dist
    if not info.on:
        return engine.push(run.model, step)
    t0 = time.monotonic()
    dead = [None] * info.world
    dist.all_gather_object(dead, [s.url for s in engine.servers if not s.alive])
    for s in engine.servers:
        s.alive = s.alive and not any(s.url in d for d in dead)
    engine.alive  # no server left: a ServerError here, on every rank alike (they share the set now)
    entries = engine.weights(run.model)
    order, changed = sorted(entries), engine.changed(entries)
    flags = torch.tensor([n in changed for n in order], dtype=torch.int32, device=device_of(info))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    names = engine.to_send(entries, {n for n, f in zip(order, flags.tolist(), strict=True) if f})
    if not names:
        return 0
    dtype = engine.torch_dtype
    tensors = {}
    for n in names:  # the same order on every rank: FSDP2's all-gathers match
        whole = full_tensor(entries[n][1]())
        if info.main:
            tensors[n] = whole.to("cpu", dtype)  # one at a time: no second copy of the model on the device
    mine = run.policy(engine.trainer_probe, names)
    keys = {n: entries[n][0] for n in names}
    err = None
    if info.main:
        try:  # rank-local (the others wait in the broadcast below): a stop signal may cut it short
            with run.signals.abortable(), engine.lock:
                engine.send(tensors, keys, mine, step, t0)
        except Exception as exc:
            err = exc
    box = [_said(err), engine.loads, engine.adapter]
    dist.broadcast_object_list(box, src=0)
    raise_agreed(err, box[:1])
    engine.versions.update(keys)
    engine.loads.update(box[1])  # what every server's load count is after rank 0's load: checked by all
    engine.adapter = box[2]  # LoRA pushed alone: the version every rank's requests name
    return len(names)


class WeightCopy:
    """The generation thread's own copy of the policy (colocated asynchronous GRPO): the trainer updates the
    policy in place while the copy samples; `push` copies in the parameters changed since the last push
    (their version counters). `twin`: the copy, taken before the policy was wrapped (an FSDP2 shard cannot be
    copied whole). Under torchrun each rank keeps its own, and the push is a collective: the changed set
    agreed across ranks, each FSDP2 shard gathered whole, in the same order on every rank. Costs one more copy
    of the weights in memory, on every rank."""

    def __init__(self, model, twin, info):
        self.model, self.info = twin.eval().requires_grad_(False), info
        mine = dict(self.model.named_parameters())
        theirs = dict(model.named_parameters())
        if mine.keys() != theirs.keys():
            raise RuntimeError("the generation thread's copy has other parameters than the policy")
        self.pairs = [(p, mine[n]) for n, p in theirs.items()]  # (trained, copy)
        self.versions = [version_of(p) for p, _ in self.pairs]

    @torch.no_grad()
    def push(self, step) -> dict:
        t0, moved = time.monotonic(), 0
        changed = [version_of(p) != v for (p, _), v in zip(self.pairs, self.versions, strict=True)]
        if self.info.on:
            flags = torch.tensor(changed, dtype=torch.int32, device=device_of(self.info))
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            changed = [bool(f) for f in flags.tolist()]
        for i, ((p, q), go) in enumerate(zip(self.pairs, changed, strict=True)):
            if go:
                q.copy_(full_tensor(p))
                self.versions[i] = version_of(p)
                moved += q.numel() * q.element_size()
        return {"sync/seconds": time.monotonic() - t0, "sync/bytes": moved}


def rank_rows(rows: list, cfg, dist) -> list:
    """This rank's prompts of a rollout's global batch: of each optimizer step's prompts_per_step (a rollout
    feeds generation_steps of them, in order), its contiguous share, so that every step trains the prompts
    a single process would."""
    steps, world = generation_steps(cfg), dist.world
    per_step = len(rows) // steps
    share = per_step // world
    return [r for j in range(steps) for r in rows[j * per_step + dist.rank * share :][:share]]


def for_run(run, make):
    """The run's rollout source (make(run, rows, generator) -> Rollout): `Inline` for a synchronous colocated
    run; else `Ahead`, on vLLM servers (under torchrun, `Agreed`) or on a `WeightCopy` of the policy."""
    cfg, info = run.cfg, run.dist
    on_servers = cfg.rollout == "vllm" and cfg.vllm_mode == "server"
    if not on_servers and not cfg.max_staleness:
        return Inline(run, make)
    # the thread's own view of the run: its own tokenizer (a fast tokenizer's padding state is not shared
    # between threads); on a server it never touches the model's parameters, colocated it samples a copy
    mine = dataclasses.replace(run, tokenizer=copy.deepcopy(run.tokenizer))
    if on_servers:
        push, close = server_push(run)
    else:
        weights = WeightCopy(run.model, run.rollout_copy, info)
        # the copy is whole on every rank: its decode runs alone (no rank waits for another's)
        mine = dataclasses.replace(mine, model=weights.model, policy=Policy(weights.model), dist=DistInfo())
        push, close = weights.push, None
    base_state = run.sampler.state_dict()
    device = "cpu" if on_servers else run.device  # a server's rollout draws request seeds on the CPU

    def produce(j):
        rows = rank_rows(run.sampler.next(), cfg, info)
        generator = torch.Generator(device).manual_seed((cfg.seed * 1_000_003 + j) * 1009 + info.rank)
        return rows, make(mine, rows, generator), run.sampler.state_dict()

    k = steps_per_rollout(cfg)  # optimizer steps per batch
    last = -(-cfg.max_steps // k)
    source = Ahead(produce, push, run.step // k, cfg.max_staleness, prompts_per_rollout(cfg), last, close,
                   abortable=run.signals.abortable, push_abortable=not info.on)  # fmt: skip
    source.trained_state = base_state
    return Agreed(source, info) if info.on else source


def server_push(run):
    """Connect to the run's vLLM servers, push every weight (verified) before the first sample, and return
    (the push of each later step: push(step) -> its metrics, the engine's `close`)."""
    from .step import engine_options

    opts = {k: v for k, v in engine_options(run.cfg, run.identity)["vllm_options"].items() if k != "mode"}
    engine = agree(
        lambda: server.engine_for(run.model, **{**opts, "auto_push": False, "tokenizer": run.tokenizer}),
        run.dist,
    )
    push_weights(engine, run, run.step)

    def push(step):
        if not push_weights(engine, run, step):
            return {"sync/seconds": 0.0, "sync/bytes": 0}
        s = engine.stats
        return {
            "sync/seconds": s["sync_s"],
            "sync/bytes": s["sync_bytes"],
            "sync/probe_error": s["probe_error"],
            "sync/failed_servers": s["failed_servers"],
        }

    return push, engine.close
