"""Adapters by name: registered (a folder), checked copies in host memory, up to ``max_loras`` resident.

Three tiers, each a subset of the one before. Registering reads and checks an
adapter at once (a bad one is refused before anything changes) and keeps its
checked copy in host memory; the host copies are an LRU of ``max_cpu_loras``
(None: all stay), an evicted one is read from its folder again when needed.
A step computes with resident adapters only: ``acquire`` makes one resident,
evicting the least recently used adapter that no running sequence uses. An
adapter a running sequence uses is never evicted, so when every slot holds
one, ``acquire`` returns False and the caller keeps the sequence out (the
runner fails it with a message saying so; a scheduler that keeps at most
``max_loras`` distinct adapters among an executor's running sequences never
meets it). Which adapters are in use is the owner's to say (``in_use``: the
runner's sequences'), asked only when a slot must be freed.

Removing an adapter that running sequences use retires it: it leaves the
listing at once and goes when the last of them ends (``sweep``), so a
request that runs with it finishes with it, preempted and recomputed or not.

Called from the runner's one model thread, like the steps.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Callable, Collection
from pathlib import Path

import torch

from executor_svc.loading.model_config import ModelConfig
from executor_svc.lora.adapter import LoraAdapter, load_adapter
from executor_svc.lora.errors import LoraAdapterError, LoraRegistryError
from executor_svc.lora.peft_format import CONFIG_FILE, WEIGHTS_FILE
from executor_svc.lora.weights import DeviceLora, Packer, to_device


@dataclasses.dataclass(frozen=True)
class LoraInfo:
    """A registered adapter, as the executor reports it."""

    name: str
    path: str
    rank: int  # its largest module rank
    target_modules: tuple[str, ...]  # inside model.layers.N. ("self_attn.q_proj", ...)
    # A digest of its two files: KV computed with it is keyed by this (the scheduler's block hashes).
    fingerprint: str


class LoraRegistry:
    """The executor's adapters: every registered one's folder, host copies (LRU) and resident ones (LRU)."""

    def __init__(
        self,
        config: ModelConfig,
        pack: Packer,
        dtype: torch.dtype,
        device: torch.device,
        *,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int | None = None,
        in_use: Callable[[], Collection[str]] = tuple,
    ):
        """An empty registry.

        Args:
            config: the base model's (adapters are checked against it).
            pack: packs an adapter matrix for the model's layer ops (``LayerOps.pack`` with dense=True).
            dtype, device: of the resident adapters (the model's).
            max_loras: adapters resident at once (>= 1).
            max_rank: the largest rank an adapter's module may have.
            max_cpu_loras: checked copies kept in host memory (None: every registered adapter's).
            in_use: the names of the adapters running sequences use now.
        """
        if max_loras < 1 or max_rank < 1 or (max_cpu_loras is not None and max_cpu_loras < 0):
            raise ValueError(f"max_loras {max_loras} and max_rank {max_rank} must be >= 1, max_cpu_loras >= 0")
        self.config, self.pack, self.dtype, self.device = config, pack, dtype, device
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.in_use = in_use
        self._infos: dict[str, LoraInfo] = {}
        self._stamps: dict[str, tuple[int, ...]] = {}  # its files' sizes and times when it was registered
        self._host: collections.OrderedDict[str, LoraAdapter] = collections.OrderedDict()  # least recent first
        self._resident: collections.OrderedDict[str, DeviceLora] = collections.OrderedDict()  # least recent first
        self._retiring: set[str] = set()  # removed while in use: gone when no running sequence uses them

    def __len__(self) -> int:
        """Registered adapters."""
        return len(self._infos)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def infos(self) -> tuple[LoraInfo, ...]:
        """Every registered adapter new sequences may name, in registration order (not the retiring ones)."""
        return tuple(info for name, info in self._infos.items() if name not in self._retiring)

    def resident_names(self) -> tuple[str, ...]:
        """The resident adapters, least recently used first."""
        return tuple(self._resident)

    def host_names(self) -> tuple[str, ...]:
        """The adapters with a checked copy in host memory, least recently used first."""
        return tuple(self._host)

    def register(self, name: str, path: str | Path) -> LoraInfo:
        """Reads and checks the adapter at ``path`` and registers it as ``name`` (not resident yet).

        The same adapter (folder and files) registered again under its name is returned as it is (and kept, if
        it was retiring): a scheduler replays its adapters to every executor it finds.

        Raises:
            LoraAdapterError: the adapter does not fit the model (nothing changes).
            LoraRegistryError: ``name`` is empty or holds another adapter.
        """
        if not name:
            raise LoraRegistryError("an adapter needs a name")
        fingerprint = _fingerprint(path)
        known = self._infos.get(name)
        if known is not None:
            if (known.path, known.fingerprint) != (str(path), fingerprint):
                raise LoraRegistryError(
                    f"LoRA adapter {name!r} is registered already, from {known.path} (remove it first)"
                )
            self._retiring.discard(name)
            return known
        adapter = load_adapter(path, self.config, self.max_rank)
        info = LoraInfo(name, str(path), adapter.rank, adapter.target_modules, fingerprint)
        self._infos[name] = info
        self._stamps[name] = _stamp(path)
        self._keep_on_host(name, adapter)
        return info

    def unregister(self, name: str) -> bool:
        """Forgets an adapter: its folder, host copy and slot; at once, or, while running sequences use it,
        when the last of them ends (``sweep``). Returns whether it went at once.

        Raises:
            LoraRegistryError: unknown (or retiring already).
        """
        if name in self._retiring:
            raise LoraRegistryError(f"LoRA adapter {name!r} is being removed already")
        self._check_known(name)
        if name in set(self.in_use()):
            self._retiring.add(name)
            return False
        self._forget(name)
        return True

    def sweep(self) -> tuple[str, ...]:
        """Forgets the retiring adapters no running sequence uses any more; returns their names."""
        if not self._retiring:
            return ()
        busy = set(self.in_use())
        gone = tuple(name for name in self._retiring if name not in busy)
        for name in gone:
            self._retiring.discard(name)
            self._forget(name)
        return gone

    def _forget(self, name: str) -> None:
        del self._infos[name]
        del self._stamps[name]
        self._host.pop(name, None)
        self._resident.pop(name, None)

    def acquire(self, name: str) -> bool:
        """Makes ``name`` resident (most recently used); False when every slot holds an adapter in use.

        Raises:
            LoraRegistryError: unknown name.
            LoraAdapterError: its host copy was evicted and its folder no longer holds it (gone, or changed).
        """
        self._check_known(name)
        if name in self._resident:
            self._resident.move_to_end(name)
            return True
        victim = None
        if len(self._resident) >= self.max_loras:
            busy = set(self.in_use())
            victim = next((resident for resident in self._resident if resident not in busy), None)
            if victim is None:
                return False
        adapter = self._host_copy(name)  # may fail: the victim stays until it has
        if victim is not None:
            del self._resident[victim]
        self._resident[name] = to_device(name, adapter, self.config.num_layers, self.pack, self.dtype, self.device)
        return True

    def resident(self, name: str) -> DeviceLora:
        """A resident adapter for a step (most recently used now).

        Raises:
            KeyError: not resident (a sequence's adapter is acquired when it arrives).
        """
        self._resident.move_to_end(name)
        return self._resident[name]

    def _host_copy(self, name: str) -> LoraAdapter:
        adapter = self._host.get(name)
        if adapter is None:
            path = self._infos[name].path
            adapter = load_adapter(path, self.config, self.max_rank)
            if _stamp(path) != self._stamps[name]:
                raise LoraAdapterError(f"{path}: its files changed since {name!r} was registered (add it anew)")
        self._keep_on_host(name, adapter)
        return adapter

    def _keep_on_host(self, name: str, adapter: LoraAdapter) -> None:
        """Keeps the checked copy as the most recently used one, dropping the least recent past the limit."""
        self._host[name] = adapter
        self._host.move_to_end(name)
        while self.max_cpu_loras is not None and len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def _check_known(self, name: str) -> None:
        if name not in self._infos:
            known = ", ".join(self._infos) or "none"
            raise LoraRegistryError(f"unknown LoRA adapter {name!r} (registered: {known})")


def _fingerprint(path: str | Path) -> str:
    """A digest of an adapter's two files (what its KV depends on); missing files are load_adapter's to name."""
    digest = hashlib.blake2b(digest_size=12)
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            with open(Path(path) / file, "rb") as f:
                digest.update(hashlib.file_digest(f, "blake2b").digest())
        except OSError:
            return ""
    return digest.hexdigest()


def _stamp(path: str | Path) -> tuple[int, ...]:
    """Sizes and modification times of an adapter's two files (a host copy read again must be the same)."""
    stats = [(Path(path) / file).stat() for file in (CONFIG_FILE, WEIGHTS_FILE)]
    return tuple(value for stat in stats for value in (stat.st_size, stat.st_mtime_ns))
