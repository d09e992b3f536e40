"""The one place /api/v1 turns an error into a response (settings' EXCEPTION_HANDLER).

Services raise domain errors (``billing_platform.errors``); every one of them becomes DRF's
error shape here, ``{"detail", "code"[, "param"]}`` with the error's status, so a view never
catches one to answer it. Anything else is left to DRF (its validation, auth and 404 errors).
"""

from __future__ import annotations

from typing import Any

from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from billing_platform.errors import DomainError


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """Map domain errors to DRF's error shape; leave the rest to DRF."""
    if isinstance(exc, DomainError):
        body = {"detail": exc.message, "code": exc.code}
        if exc.param:
            body["param"] = exc.param
        return Response(body, status=exc.status)
    return drf_exception_handler(exc, context)
