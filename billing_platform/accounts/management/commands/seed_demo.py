"""Seed the demo organization, login and API key (idempotent; the key is rotated each run)."""

from __future__ import annotations

from django.core.management.base import BaseCommand
from django.db import transaction

from billing_platform.accounts import services
from billing_platform.accounts.choices import Scope
from billing_platform.accounts.models import ApiKey, Organization, User

DEMO_EMAIL = "demo@tollgate.local"
DEMO_PASSWORD = "tollgate-demo"  # noqa: S105 - a published demo login for local runs only
DEMO_SLUG = "demo"
DEMO_KEY_NAME = "demo key (rotated by seed_demo)"


class Command(BaseCommand):
    help = "Create the demo org, login and a fresh demo API key; safe to run repeatedly."

    @transaction.atomic
    def handle(self, *args, **options) -> None:
        user = User.objects.filter(email=DEMO_EMAIL).first()
        if user is None:
            user = User.objects.create_superuser(email=DEMO_EMAIL, password=DEMO_PASSWORD)
        org = Organization.objects.filter(slug=DEMO_SLUG).first()
        if org is None:
            org = services.organization_create(name="Demo Org", owner=user)
            org.slug = DEMO_SLUG
            org.save(update_fields=["slug"])
        project = org.projects.order_by("created_at").first()
        for old in ApiKey.objects.filter(project=project, name=DEMO_KEY_NAME,
                                         revoked_at__isnull=True):
            services.api_key_revoke(api_key=old, acting_user=user)
        _key, secret = services.api_key_create(
            project=project, name=DEMO_KEY_NAME, acting_user=user,
            scopes=[Scope.INFERENCE, Scope.BATCH, Scope.USAGE_READ, Scope.ADMIN],
        )
        self.stdout.write(
            f"demo login  {DEMO_EMAIL} / {DEMO_PASSWORD}  (staff: /admin/ too)\n"
            f"demo org    {org.name} ({org.public_id}), project {project.public_id}\n"
            f"demo key    {secret}\n"
            f"            (a new key each run; the previous demo key was revoked)"
        )
