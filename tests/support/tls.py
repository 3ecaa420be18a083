"""Self-signed certificates for the TLS tests of raymesh's gRPC services (the control API, the shards)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path


def self_signed(*ips: str) -> tuple[bytes, bytes]:
    """A certificate valid for the addresses ``ips`` (127.0.0.1 when none: what the servers announce on loopback)
    and its key, in PEM; gRPC checks the dialled address against these subject alternative names."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "raymesh-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    names = [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips or ("127.0.0.1",)]
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(names), False)
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def pem_files(folder: Path, *ips: str) -> tuple[Path, Path]:
    """``self_signed(*ips)`` written to ``folder``/tls.pem and tls.key: what a job file's tls_cert/tls_key name."""
    cert, key = self_signed(*ips)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tls.pem").write_bytes(cert)
    (folder / "tls.key").write_bytes(key)
    return folder / "tls.pem", folder / "tls.key"
