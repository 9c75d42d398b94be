"""Which executors this scheduler should drive when several schedulers share them.

Every scheduler polls every executor's Describe (its heartbeat, HEARTBEAT_S
apart) and learns from each who holds its lease, which schedulers it saw live
and which ones asked for the lease and were refused (claimants). From that,
each scheduler decides alone and all decide alike:

- executors sorted by address; the *owner* of executor i is live[i mod n],
  where live is the sorted ids that executor reports (a scheduler that cannot
  reach an executor never owns it);
- free and mine: acquire it; held by another and mine: ask anyway (the refusal
  makes me a claimant, the holder's proof that I am alive and want it);
- free for RESCUE_AFTER_S and not taken by its owner (dead but still listed,
  or slow): anyone acquires it;
- held by me, owned by a claimant that has been live for HANDBACK_AFTER_S:
  release it (my sequences on it move to my other executors).

The executor's lease makes this safe while views differ for a moment: two
schedulers that both decide to acquire get one grant. Pure Python; the clock
is an argument.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

# Seconds between two polls of each executor's Describe.
HEARTBEAT_S = 0.5
# A free executor whose owner has not taken it for this long is anyone's.
RESCUE_AFTER_S = 1.5
# A new (or restarted) owner must be live this long before it gets its executor back.
HANDBACK_AFTER_S = 2.0
# With other schedulers live, a request that has had no executor here this long ends
# with UNAVAILABLE, so that its client resumes it on another scheduler.
ORPHAN_TIMEOUT_S = 3.0


@dataclasses.dataclass(frozen=True)
class ExecutorView:
    """One executor as its last Describe showed it."""

    address: str
    # Whether the last Describe answered.
    reachable: bool
    # The lease holder ("" when free).
    holder_id: str = ""
    # The epoch of the lease in force (the last one when free).
    epoch: int = 0
    # Live (non-draining) scheduler ids it reports, sorted.
    schedulers: tuple[str, ...] = ()
    # Schedulers refused the lease lately.
    claimants: tuple[str, ...] = ()
    draining: bool = False
    # False when this scheduler will not drive it (another model).
    usable: bool = True


class Action(enum.Enum):
    """What to do with one executor now."""

    NONE = "none"
    ACQUIRE = "acquire"
    RESCUE = "rescue"
    RELEASE = "release"


class Ownership:
    """The rule over time: remembers since when each executor is free and each scheduler live."""

    def __init__(self, scheduler_id: str) -> None:
        self.scheduler_id = scheduler_id
        self._free_since: dict[str, float] = {}
        self._live_since: dict[str, float] = {}

    def live_schedulers(self) -> tuple[str, ...]:
        """Every scheduler some executor reported live at the last decision, and this one (sorted)."""
        return tuple(sorted({*self._live_since, self.scheduler_id}))

    def others_live(self) -> bool:
        """Whether another scheduler was live at the last decision."""
        return any(s != self.scheduler_id for s in self._live_since)

    def owner(self, views: Sequence[ExecutorView], address: str) -> str:
        """The owner of the executor at `address` among the schedulers it reports live (and me)."""
        index = sorted(v.address for v in views).index(address)
        return self._owner(next(v for v in views if v.address == address), index)

    def decide(
        self, views: Sequence[ExecutorView], held: set[str], now: float, draining: bool = False
    ) -> dict[str, Action]:
        """The action for each executor, given what I hold (`held`: addresses) at time `now`."""
        self._track(views, held, now)
        ordered = sorted(views, key=lambda v: v.address)
        return {
            v.address: self._action(v, self._owner(v, i), v.address in held, now, draining)
            for i, v in enumerate(ordered)
        }

    def _owner(self, view: ExecutorView, index: int) -> str:
        live = sorted({*view.schedulers, self.scheduler_id})  # my poll just reached it: I am live there
        return live[index % len(live)]

    def _track(self, views: Sequence[ExecutorView], held: set[str], now: float) -> None:
        live = {s for v in views if v.reachable for s in v.schedulers}
        self._live_since = {s: self._live_since.get(s, now) for s in live}
        free = {v.address for v in views if v.reachable and not v.holder_id and v.address not in held}
        self._free_since = {a: self._free_since.get(a, now) for a in free}

    def _action(self, view: ExecutorView, owner: str, mine_now: bool, now: float, draining: bool) -> Action:
        if not view.reachable or draining:
            return Action.NONE
        if mine_now:
            handback = owner != self.scheduler_id and owner in view.claimants
            return Action.RELEASE if handback and self._live_for(owner, now) >= HANDBACK_AFTER_S else Action.NONE
        if view.draining or not view.usable:
            return Action.NONE
        if owner == self.scheduler_id:
            return Action.ACQUIRE
        if not view.holder_id and now - self._free_since.get(view.address, now) >= RESCUE_AFTER_S:
            return Action.RESCUE
        return Action.NONE

    def _live_for(self, scheduler_id: str, now: float) -> float:
        return now - self._live_since.get(scheduler_id, now)
