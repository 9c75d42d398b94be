"""Standard ``grpc.health.v1`` Check without the grpcio-health-checking package.

The launcher runs where only grpcio and protobuf may be installed, so the two
tiny messages are encoded by hand: ``HealthCheckRequest{string service = 1}`` and
``HealthCheckResponse{ServingStatus status = 1}``.
"""

from __future__ import annotations

import enum

import grpc

from pagoda.channel import Tls, open_channel

_CHECK_METHOD = "/grpc.health.v1.Health/Check"


class ServingStatus(enum.IntEnum):
    """``grpc.health.v1.HealthCheckResponse.ServingStatus``."""

    UNKNOWN = 0
    SERVING = 1
    NOT_SERVING = 2
    SERVICE_UNKNOWN = 3


def encode_request(service: str) -> bytes:
    """Wire bytes of ``HealthCheckRequest(service=service)``."""
    data = service.encode()
    if not data:
        return b""
    return b"\x0a" + _varint(len(data)) + data


def decode_response(data: bytes) -> ServingStatus:
    """``status`` of a wire ``HealthCheckResponse`` (fields other than 1 skipped)."""
    pos, status = 0, 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _read_varint(data, pos)
            if field == 1:
                status = value
        elif wire_type == 2:
            length, pos = _read_varint(data, pos)
            pos += length
        else:
            raise ValueError(f"unexpected wire type {wire_type} in HealthCheckResponse")
    return ServingStatus(status) if status in ServingStatus._value2member_map_ else ServingStatus.UNKNOWN


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def check_health(
    target: str,
    service: str = "",
    *,
    timeout: float = 1.0,
    tls: Tls = False,
) -> ServingStatus | None:
    """One health Check of ``target`` (bounded by ``timeout`` seconds); None when it cannot be reached."""
    with open_channel(target, tls) as channel:
        check: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
            _CHECK_METHOD, request_serializer=None, response_deserializer=None
        )
        try:
            return decode_response(check(encode_request(service), timeout=timeout))
        except grpc.RpcError:
            return None
