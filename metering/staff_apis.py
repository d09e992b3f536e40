"""Staff-only endpoints of the usage API: dead-lettered events, listed and retried.

A module of its own, beside ``metering.apis`` (the customers' usage surface), because nobody
but Tollgate staff reaches these: every view here takes DRF's ``IsAdminUser`` (a signed-in
staff person; an API key is never staff), so a customer gets 403 in DRF's shape, and an
unknown letter is 404. Views stay thin: validate, call ``metering.services`` or
``metering.selectors``, serialize.

- ``GET /api/v1/usage/dead_letters/``: newest first, filtered, paged by ``after``.
- ``POST /api/v1/usage/dead_letters/{id}/retry``: one letter.
- ``POST /api/v1/usage/dead_letters/retry``: many (ids, or every unresolved one, oldest first).

A retry is idempotent (see ``services.usage_dead_letter_retry``) and audited.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from django.db import DatabaseError
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.permissions import IsAdminUser, IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from billing_platform.accounts.models import Organization
from billing_platform.errors import InvalidRequest, NotFound
from metering import events, selectors, services
from metering import serializers as s
from metering.models import UsageDeadLetter
from metering.recording import TRANSIENT, close_broken_connection

T = TypeVar("T")

_ERRORS = {400: OpenApiResponse(description="Invalid filters or body."),
           401: OpenApiResponse(description="Not signed in."),
           403: OpenApiResponse(description="Not Tollgate staff.")}


class StaffApi(APIView):
    permission_classes = [IsAuthenticated, IsAdminUser]


def _organization_id(public_id: str | None) -> int | None:
    if not public_id:
        return None
    org_id = Organization.objects.filter(public_id=public_id).values_list("pk", flat=True).first()
    if org_id is None:
        raise NotFound("No such organization.", param="organization")
    return org_id


def _recording(call: Callable[[], T]) -> T:
    """Run a retry; PostgreSQL going away mid-way is a 503 to retry, not a 500."""
    try:
        return call()
    except TRANSIENT as exc:
        if isinstance(exc, DatabaseError):
            close_broken_connection(exc)
        raise services.UsageNotRecorded("The dead letters could not be recorded right now; "
                                        "retry the same call.") from exc


def _letters_data(letters: list[UsageDeadLetter]) -> list[dict[str, Any]]:
    rows = {}
    for letter in letters:
        try:
            rows[letter.pk] = events.decode_row(letter.payload)
        except InvalidRequest:
            continue  # unreadable: shown as it is
    org_ids = dict(Organization.objects.filter(
        pk__in={row[events.I_ORG] for row in rows.values()}).values_list("pk", "public_id"))
    return [{"id": letter.pk, "origin": letter.origin, "error": letter.error,
             "payload": letter.payload,
             "organization": (org_ids.get(rows[letter.pk][events.I_ORG])
                              if letter.pk in rows else None),
             "request_id": rows[letter.pk][events.I_REQUEST] if letter.pk in rows else None,
             "created_at": letter.created_at, "resolved_at": letter.resolved_at}
            for letter in letters]


class DeadLetterListApi(StaffApi):
    """Dead-lettered usage events (staff only)."""

    @extend_schema(operation_id="usage_dead_letters_list", tags=["usage"],
                   parameters=[s.DeadLetterQuerySerializer],
                   responses={200: s.DeadLetterPageSerializer, 404: OpenApiResponse(
                       description="No such organization."), **_ERRORS},
                   description="Usage events that could not be recorded (unreadable, or "
                               "refused by rating, e.g. a model without a price), newest "
                               "first. Tollgate staff only.")
    def get(self, request: Request) -> Response:
        query = s.DeadLetterQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        q = query.validated_data
        status = q["status"]
        letter_filter = selectors.DeadLetterFilter(
            resolved=None if status == "all" else status == "resolved", origin=q.get("origin"),
            organization_id=_organization_id(q.get("organization")),
            created_after=q.get("created_after"), created_before=q.get("created_before"),
            before_id=q.get("after"))
        page = list(selectors.usage_dead_letters(letter_filter=letter_filter)[:q["limit"] + 1])
        more, page = len(page) > q["limit"], page[:q["limit"]]
        return Response(s.DeadLetterPageSerializer({
            "data": _letters_data(page), "has_more": more,
            "last_id": page[-1].pk if page else None}).data)


class DeadLetterRetryApi(StaffApi):
    """Retry one dead letter (staff only)."""

    @extend_schema(operation_id="usage_dead_letters_retry", tags=["usage"], request=None,
                   responses={200: s.DeadLetterRetrySerializer, 404: OpenApiResponse(
                       description="No such dead letter."), **_ERRORS},
                   description="Record the event again (after its cause was fixed). Safe to "
                               "repeat: the event's request id keeps it from being recorded "
                               "twice. Audited.")
    def post(self, request: Request, letter_id: int) -> Response:
        result = _recording(lambda: services.usage_dead_letter_retry(
            letter_id=letter_id, acting_user=request.user))
        return Response(s.DeadLetterRetrySerializer(result).data)


class DeadLetterBulkRetryApi(StaffApi):
    """Retry many dead letters (staff only)."""

    @extend_schema(operation_id="usage_dead_letters_retry_many", tags=["usage"],
                   request=s.DeadLetterBulkRetryRequestSerializer,
                   responses={200: s.DeadLetterBulkRetrySerializer, 404: OpenApiResponse(
                       description="No such organization."), **_ERRORS},
                   description=f"Retry up to {s.MAX_RETRY_IDS} letters by id (unknown ids "
                               "are skipped), or the oldest unresolved ones. Each is retried, "
                               "and audited, on its own.")
    def post(self, request: Request) -> Response:
        body = s.DeadLetterBulkRetryRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        b = body.validated_data
        more, last = False, None
        ids = list(dict.fromkeys(b.get("ids") or ()))
        if b["all_unresolved"]:
            letter_filter = selectors.DeadLetterFilter(
                origin=b.get("origin"), organization_id=_organization_id(b.get("organization")),
                after_id=b.get("after"), oldest_first=True)
            ids = list(selectors.usage_dead_letters(letter_filter=letter_filter)
                       .values_list("pk", flat=True)[:s.MAX_RETRY_IDS + 1])
            more, ids = len(ids) > s.MAX_RETRY_IDS, ids[:s.MAX_RETRY_IDS]
            last = ids[-1] if ids else None
        results = _recording(lambda: services.usage_dead_letters_retry(
            letter_ids=ids, acting_user=request.user))
        return Response(s.DeadLetterBulkRetrySerializer(
            {"data": results, "has_more": more, "last_id": last}).data)
