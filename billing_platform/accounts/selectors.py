"""Reads of the accounts app: API-key authentication, an actor's organizations and roles."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import re
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import redis
from asgiref.sync import sync_to_async
from django.db.models import QuerySet

from billing_platform.accounts import auth_throttle, keycache
from billing_platform.accounts.choices import (
    ROLE_PERMISSIONS,
    OrgStatus,
    Role,
    Scope,
    role_capped_at_admin,
    scopes_grantable,
)
from billing_platform.accounts.metrics import KEY_LOOKUPS
from billing_platform.accounts.models import ApiKey, Membership, Organization, User, sha256_hex
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
    # the organization's own limit of requests in flight (None: the deployment's default); a
    # default, so entries cached before the field existed still load
    max_concurrent_requests: int | None = None

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
            max_concurrent_requests=key.organization.max_concurrent_requests,
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
    KEY_LOOKUPS.labels("database").inc()
    key = (ApiKey.objects.select_related("organization", "project")
           .filter(prefix=prefix).first())
    return KeyPrincipal.from_key(key) if key else None


def api_key_principal(*, key_id: int) -> KeyPrincipal | None:
    """Return a key's principal as PostgreSQL has it now (no cache), or None if it is gone.

    For work that runs long after its key authenticated (a batch's slices): whether the key is
    still usable, its organization's status and data zone, read afresh.
    """
    key = ApiKey.objects.select_related("organization", "project").filter(pk=key_id).first()
    return KeyPrincipal.from_key(key) if key else None


def _from_cache(cached: dict[str, Any], *, near: bool = False) -> KeyPrincipal | None:
    if cached is keycache.UNKNOWN:
        KEY_LOOKUPS.labels("negative_cache").inc()
        return None
    KEY_LOOKUPS.labels("near" if near else "cache").inc()
    return KeyPrincipal.from_json(cached)


def _entry(principal: KeyPrincipal | None) -> dict[str, Any] | None:
    return asdict(principal) if principal is not None else None


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
            principal = _from_cache(cached)
        else:
            principal = _load_principal(prefix)
            with contextlib.suppress(redis.RedisError):
                keycache.fill(prefix, _entry(principal), marker=marker)
    verified = _verify(principal, secret)
    if verified is not None:
        keycache.touch(verified.key_id, time.time())
    return verified


async def _aread(prefix: str) -> tuple[dict[str, Any] | None, str | None, bool] | None:
    """Return the key cache's ``(entry, marker, near)``; None when it cannot be read."""
    try:
        return await keycache.aread(prefix)
    except redis.RedisError:
        return None


async def aapi_key_authenticate(raw: str, *, client_address: str | None = None
                                ) -> KeyPrincipal | None:
    """Async ``api_key_authenticate`` for the gateway (same cache, same rules).

    With ``client_address``, a failure is counted against that address, and once it is
    throttled (``auth_throttle``) only a key that verifies from the cache gets through:
    anything that would take a database lookup, or fails, raises ``RateLimited`` instead.
    So a key that verifies from the cache (nearly every request) costs one Redis read and
    nothing else (no read from the process's near copy, ``keycache._Near``); the throttle is
    read only on the way to a lookup or a failure. (Reading it beside the cache entry, in the
    same round trip, cost every request a second command and the two tasks that awaited
    them: ~25 us of CPU of the ~65 us the two took.)
    """
    match = KEY_RE.match(raw.strip())
    prefix, secret = (match["prefix"], match["secret"]) if match else ("", "")
    read_at = time.monotonic()
    read = await _aread(prefix) if match else None
    entry, near = (read[0], read[2]) if read is not None else (None, False)
    verified = _verify(_from_cache(entry, near=near), secret) if entry is not None else None
    if verified is None:
        retry_after = (await auth_throttle.aretry_after(client_address) if client_address
                       else None)
        if match and entry is None and retry_after is None:  # throttled: no query
            principal, mine = await _alookup(prefix, read_at)
            if read is not None and mine:
                with contextlib.suppress(redis.RedisError):
                    await keycache.afill(prefix, _entry(principal), marker=read[1])
            verified = _verify(principal, secret)
        if verified is None:
            if retry_after is not None:
                raise auth_throttle.throttled(retry_after)
            if client_address:
                await auth_throttle.afailed(client_address)
            return None
    # Advisory and off the request's path: batched with other uses, written within a second.
    keycache.atouch_soon(verified.key_id, time.time())
    return verified


# The database lookups of keys this process has in flight: prefix -> (when it started,
# monotonic; the lookup). When a busy key's cache entry expires (every API_KEY_CACHE_TTL_S) or
# Redis loses the cache, every request in flight for that key misses at once; they share one
# lookup instead of each sending its own to PostgreSQL (and taking a database thread).
_lookups: dict[str, tuple[float, asyncio.Task[KeyPrincipal | None]]] = {}


async def _alookup(prefix: str, read_at: float) -> tuple[KeyPrincipal | None, bool]:
    """Return the key's principal as PostgreSQL has it, and whether this call looked it up
    (the one that fills the cache, with the marker its own read saw).

    A request joins a lookup only if it started after the request's cache read began: so it
    is never older than what the request read, and a key revoked before then is refused as
    it would be without sharing.
    """
    loop = asyncio.get_running_loop()
    held = _lookups.get(prefix)
    if held is not None and held[0] >= read_at and held[1].get_loop() is loop:
        return await asyncio.shield(held[1]), False
    task = loop.create_task(sync_to_async(_load_principal, thread_sensitive=False)(prefix))
    _lookups[prefix] = (time.monotonic(), task)
    task.add_done_callback(functools.partial(_lookup_done, prefix))
    return await asyncio.shield(task), True


def _lookup_done(prefix: str, task: asyncio.Task[KeyPrincipal | None]) -> None:
    held = _lookups.get(prefix)
    if held is not None and held[1] is task:
        del _lookups[prefix]
    if not task.cancelled():
        task.exception()  # retrieved: the requests that awaited it were given it


def organizations_for_user(*, user: User) -> QuerySet[Organization]:
    """Return the organizations ``user`` is a member of."""
    return Organization.objects.filter(memberships__user=user).order_by("name")


# --- Organization facts other apps read (metering's recording) -------------------------------

def organization_file_limits(*, org_id: int) -> tuple[int | None, int | None]:
    """Return an organization's own limits of stored files: (count, bytes); None where it has
    none of its own (the deployment's default applies)."""
    row = (Organization.objects.filter(pk=org_id)
           .values_list("max_stored_files", "max_stored_bytes").first())
    return row if row is not None else (None, None)


def organization_data_zones(*, org_ids: Iterable[int]) -> dict[int, str]:
    """Return the data zone of each organization among ``org_ids`` that exists."""
    return dict(Organization.objects.filter(id__in=list(org_ids))
                .values_list("id", "data_zone"))


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


def key_role(*, organization_id: int, created_by_id: int | None) -> str | None:
    """Return the role an ``admin``-scoped key acts with: its creator's, at most admin.

    The creator's role is read now, so a key never carries more authority than the person
    who made it has today. A key the platform made (seed, staff tooling: no creator) acts as
    an admin; a key whose creator left the organization has no role (None).
    """
    if created_by_id is None:
        return Role.ADMIN
    role = (Membership.objects.filter(organization_id=organization_id, user_id=created_by_id)
            .values_list("role", flat=True).first())
    return role_capped_at_admin(role) if role else None


def org_access(*, user: Any, principal: KeyPrincipal | None, org_public_id: str) -> OrgAccess:
    """Return the actor's access to an organization, or raise NotFound if they have none.

    An API key with the ``admin`` scope acts in its own organization only, with its creator's
    role capped at admin (``key_role``). Not-a-member and does-not-exist look the same, so
    nothing leaks.
    """
    if principal is not None:
        if principal.org_public_id != org_public_id:
            raise NotFound("No such organization.")
        if not principal.has_scope(Scope.ADMIN):
            raise Forbidden("This API key lacks the 'admin' scope.")
        created_by_id = (ApiKey.objects.filter(pk=principal.key_id)
                         .values_list("created_by_id", flat=True).first())
        role = key_role(organization_id=principal.org_id, created_by_id=created_by_id)
        if role is None:
            raise Forbidden("The person who made this API key is no longer a member.")
        return OrgAccess(Organization.objects.get(pk=principal.org_id), role)
    membership = (
        Membership.objects.select_related("organization")
        .filter(user=user, organization__public_id=org_public_id).first()
        if getattr(user, "is_authenticated", False) else None
    )
    if membership is None:
        raise NotFound("No such organization.")
    return OrgAccess(membership.organization, membership.role)


@dataclass(frozen=True)
class Authority:
    """What an actor may do in one organization, as the services check it.

    ``role`` is the member's role (an ``admin``-scoped key's: see ``key_role``), None for
    someone with no standing there. ``unrestricted`` is platform staff or the system itself
    (no actor): customer rules (grantable scopes, tier ceilings) do not bind them. ``person``
    answers for the act: the user, or the person who made the acting key.
    """

    role: str | None
    unrestricted: bool = False
    person: User | None = None

    def can(self, permission: str) -> bool:
        return self.unrestricted or (
            self.role is not None and permission in ROLE_PERMISSIONS[self.role])

    @property
    def grantable_scopes(self) -> frozenset[str]:
        return frozenset(Scope.values) if self.unrestricted else scopes_grantable(self.role)

    @property
    def is_owner(self) -> bool:
        return self.unrestricted or self.role == Role.OWNER


SYSTEM = Authority(role=Role.OWNER, unrestricted=True)


def _key_id_of(acting_user: Any) -> int | None:
    if isinstance(acting_user, ApiKey):
        return acting_user.pk
    principal = getattr(acting_user, "principal", acting_user)  # KeyUser -> KeyPrincipal
    return principal.key_id if isinstance(principal, KeyPrincipal) else None


def authority_of(*, organization_id: int, acting_user: Any) -> Authority:
    """Return what ``acting_user`` (a User, an ApiKey or a key's KeyUser, or None for the
    system) may do in the organization ``organization_id``."""
    if acting_user is None:
        return SYSTEM
    key_id = _key_id_of(acting_user)
    if key_id is not None:
        row = (ApiKey.objects.filter(pk=key_id, organization_id=organization_id,
                                     scopes__contains=[Scope.ADMIN])
               .select_related("created_by").first())
        if row is None:
            return Authority(role=None)
        return Authority(role=key_role(organization_id=organization_id,
                                       created_by_id=row.created_by_id),
                         person=row.created_by)
    if not getattr(acting_user, "is_authenticated", False):
        return Authority(role=None)
    role = (Membership.objects.filter(organization_id=organization_id, user=acting_user)
            .values_list("role", flat=True).first())
    return Authority(role=role, unrestricted=bool(acting_user.is_staff), person=acting_user)


def api_keys_for_project(*, project_id: int) -> QuerySet[ApiKey]:
    """Return a project's keys, newest first (revoked ones included)."""
    return ApiKey.objects.filter(project_id=project_id).order_by("-created_at")


