"""Executor discovery: each `host:port` entry may resolve to many addresses
(a Kubernetes headless Service); each address is one executor."""

from __future__ import annotations

import asyncio
import socket

import structlog

log = structlog.get_logger("scheduler")


def split_host_port(target: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` -> (host, port)."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"executor address {target!r} is not host:port")
    return host.strip("[]"), int(port)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def resolve_targets(targets: list[str]) -> list[str]:
    """Every address the targets resolve to now, in a stable order.

    A target that does not resolve (yet) contributes nothing; it is retried at
    the next refresh.
    """
    loop = asyncio.get_running_loop()
    addresses: list[str] = []
    for target in targets:
        host, port = split_host_port(target)
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            log.warning("executor_address_unresolved", target=target, error=str(exc))
            continue
        for info in infos:
            address = format_address(str(info[4][0]), port)
            if address not in addresses:
                addresses.append(address)
    return addresses
