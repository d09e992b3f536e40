"""Domain errors raised by services; each surface maps them to its own error shape.

A service says what went wrong in the domain's words (this object does not exist, this request
is invalid, a limit says not now) and never how a surface answers it. Each surface maps every
``DomainError`` in one place: ``/v1`` to OpenAI's error shape (``gateway/errors.py``), ``/api``
to DRF's (``api/errors.py``), the console to a page or a message (``console/views.org_page``).

``code`` is stable and machine-readable (clients branch on it). ``status`` is the HTTP status a
surface answers with; it belongs to the class, so no raise site picks one. ``headers`` carry
what the answer must say besides the words: when to retry, the caller's rate-limit state.
"""

from __future__ import annotations


class DomainError(Exception):
    """Base class: a business rule said no. ``code`` is stable and machine-readable."""

    code = "invalid_request"
    status = 400

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}
        if code:
            self.code = code


class InvalidRequest(DomainError):
    code = "invalid_request"
    status = 400


class Unauthenticated(DomainError):
    """No credentials, or ones that are wrong, revoked or expired."""

    code = "unauthenticated"
    status = 401


class Forbidden(DomainError):
    code = "permission_denied"
    status = 403


class NotFound(DomainError):
    code = "not_found"
    status = 404


class Conflict(DomainError):
    code = "conflict"
    status = 409


class PayloadTooLarge(DomainError):
    code = "request_too_large"
    status = 413


class RateLimited(DomainError):
    """A limit or the capacity says not now; ``headers`` say when to retry."""

    code = "rate_limit_exceeded"
    status = 429


class Unavailable(DomainError):
    """Something the answer needs is down right now; retrying shortly may succeed."""

    code = "service_unavailable"
    status = 503


class UpstreamFailed(DomainError):
    """A system behind the platform (an inference engine) failed; its status is passed on
    (502 by default, 503 when nothing could take the request, 504 on a timeout)."""

    code = "upstream_error"
    status = 502

    def __init__(self, message: str, *, status: int = 502, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message, param=param, code=code, headers=headers)
        self.status = status
