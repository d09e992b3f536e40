"""The id of the request being served, for audit rows written anywhere below the view.

``RequestIdMiddleware`` sets it for every Django request (and echoes it as ``x-request-id``);
the gateway sets its own. Outside a request (Celery, shell) it is empty.
"""

from __future__ import annotations

import contextvars
import uuid
from collections.abc import Callable

from django.http import HttpRequest, HttpResponse

current_request_id: contextvars.ContextVar[str] = contextvars.ContextVar(
    "tollgate_request_id", default="")


class RequestIdMiddleware:
    """Give each request an id of our own (a client's header is never trusted as the id)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        request_id = f"req_{uuid.uuid4().hex}"
        token = current_request_id.set(request_id)
        try:
            response = self.get_response(request)
        finally:
            current_request_id.reset(token)
        response.headers.setdefault("x-request-id", request_id)
        return response
