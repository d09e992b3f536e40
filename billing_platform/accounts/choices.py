"""Enumerations of the accounts app."""

from django.db import models


class DataZone(models.TextChoices):
    GLOBAL = "global", "Global"
    US = "us", "United States"
    EU = "eu", "European Union"


class OrgStatus(models.TextChoices):
    ACTIVE = "active", "Active"
    SUSPENDED = "suspended", "Suspended"
    CLOSED = "closed", "Closed"


class Role(models.TextChoices):
    OWNER = "owner", "Owner"
    ADMIN = "admin", "Admin"
    DEVELOPER = "developer", "Developer"
    FINANCE = "finance", "Finance"
    VIEWER = "viewer", "Viewer"


class Scope(models.TextChoices):
    INFERENCE = "inference", "Inference (/v1)"
    BATCH = "batch", "Batch API"
    USAGE_READ = "usage:read", "Read usage"
    ADMIN = "admin", "Manage the organization"


class ProjectStatus(models.TextChoices):
    ACTIVE = "active", "Active"
    ARCHIVED = "archived", "Archived"


# What each role may do in its organization. One table, read by the API and the console.
ROLE_PERMISSIONS: dict[str, frozenset[str]] = {
    Role.OWNER: frozenset({"read", "keys.write", "batches.write", "projects.write",
                           "members.write", "org.write", "owners.write", "billing.read",
                           "audit.read"}),
    Role.ADMIN: frozenset({"read", "keys.write", "batches.write", "projects.write",
                           "members.write", "org.write", "billing.read", "audit.read"}),
    Role.DEVELOPER: frozenset({"read", "keys.write", "batches.write"}),
    Role.FINANCE: frozenset({"read", "billing.read"}),
    Role.VIEWER: frozenset({"read"}),
}

# What holding a scope lets a key do, in the permissions above: a key's scopes must all be
# within its creator's role. ``admin`` lets a key act as an org admin, so only a role that has
# every admin permission may grant it.
SCOPE_PERMISSIONS: dict[str, frozenset[str]] = {
    Scope.INFERENCE: frozenset({"keys.write"}),
    Scope.BATCH: frozenset({"batches.write"}),
    Scope.USAGE_READ: frozenset({"read"}),
    Scope.ADMIN: ROLE_PERMISSIONS[Role.ADMIN],
}


def scopes_grantable(role: str | None) -> frozenset[str]:
    """Return the scopes a key made by a member with ``role`` may carry."""
    mine = ROLE_PERMISSIONS.get(role or "", frozenset())
    return frozenset(scope for scope, needs in SCOPE_PERMISSIONS.items() if needs <= mine)


def role_capped_at_admin(role: str) -> str:
    """Return the role an ``admin``-scoped key acts with when ``role`` made it."""
    return Role.ADMIN if role in (Role.OWNER, Role.ADMIN) else role
