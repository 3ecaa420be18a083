"""Errors the parameter-server client tells apart."""


class ShardDown(ConnectionError):
    """A shard did not answer because it is gone (actor died, endpoint unavailable): fail over to the successor."""
