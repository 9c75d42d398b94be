"""API keys and TLS from the client's side, against a real system."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest
from support.system import fp32_launcher

from pagoda_client import Client, PagodaError, TlsConfig
from scripts.make_certs import CertPaths, write_certs

pytestmark = pytest.mark.integration

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    """Throwaway certificates: a CA and a server certificate for 127.0.0.1 signed by it."""
    return write_certs(tmp_path_factory.mktemp("certs"), days=1)


@pytest.fixture(scope="module")
def secure_system(client_tiny_model_dir, certs, tmp_path_factory):
    """The tiny system serving TLS and requiring an API key."""
    cert, key = str(certs.server_cert), str(certs.server_key)
    with fp32_launcher(
        client_tiny_model_dir,
        tmp_path_factory.mktemp("secure-logs"),
        extra_scheduler_args=["--api-keys", KEY, "--tls-cert", cert, "--tls-key", key],
        client_tls=TlsConfig(root_certificates=str(certs.ca)),
        client_api_key=KEY,
        startup_timeout_s=180,
    ) as system:
        yield system


def test_key_and_tls_work(secure_system, certs):
    with Client(secure_system.target, tls=TlsConfig(str(certs.ca)), api_key=KEY, timeout=30) as client:
        result = client.generate(token_ids=[5, 6, 7], max_tokens=3, ignore_eos=True)
    assert len(result.token_ids) == 3


@pytest.mark.parametrize("api_key", [None, "wrong-key"])
def test_missing_or_wrong_key_is_unauthenticated(secure_system, certs, api_key):
    with Client(secure_system.target, tls=TlsConfig(str(certs.ca)), api_key=api_key, timeout=30) as client:
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


def test_cli_with_tls_flags_and_key_from_environment(secure_system, certs):
    env = {**os.environ, "PAGODA_API_KEY": KEY, "PAGODA_TARGET": secure_system.target}
    proc = _cli(env, "models", "--json", "--tls-ca", str(certs.ca))
    assert proc.returncode == 0, proc.stderr
    env.pop("PAGODA_API_KEY")
    proc = _cli(env, "models", "--tls-ca", str(certs.ca))
    assert proc.returncode == 1 and proc.stderr.startswith("error: UNAUTHENTICATED: ")


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``pagoda`` (the client CLI) with ``args``, bounded to a minute."""
    return subprocess.run(
        [sys.executable, "-m", "pagoda_client.cli", *args], capture_output=True, text=True, timeout=60, env=env
    )
