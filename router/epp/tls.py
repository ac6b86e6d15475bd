"""TLS for the picker's gRPC port: gateways connect over TLS by default, without verifying.

Either the operator's certificate and key, or a self-signed one made at start (the reference
picker does the same; Envoy, Istio and kgateway skip verification of the picker's cert).
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def self_signed(hosts: tuple[str, ...] = ("localhost", "127.0.0.1")) -> tuple[bytes, bytes]:
    """(key PEM, certificate PEM), valid for a year, for ``hosts``."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvroute-epp")])
    now = datetime.datetime.now(datetime.UTC)
    alt: list[x509.GeneralName] = []
    for host in hosts:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


def server_context(cert: str | None, key: str | None) -> ssl.SSLContext:
    """TLS 1.2+ offering HTTP/2 (ALPN ``h2``), with the given certificate and key files, else
    a fresh self-signed pair."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2"])
    if cert and key:
        context.load_cert_chain(cert, key)
        return context
    key_pem, cert_pem = self_signed()
    # The ssl module loads certificates from files only: a private temporary pair.
    with tempfile.TemporaryDirectory() as folder:
        key_file, cert_file = Path(folder, "key.pem"), Path(folder, "cert.pem")
        key_file.write_bytes(key_pem)
        cert_file.write_bytes(cert_pem)
        context.load_cert_chain(cert_file, key_file)
    return context
