"""Read the audit log: an organization's own rows, or all of them for platform staff."""

from __future__ import annotations

from datetime import datetime

from django.db.models import Q, QuerySet

from billing_platform.accounts.models import Organization
from billing_platform.audit.models import AuditEvent


def audit_events(*, organization: Organization | None, action: str = "", target: str = "",
                 actor: str = "", since: datetime | None = None,
                 until: datetime | None = None) -> QuerySet[AuditEvent]:
    """Return audit rows, newest first; ``organization=None`` means every organization.

    ``action`` matches a prefix (``api_key.`` finds every key action); ``actor`` matches the
    actor's email or key label exactly.
    """
    rows = AuditEvent.objects.order_by("-created_at", "-id")
    if organization is not None:
        rows = rows.filter(organization_id=organization.pk)
    if action:
        rows = rows.filter(action__startswith=action)
    if target:
        rows = rows.filter(target=target)
    if actor:
        rows = rows.filter(actor_label=actor)
    if since is not None:
        rows = rows.filter(created_at__gte=since)
    if until is not None:
        rows = rows.filter(created_at__lt=until)
    return rows


QUOTA_ACTIONS = ("limits.", "budget.", "keys.suspended", "keys.reinstated")


def quota_audit_events(*, organization: Organization) -> QuerySet[AuditEvent]:
    """Return the rows quota enforcement wrote: limits, budgets, suspensions, alerts."""
    rows = audit_events(organization=organization)
    match = Q()
    for prefix in QUOTA_ACTIONS:
        match |= Q(action__startswith=prefix)
    return rows.filter(match)
