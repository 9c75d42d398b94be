"""docker/health_probe.py (the exec probe of the tls component) against a real
gRPC health server, plaintext and mTLS with a throwaway CA."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from k8s_manifests import REPO

_spec = importlib.util.spec_from_file_location("health_probe", REPO / "docker" / "health_probe.py")
health_probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(health_probe)

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


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


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_certs(tmp_path):
    """A CA, a server certificate for the executor's DNS name, a client certificate."""
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        cwd=tmp_path,
    )
    for name, ext in [
        ("server", "subjectAltName=DNS:pagoda-executor.pagoda.svc.cluster.local"),
        ("client", "extendedKeyUsage=clientAuth"),
    ]:
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={name}",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            cwd=tmp_path,
        )
        (tmp_path / f"{name}.ext").write_text(ext + "\n")
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            f"{name}.ext",
            "-out",
            f"{name}.crt",
            cwd=tmp_path,
        )
    return {p.name: p for p in tmp_path.iterdir()}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_mtls(tmp_path):
    files = _make_certs(tmp_path)
    creds = grpc.ssl_server_credentials(
        [(files["server.key"].read_bytes(), files["server.crt"].read_bytes())],
        root_certificates=files["ca.crt"].read_bytes(),
        require_client_auth=True,
    )
    server, servicer, port = _server(creds)
    tls = [
        "--port",
        str(port),
        "--tls-ca",
        str(files["ca.crt"]),
        "--server-name",
        "pagoda-executor.pagoda.svc.cluster.local",
    ]
    try:
        servicer.set("", SERVING)
        assert (
            health_probe.main(tls + ["--tls-cert", str(files["client.crt"]), "--tls-key", str(files["client.key"])])
            == 0
        )
        assert health_probe.main(tls + ["--timeout-s", "1"]) == 1  # no client certificate
        assert health_probe.main(["--port", str(port), "--timeout-s", "1"]) == 1  # plaintext
    finally:
        server.stop(None)
