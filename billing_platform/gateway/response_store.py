"""Stored answers of the Responses API (``StoredResponse``): written when a response with
``store`` true (the default) finishes, read to rebuild the conversation a
``previous_response_id`` continues, and by ``GET``/``DELETE /v1/responses/{id}``.

Every read and write is scoped to the caller's organization: another organization's id is
answered exactly as an id that never existed (404), so an id says nothing about whether it is
someone else's. A response is kept ``RESPONSES_RETENTION_DAYS`` (the beat's
``responses_expire`` deletes it afterwards; until then an expired one is already not found).

Synchronous (the ORM): /v1 views run these through ``db_connections.in_thread``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from billing_platform.errors import InvalidRequest, NotFound
from billing_platform.gateway.models import StoredResponse

# A chain longer than this is refused rather than rebuilt: any real conversation of this many
# turns is far past every model's context, and the walk must stay one bounded query.
MAX_CHAIN = 1000
EXPIRE_BATCH = 5000

_CHAIN_SQL = """
WITH RECURSIVE chain (id, previous_id, input_items, output_text, depth) AS (
    SELECT id, previous_id, input_items, output_text, 0
      FROM gateway_storedresponse
     WHERE public_id = %(head)s AND organization_id = %(org)s AND expires_at > %(now)s
    UNION ALL
    SELECT r.id, r.previous_id, r.input_items, r.output_text, c.depth + 1
      FROM gateway_storedresponse r JOIN chain c ON r.id = c.previous_id
     WHERE r.organization_id = %(org)s AND r.expires_at > %(now)s AND c.depth < %(max)s
)
SELECT id, input_items, output_text, depth FROM chain ORDER BY depth DESC
"""


@dataclass(frozen=True)
class Chain:
    """A stored conversation: its newest response's row id and its turns, oldest first."""

    head_pk: int
    messages: list[dict[str, str]]


def not_found(public_id: str) -> NotFound:
    """Return the one answer for a response id this organization has no stored response of."""
    return NotFound(f"Response with id '{public_id}' not found.", code="not_found")


def stored_response_chain(*, org_id: int, public_id: str) -> Chain:
    """Return the conversation ``public_id`` ends (its input turns and answers, oldest first),
    in one query; raise NotFound (param ``previous_response_id``) when it is not stored for
    this organization, InvalidRequest past MAX_CHAIN responses."""
    with connection.cursor() as cursor:
        cursor.execute(_CHAIN_SQL, {"head": public_id, "org": org_id,
                                    "now": timezone.now(), "max": MAX_CHAIN})
        rows = cursor.fetchall()
    if not rows:
        raise NotFound(f"Previous response with id '{public_id}' not found.",
                       param="previous_response_id", code="previous_response_not_found")
    if rows[0][3] >= MAX_CHAIN:
        raise InvalidRequest(f"The conversation ending in '{public_id}' has more than "
                             f"{MAX_CHAIN} responses; start a new one.",
                             param="previous_response_id")
    messages: list[dict[str, str]] = []
    for _pk, items, output_text, _depth in rows:
        # Django reads jsonb as text (its JSONField decodes it); a raw cursor gets that text
        messages.extend(json.loads(items) if isinstance(items, str) else items)
        messages.append({"role": "assistant", "content": output_text})
    return Chain(head_pk=rows[-1][0], messages=messages)


def _storable(value: Any) -> Any:
    """Return ``value`` with every NUL character as U+FFFD: PostgreSQL's text and jsonb hold
    any Unicode but NUL, and a prompt with one is still served (only its stored copy
    differs, by that character)."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, list):
        return [_storable(v) for v in value]
    if isinstance(value, dict):
        return {_storable(k): _storable(v) for k, v in value.items()}
    return value


def stored_response_create(*, org_id: int, project_id: int | None, public_id: str,
                           request_id: str, previous_pk: int | None, model: str,
                           input_items: list[dict[str, str]], output_text: str,
                           usage: dict[str, Any], body: dict[str, Any],
                           created_at: datetime) -> StoredResponse:
    """Store one finished response for the retention period."""
    return StoredResponse.objects.create(
        public_id=public_id, organization_id=org_id, project_id=project_id,
        previous_id=previous_pk, request_id=request_id, model=model,
        input_items=_storable(input_items), output_text=_storable(output_text), usage=usage,
        body=_storable(body),
        created_at=created_at,
        expires_at=created_at + timedelta(days=settings.RESPONSES_RETENTION_DAYS))


def _live(*, org_id: int, public_id: str):
    return StoredResponse.objects.filter(organization_id=org_id, public_id=public_id,
                                         expires_at__gt=timezone.now())


def stored_response_get(*, org_id: int, public_id: str) -> StoredResponse:
    """Return the organization's stored response ``public_id``; raise NotFound."""
    found = _live(org_id=org_id, public_id=public_id).first()
    if found is None:
        raise not_found(public_id)
    return found


def input_item_objects(stored: StoredResponse) -> list[dict[str, Any]]:
    """Return a stored response's own input turns as OpenAI's input items, oldest first
    (ids stable per response and position, so ``after`` pages through them)."""
    out = []
    for i, turn in enumerate(stored.input_items):
        kind = "output_text" if turn["role"] == "assistant" else "input_text"
        part: dict[str, Any] = {"type": kind, "text": turn["content"]}
        if kind == "output_text":
            part["annotations"] = []
        out.append({"id": f"msg_{stored.public_id[5:]}_{i}", "type": "message",
                    "role": turn["role"], "status": "completed", "content": [part]})
    return out


def stored_response_delete(*, org_id: int, public_id: str) -> None:
    """Delete the organization's stored response ``public_id`` (the responses that continued
    it keep their own turns, and their chain now starts with them); raise NotFound."""
    with transaction.atomic():
        deleted, _ = _live(org_id=org_id, public_id=public_id).delete()
    if not deleted:
        raise not_found(public_id)


def stored_responses_expire(*, now: datetime | None = None) -> int:
    """Delete every stored response past its retention, in batches; return how many.

    Safe to run twice or side by side: a second run finds nothing left to delete.
    """
    now = now or timezone.now()
    total = 0
    while True:
        ids = list(StoredResponse.objects.filter(expires_at__lte=now)
                   .order_by("expires_at").values_list("id", flat=True)[:EXPIRE_BATCH])
        if not ids:
            return total
        with transaction.atomic():
            # SET_NULL on ``previous``: the responses that continued these start a chain
            StoredResponse.objects.filter(id__in=ids).delete()
        total += len(ids)
