"""Writes of the accounts app: sign-up, organizations, projects, API keys, members."""

from __future__ import annotations

import secrets
import string
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.mail import send_mail
from django.db import IntegrityError, transaction
from django.utils import timezone
from django.utils.text import slugify
from redis import RedisError

from billing_platform.accounts import keycache
from billing_platform.accounts.choices import (
    DataZone,
    ProjectStatus,
    Role,
    Scope,
    scopes_grantable,
)
from billing_platform.accounts.models import (
    ApiKey,
    Invitation,
    Membership,
    Organization,
    Project,
    User,
    sha256_hex,
)
from billing_platform.accounts.selectors import Authority, authority_of
from billing_platform.audit.services import audit_record
from billing_platform.errors import Conflict, DomainError, Forbidden, InvalidRequest, NotFound

__all__ = ["sha256_hex"]  # re-exported: the hashing of secrets and tokens lives in models

KEY_PREFIX_ALPHABET = string.ascii_lowercase + string.digits
INVITATION_TTL = timedelta(days=7)


class KeyCacheUnavailable(DomainError):
    """The key cache could not be told about a change, so the change was not made."""

    code = "service_unavailable"
    status = 503


def api_key_cache_refresh(*, prefixes: list[str]) -> None:
    """Make a change to these keys take effect at once on every cached lookup.

    Call it inside the transaction that changes the keys: it holds the cache before the
    commit (or raises ``KeyCacheUnavailable``, rolling the change back) and releases it after
    (see ``keycache``), so no lookup can serve or store the keys as they were.
    """
    if not prefixes:
        return
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("api_key_cache_refresh must run inside the change's transaction")
    try:
        token = keycache.hold(prefixes)
    except RedisError as exc:
        raise KeyCacheUnavailable(
            "The change could not be applied to the API key cache, so nothing was changed; "
            "try again in a moment.") from exc
    transaction.on_commit(lambda: keycache.release(prefixes, token))


def api_key_state(key: ApiKey) -> dict[str, Any]:
    """Return the audited fields of a key (audit rows' before and after)."""
    return {"name": key.name, "project": key.project.public_id, "scopes": list(key.scopes),
            "allowed_models": list(key.allowed_models),
            "expires_at": key.expires_at.isoformat() if key.expires_at else None,
            "revoked_at": key.revoked_at.isoformat() if key.revoked_at else None}


def _unique_slug(name: str) -> str:
    base = slugify(name)[:40] or "org"
    slug, n = base, 1
    while Organization.objects.filter(slug=slug).exists():
        n += 1
        slug = f"{base}-{n}"
    return slug


@transaction.atomic
def organization_create(
    *, name: str, owner: User, billing_email: str | None = None,
    data_zone: str = DataZone.GLOBAL, currency: str = "USD",
) -> Organization:
    """Create an organization with ``owner`` as its owner and a default project."""
    if data_zone not in DataZone.values:
        raise InvalidRequest(f"Unknown data zone {data_zone!r}.", param="data_zone")
    org = Organization.objects.create(
        name=name, slug=_unique_slug(name), billing_email=billing_email or owner.email,
        data_zone=data_zone, currency=currency.upper(),
    )
    Membership.objects.create(user=owner, organization=org, role=Role.OWNER)
    Project.objects.create(organization=org, name="Default project")
    return org


@transaction.atomic
def user_sign_up(*, email: str, password: str, org_name: str) -> tuple[User, Organization]:
    """Create a user and their first organization, which they own."""
    email = email.strip().lower()
    if User.objects.filter(email=email).exists():
        raise Conflict("An account with this email already exists.", param="email")
    user = User.objects.create_user(email=email, password=password)
    return user, organization_create(name=org_name, owner=user)


ORG_FIELDS = ("name", "billing_email", "data_zone", "tax_rate", "currency", "status",
              "max_concurrent_requests", "max_stored_files", "max_stored_bytes",
              # the rest of the billing profile (customers set it through billing_profile)
              "legal_name", "address_line1", "address_line2", "postal_code", "city", "region",
              "country", "tax_id")


def organization_state(organization: Organization) -> dict[str, Any]:
    return {name: str(getattr(organization, name)) for name in ORG_FIELDS}


@transaction.atomic
def organization_update(*, organization: Organization, acting_user: Any = None,
                        **fields: object) -> Organization:
    """Change an organization's settings; its keys re-read them at once."""
    before = organization_state(Organization.objects.get(pk=organization.pk))
    for name, value in fields.items():
        if name not in ORG_FIELDS:
            raise InvalidRequest(f"{name} cannot be changed.", param=name)
        setattr(organization, name, value)
    organization.save()
    organization_saved(organization=organization, before=before, acting_user=acting_user)
    return organization


def organization_saved(*, organization: Organization, before: dict[str, Any] | None,
                       acting_user: Any) -> None:
    """Record a saved organization change and make its keys re-read it at once.

    ``organization_update`` calls it; so does the Django admin, which saves the row itself.
    Call it inside the change's transaction.
    """
    after = organization_state(organization)
    api_key_cache_refresh(prefixes=list(organization.api_keys.values_list("prefix", flat=True)))
    changed = {k for k in after if before is None or before.get(k) != after[k]}
    if changed:
        audit_record(acting_user=acting_user, organization=organization,
                     action="organization.update", target=organization.public_id,
                     before={k: before[k] for k in changed} if before else None,
                     after={k: after[k] for k in changed})


def project_create(*, organization: Organization, name: str) -> Project:
    """Create a project in ``organization``."""
    if not name.strip():
        raise InvalidRequest("A project needs a name.", param="name")
    return Project.objects.create(organization=organization, name=name.strip())


def project_update(*, project: Project, name: str) -> Project:
    """Rename a project."""
    if not name.strip():
        raise InvalidRequest("A project needs a name.", param="name")
    project.name = name.strip()
    project.save(update_fields=["name"])
    return project


@transaction.atomic
def project_archive(*, project: Project, acting_user: Any = None) -> Project:
    """Archive a project and revoke its keys (usage history stays)."""
    project.status = ProjectStatus.ARCHIVED
    project.save(update_fields=["status"])
    api_keys_revoke(keys=project.api_keys.filter(revoked_at__isnull=True),
                    acting_user=acting_user, reason="project archived")
    return project


def _new_prefix() -> str:
    return "".join(secrets.choice(KEY_PREFIX_ALPHABET) for _ in range(12))


def _refuse_scopes_beyond(authority: Authority, scopes: Iterable[str]) -> None:
    beyond = sorted(set(scopes) - authority.grantable_scopes)
    if beyond:
        raise Forbidden(
            f"Your role ({authority.role or 'none'}) cannot create a key with the "
            f"{', '.join(repr(s) for s in beyond)} scope{'s' if len(beyond) > 1 else ''}: "
            "a key never carries more authority than the person who made it.",
            param="scopes")


def api_key_create(
    *, project: Project, name: str, scopes: Iterable[str],
    allowed_models: Iterable[str] = (), expires_at: datetime | None = None,
    acting_user: Any = None,
) -> tuple[ApiKey, str]:
    """Create a key; return it with its secret, which is never available again.

    The scopes must be within what the actor's role may grant (``SCOPE_PERMISSIONS``); the
    key is recorded as made by the person who answers for the actor (for a key, its maker).
    """
    scopes = sorted(set(scopes))
    if not scopes:
        raise InvalidRequest("Choose at least one scope.", param="scopes")
    unknown = set(scopes) - set(Scope.values)
    if unknown:
        raise InvalidRequest(f"Unknown scopes: {', '.join(sorted(unknown))}.", param="scopes")
    authority = authority_of(organization_id=project.organization_id, acting_user=acting_user)
    if not authority.can("keys.write"):
        raise Forbidden(f"Your role ({authority.role or 'none'}) cannot create keys.")
    _refuse_scopes_beyond(authority, scopes)
    if project.status != ProjectStatus.ACTIVE:
        raise InvalidRequest("The project is archived.", param="project")
    if expires_at is not None and expires_at <= timezone.now():
        raise InvalidRequest("The expiry must be in the future.", param="expires_at")
    if not name.strip():
        raise InvalidRequest("A key needs a name.", param="name")
    secret = secrets.token_urlsafe(32)
    for _ in range(5):
        prefix = _new_prefix()
        try:
            with transaction.atomic():
                key = ApiKey.objects.create(
                    organization=project.organization, project=project, name=name.strip(),
                    prefix=prefix, secret_hash=sha256_hex(secret), scopes=scopes,
                    allowed_models=sorted(set(allowed_models)), expires_at=expires_at,
                    created_by=authority.person,
                )
                audit_record(acting_user=acting_user, organization=project.organization,
                             action="api_key.create", target=key.public_id,
                             after=api_key_state(key))
        except IntegrityError:
            continue  # prefix collision: astronomically rare, try another
        return key, f"tg-{prefix}_{secret}"
    raise RuntimeError("could not allocate a unique API key prefix")


@transaction.atomic
def api_key_revoke(*, api_key: ApiKey, acting_user: Any = None) -> ApiKey:
    """Revoke a key; from the moment this commits, every request with it gets 401."""
    api_keys_revoke(keys=[api_key], acting_user=acting_user)
    return api_key


@transaction.atomic
def api_keys_revoke(*, keys: Iterable[ApiKey], acting_user: Any, reason: str = "") -> int:
    """Revoke these keys (one audit row each); return how many were still active."""
    now = timezone.now()
    keys = list(keys)
    fresh = [key for key in keys if key.revoked_at is None]
    for key in fresh:
        key.revoked_at = now
        key.save(update_fields=["revoked_at"])
        audit_record(acting_user=acting_user, organization=key.organization_id,
                     action="api_key.revoke", target=key.public_id,
                     after={"revoked_at": now.isoformat(), **({"reason": reason} if reason
                                                             else {})})
    # Also for keys already revoked: a repeated revoke re-asserts the cache, never loosens it.
    api_key_cache_refresh(prefixes=[key.prefix for key in keys])
    return len(fresh)


def api_key_saved(*, api_key: ApiKey, before: dict[str, Any] | None, acting_user: Any) -> None:
    """Record a key changed outside the services (the Django admin) and apply it at once."""
    after = api_key_state(api_key)
    api_key_cache_refresh(prefixes=[api_key.prefix])
    changed = {k for k in after if before is None or before.get(k) != after[k]}
    if changed:
        action = ("api_key.revoke" if changed == {"revoked_at"} and api_key.revoked_at
                  else "api_key.update")
        audit_record(acting_user=acting_user, organization=api_key.organization_id,
                     action=action, target=api_key.public_id,
                     before={k: before[k] for k in changed} if before else None,
                     after={k: after[k] for k in changed})


def api_key_last_used_flush() -> int:
    """Write the last-used times noted in Redis to the database; return how many keys."""
    pending = keycache.drain_last_used()
    for key_id, at in pending.items():
        when = datetime.fromtimestamp(at, tz=UTC)
        ApiKey.objects.filter(id=key_id).exclude(last_used_at__gt=when).update(last_used_at=when)
    return len(pending)


def _check_role_change(*, authority: Authority, old_role: str | None, new_role: str) -> None:
    if new_role not in Role.values:
        raise InvalidRequest(f"Unknown role {new_role!r}.", param="role")
    if not authority.can("members.write"):
        raise Forbidden(f"Your role ({authority.role or 'none'}) cannot change members.")
    if Role.OWNER in (new_role, old_role) and not authority.is_owner:
        raise Forbidden("Only an owner can grant or change the owner role.")


@transaction.atomic
def member_invite(
    *, organization: Organization, email: str, role: str, acting_user: User,
) -> tuple[Invitation, str]:
    """Invite ``email`` with ``role``; email them a link. Return the invitation and token.

    Only the person at ``email`` can accept it (``invitation_accept``).
    """
    if not isinstance(acting_user, User):
        raise Forbidden("Invitations are sent by a person, not a key.")
    authority = authority_of(organization_id=organization.pk, acting_user=acting_user)
    _check_role_change(authority=authority, old_role=None, new_role=role)
    email = email.strip().lower()
    if Membership.objects.filter(organization=organization, user__email=email).exists():
        raise Conflict(f"{email} is already a member.", param="email")
    token = secrets.token_urlsafe(32)
    invitation = Invitation.objects.create(
        organization=organization, email=email, role=role, token_hash=sha256_hex(token),
        invited_by=acting_user, expires_at=timezone.now() + INVITATION_TTL,
    )
    audit_record(acting_user=acting_user, organization=organization, action="member.invite",
                 target=email, after={"email": email, "role": role,
                                      "expires_at": invitation.expires_at.isoformat()})
    link = f"{settings.PUBLIC_URL}/console/invitations/{token}/"
    transaction.on_commit(lambda: send_mail(
        subject=f"You are invited to {organization.name} on Tollgate",
        message=f"{acting_user.email} invited you to join {organization.name} as {role}.\n\n"
                f"Accept within 7 days: {link}\n",
        from_email=None, recipient_list=[email],
    ))
    return invitation, token


@transaction.atomic
def invitation_accept(*, token: str, user: User) -> Membership:
    """Turn a valid invitation into a membership of ``user``, who must hold its email.

    The token alone is not enough: a forwarded or leaked link cannot add anyone else.
    """
    invitation = (
        Invitation.objects.select_for_update().select_related("organization")
        .filter(token_hash=sha256_hex(token), accepted_at__isnull=True,
                expires_at__gt=timezone.now())
        .first()
    )
    if invitation is None:
        raise NotFound("This invitation is invalid, used or expired.")
    if user.email.strip().lower() != invitation.email.strip().lower():
        raise Forbidden("This invitation was sent to another email address. Sign in with "
                        "the address it was sent to, or ask for an invitation to yours.")
    membership, created = Membership.objects.get_or_create(
        user=user, organization=invitation.organization, defaults={"role": invitation.role}
    )
    invitation.accepted_at = timezone.now()
    invitation.save(update_fields=["accepted_at"])
    if created:
        audit_record(acting_user=user, organization=invitation.organization,
                     action="member.join", target=user.email,
                     after={"role": membership.role, "invitation": invitation.pk})
    return membership


def _owners_left(organization: Organization, excluding: Membership) -> int:
    return (
        organization.memberships.filter(role=Role.OWNER).exclude(pk=excluding.pk).count()
    )


def member_keys_reconcile(*, user: User, organization: Organization, role: str | None,
                          acting_user: Any) -> int:
    """Revoke ``user``'s keys in ``organization`` that ``role`` could not make (all of them
    when ``role`` is None: the member left). Return how many were revoked.

    Keys belong to the person who made them, not to the project: a key must not outlive its
    maker's standing, or leaving the organization (or a demotion) would keep their authority.
    """
    allowed = scopes_grantable(role) if role else frozenset()
    keys = [key for key in ApiKey.objects.select_for_update()
            .filter(organization=organization, created_by=user, revoked_at__isnull=True)
            if not set(key.scopes) <= allowed]
    why = "member removed" if role is None else f"member is now {role}"
    return api_keys_revoke(keys=keys, acting_user=acting_user, reason=why)


def member_saved(*, user: User, organization: Organization, before: str | None,
                 role: str | None, acting_user: Any) -> None:
    """Record a membership added (``before`` None), re-roled or removed (``role`` None) and
    apply it: the audit row, and the member's keys that the new role could not make revoked.

    ``member_set_role`` and ``member_remove`` call it; so does the Django admin, which saves
    memberships itself. Call it inside the change's transaction.
    """
    if before == role:
        return
    action = ("member.add" if before is None else "member.remove" if role is None
              else "member.role_set")
    audit_record(acting_user=acting_user, organization=organization, action=action,
                 target=user.email, before=None if before is None else {"role": before},
                 after=None if role is None else {"role": role})
    if before is not None:
        member_keys_reconcile(user=user, organization=organization, role=role,
                              acting_user=acting_user)


@transaction.atomic
def member_set_role(*, membership: Membership, role: str, acting_user: Any) -> Membership:
    """Change a member's role; an organization always keeps at least one owner.

    Keys the member made that the new role could not make are revoked.
    """
    authority = authority_of(organization_id=membership.organization_id, acting_user=acting_user)
    _check_role_change(authority=authority, old_role=membership.role, new_role=role)
    Organization.objects.select_for_update().get(pk=membership.organization_id)
    membership.refresh_from_db()
    if membership.role == Role.OWNER and role != Role.OWNER and not _owners_left(
        membership.organization, membership
    ):
        raise Conflict("An organization needs at least one owner.", param="role")
    before = membership.role
    membership.role = role
    membership.save(update_fields=["role"])
    member_saved(user=membership.user, organization=membership.organization, before=before,
                 role=role, acting_user=acting_user)
    return membership


@transaction.atomic
def member_remove(*, membership: Membership, acting_user: Any) -> None:
    """Remove a member and revoke the keys they made; the last owner cannot be removed."""
    authority = authority_of(organization_id=membership.organization_id, acting_user=acting_user)
    if not authority.can("members.write"):
        raise Forbidden(f"Your role ({authority.role or 'none'}) cannot remove members.")
    if membership.role == Role.OWNER and not authority.is_owner:
        raise Forbidden("Only an owner can remove an owner.")
    Organization.objects.select_for_update().get(pk=membership.organization_id)
    if membership.role == Role.OWNER and not _owners_left(membership.organization, membership):
        raise Conflict("An organization needs at least one owner.")
    member_saved(user=membership.user, organization=membership.organization,
                 before=membership.role, role=None, acting_user=acting_user)
    membership.delete()
