"""Which part of each checkpoint tensor a rank of an executor group holds, and the config of that part.

Tensor parallel (T ranks) splits every layer the Megatron way: q/k/v and
gate/up by output rows (column parallel), o and down by input columns (row
parallel, one all-reduce each), each expert of a MoE layer like a dense MLP,
and the embedding and LM head by vocabulary rows. KV heads are split when T
divides them and replicated when they divide T. Pipeline parallel (P stages)
gives each stage a run of layers, renamed to start at 0 so the model code
builds and runs them as a whole model; the embedding lives on the first stage,
the final norm and LM head on the last.

A rank reads only its part: ``take(name)`` says which rows or columns, and the
loader reads just those (``executor_svc.loading.weights``). Every tensor name is
classified; one this module does not know fails the start, so a new family is
never served with a silently replicated matrix.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from executor_svc.loading.model_config import ModelConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Inside a layer: matrices split by output rows, q / kv heads or the (expert's) intermediate size.
_Q_ROWS = ("self_attn.q_proj.weight", "self_attn.q_proj.bias")
_KV_ROWS = ("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias")
_MLP_ROWS = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
_EXPERT = re.compile(r"^(mlp|block_sparse_moe)\.experts\.\d+\.(gate_proj|up_proj|w1|w3|down_proj|w2)\.weight$")
_EXPERT_COLS = ("down_proj", "w2")
# Replicated inside a layer: norms and MoE routers.
_ROUTERS = ("mlp.gate.weight", "block_sparse_moe.gate.weight")


@dataclasses.dataclass(frozen=True)
class Placement:
    """A rank's place in its group: rank = pp_rank * tp_size + tp_rank."""

    rank: int = 0
    tp_size: int = 1
    pp_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


@dataclasses.dataclass(frozen=True)
class Take:
    """The part of a tensor a rank reads: ``ranges`` of ``dim`` (concatenated in order), stored as ``name``,
    padded with zero rows to ``rows`` (vocabulary shards; 0: no padding)."""

    name: str
    dim: int | None  # None: the whole tensor
    ranges: tuple[tuple[int, int], ...] = ()
    rows: int = 0


class GroupShard:
    """The shard of a model one rank holds: its config and, per tensor, what it reads.

    Raises (constructor):
        ValueError: the model does not split this way (heads, sizes or layers not divisible), by name.
    """

    def __init__(self, config: ModelConfig, placement: Placement):
        self.full = config
        self.placement = placement
        tp = placement.tp_size
        _check_divisible(config, tp, placement.pp_size)
        self.first_layer, self.end_layer = stage_layers(config.num_layers, placement.pp_size, placement.pp_rank)
        h, kv, dh = config.num_heads, config.num_kv_heads, config.head_dim
        r = placement.tp_rank
        self.q_heads = (r * h // tp, (r + 1) * h // tp)
        self.kv_replicas = max(1, tp // kv)  # ranks that hold each KV head
        first_kv = r * kv // tp if kv >= tp else r // self.kv_replicas
        self.kv_heads = (first_kv, first_kv + max(1, kv // tp))
        self.vocab_rows = -(-config.vocab_size // tp)  # each rank's vocabulary rows (the last padded)
        self.vocab_start = r * self.vocab_rows
        self.head_dim = dh
        fields: dict[str, Any] = dict(
            num_layers=self.end_layer - self.first_layer,
            layers=config.layers[self.first_layer : self.end_layer],
            num_heads=h // tp,
            num_kv_heads=max(1, kv // tp),
            intermediate_size=config.intermediate_size // tp,
            vocab_size=self.vocab_rows,
        )
        if getattr(config, "moe_intermediate_size", 0):
            fields["moe_intermediate_size"] = config.moe_intermediate_size // tp  # type: ignore[attr-defined]
        self.config = dataclasses.replace(config, **fields)

    def describe(self) -> str:
        """What this rank holds, for logs and status: layers, heads, vocabulary rows."""
        q0, q1 = self.q_heads
        k0, k1 = self.kv_heads
        v0 = self.vocab_start
        v1 = min(v0 + self.vocab_rows, self.full.vocab_size)
        return (
            f"layers {self.first_layer}-{self.end_layer - 1}, q heads {q0}-{q1 - 1}, kv heads {k0}-{k1 - 1}, "
            f"vocab {v0}-{v1 - 1}"
        )

    def absent(self) -> frozenset[str]:
        """The model's global tensors this rank does not hold (its stage does not run them)."""
        names = ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")
        return frozenset(name for name in names if self._take_global(name) is None)

    def take(self, name: str, shape: tuple[int, ...]) -> Take | None:
        """What this rank reads of checkpoint tensor ``name`` (None: nothing).

        Raises:
            ValueError: a tensor this module does not know how to split.
        """
        match = _LAYER.match(name)
        if match is None:
            return self._take_global(name)
        index, inner = int(match.group(1)), match.group(2)
        if not self.first_layer <= index < self.end_layer:
            return None
        local = f"model.layers.{index - self.first_layer}.{inner}"
        return self._take_layer(local, inner, shape)

    def _take_global(self, name: str) -> Take | None:
        p = self.placement
        rows = ((self.vocab_start, min(self.vocab_start + self.vocab_rows, self.full.vocab_size)),)
        if name == "model.embed_tokens.weight":
            if p.first_stage or (p.last_stage and self.full.tie_word_embeddings):
                return Take(name, 0, rows, self.vocab_rows)
            return None
        if name == "lm_head.weight":
            return Take(name, 0, rows, self.vocab_rows) if p.last_stage else None
        if name == "model.norm.weight":
            return Take(name, None) if p.last_stage else None
        raise ValueError(f"tensor {name!r}: not known to the group sharding (executor_svc/parallel/shard.py)")

    def _take_layer(self, local: str, inner: str, shape: tuple[int, ...]) -> Take:
        dh, full = self.head_dim, self.full
        q_rows = _scaled(self.q_heads, dh)
        kv_rows = _scaled(self.kv_heads, dh)
        tp, r = self.placement.tp_size, self.placement.tp_rank
        if inner in _Q_ROWS:
            return Take(local, 0, (q_rows,))
        if inner in _KV_ROWS:
            return Take(local, 0, (kv_rows,))
        if inner == "self_attn.qkv_proj.weight":  # Phi-3: q, k and v stacked
            q_size, kv_size = full.num_heads * dh, full.num_kv_heads * dh
            k = _shift(kv_rows, q_size)
            return Take(local, 0, (q_rows, k, _shift(kv_rows, q_size + kv_size)))
        if inner == "self_attn.o_proj.weight":
            return Take(local, 1, (q_rows,))
        if inner in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
            if not full.qk_norm_over_heads:
                return Take(local, None)
            return Take(local, 0, (q_rows if inner.startswith("self_attn.q") else kv_rows,))
        inter = full.intermediate_size
        mine = (r * inter // tp, (r + 1) * inter // tp)
        if inner in _MLP_ROWS:
            return Take(local, 0, (mine,))
        if inner == "mlp.gate_up_proj.weight":  # Phi-3: gate then up
            return Take(local, 0, (mine, _shift(mine, inter)))
        if inner == "mlp.down_proj.weight":
            return Take(local, 1, (mine,))
        expert = _EXPERT.match(inner)
        if expert is not None:
            e_inter = full.moe_intermediate_size  # type: ignore[attr-defined]
            part = (r * e_inter // tp, (r + 1) * e_inter // tp)
            return Take(local, 1 if expert.group(2) in _EXPERT_COLS else 0, (part,))
        if inner.endswith("norm.weight") or inner in _ROUTERS:
            return Take(local, None)
        raise ValueError(
            f"tensor model.layers.N.{inner} (shape {list(shape)}): not known to the group sharding "
            "(executor_svc/parallel/shard.py)"
        )


def read(take: Take, tensor: Any) -> Any:
    """``take``'s part of a whole tensor (or of a lazily read safetensors slice, or GGUF blocks)."""
    lazy = hasattr(tensor, "get_shape")  # a safetensors slice: only what is indexed is read
    if take.dim is None:
        return tensor[:] if lazy else tensor
    parts = [_narrow(tensor, lazy, take.dim, start, end) for start, end in take.ranges]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=take.dim)
    if take.rows and out.shape[0] < take.rows:  # the last vocabulary shard: zero rows up to the others' size
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"{take.name}: a vocabulary the group does not divide evenly, kept as GGUF blocks")
        pad = torch.zeros((take.rows - out.shape[0], *out.shape[1:]), dtype=out.dtype)
        out = torch.cat([out, pad])
    return out


def _narrow(tensor: Any, lazy: bool, dim: int, start: int, end: int) -> Any:
    if lazy:
        index = [slice(None)] * (dim + 1)
        index[dim] = slice(start, end)
        return tensor[tuple(index)]
    if isinstance(tensor, torch.Tensor):
        return tensor.narrow(dim, start, end - start).clone()
    from executor_svc.quant.gguf_blocks import narrow_blocks

    return narrow_blocks(tensor, dim, start, end)


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """[first, end) layers of a pipeline stage: contiguous runs as even as the count allows (earlier stages get
    the extra ones: the last stage also runs the LM head)."""
    base, extra = divmod(num_layers, pp_size)
    first = pp_rank * base + min(pp_rank, extra)
    return first, first + base + (1 if pp_rank < extra else 0)


def _check_divisible(config: ModelConfig, tp: int, pp: int) -> None:
    problems = []
    if config.num_heads % tp:
        problems.append(f"{config.num_heads} attention heads")
    kv = config.num_kv_heads
    if kv % tp and tp % kv:
        problems.append(f"{kv} KV heads (they must divide or be divided by it)")
    if config.intermediate_size % tp:
        problems.append(f"intermediate size {config.intermediate_size}")
    moe_inter = getattr(config, "moe_intermediate_size", 0)
    if moe_inter % tp:
        problems.append(f"expert intermediate size {moe_inter}")
    if problems:
        raise ValueError(f"--tensor-parallel-size {tp} does not divide the model's {', '.join(problems)}")
    if pp > config.num_layers:
        raise ValueError(f"--pipeline-parallel-size {pp} exceeds the model's {config.num_layers} layers")


def _scaled(heads: tuple[int, int], head_dim: int) -> tuple[int, int]:
    return heads[0] * head_dim, heads[1] * head_dim


def _shift(span: tuple[int, int], offset: int) -> tuple[int, int]:
    return span[0] + offset, span[1] + offset
