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
                           "members.write", "org.write", "owners.write", "billing.read"}),
    Role.ADMIN: frozenset({"read", "keys.write", "batches.write", "projects.write",
                           "members.write", "org.write", "billing.read"}),
    Role.DEVELOPER: frozenset({"read", "keys.write", "batches.write"}),
    Role.FINANCE: frozenset({"read", "billing.read"}),
    Role.VIEWER: frozenset({"read"}),
}
