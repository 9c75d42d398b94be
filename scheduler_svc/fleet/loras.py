"""LoRA adapters over the executors: which executor has which, loading and unloading everywhere, replay.

The executors own the adapters (registered from folders on their file system,
docs/lora.md); a scheduler learns which executor has which from their Describe
(``ExecutorHandle.loras``) and routes a request only to executors that have its
adapter with the same weights (fingerprint). It loads an adapter on every
executor it knows, and keeps it wanted (its ``--lora`` flags too): an executor
that comes back, restarted or reachable again, gets each wanted adapter it
lacks at the next heartbeat, once per incarnation. Until then, a request for
a wanted adapter waits for an executor that has it, as any request waits for
an executor; it is never failed for it.

Pure Python: no torch, no numpy; gRPC statuses are mapped onto the engine's
errors here.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Coroutine, Iterable, Mapping
from typing import Any

import grpc
import structlog

from pagoda.step import LoraAdapter
from scheduler_svc.errors import AlreadyExists, InvalidRequest, NotFound, RequestError, Unavailable
from scheduler_svc.fleet.executor_handle import ExecutorHandle

log = structlog.get_logger("scheduler")

MAX_NAME_CHARS = 128
MAX_PATH_CHARS = 4096
# An executor's refusal, as the engine's error (other statuses: the executor is unreachable now).
_REFUSALS: dict[grpc.StatusCode, type[RequestError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
}


def check_name(name: str, base_model: str) -> None:
    """A name requests can give: 1-128 printable characters without spaces, not the base model's name.

    Raises:
        InvalidRequest: it is not.
    """
    if not name or len(name) > MAX_NAME_CHARS or not name.isprintable() or any(c.isspace() for c in name):
        raise InvalidRequest("lora_name", f"1 to {MAX_NAME_CHARS} printable characters without spaces")
    if name == base_model:
        raise InvalidRequest("lora_name", f"{name!r} is the base model's name")


class LoraCatalog:
    """The adapters of the executors one scheduler knows, and the ones it wants on each of them."""

    def __init__(
        self,
        executors: Mapping[str, ExecutorHandle],
        wanted: Mapping[str, str],
        on_loaded: Callable[[], None] = lambda: None,
        in_use: Callable[[], set[str]] = set,
    ) -> None:
        """``wanted``: name -> folder of the adapters to register on every executor (``--lora``);
        ``on_loaded``: called when an executor got an adapter (requests waiting for it can be placed);
        ``in_use``: the adapters this scheduler's unfinished requests name."""
        self._executors = executors
        self._on_loaded = on_loaded
        self._in_use = in_use
        # Unloaded, still used by requests here: the executors unregister them when those end (``tick``).
        self.retiring: set[str] = set()
        # Unloads being sent to the executors, by name (a load of the name waits for its unload).
        self._unregistering: dict[str, asyncio.Task[None]] = {}
        self.wanted: dict[str, str] = dict(wanted)
        # (address, incarnation, name) given a wanted adapter already: not again until it restarts.
        self._given: set[tuple[str, str, str]] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def adapters(self) -> tuple[LoraAdapter, ...]:
        """Every adapter an executor has now, by name (the first executor's, when several have it)."""
        found: dict[str, LoraAdapter] = {}
        for executor in self._live():
            for name, adapter in executor.loras.items():
                if name not in self.retiring:
                    found.setdefault(name, adapter)
        return tuple(found[name] for name in sorted(found))

    def check_known(self, name: str) -> None:
        """Raises NotFound unless an executor has adapter ``name`` (not being unloaded) or it is wanted (loading)."""
        if name in self.wanted or name not in self.retiring and any(name in e.loras for e in self._live()):
            return
        known = ", ".join(a.name for a in self.adapters()) or "none"
        raise NotFound(f"LoRA adapter {name!r} is not loaded (loaded: {known})")

    def holders(self, name: str, fingerprint: str) -> tuple[list[ExecutorHandle], str]:
        """The executors with adapter ``name`` and the fingerprint they share: ``fingerprint`` when given (a
        sequence placed before keeps its adapter's weights), else the one most of them have."""
        having = [e for e in self._executors.values() if name in e.loras]
        if not fingerprint and having:
            counts = collections.Counter(e.loras[name].fingerprint for e in having)
            fingerprint = counts.most_common(1)[0][0]
        return [e for e in having if e.loras[name].fingerprint == fingerprint], fingerprint

    async def load(self, name: str, path: str) -> LoraAdapter:
        """Registers the adapter in folder ``path`` as ``name`` on every executor described and reachable,
        and wants it on the others. Refused by one, it is taken back from those that took it just now.

        Raises:
            InvalidRequest: a bad name or path, or the adapter does not fit the model (the executor's reason).
            NotFound: no such folder. AlreadyExists: ``name`` holds another adapter.
            Unavailable: no executor could be reached.
        """
        if not path or len(path) > MAX_PATH_CHARS:
            raise InvalidRequest("lora_path", f"1 to {MAX_PATH_CHARS} characters")
        unregistering = self._unregistering.get(name)
        if unregistering is not None:  # an unload of this name on its way to the executors: after it
            await unregistering
        targets = list(self._live())
        if not targets:
            raise Unavailable("no executor has connected yet")
        had = {e.address for e in targets if name in e.loras}
        results = await asyncio.gather(*(e.load_lora(name, path) for e in targets), return_exceptions=True)
        refusal = next((r for r in results if isinstance(r, grpc.aio.AioRpcError) and _refusal(r) is not None), None)
        if refusal is not None:
            taken = [e for e, r in zip(targets, results, strict=True) if isinstance(r, LoraAdapter)]
            await self._take_back(name, [e for e in taken if e.address not in had])
            raise _as_error(refusal)
        loaded = [r for r in results if isinstance(r, LoraAdapter)]
        if not loaded:
            raise Unavailable(f"no executor could be reached to load LoRA adapter {name!r}: {results[0]}")
        self.wanted[name] = path
        self.retiring.discard(name)  # unloaded, then loaded again before its requests ended: it stays
        for executor, result in zip(targets, results, strict=True):
            if isinstance(result, LoraAdapter):
                self._given.add((executor.address, _incarnation(executor), name))
        log.info(
            "lora_loaded", name=name, path=path, num_executors=len(loaded), num_unreachable=len(targets) - len(loaded)
        )
        self._on_loaded()
        return loaded[0]

    def unload(self, name: str) -> None:
        """Retires adapter ``name``: new requests naming it get NotFound now; the executors unregister it
        when this scheduler's requests that use it have ended (``tick``).

        Raises:
            NotFound: no executor has it and it is not wanted.
        """
        if name in self.retiring or name not in self.wanted and not any(name in e.loras for e in self._live()):
            raise NotFound(f"LoRA adapter {name!r} is not loaded")
        self.wanted.pop(name, None)
        self.retiring.add(name)
        log.info("lora_unloading", name=name)
        self.tick()

    def tick(self) -> None:
        """After each heartbeat: unregister the retired adapters no request here uses; replay wanted ones."""
        if self.retiring:
            used = self._in_use()
            for name in [name for name in self.retiring if name not in used]:
                self.retiring.discard(name)
                self._unregistering[name] = self._spawn(self._unregister(name))
        self._replay()

    async def _unregister(self, name: str) -> None:
        try:
            holders = [e for e in self._executors.values() if name in e.loras]
            results = await asyncio.gather(*(e.unload_lora(name) for e in holders), return_exceptions=True)
            failed = [e.address for e, r in zip(holders, results, strict=True) if isinstance(r, Exception)]
            log.info("lora_unloaded", name=name, num_executors=len(holders), failed=failed)
        finally:
            self._unregistering.pop(name, None)

    def _replay(self) -> None:
        """Gives each described, reachable executor the wanted adapters it lacks (once per incarnation)."""
        for executor in self._live():
            incarnation = _incarnation(executor)
            for name, path in self.wanted.items():
                key = (executor.address, incarnation, name)
                if name not in executor.loras and key not in self._given:
                    self._given.add(key)
                    self._spawn(self._give(executor, name, path, key))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _give(self, executor: ExecutorHandle, name: str, path: str, key: tuple[str, str, str]) -> None:
        try:
            await executor.load_lora(name, path)
            log.info("lora_replayed", name=name, executor=executor.address)
            self._on_loaded()
        except grpc.aio.AioRpcError as exc:
            if _refusal(exc) is None:  # unreachable: try again at a later heartbeat
                self._given.discard(key)
            log.warning("lora_replay_failed", name=name, executor=executor.address, error=exc.details())

    async def _take_back(self, name: str, executors: Iterable[ExecutorHandle]) -> None:
        await asyncio.gather(*(e.unload_lora(name) for e in executors), return_exceptions=True)

    def _live(self) -> Iterable[ExecutorHandle]:
        return (e for e in self._executors.values() if e.info is not None and e.view.reachable and e.usable)


def _incarnation(executor: ExecutorHandle) -> str:
    return executor.info.incarnation_id if executor.info is not None else ""


def _refusal(result: object) -> grpc.StatusCode | None:
    """The status of an executor's refusal (the adapter or the name), None for anything else."""
    if isinstance(result, grpc.aio.AioRpcError) and result.code() in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
    ):
        return result.code()
    return None


def _as_error(exc: grpc.aio.AioRpcError) -> RequestError:
    details = exc.details() or exc.code().name
    error = _REFUSALS.get(exc.code())
    return error(details) if error is not None else InvalidRequest("lora_path", details)
