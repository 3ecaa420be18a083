"""Errors the parameter-server client tells apart."""


class ShardDown(ConnectionError):
    """A shard did not answer because it is gone (actor died, endpoint unavailable): fail over to the successor."""


class CertificateRefused(PermissionError):
    """A shard's TLS handshake failed: the certificate does not name the address dialled, or is not the one the
    caller trusts. Every shard would refuse the same way, so this is not failed over as ``ShardDown``: the job's
    ``parameter_server.tls_cert`` needs fixing."""
