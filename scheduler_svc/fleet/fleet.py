"""The executors one scheduler knows: discovery, heartbeats and the ownership rule.

Discovery re-resolves the executor targets every `dns_refresh_s` (a
Kubernetes headless Service resolves to every executor pod) and keeps one
ExecutorHandle per address. Every HEARTBEAT_S the fleet polls every handle
(a brief Describe each, concurrently, each bounded) and applies the ownership
rule (scheduler_svc.fleet.ownership): acquire, rescue or release. The engine owns
the requests; the fleet owns the handles.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

import grpc
import structlog

from pagoda.step import ExecutorInfo
from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.fleet.discovery import resolve_targets
from scheduler_svc.fleet.executor_handle import ExecutorHandle, ExecutorListener
from scheduler_svc.fleet.ownership import HEARTBEAT_S, RESCUE_AFTER_S, Action, ExecutorView, Ownership

log = structlog.get_logger("scheduler")


class Fleet:
    """One handle per discovered executor, and the loop that decides which ones this scheduler drives."""

    def __init__(
        self,
        config: SchedulerServiceConfig,
        listener: ExecutorListener,
        make_config: Callable[[ExecutorInfo], SchedulerConfig],
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.config = config
        self.executors: dict[str, ExecutorHandle] = {}
        self.ownership = Ownership(config.scheduler_id)
        # Set while the scheduler drains: it acquires nothing and is not counted live by the others.
        self.draining = False
        # Called after each heartbeat round (the engine expires orphans and updates health).
        self.on_tick: Callable[[], None] = lambda: None
        self._listener = listener
        self._make_config = make_config
        self._credentials = credentials
        self._tasks: list[asyncio.Task[None]] = []
        self._live: tuple[str, ...] = ()

    @property
    def scheduler_id(self) -> str:
        return self.ownership.scheduler_id

    async def start(self, scheduler_id: str) -> None:
        """Resolve the executors, then poll and apply the rule every HEARTBEAT_S."""
        self.ownership = Ownership(scheduler_id)
        log.info("scheduler_id", scheduler_id=scheduler_id)
        await self.refresh()
        self._tasks = [
            asyncio.create_task(
                self._every(self.config.dns_refresh_s, self.refresh, "executor_discovery_failed", True)
            ),
            asyncio.create_task(self._every(HEARTBEAT_S, self.tick, "heartbeat_failed")),
        ]

    async def stop(self) -> None:
        """Stop polling; release every lease held (their sequences go back to the engine first)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(e.stop() for e in self.executors.values()), return_exceptions=True)

    async def refresh(self) -> None:
        """Start a handle for each new address; drop handles of vanished addresses not driven."""
        addresses = await resolve_targets(self.config.executor_targets)
        for address in addresses:
            if address not in self.executors:
                executor = ExecutorHandle(
                    address,
                    self._listener,
                    self._make_config,
                    self.config.step_timeout_s,
                    self._credentials,
                    self.config.executor_tls_server_name,
                )
                self.executors[address] = executor
                executor.start()
                log.info("executor_discovered", executor=address)
        for address, executor in list(self.executors.items()):
            if address not in addresses and not executor.driving:
                del self.executors[address]
                await executor.stop()
                log.info("executor_removed", executor=address)

    async def tick(self) -> None:
        """One heartbeat round: poll every executor, then acquire, rescue or release what the rule says."""
        handles = list(self.executors.values())
        views = await asyncio.gather(*(h.poll(self.scheduler_id, self.draining) for h in handles))
        held = {h.address for h in handles if h.driving}
        actions = self.ownership.decide(views, held, time.monotonic(), self.draining)
        for handle in handles:
            await self._apply(handle, actions[handle.address], views)
        live = self.ownership.live_schedulers()
        if live != self._live:
            log.info("schedulers_changed", scheduler_id=self.scheduler_id, live=list(live))
            self._live = live
        self.on_tick()

    async def _apply(self, handle: ExecutorHandle, action: Action, views: Sequence[ExecutorView]) -> None:
        if action is Action.NONE or (action is not Action.RELEASE and handle.driving):
            return
        owner = self.ownership.owner(views, handle.address)
        if action is Action.RELEASE:
            log.info("lease_handback", executor=handle.address, epoch=handle.epoch, owner=owner)
            await handle.release(f"owned by {owner}, which is live and asks for it")
            return
        if action is Action.RESCUE:
            log.info("lease_rescue", executor=handle.address, owner=owner, free_for_s=RESCUE_AFTER_S)
        handle.acquire(self.scheduler_id)

    async def _every(
        self, period_s: float, fn: Callable[[], Awaitable[None]], failure: str, wait_first: bool = False
    ) -> None:
        """Run `fn` every `period_s` (a round that fails is logged; the next one runs)."""
        loop = asyncio.get_running_loop()
        if wait_first:
            await asyncio.sleep(period_s)
        while True:
            started = loop.time()
            try:
                await fn()
            except Exception:
                log.exception(failure)
            await asyncio.sleep(max(0.0, period_s - (loop.time() - started)))
