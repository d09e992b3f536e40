"""Rate limits of an organization, a project or a key: who may set them, and up to what.

Why a module of its own: limits are configuration a customer (or Tollgate staff) writes, with
rules of authority (a role may change only some scopes, and only up to the usage tier's
ceiling) and an audit row per change; admission only reads them (``plans.admission.loading``)
and holds the tiers' defaults (``plans.admission.policy.USAGE_TIERS``). Budgets, the other
thing customers cap, are ``plans.quotas``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db import transaction
from django.utils import timezone

from billing_platform.accounts.choices import Role
from billing_platform.accounts.models import ApiKey, Organization, Project
from billing_platform.accounts.selectors import authority_of
from billing_platform.audit.services import audit_record
from billing_platform.errors import Forbidden, InvalidRequest
from plans.admission.policy import DEFAULT_USAGE_TIER, USAGE_TIERS
from plans.models import QuotaLimit

__all__ = ["DEFAULT_USAGE_TIER", "USAGE_TIERS", "limits_rows_of", "quota_limit_delete",
           "quota_limit_set"]


def limits_rows_of(*, organization: Organization) -> list[QuotaLimit]:
    """Return the limits set in an organization: its own, its projects', its keys'."""
    return list(QuotaLimit.objects.filter(organization=organization)
                .select_related("project", "api_key").order_by("project_id", "api_key_id"))



STAFF_ROLE = "staff"  # ``QuotaLimit.set_by_role`` of rows staff or the system set


def _limit_target(organization: Organization, project: Project | None,
                  api_key: ApiKey | None) -> str:
    return (api_key.public_id if api_key else project.public_id if project
            else organization.public_id)


def _limit_state(row: QuotaLimit | None) -> dict[str, Any] | None:
    if row is None:
        return None
    return {"rpm": row.rpm, "tpm": row.tpm, "usage_tier": row.usage_tier,
            "allowed_regions": list(row.allowed_regions), "set_by_role": row.set_by_role}


def _limit_lookup(organization: Organization, project: Project | None,
                  api_key: ApiKey | None) -> dict[str, Any]:
    if api_key is not None:
        return {"organization": organization, "api_key": api_key}
    if project is not None:
        return {"organization": organization, "project": project, "api_key__isnull": True}
    return {"organization": organization, "project__isnull": True, "api_key__isnull": True}


def _check_limit_authority(*, authority: Any, row: QuotaLimit | None,
                           project: Project | None, api_key: ApiKey | None) -> None:
    """Refuse a change of this scope's limits that the actor's role may not make.

    The org's limits need ``org.write``, a project's ``projects.write``, a key's
    ``keys.write`` and, below ``org.write``, a key the actor made. A row that an owner,
    admin or staff set (or one from before this was recorded) is changed or removed only with
    ``org.write``: a developer cannot lift a limit an admin put on their key.
    """
    needed = "keys.write" if api_key else "projects.write" if project else "org.write"
    if not authority.can(needed):
        raise Forbidden(f"Your role ({authority.role or 'none'}) cannot change these limits "
                        f"({needed}).")
    if authority.can("org.write"):
        return
    if api_key is not None and (authority.person is None
                                or api_key.created_by_id != authority.person.pk):
        raise Forbidden("Only an owner or admin can change the limits of a key someone else "
                        "made.")
    if row is not None and row.set_by_role not in _LOWER_ROLES:
        raise Forbidden(f"These limits were set by {row.set_by_role or 'an admin'}; only an "
                        "owner or admin can change or remove them.")


_LOWER_ROLES = frozenset({Role.DEVELOPER, Role.FINANCE, Role.VIEWER})


def _tier_ceiling(organization: Organization, tier: str) -> dict[str, int]:
    """Return the highest rpm and tpm a customer may set: the tier's, or the org's own limits
    where staff set them higher."""
    rpm, tpm = USAGE_TIERS[tier or DEFAULT_USAGE_TIER]
    org_row = QuotaLimit.objects.filter(**_limit_lookup(organization, None, None)).first()
    if org_row is not None:
        rpm = max(rpm, org_row.rpm or 0)
        tpm = max(tpm, org_row.tpm or 0)
    return {"rpm": rpm, "tpm": tpm}


def quota_limit_set(*, organization: Organization, project: Project | None = None,
                    api_key: ApiKey | None = None, rpm: int | None = None,
                    tpm: int | None = None, usage_tier: str | None = None,
                    allowed_regions: Iterable[str] = (), acting_user: Any = None
                    ) -> QuotaLimit:
    """Create or replace the limits of an org, a project or a key (null: inherit/none).

    Customers may set limits at or below their usage tier's ceiling, on the scopes their
    role may change (``_check_limit_authority``); the usage tier itself is set by Tollgate
    staff (``usage_tier=None`` keeps it). Staff and the system (no actor) are not bound.
    """
    if usage_tier and usage_tier not in USAGE_TIERS:
        raise InvalidRequest(f"Unknown usage tier {usage_tier!r}; one of "
                             f"{', '.join(USAGE_TIERS)}.", param="usage_tier")
    if usage_tier and (project or api_key):
        raise InvalidRequest("A usage tier is set on the organization only.",
                             param="usage_tier")
    for name, value in (("rpm", rpm), ("tpm", tpm)):
        if value is not None and value < 0:
            raise InvalidRequest(f"'{name}' must be a non-negative integer.", param=name)
    if api_key is not None:
        project = None
    regions = sorted(set(allowed_regions))
    authority = authority_of(organization_id=organization.pk, acting_user=acting_user)
    with transaction.atomic():
        row = QuotaLimit.objects.select_for_update().filter(
            **_limit_lookup(organization, project, api_key)).first()
        _check_limit_authority(authority=authority, row=row, project=project, api_key=api_key)
        before = _limit_state(row)
        current_tier = row.usage_tier if row is not None else ""
        tier = current_tier if usage_tier is None else usage_tier
        if tier != current_tier and not authority.unrestricted:
            raise Forbidden("The usage tier is set by Tollgate staff (it follows your payment "
                            "history); ask support to change it.", param="usage_tier")
        if not authority.unrestricted:
            org_tier = tier if project is None and api_key is None else (
                QuotaLimit.objects.filter(**_limit_lookup(organization, None, None))
                .values_list("usage_tier", flat=True).first() or "")
            ceiling = _tier_ceiling(organization, org_tier)
            for name, value in (("rpm", rpm), ("tpm", tpm)):
                unchanged = row is not None and getattr(row, name) == value
                if value is not None and value > ceiling[name] and not unchanged:
                    raise InvalidRequest(
                        f"'{name}' may be at most {ceiling[name]:,} on usage tier "
                        f"{org_tier or DEFAULT_USAGE_TIER}; ask Tollgate to raise your tier.",
                        param=name)
        if row is None:
            row = QuotaLimit(organization=organization, project=project, api_key=api_key)
        row.rpm, row.tpm, row.usage_tier = rpm, tpm, tier
        row.allowed_regions, row.updated_at = regions, timezone.now()
        row.set_by_role = STAFF_ROLE if authority.unrestricted else authority.role or ""
        row.save()
        audit_record(acting_user=acting_user, organization=organization, action="limits.set",
                     target=_limit_target(organization, project, api_key), before=before,
                     after=_limit_state(row))
    return row


def quota_limit_delete(*, organization: Organization, project: Project | None = None,
                       api_key: ApiKey | None = None, acting_user: Any = None) -> bool:
    """Remove the limits of a project or a key (they inherit again); return whether any were
    set. The same role rules as ``quota_limit_set`` apply."""
    if project is None and api_key is None:
        raise InvalidRequest("The organization's limits are changed, not removed.")
    if api_key is not None:
        project = None
    authority = authority_of(organization_id=organization.pk, acting_user=acting_user)
    with transaction.atomic():
        row = QuotaLimit.objects.select_for_update().filter(
            **_limit_lookup(organization, project, api_key)).first()
        _check_limit_authority(authority=authority, row=row, project=project, api_key=api_key)
        if row is None:
            return False
        audit_record(acting_user=acting_user, organization=organization,
                     action="limits.delete", target=_limit_target(organization, project,
                                                                  api_key),
                     before=_limit_state(row))
        row.delete()
    return True
