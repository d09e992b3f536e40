"""``idempotent``: the decorator for DRF view methods that charge or grant money; and
``idempotent_call``, the same rule for a caller that is not a DRF view (the console's forms,
which carry their key in a hidden field)."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.db import connection, transaction
from django.utils import timezone
from rest_framework import exceptions
from rest_framework.request import Request
from rest_framework.response import Response

from billing_platform.errors import InvalidRequest
from billing_platform.idempotency.models import IdempotentRequest

HEADER = "Idempotency-Key"
KEEP = timedelta(hours=24)
MAX_KEY = 255


class IdempotencyKeyReused(exceptions.APIException):
    status_code = 400
    default_code = "idempotency_key_reused"
    default_detail = ("Keys for idempotent requests can only be used with the same parameters "
                      "they were first used with. Use a new Idempotency-Key for a new request.")


def _caller(request: Request) -> str:
    principal = getattr(request.user, "principal", None)
    if principal is not None:
        return f"api_key:{principal.key_id}"
    return f"user:{request.user.pk}"


def _fingerprint(request: Request) -> str:
    body = json.dumps(request.data, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(f"{request.method} {request.path}\n{body}".encode()).hexdigest()


def _claim(caller: str, key: str, fingerprint: str) -> bool:
    """Insert the key's row (waiting for a concurrent holder); return False when it existed."""
    with connection.cursor() as cur:
        table = IdempotentRequest._meta.db_table
        cur.execute(f"DELETE FROM {table} WHERE caller = %s AND key = %s "  # noqa: S608
                    "AND created_at < %s", [caller, key, timezone.now() - KEEP])
        cur.execute(f"INSERT INTO {table} (caller, key, fingerprint, created_at) "  # noqa: S608
                    "VALUES (%s, %s, %s, %s) ON CONFLICT (caller, key) DO NOTHING RETURNING id",
                    [caller, key, fingerprint, timezone.now()])
        return cur.fetchone() is not None


def idempotent(view: Callable[..., Response]) -> Callable[..., Response]:
    """Make a DRF view method honour ``Idempotency-Key`` (see the package docstring)."""

    @functools.wraps(view)
    def wrapper(self: Any, request: Request, *args: Any, **kwargs: Any) -> Response:
        key = request.headers.get(HEADER)
        if key is None:
            return view(self, request, *args, **kwargs)
        if not key.strip() or len(key) > MAX_KEY:
            raise exceptions.ValidationError(
                {HEADER: [f"An Idempotency-Key is 1 to {MAX_KEY} characters."]})
        caller, fingerprint = _caller(request), _fingerprint(request)
        with transaction.atomic():
            if not _claim(caller, key, fingerprint):
                first = IdempotentRequest.objects.get(caller=caller, key=key)
                if first.fingerprint != fingerprint:
                    raise IdempotencyKeyReused()
                return Response(first.body, status=first.status_code,
                                headers={"Idempotent-Replayed": "true"})
            response = view(self, request, *args, **kwargs)
            if response.status_code >= 500:
                transaction.set_rollback(True)
                return response
            IdempotentRequest.objects.filter(caller=caller, key=key).update(
                status_code=response.status_code, body=response.data)
            return response

    return wrapper


def idempotent_call(*, caller: str, key: str, fingerprint: str,
                    call: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], bool]:
    """Run ``call`` once per (caller, key); return its result and whether it was replayed.

    As the decorator does: the result (JSON) is stored with the key in the transaction of
    whatever ``call`` wrote; the same key with the same ``fingerprint`` returns the stored
    result without running ``call`` (a concurrent one waits for the first); with another
    fingerprint it is refused. An exception rolls the writes and the key back together.
    """
    if not key.strip() or len(key) > MAX_KEY:
        raise InvalidRequest(f"An idempotency key is 1 to {MAX_KEY} characters.",
                             param="idempotency_key")
    with transaction.atomic():
        if not _claim(caller, key, fingerprint):
            first = IdempotentRequest.objects.get(caller=caller, key=key)
            if first.fingerprint != fingerprint:
                raise InvalidRequest("This form was already sent with other values; reload "
                                     "the page to send new ones.", param="idempotency_key")
            return dict(first.body or {}), True
        result = call()
        IdempotentRequest.objects.filter(caller=caller, key=key).update(status_code=200,
                                                                        body=result)
        return result, False


def idempotent_requests_prune(*, now: Any = None) -> int:
    """Delete keys older than 24 hours; return how many."""
    cutoff = (now or timezone.now()) - KEEP
    deleted, _ = IdempotentRequest.objects.filter(created_at__lt=cutoff).delete()
    return deleted
