"""Write audit rows. Every privileged or money-moving service calls ``audit_record`` inside its
own ``transaction.atomic()``, so the action and its row commit or roll back together (as Zulip's
actions write ``RealmAuditLog``).

``acting_user`` is whoever acted: a console or API ``User``, an ``ApiKey`` (or the
``KeyUser``/``KeyPrincipal`` the API authenticates), or ``None`` for the system itself (a
webhook, a Celery sweep).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models, transaction
from django.forms.models import model_to_dict
from django.utils import timezone

from billing_platform.accounts.models import ApiKey, Organization, User
from billing_platform.audit.context import current_request_id
from billing_platform.audit.models import AuditEvent, _audit_id


def is_secret_field(name: str) -> bool:
    """True for fields an audit row never holds: secrets and digests of secrets."""
    return "secret" in name or name.startswith("password") or name.endswith(("_hash", "_token"))


def _actor(acting_user: Any) -> dict[str, Any]:
    if acting_user is None or not getattr(acting_user, "is_authenticated", True):
        return {"actor_label": "system"}
    if isinstance(acting_user, User):
        return {"actor_user": acting_user, "actor_label": acting_user.email}
    if isinstance(acting_user, ApiKey):
        return {"actor_key_id": acting_user.pk, "actor_label": f"api-key:{acting_user.prefix}"}
    principal = getattr(acting_user, "principal", acting_user)  # KeyUser -> KeyPrincipal
    if hasattr(principal, "key_id") and hasattr(principal, "prefix"):
        return {"actor_key_id": principal.key_id, "actor_label": f"api-key:{principal.prefix}"}
    raise TypeError(f"acting_user must be a User, an ApiKey or None, not {acting_user!r}")


def audit_record(*, acting_user: Any, organization: Organization | int | None, action: str,
                 target: str = "", before: dict[str, Any] | None = None,
                 after: dict[str, Any] | None = None) -> AuditEvent:
    """Append one audit row; call it inside the action's transaction.

    ``organization`` is the org acted on (or its pk), ``None`` for a platform-wide action such as
    a staff price-book change.
    """
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError(f"audit_record({action!r}) must run inside the action's "
                           "transaction.atomic() block")
    return AuditEvent.objects.create(
        organization_id=getattr(organization, "pk", organization), action=action,
        target=target or "", before=before, after=after, request_id=current_request_id.get(),
        **_actor(acting_user))


def audit_record_many(*, acting_user: Any, action: str,
                      rows: Iterable[tuple[int | None, str, dict[str, Any] | None,
                                           dict[str, Any] | None]]) -> int:
    """Append one row of ``action`` per (organization id, target, before, after), in bulk.

    For an action done to many objects at once (a period close finalizing thousands of
    invoices), where a row at a time would cost a statement each. The same rule as
    ``audit_record``: call it inside the action's transaction. Returns the rows written.
    """
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError(f"audit_record_many({action!r}) must run inside the action's "
                           "transaction.atomic() block")
    actor, request_id = _actor(acting_user), current_request_id.get()
    user = actor.get("actor_user")
    user_id, key_id = (user.pk if user is not None else None), actor.get("actor_key_id")
    label = actor["actor_label"]

    def dumped(value: dict[str, Any] | None) -> str | None:
        return None if value is None else json.dumps(value, cls=DjangoJSONEncoder)

    count = 0
    # COPY, not bulk_create: a period close writes one row per invoice (10,000 at a time), and
    # bulk_create's per-row model and field preparation cost more than the database's insert.
    # The values are what bulk_create writes (the fields' defaults, JSON by the fields' encoder).
    with transaction.get_connection().cursor() as cur, cur.copy(_AUDIT_COPY) as copy:
        for org_id, target, before, after in rows:
            copy.write_row((_audit_id(), org_id, user_id, key_id, label, action, target or "",
                            dumped(before), dumped(after), request_id, timezone.now()))
            count += 1
    return count


_AUDIT_COPY = (f"COPY {AuditEvent._meta.db_table} (public_id, organization_id, actor_user_id, "
               "actor_key_id, actor_label, action, target, before, after, request_id, "
               "created_at) FROM STDIN")


def audit_snapshot(instance: models.Model, fields: tuple[str, ...] | None = None
                   ) -> dict[str, Any]:
    """Return an object's editable fields (or ``fields``) as a JSON-able before/after dict.

    Secrets and their digests (key hashes, passwords, webhook secrets, tokens) are left out.
    """
    return {k: audit_plain(v) for k, v in model_to_dict(instance, fields=fields).items()
            if not is_secret_field(k)}


def audit_plain(value: Any) -> Any:
    """Return a value as an audit row holds it: model instances as their pk, querysets and
    many-to-many values as lists of pks."""
    if hasattr(value, "_meta"):
        return value.pk
    if hasattr(value, "values_list"):
        return list(value.values_list("pk", flat=True))
    if isinstance(value, list | tuple):
        return [audit_plain(v) for v in value]
    return value
