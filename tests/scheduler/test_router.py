"""Routing a new request: least loaded while the scheduler keeps up, packed onto busy executors when it is the limit."""

from __future__ import annotations

from scheduler.test_tier_scheduler import _ready_handle, make_sched, make_seq

from scheduler_svc.engine import _behind
from scheduler_svc.fleet.router import PACK_MAX_KV_USAGE, choose_executor


def _handles(*num_seqs: int, max_num_seqs: int = 8):
    """One ready executor per count, each with that many queued sequences."""
    handles = []
    for i, count in enumerate(num_seqs):
        scheduler = make_sched(num_blocks=64, max_num_seqs=max_num_seqs)
        for j in range(count):
            scheduler.add(make_seq(100 * i + j, [500 + j, 600 + i]))
        handles.append(_ready_handle(f"e{i}", scheduler))
    return handles


def test_spread_to_the_least_loaded_while_the_scheduler_keeps_up():
    handles = _handles(5, 2, 0)
    assert choose_executor(handles, [1, 2, 3])[0] is handles[2]


def test_packed_onto_the_busiest_executor_with_room_when_the_scheduler_is_the_limit():
    handles = _handles(5, 2, 0)
    assert choose_executor(handles, [1, 2, 3], pack=True)[0] is handles[0]
    full = _handles(8, 2, 0)  # the busiest is at max_num_seqs: the next busiest
    assert choose_executor(full, [1, 2, 3], pack=True)[0] is full[1]
    idle = _handles(0, 0)  # nothing runs anywhere: nothing to pack onto
    assert choose_executor(idle, [1, 2, 3], pack=True)[0] in idle


def test_packing_leaves_an_executor_whose_kv_cache_is_nearly_full():
    handles = _handles(5, 2, 0)
    busy = handles[0].scheduler
    busy.kv.pool.allocate(int(busy.kv.pool.num_blocks * PACK_MAX_KV_USAGE) + 1)  # as running sequences would
    assert busy.kv.usage >= PACK_MAX_KV_USAGE
    assert choose_executor(handles, [1, 2, 3], pack=True)[0] is handles[1]


def test_the_scheduler_is_the_limit_when_it_holds_back_most_of_its_executors():
    handles = _handles(1, 1, 1)
    assert not _behind(handles)
    handles[0].behind = True
    assert not _behind(handles)  # one of three: not most
    handles[1].behind = True
    assert _behind(handles)
    assert not _behind(handles[:1])  # one executor: nothing to pack onto instead
