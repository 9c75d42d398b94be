"""Command lines of several schedulers, and the ``pagoda serve`` flags that build them (no process started)."""

from __future__ import annotations

from pagoda.launch.launcher import Launcher
from pagoda.launch.serve import launcher_from_args
from pagoda_client.cli import build_parser


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_several_schedulers_on_consecutive_ports_share_every_executor():
    launcher = Launcher("/m", num_executors=3, num_schedulers=2, port=6000, metrics_port=9100, http_port=8000)
    assert [c.name for c in launcher.schedulers] == ["scheduler-0", "scheduler-1"]
    assert launcher.targets == ["127.0.0.1:6000", "127.0.0.1:6001"]
    assert launcher.target == "127.0.0.1:6000" and launcher.scheduler is launcher.schedulers[0]
    executors = ",".join(launcher.executor_addresses)
    for index, child in enumerate(launcher.schedulers):
        assert _flag(child.argv, "--port") == str(6000 + index)
        assert _flag(child.argv, "--executors") == executors
        assert _flag(child.argv, "--scheduler-id") == f"scheduler-{index}"
        assert _flag(child.argv, "--metrics-port") == str(9100 + index)
        assert _flag(child.argv, "--http-port") == str(8000 + index)
    assert launcher.children == [*launcher.schedulers, *launcher.executors]


def test_one_scheduler_keeps_its_name_and_gets_no_scheduler_id():
    launcher = Launcher("/m", num_executors=2)
    assert [c.name for c in launcher.schedulers] == ["scheduler"]
    assert "--scheduler-id" not in launcher.scheduler.argv
    assert launcher.targets == [launcher.target]


def test_port_zero_gives_each_scheduler_its_own_free_port():
    launcher = Launcher("/m", num_schedulers=3)
    assert len(set(launcher.ports)) == 3 and all(launcher.ports)


def test_serve_flags_supervision_and_schedulers():
    args, unknown = build_parser().parse_known_args(
        ["serve", "--schedulers", "2", "--executors", "2", "--port", "7000", "--crash-loop-exits", "3"]
    )
    launcher = launcher_from_args(args, unknown)
    assert launcher.targets == ["127.0.0.1:7000", "127.0.0.1:7001"]
    assert launcher.supervisor is not None
    assert launcher.supervisor.policy.crash_loop_exits == 3
    assert launcher.supervisor.policy.initial_backoff_s == 1.0 and launcher.supervisor.policy.max_backoff_s == 30.0
    assert launcher.stop_grace_s == 35.0
    args, _ = build_parser().parse_known_args(["serve", "--no-restart"])
    assert launcher_from_args(args, []).supervisor is None


def test_launcher_without_restart_is_not_supervised():
    assert Launcher("/m").supervisor is None
    assert Launcher("/m", restart=True).supervisor is not None
