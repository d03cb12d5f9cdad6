"""Past one device with PyTorch's own stack: torchrun, DDP, FSDP2 (`fully_shard`), distributed state dicts.

    torchrun --nproc_per_node 4 -m grpo_fast.train --distributed fsdp ...

The trainer's differentiable work (and its rollouts and log-probs) goes through one module, `Policy`, so
that DDP's reducer and FSDP's unshard / reshard hooks see every use of the parameters, including the LM
head weight that the fused loss reads outside the decoder. Prompts are split across ranks with whole groups
on each rank; rewards are all-gathered so advantages (group or batch std) are those of the global batch.
"""

import datetime
import gc
import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    kind: str = "none"  # "none" (one process), "ddp" or "fsdp"

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def on(self) -> bool:
        return self.world > 1


def init_distributed(kind: str, timeout_s: float) -> DistInfo:
    """Join the torchrun job described by the environment (WORLD_SIZE > 1), else run as one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # a rank that dies leaves the others blocked in a collective: the timeout turns that into an error
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), kind)


def shutdown(info: DistInfo) -> None:
    """Destroy the process group once nothing holds it and every rank is here. The caller drops its DDP /
    FSDP modules and sharded parameters first: destroyed while a DDP reducer still held it, gloo's threads
    were torn down at interpreter exit and the process aborted ("terminate called without an active
    exception") in about 1 of 30 two-rank runs; released first, none in 80."""
    if info.on and dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def all_sum(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.on:
        x = x.clone()
        dist.all_reduce(x)
    return x


def all_gather_rows(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Concatenate equal-shaped per-rank tensors along dim 0, in rank order."""
    if not info.on:
        return x
    parts = [torch.empty_like(x) for _ in range(info.world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def all_done(local_done: bool, info: DistInfo) -> bool:
    """True once every rank is done (ranks keep stepping together: FSDP's all-gathers must match)."""
    if not info.on:
        return local_done
    flag = torch.tensor([0 if local_done else 1], device=device_of(info))
    dist.all_reduce(flag)
    return int(flag) == 0


def device_of(info: DistInfo) -> torch.device:
    """This rank's device: its local GPU, else the CPU."""
    return torch.device("cuda", info.local_rank) if torch.cuda.is_available() else torch.device("cpu")


def barrier(info: DistInfo) -> None:
    if info.on:
        dist.barrier()


def from_rank0(make, info: DistInfo):
    """make() run on rank 0 alone, its value (any picklable object) returned on every rank."""
    box = [make() if info.main else None]
    if info.on:
        dist.broadcast_object_list(box, src=0)
    return box[0]


class Policy(nn.Module):
    """The model behind one forward: `fn(model, *args, **kwargs)` runs inside it, so that DDP / FSDP hooks
    wrap every use of the parameters (rollout, log-probs, the fused loss)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn, *args, **kwargs):
        return fn(self.model, *args, **kwargs)


def wrap(model: nn.Module, info: DistInfo, trainable: bool = True) -> nn.Module:
    """Policy(model), under DDP or FSDP2 when distributed. FSDP shards each decoder layer, then the rest
    (embeddings, final norm, LM head) as the root; parameters, gradients and optimizer state are sharded."""
    policy = Policy(model)
    if not info.on:
        return policy
    if info.kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        from ..models.model_parts import decoder_of

        for layer in decoder_of(model).layers:
            fully_shard(layer)
        return fully_shard(policy)
    if not trainable:  # a frozen replica needs no gradient reducer
        return policy
    from torch.nn.parallel import DistributedDataParallel as DDP

    device_ids = [info.local_rank] if torch.cuda.is_available() else None
    return DDP(policy, device_ids=device_ids, broadcast_buffers=False)


def inner_model(policy: nn.Module) -> nn.Module:
    return policy.module.model if hasattr(policy, "module") else policy.model


@contextmanager
def gradient_sync(policy: nn.Module, enabled: bool):
    """Skip the gradient all-reduce / reduce-scatter on all but the last micro-batch of a step."""
    if hasattr(policy, "no_sync"):  # DDP
        with nullcontext() if enabled else policy.no_sync():
            yield
    elif hasattr(policy, "set_requires_gradient_sync"):  # FSDP2
        policy.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            policy.set_requires_gradient_sync(True)
    else:
        yield


def full_tensor(x):
    return x.full_tensor() if hasattr(x, "full_tensor") else x


# ---------------------------------------------------------------------------------------------------------
# State dicts that do not depend on the world size: full tensors, parameter names as keys
# ---------------------------------------------------------------------------------------------------------
def _options(info: DistInfo, **kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=info.on, **kw)


def full_model_state(policy: nn.Module, info: DistInfo) -> dict:
    """The model's full state dict (keys as `model.state_dict()`); a collective when distributed."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    sd = get_model_state_dict(policy, options=_options(info))
    sd = {k.removeprefix("module.").removeprefix("model."): v for k, v in sd.items()}
    model = inner_model(policy)
    if getattr(model.config, "tie_word_embeddings", False):  # one tensor on disk, as save_pretrained does
        head = model.get_output_embeddings()
        sd.pop(next(f"{n}.weight" for n, m in model.named_modules() if m is head), None)
    return sd


def full_optimizer_state(policy: nn.Module, optimizer, info: DistInfo) -> dict:
    """The optimizer's full state keyed by parameter name; a collective when distributed."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(policy, optimizer, options=_options(info))


def load_full_optimizer_state(policy: nn.Module, optimizer, state: dict, info: DistInfo) -> None:
    """Load a full, name-keyed optimizer state written with any world size (each rank keeps its shard)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(policy, optimizer, state, options=StateDictOptions(full_state_dict=True))
