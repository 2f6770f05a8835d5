"""One exception tree for everything the gateway refuses, rendered in one place.

Handlers raise; ``openai_error_response`` turns any :class:`GatewayError` into
the OpenAI error body ``{"error": {"message", "type", "param", "code"}}`` so
every client SDK parses it the same way.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from starlette.responses import Response


class GatewayError(Exception):
    status = 500
    error_type = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = dict(headers or {})

    def body(self) -> bytes:
        return error_body(self.message, self.error_type, self.param, self.code)


class InternalError(GatewayError):
    """What the gateway did not expect, wherever it was caught: the handler, Starlette's
    routes, or the HTTP protocol when the app failed before answering."""

    code = "internal_error"

    def __init__(self, *, headers: Mapping[str, str] | None = None) -> None:
        super().__init__("the gateway failed to handle this request", headers=headers)


class InvalidRequest(GatewayError):
    status = 400
    error_type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class Unauthorized(GatewayError):
    status = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class ModelNotFound(GatewayError):
    status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class NotFound(GatewayError):
    status = 404
    error_type = "invalid_request_error"
    code = "not_found"


class PayloadTooLarge(GatewayError):
    status = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class RateLimited(GatewayError):
    """Shed by admission control; ``Retry-After`` tells the SDK when to retry."""

    status = 429
    error_type = "rate_limit_error"


class Unavailable(GatewayError):
    status = 503
    error_type = "service_unavailable"
    code = "no_healthy_backend"


class UpstreamError(GatewayError):
    status = 502
    error_type = "upstream_error"
    code = "bad_gateway"


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"


def error_body(message: str, error_type: str, param: str | None, code: str | None) -> bytes:
    payload = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    return json.dumps(payload).encode()


def openai_error_response(error: GatewayError) -> Response:
    return Response(
        error.body(), status_code=error.status, media_type="application/json", headers=error.headers
    )
