"""Writes of the accounts app: sign-up, organizations, projects, API keys, members."""

from __future__ import annotations

import hashlib
import secrets
import string
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.core.mail import send_mail
from django.db import IntegrityError, transaction
from django.utils import timezone
from django.utils.text import slugify

from billing_platform.accounts import keycache
from billing_platform.accounts.choices import DataZone, ProjectStatus, Role, Scope
from billing_platform.accounts.models import (
    ApiKey,
    Invitation,
    Membership,
    Organization,
    Project,
    User,
)
from billing_platform.errors import Conflict, Forbidden, InvalidRequest, NotFound

KEY_PREFIX_ALPHABET = string.ascii_lowercase + string.digits
INVITATION_TTL = timedelta(days=7)


def sha256_hex(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


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


@transaction.atomic
def organization_update(*, organization: Organization, **fields: object) -> Organization:
    """Change an organization's settings; its keys re-read them at once."""
    allowed = {"name", "billing_email", "data_zone", "tax_rate", "currency", "status"}
    for name, value in fields.items():
        if name not in allowed:
            raise InvalidRequest(f"{name} cannot be changed.", param=name)
        setattr(organization, name, value)
    organization.save()
    prefixes = list(organization.api_keys.values_list("prefix", flat=True))
    transaction.on_commit(lambda: keycache.invalidate(prefixes))
    return organization


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
def project_archive(*, project: Project) -> Project:
    """Archive a project and revoke its keys (usage history stays)."""
    project.status = ProjectStatus.ARCHIVED
    project.save(update_fields=["status"])
    for key in project.api_keys.filter(revoked_at__isnull=True):
        api_key_revoke(api_key=key)
    return project


def _new_prefix() -> str:
    return "".join(secrets.choice(KEY_PREFIX_ALPHABET) for _ in range(12))


def api_key_create(
    *, project: Project, name: str, scopes: Iterable[str],
    allowed_models: Iterable[str] = (), expires_at: datetime | None = None,
    created_by: User | None = None,
) -> tuple[ApiKey, str]:
    """Create a key; return it with its secret, which is never available again."""
    scopes = sorted(set(scopes))
    if not scopes:
        raise InvalidRequest("Choose at least one scope.", param="scopes")
    unknown = set(scopes) - set(Scope.values)
    if unknown:
        raise InvalidRequest(f"Unknown scopes: {', '.join(sorted(unknown))}.", param="scopes")
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
                    created_by=created_by,
                )
        except IntegrityError:
            continue  # prefix collision: astronomically rare, try another
        return key, f"tg-{prefix}_{secret}"
    raise RuntimeError("could not allocate a unique API key prefix")


@transaction.atomic
def api_key_revoke(*, api_key: ApiKey) -> ApiKey:
    """Revoke a key; from the moment this commits, every request with it gets 401."""
    if api_key.revoked_at is None:
        api_key.revoked_at = timezone.now()
        api_key.save(update_fields=["revoked_at"])
    prefix = api_key.prefix
    transaction.on_commit(lambda: keycache.invalidate([prefix]))
    return api_key


def api_key_last_used_flush() -> int:
    """Write the last-used times noted in Redis to the database; return how many keys."""
    pending = keycache.drain_last_used()
    for key_id, at in pending.items():
        when = datetime.fromtimestamp(at, tz=UTC)
        ApiKey.objects.filter(id=key_id).exclude(last_used_at__gt=when).update(last_used_at=when)
    return len(pending)


def _check_role_change(*, acting_role: str, old_role: str | None, new_role: str) -> None:
    if new_role not in Role.values:
        raise InvalidRequest(f"Unknown role {new_role!r}.", param="role")
    if Role.OWNER in (new_role, old_role) and acting_role != Role.OWNER:
        raise Forbidden("Only an owner can grant or change the owner role.")


@transaction.atomic
def member_invite(
    *, organization: Organization, email: str, role: str, invited_by: User, acting_role: str,
) -> tuple[Invitation, str]:
    """Invite ``email`` with ``role``; email them a link. Return the invitation and token."""
    _check_role_change(acting_role=acting_role, old_role=None, new_role=role)
    email = email.strip().lower()
    if Membership.objects.filter(organization=organization, user__email=email).exists():
        raise Conflict(f"{email} is already a member.", param="email")
    token = secrets.token_urlsafe(32)
    invitation = Invitation.objects.create(
        organization=organization, email=email, role=role, token_hash=sha256_hex(token),
        invited_by=invited_by, expires_at=timezone.now() + INVITATION_TTL,
    )
    link = f"{settings.PUBLIC_URL}/console/invitations/{token}/"
    transaction.on_commit(lambda: send_mail(
        subject=f"You are invited to {organization.name} on Tollgate",
        message=f"{invited_by.email} invited you to join {organization.name} as {role}.\n\n"
                f"Accept within 7 days: {link}\n",
        from_email=None, recipient_list=[email],
    ))
    return invitation, token


@transaction.atomic
def invitation_accept(*, token: str, user: User) -> Membership:
    """Turn a valid invitation into a membership of ``user``."""
    invitation = (
        Invitation.objects.select_for_update()
        .filter(token_hash=sha256_hex(token), accepted_at__isnull=True,
                expires_at__gt=timezone.now())
        .first()
    )
    if invitation is None:
        raise NotFound("This invitation is invalid, used or expired.")
    membership, _ = Membership.objects.get_or_create(
        user=user, organization=invitation.organization, defaults={"role": invitation.role}
    )
    invitation.accepted_at = timezone.now()
    invitation.save(update_fields=["accepted_at"])
    return membership


def _owners_left(organization: Organization, excluding: Membership) -> int:
    return (
        organization.memberships.filter(role=Role.OWNER).exclude(pk=excluding.pk).count()
    )


@transaction.atomic
def member_set_role(*, membership: Membership, role: str, acting_role: str) -> Membership:
    """Change a member's role; an organization always keeps at least one owner."""
    _check_role_change(acting_role=acting_role, old_role=membership.role, new_role=role)
    Organization.objects.select_for_update().get(pk=membership.organization_id)
    if membership.role == Role.OWNER and role != Role.OWNER and not _owners_left(
        membership.organization, membership
    ):
        raise Conflict("An organization needs at least one owner.", param="role")
    membership.role = role
    membership.save(update_fields=["role"])
    return membership


@transaction.atomic
def member_remove(*, membership: Membership, acting_role: str) -> None:
    """Remove a member; the last owner cannot be removed."""
    if membership.role == Role.OWNER and acting_role != Role.OWNER:
        raise Forbidden("Only an owner can remove an owner.")
    Organization.objects.select_for_update().get(pk=membership.organization_id)
    if membership.role == Role.OWNER and not _owners_left(membership.organization, membership):
        raise Conflict("An organization needs at least one owner.")
    membership.delete()
