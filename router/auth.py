"""Bearer-key checks for client endpoints (/v1/*) and admin endpoints (/metrics, /admin/*)."""

from __future__ import annotations

import hmac
import logging

from aiohttp import web

from . import errors
from .config import AuthConfig, api_key_value, resolve_secret

_LOOPBACK = ("127.0.0.1", "::1")
log = logging.getLogger(__name__)


class Auth:
    def __init__(self, config: AuthConfig) -> None:
        self._client_keys = [
            resolve_secret(api_key_value(k), f"auth.api_keys[{i}]").encode()
            for i, k in enumerate(config.api_keys)
        ]
        # The tenant each key belongs to (None: named by the request's headers, if at all).
        self._tenants = [None if isinstance(k, str) else k.tenant for k in config.api_keys]
        key = config.admin_api_key
        self._admin_key = resolve_secret(key, "auth.admin_api_key").encode() if key else None
        if self._client_keys and self._admin_key is None:
            log.warning(
                "auth.api_keys is set and auth.admin_api_key is not: the admin API (/admin/*, "
                "/status data) is closed; set auth.admin_api_key to use it"
            )

    @property
    def clients_need_key(self) -> bool:
        return bool(self._client_keys)

    def check_client(self, request: web.Request) -> str | None:
        """Raise 401 unless the request carries a client key; the key's tenant, if it has one."""
        if not self._client_keys:
            return None
        presented = _bearer(request)
        # Compare against every key (no early exit), in constant time per key.
        matched = -1
        for i, key in enumerate(self._client_keys):
            if presented is not None and hmac.compare_digest(presented, key):
                matched = i
        if matched < 0:
            raise errors.unauthorized(presented is None)
        return self._tenants[matched]

    def check_admin(self, request: web.Request, *, open_without_key: bool = False) -> None:
        """Admin endpoints need the admin key. Without one configured: closed to everyone when
        clients need keys (``auth.api_keys``: the admin API never asks less than the client
        API), else open to loopback clients only; ``open_without_key`` endpoints (/metrics)
        to anyone."""
        if self._admin_key is None:
            if open_without_key:
                return
            if self._client_keys:
                raise errors.forbidden(
                    "admin endpoints need auth.admin_api_key when auth.api_keys is set "
                    "(clients need a key, so the admin API is closed without one)"
                )
            if request.remote not in _LOOPBACK:
                raise errors.forbidden("admin endpoints without auth.admin_api_key: loopback only")
            return
        presented = _bearer(request)
        if presented is None or not hmac.compare_digest(presented, self._admin_key):
            raise errors.unauthorized(presented is None)


def _bearer(request: web.Request) -> bytes | None:
    """The key presented: ``Authorization: Bearer`` (OpenAI's clients, vLLM), else
    ``x-api-key`` (Anthropic's clients send their key there: Claude Code's ANTHROPIC_API_KEY)."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        token = request.headers.get("x-api-key", "")
        if not token.strip():
            return None
    return token.strip().encode("utf-8", "surrogateescape")  # any bytes: compared, never shown
