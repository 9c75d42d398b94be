"""Two schedulers over two executors, real processes killed from outside: each executor is driven by one
scheduler at a time (leases with a fencing epoch), and a dead scheduler's executors serve through the other."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from support.leases import acquire, execute
from support.services import executor_service, lease_overlaps, scheduler_service, wait_until

from pagoda.launch.health import ServingStatus, check_health
from pagoda.v1 import executor_pb2, executor_pb2_grpc
from pagoda_client import Client, PagodaError

pytestmark = pytest.mark.integration

PROMPT = [5, 6, 7, 8, 9, 10]
MAX_TOKENS = 24
# A scheduler's executors must serve again through another within this (the rule needs ~2 s).
FAILOVER_BOUND_S = 10.0


@pytest.fixture(scope="module")
def system(tiny_model_dir, tmp_path_factory):
    """Executors e0, e1; schedulers sched-a, sched-b over both. Tests leave it as they found it."""
    logs = tmp_path_factory.mktemp("leases")
    executors = [executor_service(f"e{i}", tiny_model_dir, logs) for i in range(2)]
    schedulers = [scheduler_service(s, executors, logs) for s in ("sched-a", "sched-b")]
    try:
        for service in executors + schedulers:
            service.start()
        for service in executors + schedulers:
            service.wait_serving()
        system = {s.name: s for s in executors + schedulers}
        wait_until(lambda: _split_evenly(system), 30, "each scheduler to hold one executor")
        yield system
    finally:
        for service in schedulers + executors:
            service.stop()
    for executor in executors:
        assert lease_overlaps(executor) == [], executor.name


def _status(service):
    with Client(service.address, timeout=5, max_retries=0) as client:
        return client.status()


def _held(service) -> set[str]:
    """Addresses of the executors the scheduler drives (READY in its status)."""
    try:
        return {e.address for e in _status(service).executors if e.state == "READY"}
    except PagodaError:
        return set()


def _split_evenly(system) -> bool:
    a, b = _held(system["sched-a"]), _held(system["sched-b"])
    return len(a) == 1 and len(b) == 1 and a != b


def _generate(service) -> list[int]:
    with Client(service.address, timeout=60, max_retries=0) as client:
        return client.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True).token_ids


def _executor_held_by(system, scheduler: str):
    address = next(iter(_held(system[scheduler])))
    return next(s for s in system.values() if s.address == address)


def test_each_scheduler_holds_one_executor_and_both_serve(system):
    a, b = system["sched-a"], system["sched-b"]
    assert _generate(a) == _generate(b)
    # sched-a sees the other executor's holder at its next poll of it (every 0.5 s).
    held_by_each = {("READY", "sched-a"), ("HELD_BY_OTHER", "sched-b")}
    wait_until(lambda: {(e.state, e.lease_holder) for e in _status(a).executors} == held_by_each, 10, "holders", a)
    status = _status(a)
    assert (status.scheduler_id, status.schedulers) == ("sched-a", ("sched-a", "sched-b"))
    assert all(e.lease_epoch > 0 for e in status.executors)


def test_sigkill_of_a_scheduler_its_executor_serves_through_the_other_then_returns(system):
    a, b = system["sched-a"], system["sched-b"]
    expected = _generate(b)
    a.kill(signal.SIGKILL)
    took_s = wait_until(lambda: len(_held(b)) == 2, FAILOVER_BOUND_S, "sched-b to hold both executors", b)
    print(f"scheduler SIGKILL -> survivor holds both executors: {took_s:.2f}s")
    assert _generate(b) == expected
    assert [e.lease_holder for e in _status(b).executors] == ["sched-b", "sched-b"]

    a.start().wait_serving()  # the same id comes back: the other hands its executor back
    wait_until(lambda: _split_evenly(system), 20, "the restarted scheduler to get its executor back", a, b)
    assert _generate(a) == expected
    assert '"lease_handback"' in b.log_text()


def test_no_executor_is_driven_by_two_schedulers(system):
    """Force it: another id asks for the lease, streams with the holder's, a stale or a made-up epoch."""
    a = system["sched-a"]
    executor = _executor_held_by(system, "sched-a")
    epoch = next(e.lease_epoch for e in _status(a).executors if e.address == executor.address)
    expected = _generate(a)
    tokens: list[int] = []
    streaming = threading.Thread(target=lambda: tokens.extend(_slow_stream(a)))
    streaming.start()
    try:
        with grpc.insecure_channel(executor.address) as channel:
            for intruder in ("intruder", "sched-b"):
                lease = acquire(channel, intruder)
                assert (lease.granted, lease.holder_id, lease.epoch) == (False, "sched-a", epoch)
            for scheduler_id, stream_epoch, why in (
                ("intruder", epoch, f"held by sched-a at epoch {epoch}"),
                ("sched-a", epoch, "another stream already uses this lease"),
                ("sched-a", epoch - 1, f"held by sched-a at epoch {epoch}"),
                ("sched-a", epoch + 1, f"held by sched-a at epoch {epoch}"),
            ):
                with pytest.raises(grpc.RpcError) as info:
                    list(execute(channel, [executor_pb2.StepPlan(step_id=1)], scheduler_id, stream_epoch, timeout=10))
                assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert why in info.value.details()
    finally:
        streaming.join(timeout=120)
    assert tokens == expected, "the holder's request must be unharmed"
    assert _generate(a) == expected
    assert next(e.lease_epoch for e in _status(a).executors if e.address == executor.address) == epoch


def _slow_stream(service) -> list[int]:
    """The reference request, read slowly so that it is in flight while the intruders try."""
    tokens = []
    with Client(service.address, timeout=60, max_retries=0) as client:
        for delta in client.stream(token_ids=PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True):
            tokens += delta.token_ids
            time.sleep(0.05)
    return tokens


def test_a_plan_of_another_epoch_is_refused_and_ends_the_lease(tiny_model_dir, tmp_path):
    executor = executor_service("alone", tiny_model_dir, tmp_path).start()
    try:
        executor.wait_serving()
        with grpc.insecure_channel(executor.address) as channel:
            lease = acquire(channel, "driver")
            assert lease.granted and lease.holder_id == "driver"
            plans = [executor_pb2.StepPlan(step_id=1, epoch=lease.epoch), executor_pb2.StepPlan(step_id=2, epoch=7)]
            stream = execute(channel, plans, "driver", lease.epoch, stamp=False)
            assert next(stream).step_id == 1
            with pytest.raises(grpc.RpcError) as info:
                next(stream)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert (
                f"plan with epoch 7 refused: the lease is held by driver at epoch {lease.epoch}" in info.value.details()
            )
            stub = executor_pb2_grpc.ExecutorStub(channel)
            wait_until(lambda: not stub.Describe(executor_pb2.DescribeRequest(), timeout=5).lease_holder, 10, "release")
            assert acquire(channel, "other").epoch == lease.epoch + 1
    finally:
        executor.stop()


def test_a_scheduler_with_no_executor_is_not_serving_and_answers_unavailable(system, tmp_path):
    executors = [system["e0"], system["e1"]]
    c = scheduler_service("sched-c", executors, tmp_path).start()  # sorts last: live[i mod 3] never picks it
    try:
        c.wait_serving(service="liveness")
        wait_until(lambda: _status(c).schedulers == ("sched-a", "sched-b", "sched-c"), 15, "sched-c to be seen", c)
        status = _status(c)
        assert {(e.state, e.lease_holder) for e in status.executors} == {
            ("HELD_BY_OTHER", "sched-a"),
            ("HELD_BY_OTHER", "sched-b"),
        }
        assert check_health(c.address) == ServingStatus.NOT_SERVING
        started = time.monotonic()
        with Client(c.address, timeout=30, max_retries=0) as client, pytest.raises(PagodaError) as info:
            client.generate(token_ids=PROMPT, max_tokens=4)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE and "holds no executor" in info.value.message
        # A wait would last the client's 30 s (or end with another message); the bound is for a loaded machine.
        assert time.monotonic() - started < 10.0, "UNAVAILABLE at once, not after a wait"
        assert _split_evenly(system)
    finally:
        c.stop()
    assert c.process.returncode == 0


def test_requests_without_an_executor_end_unavailable_when_another_scheduler_lives(system):
    """sched-b's only executor dies: its streams end with UNAVAILABLE (the client resumes them on sched-a)."""
    b = system["sched-b"]
    executor = _executor_held_by(system, "sched-b")
    errors: list[PagodaError] = []
    first_token = threading.Event()

    def long_stream() -> None:
        # No resume: the test looks at how sched-b ends the stream, not at the client's failover.
        with Client(b.address, timeout=60, max_retries=0, max_resumes=0) as client:
            try:
                for delta in client.stream(token_ids=PROMPT, max_tokens=900, temperature=0, ignore_eos=True):
                    if delta.token_ids:
                        first_token.set()
            except PagodaError as exc:
                errors.append(exc)

    streaming = threading.Thread(target=long_stream)
    streaming.start()
    assert first_token.wait(timeout=60)
    executor.kill(signal.SIGKILL)
    killed_at = time.monotonic()
    streaming.join(timeout=30)
    assert not streaming.is_alive() and len(errors) == 1
    assert errors[0].code == grpc.StatusCode.UNAVAILABLE and "resume on another scheduler" in errors[0].message
    # Not before the orphan timeout (3 s after the loss); the upper bound leaves a loaded machine room.
    assert 2.5 < time.monotonic() - killed_at < 20
    assert check_health(b.address) == ServingStatus.NOT_SERVING

    executor.start().wait_serving()  # back: its owner takes it again
    wait_until(lambda: _split_evenly(system), 20, "sched-b to hold its executor again", b)
    assert check_health(b.address) == ServingStatus.SERVING
    assert len(_generate(b)) == MAX_TOKENS


def test_sigterm_drains_releases_and_the_other_takes_over(system):
    a, b = system["sched-a"], system["sched-b"]
    expected = _generate(a)
    with Client(a.address, timeout=60, max_retries=0) as client:
        tokens = []
        stream = client.stream(token_ids=PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        tokens += next(stream).token_ids
        a.process.send_signal(signal.SIGTERM)  # drain: in-flight requests finish, new ones go elsewhere
        for delta in stream:
            tokens += delta.token_ids
        assert tokens == expected
    assert a.process.wait(timeout=30) == 0
    assert '"lease_released"' in a.log_text()
    took_s = wait_until(lambda: len(_held(b)) == 2, FAILOVER_BOUND_S, "sched-b to hold both executors", b)
    print(f"scheduler SIGTERM -> survivor holds both executors: {took_s:.2f}s")
    a.start().wait_serving()
    wait_until(lambda: _split_evenly(system), 20, "sched-a to get its executor back", a, b)
