"""API keys and TLS from the client's side, against a real system."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest

from pagoda.launch.launcher import Launcher
from pagoda_client import Client, PagodaError, TlsConfig

pytestmark = pytest.mark.integration

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def server_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A throwaway self-signed certificate for 127.0.0.1 (its own CA)."""
    folder = tmp_path_factory.mktemp("certs")
    cert, key = folder / "server.pem", folder / "server.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=pagoda-test",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return str(cert), str(key)


@pytest.fixture(scope="module")
def secure_system(client_tiny_model_dir, server_cert, tmp_path_factory):
    """The tiny system serving TLS and requiring an API key."""
    cert, key = server_cert
    with Launcher(
        str(client_tiny_model_dir),
        dtype="float32",
        kv_cache_memory="256KiB",
        extra_scheduler_args=["--api-keys", KEY, "--tls-cert", cert, "--tls-key", key],
        client_tls=TlsConfig(root_certificates=cert),
        client_api_key=KEY,
        log_dir=tmp_path_factory.mktemp("secure-logs"),
        startup_timeout_s=180,
    ) as system:
        yield system


def test_key_and_tls_work(secure_system, server_cert):
    with Client(secure_system.target, tls=TlsConfig(server_cert[0]), api_key=KEY, timeout=30) as client:
        result = client.generate(token_ids=[5, 6, 7], max_tokens=3, ignore_eos=True)
    assert len(result.token_ids) == 3


@pytest.mark.parametrize("api_key", [None, "wrong-key"])
def test_missing_or_wrong_key_is_unauthenticated(secure_system, server_cert, api_key):
    with Client(secure_system.target, tls=TlsConfig(server_cert[0]), api_key=api_key, timeout=30) as client:
        with pytest.raises(PagodaError) as caught:
            client.generate(token_ids=[5, 6, 7], max_tokens=3)
        assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(PagodaError) as caught:
            client.model_info()
        assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_plaintext_client_fails(secure_system):
    with Client(secure_system.target, api_key=KEY, timeout=5, max_retries=0) as client:
        with pytest.raises(PagodaError) as caught:
            client.model_info()
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE


def test_cli_with_tls_flags_and_key_from_environment(secure_system, server_cert):
    env = {**os.environ, "PAGODA_API_KEY": KEY, "PAGODA_TARGET": secure_system.target}
    proc = subprocess.run(
        [sys.executable, "-m", "pagoda_client.cli", "models", "--json", "--tls-ca", server_cert[0]],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    env.pop("PAGODA_API_KEY")
    proc = subprocess.run(
        [sys.executable, "-m", "pagoda_client.cli", "models", "--tls-ca", server_cert[0]],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 1 and proc.stderr.startswith("error: UNAUTHENTICATED: ")
