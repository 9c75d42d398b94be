"""Throwaway certificates for local TLS/mTLS: a CA, a server and a client certificate.

For development and tests only (`make certs` writes them into ./certs/):

    python -m scripts.make_certs --out certs --dns pagoda-executor.default.svc

writes ca.pem (+ ca-key.pem), server.pem/server-key.pem (SAN IP:127.0.0.1,
DNS:localhost and every --dns name) and client.pem/client-key.pem (client
authentication, for the scheduler → executor hop). Keys are ECDSA P-256.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import ipaddress
import pathlib
from collections.abc import Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_DAYS = 30


@dataclasses.dataclass(frozen=True)
class Issued:
    """A PEM certificate and its PEM private key."""

    cert_pem: bytes
    key_pem: bytes


@dataclasses.dataclass(frozen=True)
class CertPaths:
    """Where `write_certs` put each file."""

    ca: pathlib.Path
    ca_key: pathlib.Path
    server_cert: pathlib.Path
    server_key: pathlib.Path
    client_cert: pathlib.Path
    client_key: pathlib.Path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Pagoda development"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _key_usage(**enabled: bool) -> x509.KeyUsage:
    flags = dict.fromkeys(
        (
            "digital_signature",
            "content_commitment",
            "key_encipherment",
            "data_encipherment",
            "key_agreement",
            "key_cert_sign",
            "crl_sign",
            "encipher_only",
            "decipher_only",
        ),
        False,
    )
    return x509.KeyUsage(**{**flags, **enabled})


def _builder(subject: x509.Name, issuer: x509.Name, public_key, days: int) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def make_ca(common_name: str = "Pagoda development CA", days: int = DEFAULT_DAYS) -> Issued:
    """A self-signed CA that may sign leaf certificates only."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(_name(common_name), _name(common_name), key.public_key(), days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(key_cert_sign=True, crl_sign=True), critical=True)
        .sign(key, hashes.SHA256())
    )
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def issue(
    ca: Issued,
    common_name: str,
    *,
    hosts: Sequence[str] = (),
    server: bool = True,
    client: bool = False,
    days: int = DEFAULT_DAYS,
) -> Issued:
    """A leaf certificate signed by `ca`.

    Args:
        ca: the signing CA.
        common_name: subject CN.
        hosts: SAN entries; IP addresses become IP SANs, the rest DNS names.
        server: usable for TLS server authentication.
        client: usable for TLS client authentication (mTLS).
        days: validity.
    """
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
        [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
    )
    builder = (
        _builder(_name(common_name), ca_cert.subject, key.public_key(), days)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(digital_signature=True), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    if hosts:
        builder = builder.add_extension(_san(hosts), critical=False)
    return Issued(builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _write(path: pathlib.Path, data: bytes, private: bool = False) -> pathlib.Path:
    path.write_bytes(data)
    if private:
        path.chmod(0o600)
    return path


def write_certs(out_dir: str | pathlib.Path, dns_names: Sequence[str] = (), days: int = DEFAULT_DAYS) -> CertPaths:
    """Write a fresh CA, server and client certificate into `out_dir`."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ca = make_ca(days=days)
    server = issue(ca, "pagoda-server", hosts=["127.0.0.1", "localhost", *dns_names], server=True, days=days)
    client = issue(ca, "pagoda-scheduler", server=False, client=True, days=days)
    return CertPaths(
        ca=_write(out / "ca.pem", ca.cert_pem),
        ca_key=_write(out / "ca-key.pem", ca.key_pem, True),
        server_cert=_write(out / "server.pem", server.cert_pem),
        server_key=_write(out / "server-key.pem", server.key_pem, True),
        client_cert=_write(out / "client.pem", client.cert_pem),
        client_key=_write(out / "client-key.pem", client.key_pem, True),
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: write the certificates and print the flags that use them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="certs", help="output folder (default ./certs)")
    parser.add_argument("--dns", action="append", default=[], help="extra DNS name for the server certificate")
    parser.add_argument("--days", type=int, default=DEFAULT_DAYS, help="validity in days")
    args = parser.parse_args(argv)
    p = write_certs(args.out, args.dns, args.days)
    print(f"wrote {p.ca}, {p.server_cert}, {p.client_cert} (and keys) — for development only")
    print(f"  executor:  --tls-cert {p.server_cert} --tls-key {p.server_key} --tls-ca {p.ca}")
    print(
        f"  scheduler: --tls-cert {p.server_cert} --tls-key {p.server_key} --executor-tls-ca {p.ca} "
        f"--executor-tls-cert {p.client_cert} --executor-tls-key {p.client_key}"
    )


if __name__ == "__main__":
    main()
