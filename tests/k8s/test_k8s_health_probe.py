"""docker/health_probe.py (the exec probe of the tls component) against a real
gRPC health server, plaintext and mTLS with a throwaway CA (scripts/make_certs.py)."""

from __future__ import annotations

import importlib.util
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from k8s_manifests import REPO

from scripts.make_certs import write_certs

_spec = importlib.util.spec_from_file_location("health_probe", REPO / "docker" / "health_probe.py")
health_probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(health_probe)

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
EXECUTOR_DNS = "pagoda-executor.pagoda.svc.cluster.local"


def _server(credentials=None):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = (
        server.add_secure_port("127.0.0.1:0", credentials) if credentials else server.add_insecure_port("127.0.0.1:0")
    )
    server.start()
    return server, servicer, port


def test_plaintext_statuses():
    server, servicer, port = _server()
    try:
        servicer.set("", SERVING)
        servicer.set("liveness", NOT_SERVING)
        assert health_probe.main(["--port", str(port)]) == 0
        assert health_probe.main(["--port", str(port), "--service", "liveness"]) == 1
        assert health_probe.main(["--port", str(port), "--service", "unknown"]) == 1
        servicer.set("", NOT_SERVING)
        assert health_probe.main(["--port", str(port)]) == 1
    finally:
        server.stop(None)
    assert health_probe.main(["--port", str(port), "--timeout-s", "0.5"]) == 1


def test_mtls(tmp_path):
    certs = write_certs(tmp_path, [EXECUTOR_DNS], days=1)  # a CA, a server and a client certificate
    creds = grpc.ssl_server_credentials(
        [(certs.server_key.read_bytes(), certs.server_cert.read_bytes())],
        root_certificates=certs.ca.read_bytes(),
        require_client_auth=True,
    )
    server, servicer, port = _server(creds)
    tls = ["--port", str(port), "--tls-ca", str(certs.ca), "--server-name", EXECUTOR_DNS]
    try:
        servicer.set("", SERVING)
        assert health_probe.main(tls + ["--tls-cert", str(certs.client_cert), "--tls-key", str(certs.client_key)]) == 0
        assert health_probe.main(tls + ["--timeout-s", "1"]) == 1  # no client certificate
        assert health_probe.main(["--port", str(port), "--timeout-s", "1"]) == 1  # plaintext
    finally:
        server.stop(None)
