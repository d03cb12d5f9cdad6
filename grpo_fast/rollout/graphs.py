"""The native engine's decode step at fixed addresses, replayed as CUDA graphs (no Inductor).

A `Static` holds one call shape's decode buffers at their full size (n groups x G rows) and keeps them across
calls of that shape: the prompts' KV is copied in, everything else reset in place. The step runs on a
*bucket*, the leading (groups, rows a group) block of those buffers, as views that start where the buffers
start: compaction copies the rows still running to the front (their groups first, each group's running rows
first), pads to the next bucket with finished filler rows, and the step goes on with that bucket's views. No
tensor the step touches is ever re-allocated inside a call or between calls of one shape, so a graph captured
for a bucket stays valid: on CUDA each bucket's step is captured once (lazily, the first time the bucket is
needed; the largest first, all in one memory pool) and replayed for every token after. On a CPU the same
bucketed step runs eagerly (there is nothing to capture): it is how the CPU tests check the GPU's padding and
addresses, and each real row samples bit for bit what the unbucketed eager step samples.

Buckets: groups 1, 2, 4, ... up to n, and n; rows a group 1, 2, 4, ... up to G, and G (nano-vllm captures
batch sizes 1, 2, 4, 8, then every 16; ours keeps the group structure the prompt attention reads once per
group). The prompts' KV capacity on CUDA is rounded up to PROMPT_STEP (a longer prompt later builds a new
Static), so that batches of slightly different prompt lengths reuse the graphs; on a CPU it is exact.
"""

import dataclasses
import time

import torch

PROMPT_STEP = 64  # CUDA: prompt KV slots rounded up to this (padding masked), so nearby lengths share graphs


def buckets(n: int) -> list[int]:
    """1, 2, 4, ... below n, and n."""
    out, b = [], 1
    while b < n:
        out.append(b)
        b *= 2
    return [*out, n]


def bucket_for(k: int, n: int) -> int:
    """The smallest bucket of `buckets(n)` holding k."""
    return next(b for b in buckets(n) if b >= k)


def select_rows(alive, n: int, G: int, size, unless=None):
    """What a compaction of n groups x G rows keeps, `alive` (R,) the rows still decoding or waiting for a
    tool: the groups with any, in order, then as many copies of the last of them as the new shape needs; in
    each, its alive rows first, then its other rows as fillers. `size(groups with any, the busiest group's
    count)` gives the new shape (n2, G2): the same two for the eager step, their buckets for a `Static`.
    Returns (n2, G2), the kept groups (n2,), each new row's old row (n2 * G2,) and which are fillers; None,
    with nothing sorted or gathered, when the new shape is `unless`."""
    running = alive.view(n, G)
    per_group = running.sum(1)
    keep = per_group.nonzero().squeeze(1)
    n2, G2 = size(len(keep), int(per_group.max()))
    if (n2, G2) == unless:
        return None
    groups = torch.cat([keep, keep[-1:].expand(n2 - len(keep))])
    order = torch.sort((~running[groups]).to(torch.int8), dim=1, stable=True).indices[:, :G2]
    src = (groups[:, None] * G + order).reshape(-1)
    filler = ~running[groups].gather(1, order)
    filler[len(keep) :] = True  # the copies of the last group
    return (n2, G2), groups, src, filler.reshape(-1)


class Static:
    """One call shape's decode buffers (a `native._Buffers` at full size, `full`), the bucket in use and, on
    CUDA, one captured graph per bucket. `key`: what a call must match to reuse it (native builds it)."""

    def __init__(self, key, full, n: int, G: int, prompt_len: int, strict: bool = False):
        self.key, self.full, self.n, self.G, self.prompt_len = key, full, n, G, prompt_len
        self.strict = strict  # a failed capture raises instead of running eager
        self.capture = full.out.is_cuda
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.graphs: dict = {}  # (groups, rows a group) -> torch.cuda.CUDAGraph
        self.weights = None  # the engine's weight copies for this shape, refreshed in place each call
        self.eos = None  # the EOS ids as the step reads them (part of the key: the same for every call)
        self.capture_s = 0.0
        self.failed = None  # why this Static's graphs stopped being captured, if they did

    def fits(self, key, prompt_len: int) -> bool:
        if key != self.key:
            return False
        return prompt_len <= self.prompt_len if self.capture else prompt_len == self.prompt_len

    def view(self, groups: int, per_group: int):
        """The buffers of bucket (groups, per_group): the leading rows of each, at the same addresses."""
        f, R = self.full, groups * per_group
        rows = lambda ts: None if ts is None else [x[:R] for x in ts]  # noqa: E731
        grp = lambda ts: None if ts is None else [x[:groups] for x in ts]  # noqa: E731
        return dataclasses.replace(
            f, prompt_k=grp(f.prompt_k), prompt_v=grp(f.prompt_v), prompt_bias=f.prompt_bias[:groups],
            comp_k=rows(f.comp_k), comp_v=rows(f.comp_v), plen=f.plen[:R], out=f.out[:R], logp=f.logp[:R],
            done=f.done[:R], lengths=f.lengths[:R], t=f.t[:R], noise=f.noise[:, :R], parked=f.parked[:R],
            final=f.final[:R], prompt_kt=grp(f.prompt_kt), comp_kt=rows(f.comp_kt),
            seen=None if f.seen is None else f.seen[:R],
        )  # fmt: skip

    def step(self, bucket, b, step, args) -> None:
        """One token step of bucket `bucket` on its views `b`: eager on a CPU; on CUDA the bucket's graph,
        captured the first time after one eager step on a side stream (this call's token), watched for host
        reads: a step that makes one (a model whose modules read a value back) is not captured, and neither
        is a step whose capture fails; the Static then runs eager, its reason in `failed` (printed once), or
        with `strict` (compile="graphs" asked for by name) the call fails with it."""
        graph = self.graphs.get(bucket)
        if graph is not None:
            graph.replay()
            return
        if not self.capture or self.failed:
            step(b, *args)
            return
        t0 = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), HostReads() as watch:
            step(b, *args)  # the token itself, and the libraries' workspaces made outside the capture
        torch.cuda.current_stream().wait_stream(side)
        if watch.seen:
            ops = ", ".join(sorted(set(watch.seen)))
            return self._fail(f"the step reads values back on the host ({ops})")
        graph = torch.cuda.CUDAGraph()
        try:
            # the stream is left whatever happens (torch.cuda.graph's context would not on a failure);
            # thread_local: another thread's CUDA work (the trainer's, beside an asynchronous rollout) goes on
            with torch.cuda.stream(side):  # recorded, not run
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    step(b, *args)
                finally:
                    graph.capture_end()
        except Exception as exc:  # noqa: BLE001 - graphs are an optimization: say why (strict: fail)
            first = str(exc).splitlines()[0][:200] if str(exc) else ""
            return self._fail(f"capture failed: {type(exc).__name__}: {first}")
        torch.cuda.current_stream().wait_stream(side)
        self.graphs[bucket] = graph
        self.capture_s += time.perf_counter() - t0

    def _fail(self, reason: str) -> None:
        self.failed = f"CUDA graphs off for this shape, eager: {reason}"
        if self.strict:
            raise RuntimeError(f"compile='graphs': {self.failed}")
        print(f"grpo-fast native rollout: {self.failed}", flush=True)

    def compact(self, b, bucket, rows, final, alive):
        """Move the rows `alive` (decoding or waiting for a tool) to the front: the groups with any first, as
        many rows each as the next bucket above the busiest group's count (running rows first, then finished
        rows of the same group as fillers), groups padded to their next bucket with copies of the last kept
        group, all filler. Rows that leave are copied to `final` first. Returns (bucket, its views, the
        original row of each buffer row, -1 a filler), or the same three when the bucket would not shrink."""
        n, G = bucket
        kept = select_rows(alive, n, G, lambda g, r: (bucket_for(g, self.n), bucket_for(r, self.G)), bucket)
        if kept is None:
            return bucket, b, rows
        shape, groups, src, filler = kept
        final.take(b, rows)
        new_rows = torch.where(filler, -1, rows[src])
        v = self.view(*shape)
        for old, new in zip(_row_tensors(b), _row_tensors(v), strict=True):
            new.copy_(old.index_select(0, src.to(old.device)))
        for old, new in zip(_group_tensors(b), _group_tensors(v), strict=True):
            new.copy_(old.index_select(0, groups))
        v.noise.copy_(b.noise.index_select(1, src))
        v.done.logical_or_(filler)
        v.parked.logical_and_(~filler.cpu())
        v.final.logical_or_(filler.cpu())
        return shape, v, new_rows


def _row_tensors(b) -> list:
    """The tensors of a bucket's views indexed by row first."""
    extra = [*(b.comp_kt or []), *([] if b.seen is None else [b.seen])]
    return [*b.comp_k, *b.comp_v, *extra, b.plen, b.out, b.logp, b.done, b.lengths, b.t, b.parked, b.final]


def _group_tensors(b) -> list:
    """The tensors of a bucket's views indexed by group first."""
    return [*b.prompt_k, *b.prompt_v, *(b.prompt_kt or []), b.prompt_bias]


class HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the operators that make the host wait for the device (a tensor's value read, or a shape that
    depends on values): none can run inside a CUDA graph's capture."""

    SYNCS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "item", "is_nonzero"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.SYNCS:
            self.seen.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))
