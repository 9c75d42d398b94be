"""The client side of a gRPC channel to a Pagoda service: TLS, options, credentials.

One definition for ``pagoda_client`` (``Client``, ``AsyncClient``) and the
launcher's own health and status calls. grpcio only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

ChannelOption = tuple[str, Any]

# Reconnect quickly after the server (re)appears, so retries can succeed.
CHANNEL_OPTIONS: tuple[ChannelOption, ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
)


@dataclass(frozen=True)
class TlsConfig:
    """TLS settings of a client channel.

    Attributes:
        root_certificates: PEM file of the CA that signed the server's
            certificate; None uses the system roots.
        certificate_chain: PEM file of the client certificate (mTLS), or None.
        private_key: PEM file of the client key (mTLS), or None.
        server_name_override: host name to check the server certificate
            against instead of the target's host (tests, IP targets).
    """

    root_certificates: str | None = None
    certificate_chain: str | None = None
    private_key: str | None = None
    server_name_override: str | None = None


Tls = bool | TlsConfig
"""False: plaintext; True: TLS with the system roots; or a ``TlsConfig``."""


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def channel_credentials(tls: Tls) -> grpc.ChannelCredentials | None:
    """Credentials for ``tls`` (None for plaintext); reads the PEM files."""
    if tls is False:
        return None
    config = TlsConfig() if tls is True else tls
    return grpc.ssl_channel_credentials(
        root_certificates=_read(config.root_certificates),
        private_key=_read(config.private_key),
        certificate_chain=_read(config.certificate_chain),
    )


def channel_options(tls: Tls, extra: Sequence[ChannelOption] = ()) -> list[ChannelOption]:
    """Channel options: ours, the TLS name override, then the caller's."""
    options = list(CHANNEL_OPTIONS)
    if isinstance(tls, TlsConfig) and tls.server_name_override:
        options.append(("grpc.ssl_target_name_override", tls.server_name_override))
    return options + list(extra)


def open_channel(target: str, tls: Tls = False, extra: Sequence[ChannelOption] = ()) -> grpc.Channel:
    """A synchronous channel to ``target`` (connects lazily, on the first call)."""
    credentials, options = channel_credentials(tls), channel_options(tls, extra)
    if credentials is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, credentials, options=options)


def open_aio_channel(target: str, tls: Tls = False, extra: Sequence[ChannelOption] = ()) -> grpc.aio.Channel:
    """An asyncio channel to ``target``; create it inside the event loop that uses it."""
    credentials, options = channel_credentials(tls), channel_options(tls, extra)
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, credentials, options=options)


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The ``authorization: Bearer <key>`` metadata of one call (empty without a key)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()
