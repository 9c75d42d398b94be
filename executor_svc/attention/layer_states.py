"""Which per-step attention state each layer of a model uses.

Layers differ in their sliding window and their logit soft-cap; layers sharing
both share one state, prepared once per step by the backend. The model runner
keeps one of these for its model and the draft model one for its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from executor_svc.attention.metadata import AttentionMetadata
from executor_svc.loading.model_config import LayerConfig


class LayerStates:
    """The distinct (sliding window, soft-cap) pairs of a model's layers, and each layer's."""

    def __init__(self, layers: Sequence[LayerConfig]) -> None:
        kinds = [(layer.sliding_window, layer.logit_softcap) for layer in layers]
        self.kinds = tuple(dict.fromkeys(kinds))  # the distinct ones, in layer order
        self._layer_kind_index = [self.kinds.index(kind) for kind in kinds]

    def prepare(self, backend: Any, meta: AttentionMetadata) -> list[Any]:
        """One state per layer ([num_layers]), each distinct pair's prepared once from ``meta``.

        ``meta`` is built without a window or cap: each distinct pair gets its own copy.
        """
        states = [backend.prepare(meta.for_layers(*kind)) for kind in self.kinds]
        return [states[i] for i in self._layer_kind_index]
