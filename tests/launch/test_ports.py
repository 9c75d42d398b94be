"""Ports handed to services: outside the kernel's ephemeral range, free, and never the same one twice."""

from __future__ import annotations

import socket

import pytest

from pagoda.runtime import ports


def _range_file(tmp_path, text: str):
    path = tmp_path / "ip_local_port_range"
    path.write_text(text)
    return path


def test_listen_ports_are_the_stretches_outside_the_ephemeral_range(tmp_path):
    assert ports.listen_ports(_range_file(tmp_path, "32768\t60999\n")) == [range(10_000, 32_768), range(61_000, 65_536)]
    assert ports.listen_ports(_range_file(tmp_path, "15000 64999")) == [range(10_000, 15_000)]  # 537 above: too few
    assert ports.listen_ports(_range_file(tmp_path, "1024 65535")) == []
    assert ports.listen_ports(_range_file(tmp_path, "garbage")) == []
    assert ports.listen_ports(tmp_path / "absent") == []


def test_free_ports_lie_outside_the_ephemeral_range_and_bind():
    stretches = ports.listen_ports()
    if not stretches:
        pytest.skip("this kernel's ephemeral range cannot be read")
    given = [ports.free_port() for _ in range(50)]
    assert len(set(given)) == len(given)
    assert all(any(port in stretch for stretch in stretches) for port in given)
    with socket.socket() as sock:
        sock.bind((ports.LOOPBACK, given[0]))  # really free


def test_a_port_in_use_or_given_before_is_never_given(monkeypatch):
    given = ports.free_port()
    with socket.socket() as listening:
        listening.bind((ports.LOOPBACK, 0))
        listening.listen()
        in_use = listening.getsockname()[1]
        draws = iter([in_use, given])  # the first two candidates: a listening port, then one handed out already
        real = ports._candidate
        monkeypatch.setattr(ports, "_candidate", lambda stretches: next(draws, None) or real(stretches))
        port = ports.free_port()
    assert next(draws, None) is None and port not in (in_use, given)


def test_without_a_readable_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(ports, "listen_ports", lambda: [])
    port = ports.free_port()
    assert 0 < port < 65_536
