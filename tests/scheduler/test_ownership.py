"""The ownership rule of several schedulers, on a fake clock: who acquires, rescues and hands back what."""

from __future__ import annotations

from scheduler_svc.fleet.ownership import HANDBACK_AFTER_S, RESCUE_AFTER_S, Action, ExecutorView, Ownership

E0, E1, E2 = "10.0.0.1:50061", "10.0.0.2:50061", "10.0.0.3:50061"


def view(address: str, holder: str = "", schedulers=("a", "b"), **kw) -> ExecutorView:
    return ExecutorView(address, True, holder, 7, tuple(schedulers), **kw)


def test_executors_are_dealt_round_robin_over_the_sorted_live_schedulers():
    views = [view(E2), view(E0), view(E1)]
    a, b = Ownership("a"), Ownership("b")
    assert [a.owner(views, e) for e in (E0, E1, E2)] == ["a", "b", "a"]
    assert a.decide(views, set(), 0.0) == {E0: Action.ACQUIRE, E1: Action.NONE, E2: Action.ACQUIRE}
    assert b.decide(views, set(), 0.0) == {E0: Action.NONE, E1: Action.ACQUIRE, E2: Action.NONE}


def test_alone_a_scheduler_owns_everything():
    views = [view(E0, schedulers=("a",)), view(E1, schedulers=())]  # E1 has not recorded my first poll yet
    assert Ownership("a").decide(views, set(), 0.0) == {E0: Action.ACQUIRE, E1: Action.ACQUIRE}
    assert not Ownership("a").others_live()


def test_owner_asks_for_its_executor_while_another_holds_it():
    views = [view(E0, holder="b"), view(E1, holder="b")]
    assert Ownership("a").decide(views, set(), 0.0) == {E0: Action.ACQUIRE, E1: Action.NONE}


def test_a_free_executor_is_rescued_when_its_owner_leaves_it_free():
    a = Ownership("a")
    views = [view(E0, holder="a"), view(E1)]  # b (E1's owner) was just killed: still listed
    assert a.decide(views, {E0}, 10.0)[E1] is Action.NONE
    assert a.decide(views, {E0}, 10.0 + RESCUE_AFTER_S - 0.01)[E1] is Action.NONE
    assert a.decide(views, {E0}, 10.0 + RESCUE_AFTER_S)[E1] is Action.RESCUE
    taken = [view(E0, holder="a"), view(E1, holder="b")]
    assert a.decide(taken, {E0}, 20.0)[E1] is Action.NONE
    assert a.decide(views, {E0}, 20.5)[E1] is Action.NONE, "free again: the wait starts over"


def test_no_handback_to_a_dead_owner_still_listed():
    a = Ownership("a")
    views = [view(E0, holder="a"), view(E1, holder="a")]  # rescued; b is listed but never asks
    for t in (0.0, 5.0, 50.0):
        assert a.decide(views, {E0, E1}, t) == {E0: Action.NONE, E1: Action.NONE}


def test_handback_once_the_owner_has_been_live_and_asks():
    a = Ownership("a")
    alone = [view(E0, holder="a", schedulers=("a",)), view(E1, holder="a", schedulers=("a",))]
    assert a.decide(alone, {E0, E1}, 0.0) == {E0: Action.NONE, E1: Action.NONE}
    back = [view(E0, holder="a"), view(E1, holder="a", claimants=("b",))]  # b restarted and claims E1
    assert a.decide(back, {E0, E1}, 1.0)[E1] is Action.NONE
    assert a.decide(back, {E0, E1}, 1.0 + HANDBACK_AFTER_S - 0.01)[E1] is Action.NONE
    assert a.decide(back, {E0, E1}, 1.0 + HANDBACK_AFTER_S) == {E0: Action.NONE, E1: Action.RELEASE}


def test_a_claimant_that_is_not_the_owner_gets_nothing():
    a = Ownership("a")
    views = [view(E0, holder="a", claimants=("b",))]  # E0 is a's (index 0)
    assert a.decide(views, {E0}, 0.0) == {E0: Action.NONE}
    assert a.decide(views, {E0}, 100.0) == {E0: Action.NONE}


def test_unreachable_draining_and_unusable_executors_are_left_alone():
    a = Ownership("a")
    views = [
        ExecutorView(E0, reachable=False),
        view(E1, schedulers=("a",), draining=True),
        view(E2, schedulers=("a",), usable=False),
    ]
    for t in (0.0, 10.0):
        assert set(a.decide(views, set(), t).values()) == {Action.NONE}


def test_a_draining_scheduler_acquires_and_releases_nothing():
    a = Ownership("a")
    views = [view(E0), view(E1, holder="a", claimants=("b",))]
    for t in (0.0, 10.0):
        assert set(a.decide(views, {E1}, t, draining=True).values()) == {Action.NONE}


def test_live_schedulers_are_the_union_of_the_executors_reports():
    a = Ownership("a")
    a.decide([view(E0, schedulers=("a", "c")), view(E1, schedulers=("a", "b"))], set(), 0.0)
    assert a.live_schedulers() == ("a", "b", "c") and a.others_live()
    a.decide([view(E0, schedulers=("a",)), ExecutorView(E1, reachable=False, schedulers=("b",))], set(), 1.0)
    assert a.live_schedulers() == ("a",) and not a.others_live()


def test_the_owner_is_chosen_among_the_schedulers_that_reach_that_executor():
    # b cannot reach E1: E1 does not list it, so E1 is a's, and nothing flaps.
    a, b = Ownership("a"), Ownership("b")
    views = [view(E0, schedulers=("a", "b")), view(E1, schedulers=("a",))]
    assert [a.owner(views, e) for e in (E0, E1)] == ["a", "a"]
    assert a.decide(views, set(), 0.0) == {E0: Action.ACQUIRE, E1: Action.ACQUIRE}
    b_views = [views[0], ExecutorView(E1, reachable=False)]
    assert b.decide(b_views, set(), 0.0) == {E0: Action.NONE, E1: Action.NONE}
