"""Reads of the accounts app: API-key authentication, an actor's organizations and roles."""

from __future__ import annotations

import contextlib
import hmac
import re
import time
from dataclasses import asdict, dataclass
from typing import Any

import redis
from asgiref.sync import sync_to_async
from django.db.models import QuerySet

from billing_platform.accounts import keycache
from billing_platform.accounts.choices import ROLE_PERMISSIONS, OrgStatus, Role, Scope
from billing_platform.accounts.models import ApiKey, Membership, Organization, User
from billing_platform.accounts.services import sha256_hex
from billing_platform.errors import Forbidden, NotFound

KEY_RE = re.compile(r"^tg-(?P<prefix>[a-z0-9]{12})_(?P<secret>[A-Za-z0-9_-]{20,100})$")


@dataclass(frozen=True)
class KeyPrincipal:
    """Who is calling with an API key: everything the request path needs, cacheable as JSON."""

    key_id: int
    key_public_id: str
    prefix: str
    name: str
    secret_hash: str
    org_id: int
    org_public_id: str
    org_status: str
    data_zone: str
    project_id: int
    project_public_id: str
    scopes: tuple[str, ...]
    allowed_models: tuple[str, ...]
    expires_at: float | None
    revoked: bool

    @classmethod
    def from_key(cls, key: ApiKey) -> KeyPrincipal:
        return cls(
            key_id=key.id, key_public_id=key.public_id, prefix=key.prefix, name=key.name,
            secret_hash=key.secret_hash, org_id=key.organization_id,
            org_public_id=key.organization.public_id, org_status=key.organization.status,
            data_zone=key.organization.data_zone, project_id=key.project_id,
            project_public_id=key.project.public_id, scopes=tuple(key.scopes),
            allowed_models=tuple(key.allowed_models),
            expires_at=key.expires_at.timestamp() if key.expires_at else None,
            revoked=key.revoked_at is not None,
        )

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KeyPrincipal:
        data = {**data, "scopes": tuple(data["scopes"]),
                "allowed_models": tuple(data["allowed_models"])}
        return cls(**data)

    def usable(self, now: float) -> bool:
        return (not self.revoked and self.org_status == OrgStatus.ACTIVE
                and (self.expires_at is None or self.expires_at > now))

    def has_scope(self, scope: str) -> bool:
        return scope in self.scopes

    def may_use_model(self, model: str) -> bool:
        return not self.allowed_models or model in self.allowed_models


def _load_principal(prefix: str) -> KeyPrincipal | None:
    key = (ApiKey.objects.select_related("organization", "project")
           .filter(prefix=prefix).first())
    return KeyPrincipal.from_key(key) if key else None


def _verify(principal: KeyPrincipal | None, secret: str) -> KeyPrincipal | None:
    presented = sha256_hex(secret)
    stored = principal.secret_hash if principal else sha256_hex("")
    if not hmac.compare_digest(presented, stored) or principal is None:
        return None
    return principal if principal.usable(time.time()) else None


def api_key_authenticate(raw: str) -> KeyPrincipal | None:
    """Return the principal for a presented key, or None if it is unknown, revoked or expired.

    The secret is compared in constant time against the stored digest. The Redis cache is
    used when it answers; when it does not, the database is the answer.
    """
    match = KEY_RE.match(raw.strip())
    if not match:
        return None
    prefix, secret = match["prefix"], match["secret"]
    try:
        cached, marker = keycache.read(prefix)
    except redis.RedisError:
        principal = _load_principal(prefix)
    else:
        if cached is not None:
            principal = KeyPrincipal.from_json(cached)
        else:
            principal = _load_principal(prefix)
            if principal is not None:
                with contextlib.suppress(redis.RedisError):
                    keycache.fill(prefix, asdict(principal), marker=marker)
    verified = _verify(principal, secret)
    if verified is not None:
        keycache.touch(verified.key_id, time.time())
    return verified


async def aapi_key_authenticate(raw: str) -> KeyPrincipal | None:
    """Async ``api_key_authenticate`` for the gateway (same cache, same rules)."""
    match = KEY_RE.match(raw.strip())
    if not match:
        return None
    prefix, secret = match["prefix"], match["secret"]
    load = sync_to_async(_load_principal, thread_sensitive=False)
    try:
        cached, marker = await keycache.aread(prefix)
    except redis.RedisError:
        principal = await load(prefix)
    else:
        if cached is not None:
            principal = KeyPrincipal.from_json(cached)
        else:
            principal = await load(prefix)
            if principal is not None:
                with contextlib.suppress(redis.RedisError):
                    await keycache.afill(prefix, asdict(principal), marker=marker)
    verified = _verify(principal, secret)
    if verified is not None:
        # Advisory and off the request's path: batched with other uses, written within a second.
        keycache.atouch_soon(verified.key_id, time.time())
    return verified


def organizations_for_user(*, user: User) -> QuerySet[Organization]:
    """Return the organizations ``user`` is a member of."""
    return Organization.objects.filter(memberships__user=user).order_by("name")


@dataclass(frozen=True)
class OrgAccess:
    """An actor's standing in one organization."""

    organization: Organization
    role: str

    @property
    def permissions(self) -> frozenset[str]:
        return ROLE_PERMISSIONS[self.role]

    def can(self, permission: str) -> bool:
        return permission in self.permissions


def org_access(*, user: Any, principal: KeyPrincipal | None, org_public_id: str) -> OrgAccess:
    """Return the actor's access to an organization, or raise NotFound if they have none.

    An API key with the ``admin`` scope acts as an admin of its own organization only.
    Not-a-member and does-not-exist look the same, so nothing leaks.
    """
    if principal is not None:
        if principal.org_public_id != org_public_id:
            raise NotFound("No such organization.")
        if not principal.has_scope(Scope.ADMIN):
            raise Forbidden("This API key lacks the 'admin' scope.")
        return OrgAccess(Organization.objects.get(pk=principal.org_id), Role.ADMIN)
    membership = (
        Membership.objects.select_related("organization")
        .filter(user=user, organization__public_id=org_public_id).first()
        if getattr(user, "is_authenticated", False) else None
    )
    if membership is None:
        raise NotFound("No such organization.")
    return OrgAccess(membership.organization, membership.role)


def api_keys_for_project(*, project_id: int) -> QuerySet[ApiKey]:
    """Return a project's keys, newest first (revoked ones included)."""
    return ApiKey.objects.filter(project_id=project_id).order_by("-created_at")


