"""Domain errors raised by services; each surface maps them to its own error shape."""

from __future__ import annotations


class DomainError(Exception):
    """Base class: a business rule said no. ``code`` is stable and machine-readable."""

    code = "invalid_request"
    status = 400

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code:
            self.code = code


class InvalidRequest(DomainError):
    code = "invalid_request"
    status = 400


class NotFound(DomainError):
    code = "not_found"
    status = 404


class Forbidden(DomainError):
    code = "permission_denied"
    status = 403


class Conflict(DomainError):
    code = "conflict"
    status = 409
