"""The executor's lease state machine on a fake clock: one holder at a time, fenced by an epoch."""

from __future__ import annotations

import pytest

from executor_svc.serving.lease import LIVE_WINDOW_S, UNUSED_LEASE_S, Lease, LeaseRefused, LeaseTable


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def table(clock: Clock) -> LeaseTable:
    return LeaseTable(clock, epoch_base=100)


def test_one_holder_at_a_time_and_each_grant_a_higher_epoch(table: LeaseTable):
    assert table.acquire("s1") == Lease(True, 101, "s1")
    table.attach("s1", 101)
    assert table.acquire("s2") == Lease(False, 101, "s1")
    assert table.acquire("s1") == Lease(False, 101, "s1"), "a stream holds it: not even its holder re-acquires"
    assert table.release(101)
    assert table.acquire("s2") == Lease(True, 102, "s2")


def test_a_stream_must_name_the_lease_in_force(table: LeaseTable):
    with pytest.raises(LeaseRefused, match="no lease is held"):
        table.attach("s1", 100)
    table.acquire("s1")
    for scheduler_id, epoch in (("s2", 101), ("s1", 100), ("s1", 102), ("", 0)):
        with pytest.raises(LeaseRefused, match="held by s1 at epoch 101"):
            table.attach(scheduler_id, epoch)
    table.attach("s1", 101)
    with pytest.raises(LeaseRefused, match="another stream already uses this lease"):
        table.attach("s1", 101)


def test_plans_of_another_epoch_are_refused(table: LeaseTable):
    table.acquire("s1")
    with pytest.raises(LeaseRefused):
        table.check_plan(101, 101)  # not attached yet
    table.attach("s1", 101)
    table.check_plan(101, 101)
    with pytest.raises(LeaseRefused, match="its stream has epoch 101"):
        table.check_plan(101, 100)
    with pytest.raises(LeaseRefused, match="held by s1 at epoch 101"):
        table.check_plan(100, 100)  # a stale stream's own plan


def test_release_of_another_epoch_changes_nothing(table: LeaseTable):
    table.acquire("s1")
    assert not table.release(101), "a lease no stream used is not released by a stream end"
    table.attach("s1", 101)
    assert not table.release(100) and table.holder_id == "s1"
    assert table.release(101) and table.holder_id == "" and not table.held
    assert not table.release(101)


def test_an_unused_grant_lapses_and_may_be_renewed_by_its_holder(table: LeaseTable, clock: Clock):
    table.acquire("s1")
    assert table.acquire("s1") == Lease(True, 102, "s1"), "renewed before use: the old epoch is dead"
    with pytest.raises(LeaseRefused):
        table.attach("s1", 101)
    clock.now += UNUSED_LEASE_S - 0.1
    assert table.held and table.acquire("s2").granted is False
    clock.now += 0.2
    assert not table.held
    with pytest.raises(LeaseRefused, match="no lease is held"):
        table.attach("s1", 102)
    assert table.acquire("s2") == Lease(True, 103, "s2")


def test_an_attached_lease_never_lapses(table: LeaseTable, clock: Clock):
    table.acquire("s1")
    table.attach("s1", 101)
    clock.now += 10 * UNUSED_LEASE_S
    assert table.held and table.acquire("s2").granted is False
    table.check_plan(101, 101)


def test_live_schedulers_are_those_seen_lately_and_not_draining(table: LeaseTable, clock: Clock):
    table.seen("s2")
    table.seen("s1")
    table.seen("")  # an anonymous Describe records nobody
    assert table.live_schedulers() == ("s1", "s2")
    table.seen("s2", draining=True)
    assert table.live_schedulers() == ("s1",)
    clock.now += LIVE_WINDOW_S / 2
    table.seen("s3")
    clock.now += LIVE_WINDOW_S / 2 + 0.1
    assert table.live_schedulers() == ("s3",)


def test_claimants_are_recently_refused_schedulers_other_than_the_holder(table: LeaseTable, clock: Clock):
    table.acquire("s1")
    table.attach("s1", 101)
    table.acquire("s2")
    table.acquire("s3")
    assert table.claimants() == ("s2", "s3")
    clock.now += LIVE_WINDOW_S + 0.1
    table.acquire("s3")
    assert table.claimants() == ("s3",)
    table.release(101)
    table.acquire("s3")
    assert table.claimants() == ()


def test_epochs_start_from_a_random_48_bit_base():
    bases = {LeaseTable().epoch for _ in range(4)}
    assert len(bases) == 4 and all(0 <= b < 2**48 for b in bases)


def test_an_empty_scheduler_id_is_refused(table: LeaseTable):
    with pytest.raises(ValueError, match="scheduler_id"):
        table.acquire("")
