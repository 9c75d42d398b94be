"""gRPC health check for Kubernetes exec probes when the port speaks TLS.

The kubelet's native `grpc:` probe connects without TLS, so the `tls` component
of k8s/ replaces it with `python /opt/pagoda/health_probe.py ...`. Exit status 0
when the service reports SERVING, 1 otherwise (including connection errors).

Usage: health_probe.py --port 50061 [--service NAME] [--tls-ca CA]
       [--tls-cert CERT --tls-key KEY] [--server-name DNS-NAME] [--timeout-s 3]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _read(path: str | None) -> bytes | None:
    return pathlib.Path(path).read_bytes() if path else None


def build_parser() -> argparse.ArgumentParser:
    """Flags of the probe."""
    parser = argparse.ArgumentParser(prog="health_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--service", default="", help='health service name ("" = the whole server)')
    parser.add_argument("--tls-ca", help="CA that signed the server certificate")
    parser.add_argument("--tls-cert", help="client certificate (mTLS)")
    parser.add_argument("--tls-key", help="client key (mTLS)")
    parser.add_argument("--server-name", help="name the server certificate is checked against")
    parser.add_argument("--timeout-s", type=float, default=3.0)
    return parser


def check(args: argparse.Namespace) -> bool:
    """True when the server answers SERVING for `args.service`."""
    target = f"{args.host}:{args.port}"
    if args.tls_ca or args.tls_cert:
        creds = grpc.ssl_channel_credentials(_read(args.tls_ca), _read(args.tls_key), _read(args.tls_cert))
        options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
        channel = grpc.secure_channel(target, creds, options=options)
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout_s)
        except grpc.RpcError as exc:
            print(f"health check of {target} failed: {exc.code().name}", file=sys.stderr)
            return False
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    """Run one check; the exit status is the probe's result."""
    return 0 if check(build_parser().parse_args(argv)) else 1


if __name__ == "__main__":
    sys.exit(main())
