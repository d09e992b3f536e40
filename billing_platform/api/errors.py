"""The one place /api/v1 turns an error into a response (settings' EXCEPTION_HANDLER).

Services raise domain errors (``billing_platform.errors``); every one of them becomes DRF's
error shape here, ``{"detail", "code"[, "param"]}`` with the error's status, so a view never
catches one to answer it. Anything else is left to DRF (its validation, auth and 404 errors);
a URL no route matches is answered by ``not_found`` (the root URLconf's ``handler404``).
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views import defaults
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


def not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    """Django's 404 for a URL no route matches (letters for an ``<int:id>``, a slash in a
    code): DRF's shape under /api/, as every other /api answer; Django's page elsewhere."""
    if request.path.startswith("/api/"):
        return JsonResponse({"detail": "Not found.", "code": "not_found"}, status=404)
    return defaults.page_not_found(request, exception)
