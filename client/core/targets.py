"""The addresses a client calls: targets as given, names that resolve to several addresses, which are down.

A client takes one address, several (``"a:1,b:2"`` or a sequence), or a DNS
name that resolves to several. Each address gets its own channel (the shells
open them), so a call that fails on one can go to another. New calls go
round-robin over the addresses not known to be down; an address that failed
is down for a backoff that grows with its consecutive failures, and is up
again once a call through it gets a response.

Pure: the resolver (``socket.getaddrinfo`` in the shells) and the clock are
injected; a lock keeps the bookkeeping consistent when threads share a client.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagoda.channel import ChannelOption, Tls, TlsConfig
from pagoda_client.core.retry import Clock, RetryPolicy

DEFAULT_TARGET = "127.0.0.1:50051"

Resolver = Callable[[str, int], Sequence[str]]
"""``(host, port)`` -> the ``host:port`` addresses it resolves to (``[v6]:port`` for IPv6); raises ``OSError``."""


@dataclass(frozen=True)
class Endpoint:
    """One address a channel dials.

    Attributes:
        address: ``host:port`` (or any gRPC target) the channel connects to.
        authority: the name the user gave (``"sched.example:50051"``) when
            ``address`` came from resolving it: the channel's authority and the
            name checked in the server's TLS certificate. None when ``address``
            is what the user gave.
    """

    address: str
    authority: str | None = None


def parse_targets(target: str | Sequence[str]) -> list[str]:
    """The addresses in ``"a:1,b:2"`` or a sequence of them: stripped, without duplicates, at least one.

    Raises:
        ValueError: no address given.
    """
    items = target.split(",") if isinstance(target, str) else [part for t in target for part in str(t).split(",")]
    addresses = list(dict.fromkeys(item.strip() for item in items if item.strip()))
    if not addresses:
        raise ValueError(f"no target address in {target!r}")
    return addresses


def split_host_port(target: str) -> tuple[str, int] | None:
    """``(host, port)`` of a plain ``host:port`` (``[v6]:port`` too); None for gRPC URIs and the like."""
    if "/" in target or target.count(":") == 0:
        return None
    host, _, port = target.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host or host in ("unix", "unix-abstract", "vsock"):
        return None
    return (host, int(port)) if port.isdigit() and host else None


def is_ip_literal(host: str) -> bool:
    """Whether ``host`` is an IPv4 or IPv6 address rather than a name."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def endpoint_options(endpoint: Endpoint, tls: Tls) -> list[ChannelOption]:
    """Channel options that keep the user's name for a resolved address: authority and TLS name check."""
    if endpoint.authority is None:
        return []
    options: list[ChannelOption] = [("grpc.default_authority", endpoint.authority)]
    overridden = isinstance(tls, TlsConfig) and tls.server_name_override
    if tls is not False and not overridden:
        host_port = split_host_port(endpoint.authority)
        options.append(("grpc.ssl_target_name_override", host_port[0] if host_port else endpoint.authority))
    return options


class Targets:
    """The endpoints of a client and what is known of each: round-robin, down marks, re-resolution.

    Args:
        target: one address, several (comma-separated or a sequence), or names.
        resolve: looks a name up (None: names are dialed as given, gRPC resolves them).
        clock: the down marks' clock.
    """

    def __init__(self, target: str | Sequence[str], *, resolve: Resolver | None = None, clock: Clock = time.monotonic):
        self.given = parse_targets(target)
        self._resolve = resolve
        self._clock = clock
        self._lock = threading.Lock()
        self._endpoints: list[Endpoint] = []
        # Consecutive failures and the time until which each address counts as down.
        self._failures: dict[str, int] = {}
        self._down_until: dict[str, float] = {}
        self._next = 0
        self._resolved_at = float("-inf")
        self.refresh()

    @property
    def endpoints(self) -> list[Endpoint]:
        """Every endpoint, in the order given (a resolved name's addresses in the resolver's order)."""
        return list(self._endpoints)

    def refresh(self, min_interval_s: float = 0.0) -> None:
        """Resolve the names again (unless they were less than ``min_interval_s`` ago); what is known
        of addresses that stay is kept. The lookup blocks: the interval bounds how often a client in an
        outage (every address failing) waits on DNS."""
        now = self._clock()
        if now - self._resolved_at < min_interval_s:
            return
        self._resolved_at = now
        endpoints = list({e.address: e for target in self.given for e in self._expand(target)}.values())
        with self._lock:
            self._endpoints = endpoints
            addresses = {e.address for e in endpoints}
            self._failures = {a: n for a, n in self._failures.items() if a in addresses}
            self._down_until = {a: t for a, t in self._down_until.items() if a in addresses}
            self._next %= len(endpoints)

    def _expand(self, target: str) -> list[Endpoint]:
        """A name that resolves to several addresses becomes one endpoint each; anything else stays as given."""
        host_port = split_host_port(target)
        if self._resolve is None or host_port is None or is_ip_literal(host_port[0]):
            return [Endpoint(target)]
        try:
            addresses = list(dict.fromkeys(self._resolve(*host_port)))
        except OSError:
            return [Endpoint(target)]  # gRPC reports it (UNAVAILABLE) on the first call
        if len(addresses) < 2:
            return [Endpoint(target)]
        return [Endpoint(address, target) for address in addresses]

    def pick(self) -> Endpoint:
        """The endpoint of the next attempt: the next one round-robin that is not down, else the one back first."""
        now = self._clock()
        with self._lock:
            count = len(self._endpoints)
            for offset in range(count):
                endpoint = self._endpoints[(self._next + offset) % count]
                if self._down_until.get(endpoint.address, now) <= now:
                    self._next = (self._next + offset + 1) % count
                    return endpoint
            return min(self._endpoints, key=lambda e: self._down_until[e.address])

    def mark_down(self, endpoint: Endpoint, policy: RetryPolicy, unit: float) -> None:
        """A call through ``endpoint`` failed at the transport: down for a backoff that grows per failure.

        Args:
            policy: the backoff.
            unit: where in the jitter range to land, in [0, 1).
        """
        with self._lock:
            failures = self._failures.get(endpoint.address, 0)
            self._failures[endpoint.address] = failures + 1
            self._down_until[endpoint.address] = self._clock() + policy.backoff_s(failures, unit)

    def mark_up(self, endpoint: Endpoint) -> None:
        """A call through ``endpoint`` got a response."""
        with self._lock:
            self._failures.pop(endpoint.address, None)
            self._down_until.pop(endpoint.address, None)

    def wait_s(self) -> float:
        """Seconds until an endpoint is not known to be down (0 when one is up now)."""
        now = self._clock()
        with self._lock:
            return max(0.0, min(self._down_until.get(e.address, now) for e in self._endpoints) - now)
