"""TLS on the client API, mTLS between scheduler and executor, with real processes."""

from __future__ import annotations

import grpc
import pytest
from support.tiny_model import hf_greedy

from pagoda.v1 import executor_pb2, executor_pb2_grpc
from pagoda_client import Client, PagodaError, TlsConfig
from scripts.make_certs import issue, make_ca
from security.system import SecureSystem, is_serving

pytestmark = pytest.mark.integration
PROMPT = [5, 17, 42, 99, 7, 300, 12]


def _mtls_creds(certs, cert=None, key=None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=certs.read("ca"),
        private_key=None if key is None else key.read_bytes(),
        certificate_chain=None if cert is None else cert.read_bytes(),
    )


@pytest.fixture(scope="module")
def tls_system(security_model_dir, certs, tmp_path_factory):
    """TLS client API; the executor requires a client certificate from the CA."""
    p = certs.paths
    executor_args = ["--tls-cert", str(p.server_cert), "--tls-key", str(p.server_key), "--tls-ca", str(p.ca)]
    scheduler_args = [
        "--tls-cert",
        str(p.server_cert),
        "--tls-key",
        str(p.server_key),
        "--executor-tls-ca",
        str(p.ca),
        "--executor-tls-cert",
        str(p.client_cert),
        "--executor-tls-key",
        str(p.client_key),
    ]
    with SecureSystem(
        security_model_dir,
        tmp_path_factory.mktemp("tls-logs"),
        executor_args=executor_args,
        scheduler_args=scheduler_args,
        executor_health_creds=_mtls_creds(certs, p.client_cert, p.client_key),
        scheduler_creds=grpc.ssl_channel_credentials(certs.read("ca")),
    ) as system:
        yield system


def test_tls_client_generates_through_mtls_executor(tls_system, certs, security_model_dir):
    with Client(tls_system.target, tls=TlsConfig(root_certificates=str(certs.paths.ca)), timeout=60) as client:
        result = client.generate(token_ids=PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    assert result.token_ids == hf_greedy(security_model_dir, PROMPT, 8)
    assert '"tls": true' in tls_system.scheduler.log_text()
    assert '"tls": true' in tls_system.executor.log_text()


def test_plaintext_client_is_refused(tls_system):
    with Client(tls_system.target, timeout=5, max_retries=0) as client, pytest.raises(PagodaError) as info:
        client.generate(token_ids=PROMPT, max_tokens=2)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_client_trusting_another_ca_is_refused(tls_system, certs, tmp_path):
    (tmp_path / "other-ca.pem").write_bytes(make_ca("Other CA").cert_pem)
    tls = TlsConfig(root_certificates=str(tmp_path / "other-ca.pem"))
    with Client(tls_system.target, tls=tls, timeout=5, max_retries=0) as client, pytest.raises(PagodaError) as info:
        client.generate(token_ids=PROMPT, max_tokens=2)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def _describe(address: str, creds: grpc.ChannelCredentials | None) -> executor_pb2.ExecutorInfo:
    channel = grpc.insecure_channel(address) if creds is None else grpc.secure_channel(address, creds)
    with channel:
        return executor_pb2_grpc.ExecutorStub(channel).Describe(executor_pb2.DescribeRequest(), timeout=5)


@pytest.mark.parametrize(
    "who",
    ["plaintext", "tls-without-client-cert", "client-cert-from-another-ca", "server-cert-as-client-cert-of-another-ca"],
)
def test_executor_refuses_callers_without_a_valid_client_certificate(tls_system, certs, tmp_path, who):
    if who == "plaintext":
        creds = None
    elif who == "tls-without-client-cert":
        creds = _mtls_creds(certs)
    elif who == "client-cert-from-another-ca":
        creds = _mtls_creds(certs, certs.rogue_client_cert, certs.rogue_client_key)
    else:  # a certificate for the right name, but signed by an attacker's CA
        forged = issue(make_ca("Pagoda development CA"), "pagoda-scheduler", hosts=["127.0.0.1"], client=True)
        (tmp_path / "forged.pem").write_bytes(forged.cert_pem)
        (tmp_path / "forged-key.pem").write_bytes(forged.key_pem)
        creds = _mtls_creds(certs, tmp_path / "forged.pem", tmp_path / "forged-key.pem")
    with pytest.raises(grpc.RpcError) as info:
        _describe(tls_system.executor.address, creds)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_executor_answers_the_right_client_certificate(tls_system, certs):
    p = certs.paths
    info = _describe(tls_system.executor.address, _mtls_creds(certs, p.client_cert, p.client_key))
    assert info.vocab_size == 384 and info.num_kv_blocks > 0


def test_scheduler_checks_executor_certificate_by_name(security_model_dir, tmp_path):
    """An executor certificate naming only a DNS name (as in Kubernetes, where the
    scheduler dials pod IPs) is accepted with --executor-tls-server-name."""
    ca = make_ca()
    server = issue(ca, "executor", hosts=["executor.pagoda.test"])
    client = issue(ca, "scheduler", server=False, client=True)
    files = {
        "ca": ca.cert_pem,
        "srv": server.cert_pem,
        "srv-key": server.key_pem,
        "cli": client.cert_pem,
        "cli-key": client.key_pem,
    }
    for name, data in files.items():
        (tmp_path / f"{name}.pem").write_bytes(data)
    f = {name: str(tmp_path / f"{name}.pem") for name in files}
    client_creds = grpc.ssl_channel_credentials(ca.cert_pem, client.key_pem, client.cert_pem)
    system = SecureSystem(
        security_model_dir,
        tmp_path / "logs",
        executor_args=["--tls-cert", f["srv"], "--tls-key", f["srv-key"], "--tls-ca", f["ca"]],
        scheduler_args=[
            "--executor-tls-ca",
            f["ca"],
            "--executor-tls-cert",
            f["cli"],
            "--executor-tls-key",
            f["cli-key"],
            "--executor-tls-server-name",
            "executor.pagoda.test",
        ],
        executor_health_creds=client_creds,
        executor_server_name="executor.pagoda.test",
    )
    with system, Client(system.target, timeout=60) as client:
        assert not is_serving(system.executor.address, client_creds), "the IP is not in the certificate"
        assert is_serving(system.executor.address, client_creds, "executor.pagoda.test")
        result = client.generate(token_ids=PROMPT, max_tokens=4, temperature=0, ignore_eos=True)
        assert result.token_ids == hf_greedy(security_model_dir, PROMPT, 4)
