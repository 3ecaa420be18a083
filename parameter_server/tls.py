"""TLS for raymesh's own gRPC services, the control API and the parameter-server shards: one rule for both.

A job file names a PEM certificate chain and its key (``control.tls_cert``/``tls_key``,
``parameter_server.tls_cert``/``tls_key``); the server then listens TLS only, and a
client trusts that certificate: the bytes the controller hands a rank, or, outside the
cluster, the file the job announced (its ``event=control`` line, ``ps_routes.json``)
unless ``RAYMESH_TLS_CA`` names a copy of it (or of its CA) on the calling machine.
gRPC checks the dialled address against the certificate's subject alternative names,
so the certificate must name the address the service announces (127.0.0.1, the node's
IP, control.host). It lives here, beside the token check, because the parameter server
is the layer every other package may import.
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc

from parameter_server.errors import CertificateRefused

TLS_CA_ENV = "RAYMESH_TLS_CA"  # a copy of the announced certificate (or its CA) on the calling machine

PemPair = tuple[bytes, bytes]  # (certificate chain PEM, private key PEM)


def read_pair(section: str, cert: str | None, key: str | None) -> PemPair | None:
    """The PEM files ``section``'s TLS fields name, None without TLS (the spec allows both or neither); read once,
    by the controller, so a server on another node needs no copy of the files. ``FileNotFoundError`` naming the
    field and the fix when one is not readable here."""
    if cert is None:
        return None
    out = []
    for field, path in (("tls_cert", cert), ("tls_key", key)):
        try:
            out.append(Path(path).read_bytes())
        except OSError as exc:
            raise FileNotFoundError(f"{section}.{field} {path} cannot be read ({exc.strerror}); fix: point it at "
                                    "a PEM file readable where the controller runs") from None
    return out[0], out[1]


def add_port(server: grpc.Server, address: str, tls: PemPair | None) -> int:
    """Bind ``address`` on ``server``, TLS only when ``tls`` is given (no plaintext port beside it); the port
    bound, 0 when it could not bind."""
    if tls is None:
        return server.add_insecure_port(address)
    cert, key = tls
    return server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))


def channel(address: str, root_cert: bytes | None, options=()) -> grpc.Channel:
    """A channel to ``address``: TLS trusting ``root_cert`` (PEM) when given, plaintext otherwise."""
    if root_cert is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=root_cert), options=options)


def trusted_root(cert_path: str, what: str) -> bytes:
    """The PEM a client outside the cluster trusts for ``what`` (a service that announced TLS with ``cert_path``):
    the file ``RAYMESH_TLS_CA`` names, else the announced file; ``PermissionError`` naming the fix when it is not
    readable here."""
    ca = Path(os.environ.get(TLS_CA_ENV) or cert_path)
    if not ca.is_file():
        raise PermissionError(f"TLS to {what} (certificate {cert_path}): {ca} is not readable here; fix: point "
                              f"{TLS_CA_ENV} at a readable copy of that certificate (or of its CA)")
    return ca.read_bytes()


# what gRPC's details say when the TLS handshake, not the network, failed (grpcio 1.85's wording)
_HANDSHAKE_MARKERS = ("Hostname Verification Check failed", "CERTIFICATE_VERIFY_FAILED", "Tls handshake failed",
                      "SSL_ERROR_SSL")


def refused_handshake(exc: grpc.RpcError, field: str, address: str) -> CertificateRefused | None:
    """``CertificateRefused`` naming the job-file ``field`` and the fix when the failed call ``exc`` to
    ``address`` was a refused TLS handshake (a certificate that does not name the address, or another one than
    the caller trusts), None when it failed otherwise (nothing answered, a refused request)."""
    details = exc.details() or ""
    if exc.code() != grpc.StatusCode.UNAVAILABLE or not any(m in details for m in _HANDSHAKE_MARKERS):
        return None
    host = address.rsplit(":", 1)[0]
    return CertificateRefused(
        f"TLS handshake with {address} refused ({details.strip()}); fix: {field} must name {host} among its "
        "subject alternative names (the address Ray reports for that node: list them with `ray list nodes`), "
        f"and the caller must trust that certificate or its CA ({TLS_CA_ENV} outside the cluster)")
