"""Seed the demo organization, login and API key (idempotent; the key is rotated each run).

The demo login is published (README) and a superuser, so the command refuses to run with
``TOLLGATE_ENV=production``. The demo key is a live secret: it is printed only to a terminal,
never to output that is piped or redirected (a CI or service log others read), and written to
``--key-file`` (mode 0600) when the operator names one; with neither, no key is made.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import cast

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from billing_platform import env as E
from billing_platform.accounts import services
from billing_platform.accounts.choices import Scope
from billing_platform.accounts.models import ApiKey, Organization, Project, User

DEMO_EMAIL = "demo@tollgate.local"
DEMO_PASSWORD = "tollgate-demo"  # noqa: S105 - a published demo login for local runs only
DEMO_SLUG = "demo"
DEMO_KEY_NAME = "demo key (rotated by seed_demo)"


def _write_secret(path: Path, secret: str) -> None:
    """Write ``secret`` to ``path``, readable by its owner only (also when it already existed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CommandError(f"--key-file {path} is not a regular file")
        os.fchmod(fd, 0o600)
        os.write(fd, f"{secret}\n".encode())
    finally:
        os.close(fd)


class Command(BaseCommand):
    help = ("Create the demo org, login and a fresh demo API key; safe to run repeatedly. "
            "Refuses to run in production. The key is printed only to a terminal; pass "
            "--key-file to receive it in a file instead.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--key-file", type=Path, default=None,
            help="write the new demo key to this file (mode 0600), e.g. .tollgate/demo-key")

    def handle(self, *args, key_file: Path | None = None, **options) -> None:
        if E.PRODUCTION:
            raise CommandError(
                "seed_demo creates a published demo login (a superuser) and must never run "
                "with TOLLGATE_ENV=production; refusing. Create real users with "
                "'manage.py createsuperuser' and keys in the console or the API.")
        to_terminal = self.stdout.isatty()
        with transaction.atomic():
            user, org, project = self._seed()
            secret = self._rotate_key(user, project) if (key_file or to_terminal) else None
            if secret and key_file:
                _write_secret(key_file, secret)  # inside the transaction: no file, no key
        self.stdout.write(
            f"demo login  {DEMO_EMAIL} / {DEMO_PASSWORD}  (staff: /admin/ too)\n"
            f"demo org    {org.name} ({org.public_id}), project {project.public_id}")
        if secret is None:
            self.stdout.write(
                "demo key    not rotated: output is not a terminal, so a key printed here could "
                "end up in a shared log; rerun with --key-file PATH to get one")
            return
        if to_terminal:
            also = f"  (also in {key_file})" if key_file else ""
            self.stdout.write(f"demo key    {secret}{also}")
        else:
            self.stdout.write(f"demo key    written to {key_file} (not printed: output is not "
                              f"a terminal)")
        self.stdout.write("            (a new key each run; the previous demo key was revoked)")

    def _seed(self) -> tuple[User, Organization, Project]:
        user = User.objects.filter(email=DEMO_EMAIL).first()
        if user is None:
            user = User.objects.create_superuser(email=DEMO_EMAIL, password=DEMO_PASSWORD)
        org = Organization.objects.filter(slug=DEMO_SLUG).first()
        if org is None:
            org = services.organization_create(name="Demo Org", owner=user)
            org.slug = DEMO_SLUG
            org.save(update_fields=["slug"])
        # organization_create made its default project: never None
        return user, org, cast(Project, org.projects.order_by("created_at").first())

    def _rotate_key(self, user: User, project: Project) -> str:
        for old in ApiKey.objects.filter(project=project, name=DEMO_KEY_NAME,
                                         revoked_at__isnull=True):
            services.api_key_revoke(api_key=old, acting_user=user)
        _key, secret = services.api_key_create(
            project=project, name=DEMO_KEY_NAME, acting_user=user,
            scopes=[Scope.INFERENCE, Scope.BATCH, Scope.USAGE_READ, Scope.ADMIN],
        )
        return secret
