"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}, and in
Anthropic's for its Messages API: {"type": "error", "error": {"type", "message"}}."""

from __future__ import annotations

import msgspec
from aiohttp import web

from kvroute.kvcore.client_text import shown as shown  # callers quote with errors.shown

_JSON = "application/json"
# The error shapes: OpenAI's (chat, completions, Responses) and Anthropic's (Messages).
OPENAI = "openai"
ANTHROPIC = "anthropic"


class ApiError(Exception):
    """An error to return to the client as-is."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> bytes:
        return error_body(self.message, self.error_type, self.param, self.code)

    def response(self, shape: str = OPENAI) -> web.Response:
        """The error as the client's API shapes it (``OPENAI`` or ``ANTHROPIC``)."""
        body = self.body() if shape == OPENAI else anthropic_error_body(self.status, self.message)
        return web.Response(status=self.status, body=body, content_type=_JSON, headers=self.headers)


def shape_of_path(path: str) -> str:
    """The error shape a request's path takes: Anthropic's for Messages, else OpenAI's."""
    return ANTHROPIC if path.startswith("/v1/messages") else OPENAI


def anthropic_error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status (its API documents one per status)."""
    if status >= 500:
        return "overloaded_error" if status in (503, 529) else "api_error"
    return _ANTHROPIC_TYPES.get(status, "invalid_request_error")


_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def anthropic_error_body(status: int, message: str) -> bytes:
    error = {"type": anthropic_error_type(status), "message": message}
    return msgspec.json.encode({"type": "error", "error": error})


def error_body(message: str, error_type: str, param: str | None, code: str | None) -> bytes:
    return msgspec.json.encode(
        {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    )


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def model_not_found(model: str, available: list[str]) -> ApiError:
    return ApiError(
        404,
        f"The model {shown(model)} does not exist. Available: {', '.join(available) or 'none'}.",
        param="model",
        code="model_not_found",
    )


def body_too_large(limit: int) -> ApiError:
    return ApiError(
        413, f"Request body is larger than the limit of {limit} bytes.", code="request_too_large"
    )


def no_healthy_replica(retry_after_s: int) -> ApiError:
    return ApiError(
        503,
        "No healthy replica can serve this request right now.",
        error_type="service_unavailable_error",
        code="no_healthy_replica",
        headers={"Retry-After": str(retry_after_s)},
    )


def upstream_unavailable(retry_after_s: int) -> ApiError:
    return ApiError(
        502,
        "Every replica tried failed before answering.",
        error_type="upstream_error",
        code="upstream_unavailable",
        headers={"Retry-After": str(retry_after_s)},
    )


def too_many_requests(limit: int, retry_after_s: int = 1) -> ApiError:
    return ApiError(
        429,
        f"The router is at its limit of {limit} concurrent requests and its queue is full.",
        error_type="rate_limit_error",
        code="too_many_requests",
        headers={"Retry-After": str(retry_after_s)},
    )


def unauthorized(missing: bool) -> ApiError:
    what = "No API key was given" if missing else "The API key is not valid"
    return ApiError(
        401,
        f"{what}: send Authorization: Bearer <key> (or x-api-key: <key>).",
        error_type="authentication_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def forbidden(message: str) -> ApiError:
    return ApiError(403, message, error_type="permission_error", code="forbidden")


def request_timeout(what: str) -> ApiError:
    return ApiError(408, f"{what} took too long.", code="request_timeout")


def gateway_timeout(limit_s: float) -> ApiError:
    return ApiError(
        504,
        f"The request did not finish within the router's limit of {limit_s:g}s.",
        error_type="upstream_error",
        code="timeout",
    )


def over_budget(tenant: str, kind: str, per_minute: float, retry_after_s: int) -> ApiError:
    """A tenant's token budget is spent (OpenAI's shape for a tokens-per-minute limit)."""
    return ApiError(
        429,
        f"Rate limit reached for tenant {tenant!r} on {kind} tokens per minute: limit "
        f"{per_minute:g}. Please try again in {retry_after_s}s.",
        error_type="rate_limit_exceeded",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(retry_after_s)},
    )


def shed(priority: str, why: str, retry_after_s: int) -> ApiError:
    """A queued (or arriving) request of a lower class gives way to higher-priority work."""
    return ApiError(
        429,
        f"The router is saturated and sheds {priority} requests first: {why}.",
        error_type="rate_limit_error",
        code="shed",
        headers={"Retry-After": str(retry_after_s)},
    )
