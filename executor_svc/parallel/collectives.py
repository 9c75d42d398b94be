"""What the model and the runner exchange between the ranks of an executor group, on torch.distributed.

``SINGLE`` is a plain executor: every call is the identity, so the model code
calls these unconditionally. ``GroupComm`` is a rank of a group: all-reduce
over its tensor-parallel peers (after o_proj and the feed-forward block),
the vocabulary-parallel embedding and LM head, hidden states from stage to
stage, and the sampled tokens from the last stage to everyone.

Every collective has the group's timeout. A rank that dies, or a collective
that fails, takes this process down at once (``fatal``): a group that lost a
rank cannot compute, and its requests fail over to another executor only when
its leader's stream ends.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import structlog
import torch
import torch.distributed as dist
import torch.nn.functional as F

from executor_svc.parallel.shard import Placement

log = structlog.get_logger(__name__)
T = TypeVar("T")
# The exit status of a rank whose group lost a member (the launcher and Kubernetes restart the group).
GROUP_LOST_EXIT = 75


class ModelParallel:
    """A plain executor: one rank holds the whole model; nothing is exchanged."""

    active = False
    placement = Placement()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the tensor-parallel ranks (in place where it can be)."""
        return x

    def embed(self, input_ids: torch.Tensor, weight: Any) -> torch.Tensor:
        """Embedding rows of the ids; a group's ranks each hold a vocabulary slice."""
        return F.embedding(input_ids, weight)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] over the whole vocabulary from each rank's slice [N, V / T] (padding rows dropped)."""
        return logits


SINGLE = ModelParallel()


class GroupComm(ModelParallel):
    """One rank's end of its group's process groups (gloo on the CPU, NCCL for CUDA tensors)."""

    active = True

    def __init__(
        self, placement: Placement, address: str, timeout_s: float, device: torch.device, start_timeout_s: float = 300.0
    ):
        self.placement = placement
        self.timeout_s = timeout_s
        self.vocab_size = 0  # the model's whole vocabulary (the runner sets it once the config is read)
        self.device = device
        # Meeting may wait for a restarting peer (a pod's back-off); a collective of a formed group may not.
        start_timeout = datetime.timedelta(seconds=start_timeout_s)
        timeout = datetime.timedelta(seconds=timeout_s)
        backend = "nccl" if device.type == "cuda" else "gloo"
        log.info(
            "group_joining",
            rank=placement.rank,
            world_size=placement.world_size,
            address=address,
            start_timeout_s=start_timeout_s,
            timeout_s=timeout_s,
            backend=backend,
        )
        dist.init_process_group(
            backend,
            init_method=f"tcp://{address}",
            rank=placement.rank,
            world_size=placement.world_size,
            timeout=start_timeout,
        )
        # Commands and sampled tokens are Python objects: always over gloo, whatever the tensors use.
        self.control = dist.new_group(backend="gloo", timeout=timeout)
        # Stage to stage (all ranks: a send names its peer's global rank), with the collectives' timeout.
        self.p2p = dist.new_group(backend=backend, timeout=timeout) if pp_needed(placement) else None
        tp, pp = placement.tp_size, placement.pp_size
        self.tp_group = None
        for stage in range(pp):  # every rank creates every group, in the same order
            ranks = list(range(stage * tp, (stage + 1) * tp))
            group = dist.new_group(ranks, backend=backend, timeout=timeout)
            if stage == placement.pp_rank:
                self.tp_group = group
        log.info("group_joined", rank=placement.rank)

    @property
    def sampler_rank(self) -> int:
        """The rank that samples and shares the tokens: the first of the last stage."""
        return (self.placement.pp_size - 1) * self.placement.tp_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.placement.tp_size == 1:
            return x
        if x.device.type == "cpu" and x.dtype != torch.float32:  # gloo sums fp32; bf16 partial sums lose bits
            wide = x.float()
            guarded(lambda: dist.all_reduce(wide, group=self.tp_group))
            return x.copy_(wide)
        guarded(lambda: dist.all_reduce(x, group=self.tp_group))
        return x

    def embed(self, input_ids: torch.Tensor, weight: Any) -> torch.Tensor:
        rows = weight.shape[0]
        start = self.placement.tp_rank * rows
        local = input_ids - start
        outside = (local < 0) | (local >= rows)
        out = F.embedding(local.masked_fill(outside, 0), weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.all_reduce(out)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """The whole vocabulary's logits on the stage's first rank (the sampler, on the last stage); the others
        get a tensor of the same shape and no values (they never sample: the sampler shares its tokens)."""
        vocab_size = self.vocab_size
        tp = self.placement.tp_size
        if tp == 1:
            return logits[:, :vocab_size]
        if logits.device.type == "cpu":  # gloo gathers fp32
            logits = logits.float()
        logits = logits.contiguous()
        first = self.placement.pp_rank * tp
        if self.placement.rank != first:
            guarded(lambda: dist.gather(logits, None, dst=first, group=self.tp_group))
            return torch.empty((logits.shape[0], vocab_size), dtype=logits.dtype, device=logits.device)
        parts = [torch.empty_like(logits) for _ in range(tp)]
        guarded(lambda: dist.gather(logits, parts, dst=first, group=self.tp_group))
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def send_hidden(self, hidden: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """Starts sending hidden states to the same tensor-parallel rank of the next stage; the stage goes on with
        its next micro-batch meanwhile (``wait_all`` at the end of the step)."""
        peer = self.placement.rank + self.placement.tp_size
        hidden = hidden.contiguous()
        return guarded(lambda: dist.isend(hidden, peer, group=self.p2p)), hidden

    def wait_all(self, sends: list[tuple[Any, torch.Tensor]]) -> None:
        """Waits for the step's sends (the tensors are held until then)."""
        for work, _ in sends:
            guarded(work.wait)

    def recv_hidden(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        """Hidden states [T, hidden] from the same tensor-parallel rank of the previous stage."""
        out = torch.empty((num_tokens, hidden_size), dtype=dtype, device=self.device)
        peer = self.placement.rank - self.placement.tp_size
        guarded(lambda: dist.recv(out, peer, group=self.p2p))
        return out

    def share(self, value: T, src: int) -> T:
        """``value`` of rank ``src`` on every rank (a picklable object: sampled tokens, a command)."""
        box = [value if self.placement.rank == src else None]
        guarded(lambda: dist.broadcast_object_list(box, src=src, group=self.control))
        return box[0]  # type: ignore[return-value]

    def gather(self, value: T) -> list[T]:
        """``value`` of every rank, in rank order, on every rank."""
        out: list[Any] = [None] * self.placement.world_size
        guarded(lambda: dist.all_gather_object(out, value, group=self.control))
        return out

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` of every rank (KV blocks: every rank must hold the blocks the leader reports)."""
        box = torch.tensor([value], dtype=torch.int64)
        guarded(lambda: dist.all_reduce(box, op=dist.ReduceOp.MIN, group=self.control))
        return int(box.item())

    def close(self) -> None:
        """Leaves the group once every rank is done (a rank that leaves first aborts the others' sockets)."""
        if dist.is_initialized():
            guarded(lambda: dist.barrier(group=self.control))
            dist.destroy_process_group()


def pp_needed(placement: Placement) -> bool:
    return placement.pp_size > 1


def guarded(call: Callable[[], Any]) -> Any:
    """Runs a collective; a failure (a rank died, a timeout) ends this process: the group cannot go on."""
    try:
        return call()
    except Exception as exc:  # gloo and NCCL raise RuntimeError subclasses
        fatal(f"{type(exc).__name__}: {exc}")


def fatal(reason: str) -> None:
    """Logs why and exits at once with GROUP_LOST_EXIT (no cleanup: peers may be gone or hung)."""
    log.error("group_rank_lost", reason=reason, exit_code=GROUP_LOST_EXIT)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(GROUP_LOST_EXIT)
