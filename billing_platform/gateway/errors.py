"""The one place /v1 turns an error into OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}`` with the HTTP status OpenAI uses.

Services raise domain errors (``billing_platform.errors``); ``openai_error`` answers ANY of
them, so a new service error is never a 500 on /v1. The surface's own refusals (no key, wrong
method, a body over the limit or not sent in time, an unknown URL) are domain errors too,
answered the same way; only an unexpected exception gets ``server_error``.
"""

from __future__ import annotations

from django.http import JsonResponse

from billing_platform.errors import DomainError, InvalidRequest

TYPE_BY_STATUS = {
    400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
    404: "invalid_request_error", 408: "invalid_request_error", 409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error", 500: "server_error", 502: "server_error", 503: "server_error",
    504: "server_error",
}


class MethodNotAllowed(DomainError):
    """The /v1 endpoint exists but not for this HTTP method (a refusal of the surface)."""

    code = "method_not_allowed"
    status = 405


class RequestTimeout(DomainError):
    """The client stopped sending its request body (``GATEWAY_BODY_READ_TIMEOUT_S``)."""

    code = "request_timeout"
    status = 408


def _response(status: int, message: str, *, code: str | None, param: str | None,
              headers: dict[str, str], request_id: str | None) -> JsonResponse:
    body = {"error": {"message": message, "type": TYPE_BY_STATUS.get(
        status, "invalid_request_error"), "param": param, "code": code}}
    response = JsonResponse(body, status=status)
    for name, value in headers.items():
        response[name] = value
    if request_id:
        response["x-request-id"] = request_id
    return response


def openai_error(exc: DomainError, request_id: str | None = None) -> JsonResponse:
    """Return the OpenAI-shaped answer to a domain error (its headers included).

    A plain invalid request has a null ``code``, as OpenAI's own answers do; any specific code
    (``unknown_parameter``, ``model_not_found``, ...) is passed on.
    """
    code = None if exc.code == InvalidRequest.code else exc.code
    return _response(exc.status, exc.message, code=code, param=exc.param,
                     headers=exc.headers, request_id=request_id)


def server_error(request_id: str | None = None) -> JsonResponse:
    """Return the OpenAI-shaped 500 for an exception nothing expected (it is logged)."""
    return _response(500, "The server had an error while processing your request.",
                     code="internal_error", param=None, headers={}, request_id=request_id)
