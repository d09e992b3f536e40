"""Tenancy models.

An organization is the billing and data-residency boundary; projects group API keys; a key's
secret is shown once and only its SHA-256 digest is stored (the secret is 256 random bits, so a
fast hash is the right tool: there is nothing to brute-force).
"""

from __future__ import annotations

import hashlib
import secrets
from decimal import Decimal
from typing import Any, ClassVar

from django.contrib.auth.models import AbstractUser, BaseUserManager
from django.contrib.postgres.fields import ArrayField
from django.core.validators import MinValueValidator
from django.db import models
from django.utils import timezone

from billing_platform.accounts.choices import DataZone, OrgStatus, ProjectStatus, Role, Scope


def sha256_hex(value: str) -> str:
    """Return the hex SHA-256 of ``value`` (how key secrets and invitation tokens are stored)."""
    return hashlib.sha256(value.encode()).hexdigest()


def public_id(prefix: str) -> str:
    """Return a random, URL-safe public identifier such as ``org_3f9a...``."""
    return f"{prefix}_{secrets.token_hex(12)}"


class UserManager(BaseUserManager["User"]):
    use_in_migrations = True

    def create_user(self, email: str, password: str | None = None, **extra: Any) -> User:
        user = self.model(email=self.normalize_email(email).lower(), **extra)
        user.set_password(password)
        user.save(using=self._db)
        return user

    def create_superuser(self, email: str, password: str | None = None, **extra: Any) -> User:
        extra.setdefault("is_staff", True)
        extra.setdefault("is_superuser", True)
        return self.create_user(email, password, **extra)


class User(AbstractUser):
    """A person who logs in to the console; identified by email."""

    username = None  # type: ignore[assignment]
    email = models.EmailField("email address", unique=True)

    USERNAME_FIELD = "email"
    REQUIRED_FIELDS: ClassVar[list[str]] = []

    # ours is email-based, not a subclass of the username-based manager AbstractUser declares
    objects = UserManager()  # type: ignore[misc, assignment]

    def __str__(self) -> str:
        return self.email


class Organization(models.Model):
    """The customer: billing boundary, currency, tax rate and data zone."""

    public_id = models.CharField(max_length=40, unique=True, editable=False)
    name = models.CharField(max_length=200)
    slug = models.SlugField(max_length=60, unique=True)
    billing_email = models.EmailField()
    currency = models.CharField(max_length=3, default="USD")
    data_zone = models.CharField(max_length=16, choices=DataZone.choices, default=DataZone.GLOBAL)
    tax_rate = models.DecimalField(
        max_digits=7, decimal_places=4, default=Decimal("0"),
        help_text="Fraction, e.g. 0.2000 for 20 % VAT.",
    )
    status = models.CharField(max_length=16, choices=OrgStatus.choices, default=OrgStatus.ACTIVE)
    created_at = models.DateTimeField(default=timezone.now)
    # The billing profile: who the invoices are addressed to (billing_email, currency and
    # tax_rate above belong to it too). Owners set who they are; the platform's finance team
    # also sets currency and tax rate (accounts.billing_profile).
    legal_name = models.CharField(max_length=200, blank=True, default="",
                                  help_text="The name invoices are addressed to; blank: name.")
    address_line1 = models.CharField(max_length=200, blank=True, default="")
    address_line2 = models.CharField(max_length=200, blank=True, default="")
    postal_code = models.CharField(max_length=20, blank=True, default="")
    city = models.CharField(max_length=100, blank=True, default="")
    region = models.CharField(max_length=100, blank=True, default="",
                              help_text="State, province or county, where addresses have one.")
    country = models.CharField(max_length=2, blank=True, default="",
                               help_text="ISO 3166-1 alpha-2 code, e.g. DE.")
    tax_id = models.CharField(max_length=40, blank=True, default="",
                              help_text="The buyer's VAT/GST/tax number, printed on invoices.")
    # What one organization may hold of resources every tenant shares; blank: the deployment's
    # default (TOLLGATE_ORG_MAX_*). Set by staff, not by the customer.
    max_concurrent_requests = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)],
        help_text="Requests in flight on /v1 at once. Blank: TOLLGATE_ORG_MAX_CONCURRENT_REQUESTS.")
    max_stored_files = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="Files stored for the Batch API (uploads and outputs). Blank: "
                  "TOLLGATE_ORG_MAX_STORED_FILES.")
    max_stored_bytes = models.PositiveBigIntegerField(
        null=True, blank=True,
        help_text="Bytes of those files. Blank: TOLLGATE_ORG_MAX_STORED_BYTES.")

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=models.Q(tax_rate__gte=0) & models.Q(tax_rate__lt=1),
                name="org_tax_rate_fraction",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self.public_id:
            self.public_id = public_id("org")
        super().save(*args, **kwargs)


class Membership(models.Model):
    """A user's role in one organization."""

    user = models.ForeignKey(User, on_delete=models.CASCADE, related_name="memberships")
    organization = models.ForeignKey(
        Organization, on_delete=models.CASCADE, related_name="memberships"
    )
    role = models.CharField(max_length=16, choices=Role.choices)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["user", "organization"], name="one_membership"),
        ]

    def __str__(self) -> str:
        return f"{self.user} @ {self.organization} ({self.role})"


class Invitation(models.Model):
    """A pending invitation to join an organization; the token is stored hashed."""

    organization = models.ForeignKey(
        Organization, on_delete=models.CASCADE, related_name="invitations"
    )
    email = models.EmailField()
    role = models.CharField(max_length=16, choices=Role.choices)
    token_hash = models.CharField(max_length=64, unique=True)
    invited_by = models.ForeignKey(User, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    accepted_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.email} -> {self.organization}"


class Project(models.Model):
    """A group of API keys inside an organization (usage and limits can be set per project)."""

    public_id = models.CharField(max_length=40, unique=True, editable=False)
    organization = models.ForeignKey(
        Organization, on_delete=models.CASCADE, related_name="projects"
    )
    name = models.CharField(max_length=200)
    status = models.CharField(
        max_length=16, choices=ProjectStatus.choices, default=ProjectStatus.ACTIVE
    )
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return self.name

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self.public_id:
            self.public_id = public_id("proj")
        super().save(*args, **kwargs)


class ApiKey(models.Model):
    """A bearer credential ``tg-<prefix>_<secret>``; only the prefix and SHA-256 are stored."""

    public_id = models.CharField(max_length=40, unique=True, editable=False)
    organization = models.ForeignKey(
        Organization, on_delete=models.CASCADE, related_name="api_keys"
    )
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=200)
    prefix = models.CharField(max_length=16, unique=True)
    secret_hash = models.CharField(max_length=64)
    scopes = ArrayField(models.CharField(max_length=16, choices=Scope.choices))
    allowed_models = ArrayField(
        models.CharField(max_length=200), default=list, blank=True,
        help_text="Empty means every model offered in the organization's data zone.",
    )
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(User, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["organization", "project"])]

    def __str__(self) -> str:
        return f"{self.name} (tg-{self.prefix}_…)"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self.public_id:
            self.public_id = public_id("key")
        super().save(*args, **kwargs)

    @property
    def redacted(self) -> str:
        return f"tg-{self.prefix}_…"

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None and (
            self.expires_at is None or self.expires_at > timezone.now()
        )
