"""The executor's lease: which scheduler may drive it, fenced by an epoch.

However many schedulers run, one at a time drives an executor: it calls
`Acquire`, gets a lease with a new epoch, and opens one `Execute` stream that
carries that epoch (and so does every plan on it). The lease ends when that
stream ends, or, never used, `UNUSED_LEASE_S` after the grant. While a stream
holds the lease nobody else can take it, not even a new process of the same
scheduler: a dead holder's stream ends when its connection does (at once for
a killed process, within the keepalive timeout for a lost host).

Epochs only increase: each grant adds one, and a new executor process starts
from a random 48-bit base, so an epoch is never reused across restarts either.

`Describe` doubles as the schedulers' heartbeat: `seen` records each caller,
and `live_schedulers` is the ids seen in the last `LIVE_WINDOW_S` (draining
schedulers excluded), from which every scheduler derives the same ownership.

Pure Python with an injectable clock, so the state machine is tested alone.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger("executor")

# A granted lease that no Execute stream has used for this long lapses.
UNUSED_LEASE_S = 10.0
# A scheduler that has not called Describe for this long is no longer live.
LIVE_WINDOW_S = 3.0


@dataclasses.dataclass(frozen=True)
class Lease:
    """The answer to Acquire: whether it was granted, and the lease in force."""

    granted: bool
    epoch: int
    holder_id: str


class LeaseRefused(Exception):
    """A stream or plan that does not belong to the lease in force (FAILED_PRECONDITION)."""


class LeaseTable:
    """The lease in force and the schedulers seen; every method takes the time from `clock`."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, epoch_base: int | None = None) -> None:
        self._clock = clock
        self.epoch = random.getrandbits(48) if epoch_base is None else epoch_base
        self.holder_id = ""
        self._granted_at = 0.0
        # Whether an Execute stream holds the current lease.
        self._attached = False
        self._seen: dict[str, float] = {}
        self._draining: set[str] = set()
        # Scheduler id -> when its Acquire was last refused.
        self._claims: dict[str, float] = {}

    @property
    def held(self) -> bool:
        """Whether a scheduler holds the lease (granted and not lapsed)."""
        self._lapse_unused()
        return bool(self.holder_id)

    def seen(self, scheduler_id: str, draining: bool = False) -> None:
        """Record a heartbeat (a Describe) from `scheduler_id`."""
        if not scheduler_id:
            return
        self._seen[scheduler_id] = self._clock()
        if draining:
            self._draining.add(scheduler_id)
        else:
            self._draining.discard(scheduler_id)

    def live_schedulers(self) -> tuple[str, ...]:
        """Ids (sorted) of the non-draining schedulers seen in the last LIVE_WINDOW_S."""
        now = self._clock()
        for scheduler_id, at in list(self._seen.items()):
            if now - at > LIVE_WINDOW_S:
                del self._seen[scheduler_id]
                self._draining.discard(scheduler_id)
        return tuple(sorted(s for s in self._seen if s not in self._draining))

    def claimants(self) -> tuple[str, ...]:
        """Ids (sorted) of the schedulers, other than the holder, refused a lease in the last LIVE_WINDOW_S."""
        now = self._clock()
        for scheduler_id, at in list(self._claims.items()):
            if now - at > LIVE_WINDOW_S or scheduler_id == self.holder_id:
                del self._claims[scheduler_id]
        return tuple(sorted(self._claims))

    def acquire(self, scheduler_id: str) -> Lease:
        """Grant a new lease (epoch + 1) when nobody holds one, or the caller holds one no stream uses."""
        self._lapse_unused()
        if not scheduler_id:
            raise ValueError("scheduler_id: must not be empty")
        if self.holder_id and (self.holder_id != scheduler_id or self._attached):
            if scheduler_id not in self._claims:
                log.info("lease_refused", scheduler_id=scheduler_id, holder_id=self.holder_id, epoch=self.epoch)
            self._claims[scheduler_id] = self._clock()
            return Lease(False, self.epoch, self.holder_id)
        self.epoch += 1
        self.holder_id, self._granted_at, self._attached = scheduler_id, self._clock(), False
        self._claims.pop(scheduler_id, None)
        log.info("lease_granted", holder_id=scheduler_id, epoch=self.epoch)
        return Lease(True, self.epoch, scheduler_id)

    def attach(self, scheduler_id: str, epoch: int) -> None:
        """Bind a new Execute stream to the lease it names, or raise LeaseRefused."""
        self._lapse_unused()
        if not self.holder_id or (scheduler_id, epoch) != (self.holder_id, self.epoch) or self._attached:
            reason = self._refusal(scheduler_id, epoch, "stream")
            if self.holder_id and self._attached and (scheduler_id, epoch) == (self.holder_id, self.epoch):
                reason += " (another stream already uses this lease)"
            log.warning("lease_stream_refused", scheduler_id=scheduler_id, epoch=epoch, reason=reason)
            raise LeaseRefused(reason)
        self._attached = True
        log.info("lease_attached", holder_id=scheduler_id, epoch=epoch)

    def check_plan(self, stream_epoch: int, plan_epoch: int) -> None:
        """Raise LeaseRefused unless a plan's epoch is its stream's and that stream holds the lease in force."""
        if plan_epoch != stream_epoch or stream_epoch != self.epoch or not self._attached:
            reason = self._refusal("", plan_epoch, "plan")
            if plan_epoch != stream_epoch:
                reason += f" (its stream has epoch {stream_epoch})"
            log.warning("lease_plan_refused", epoch=plan_epoch, stream_epoch=stream_epoch, reason=reason)
            raise LeaseRefused(reason)

    def release(self, epoch: int) -> bool:
        """The stream of lease `epoch` ended: release it (no-op for any other epoch)."""
        if epoch != self.epoch or not self._attached:
            return False
        log.info("lease_released", holder_id=self.holder_id, epoch=epoch)
        self.holder_id, self._attached = "", False
        return True

    def _lapse_unused(self) -> None:
        if self.holder_id and not self._attached and self._clock() - self._granted_at > UNUSED_LEASE_S:
            log.info("lease_lapsed", holder_id=self.holder_id, epoch=self.epoch, unused_s=UNUSED_LEASE_S)
            self.holder_id = ""

    def _refusal(self, scheduler_id: str, epoch: int, what: str) -> str:
        who = f" from {scheduler_id}" if scheduler_id else ""
        if not self.holder_id:
            return f"{what}{who} with epoch {epoch} refused: no lease is held (last epoch {self.epoch}); call Acquire"
        return f"{what}{who} with epoch {epoch} refused: the lease is held by {self.holder_id} at epoch {self.epoch}"
