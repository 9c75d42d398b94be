"""Name -> implementation registries (attention backends, layer ops), with ``auto``.

Each entry knows whether it can run on a device and dtype. Asked by name, an
entry that cannot run here is refused with its reason; ``auto`` takes the
highest-priority entry that can run here (nothing is ever compiled), and falls
back to the next one when constructing it fails (a broken native build must
not stop the executor). Selection happens once, when the model loads.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

T = TypeVar("T")

# (device, dtype) -> why the entry cannot run there, or None when it can.
Availability = Callable[[torch.device, torch.dtype], str | None]


def always_available(device: torch.device, dtype: torch.dtype) -> str | None:
    """The availability of pure torch code: anywhere."""
    return None


@dataclasses.dataclass(frozen=True)
class Implementation(Generic[T]):
    """One registered implementation."""

    name: str
    # Imports (optional packages load only here) and constructs it for a device and dtype.
    create: Callable[[torch.device, torch.dtype], T]
    unavailable: Availability = always_available
    # auto tries entries from the highest priority down; None: used only when named.
    auto_priority: int | None = None


class ImplementationRegistry(Generic[T]):
    """The implementations of one interface, by name."""

    def __init__(self, kind: str):
        self.kind = kind  # what the entries are, for messages: "attention backend"
        self._entries: dict[str, Implementation[T]] = {}

    def register(self, entry: Implementation[T]) -> None:
        """Adds an entry.

        Raises:
            ValueError: the name is taken (or is "auto").
        """
        if entry.name == "auto" or entry.name in self._entries:
            raise ValueError(f"{self.kind} {entry.name!r} is registered already")
        self._entries[entry.name] = entry

    def unregister(self, name: str) -> None:
        """Removes an entry (tests that register their own)."""
        self._entries.pop(name, None)

    def names(self) -> tuple[str, ...]:
        """Every name create() takes: "auto", then the entries in registration order."""
        return ("auto", *self._entries)

    def create(self, name: str, device: torch.device, dtype: torch.dtype) -> T:
        """The named implementation (or auto's choice) for a device and dtype.

        Raises:
            ValueError: an unknown name, or an entry that cannot run here.
        """
        if name == "auto":
            return self._auto(device, dtype)
        entry = self._entries.get(name)
        if entry is None:
            raise ValueError(f"unknown {self.kind} {name!r}; use one of {', '.join(self.names())}")
        reason = entry.unavailable(device, dtype)
        if reason is not None:
            raise ValueError(f"{self.kind} {name!r} {reason}")
        return entry.create(device, dtype)

    def _auto(self, device: torch.device, dtype: torch.dtype) -> T:
        ranked = sorted(
            (e for e in self._entries.values() if e.auto_priority is not None),
            key=lambda e: -(e.auto_priority or 0),
        )
        for entry in ranked:
            if entry.unavailable(device, dtype) is not None:
                continue
            try:
                return entry.create(device, dtype)
            except Exception as exc:  # a broken build must not stop the executor
                warnings.warn(f"{self.kind} {entry.name!r} unusable ({exc}); trying the next one", stacklevel=3)
        raise ValueError(f"no {self.kind} can run on {device} with {dtype}")
