"""Bearer-token authentication for raymesh's own gRPC services: the control API and the parameter-server shards.

Every call carries ``authorization: Bearer <token>`` metadata; a server
interceptor compares it in constant time and answers ``UNAUTHENTICATED``
before any servicer method runs, so an unauthenticated call changes nothing.
Ray's own gRPC interceptor does the same for Ray's ports but is private API
and only knows Ray's token (which is off on some clusters), hence these few
lines. The token is Ray's when Ray's token authentication is on, else a
per-job secret (``orchestrator/api/auth.py`` picks it). It lives here, in the
layer every other package may import, so the shards, their clients and the
control API share one check.
"""

from __future__ import annotations

import hmac

import grpc

HEADER = "authorization"
_DENIED = ("raymesh: missing or wrong authentication token; fix: use the job's token (Ray's token when Ray's "
           "token authentication is on, else the control_token file in the job's run directory)")


def call_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata a client adds to every call."""
    return ((HEADER, f"Bearer {token}"),)


def _deny(request, context: grpc.ServicerContext):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)


class TokenInterceptor(grpc.ServerInterceptor):
    """Lets a call through only with ``authorization: Bearer <token>`` (every raymesh RPC is unary-unary)."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("an empty token would let every caller in; fix: pass the job's token")
        self._expected = f"Bearer {token}".encode()
        self._denied = grpc.unary_unary_rpc_method_handler(_deny)

    def intercept_service(self, continuation, handler_call_details):
        given = dict(handler_call_details.invocation_metadata or ()).get(HEADER, "")
        if isinstance(given, bytes) or not hmac.compare_digest(given.encode(), self._expected):
            return self._denied
        return continuation(handler_call_details)


def ray_token() -> str | None:
    """Ray's cluster token as this machine has it (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or
    ``~/.ray/auth_token``), whether or not this process runs in token mode; None when there is none."""
    from ray._raylet import AuthenticationTokenLoader

    loader = AuthenticationTokenLoader.instance()
    if not loader.has_token(ignore_auth_mode=True):
        return None
    return loader.get_raw_token(ignore_auth_mode=True)


def ray_token_auth_on() -> bool:
    """Whether this process talks to Ray in token mode (``RAY_AUTH_MODE=token``, inherited inside a cluster
    whose head runs with token authentication)."""
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    return is_token_auth_enabled()
