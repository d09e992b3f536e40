"""``manage.py seed_demo`` as the devstack and an operator run it: never in production, and its
demo key (a live secret) only on a terminal or in the file the operator names, never in output
that is piped or redirected into a log.
"""

from __future__ import annotations

import os
import pty
import re
import stat
import subprocess
import sys
from io import StringIO

import pytest
from django.core.management import call_command

from billing_platform.accounts.management.commands.seed_demo import DEMO_EMAIL, DEMO_KEY_NAME
from billing_platform.accounts.models import ApiKey, User
from billing_platform.accounts.selectors import api_key_authenticate
from tests.conftest import ROOT
from tests.gateway.conftest import test_database_url as database_url
from tests.security.test_production_defaults import production_env

pytestmark = pytest.mark.django_db(transaction=True)

KEY = re.compile(r"tg-[a-z0-9]{12}_[A-Za-z0-9_-]+")


def _live_demo_keys() -> list[ApiKey]:
    return list(ApiKey.objects.filter(name=DEMO_KEY_NAME, revoked_at__isnull=True))


def test_seed_demo_refuses_to_run_in_production():
    # when an operator runs it with the production settings
    result = subprocess.run(
        [sys.executable, "manage.py", "seed_demo"], cwd=ROOT, capture_output=True, text=True,
        env=production_env(ALLOWED_HOSTS="billing.example.com"), timeout=120)

    # then it refuses, says why, and creates no published login
    assert result.returncode != 0
    assert "must never run with TOLLGATE_ENV=production" in result.stderr
    assert not User.objects.filter(email=DEMO_EMAIL).exists()


def test_redirected_output_gets_no_key_and_the_old_key_keeps_working(tmp_path):
    # given a first seed that wrote its key to a file
    call_command("seed_demo", "--key-file", str(tmp_path / "key"), stdout=StringIO())
    (old_key,) = _live_demo_keys()

    # when it runs again with its output going to a log, without a key file
    log = StringIO()
    call_command("seed_demo", stdout=log)

    # then the log has the login and no key, says how to get one, and nothing was rotated
    assert DEMO_EMAIL in log.getvalue()
    assert not KEY.search(log.getvalue())
    assert "rerun with --key-file PATH" in log.getvalue()
    assert _live_demo_keys() == [old_key]


def test_key_file_gets_the_key_owner_only_and_the_log_does_not(tmp_path):
    # given an old key file left readable by others
    key_file = tmp_path / "demo-key"
    key_file.write_text("old\n")
    key_file.chmod(0o644)

    # when seeding with that key file and the output going to a log
    log = StringIO()
    call_command("seed_demo", "--key-file", str(key_file), stdout=log)

    # then the file holds the new, working key and only its owner may read it
    secret = key_file.read_text().strip()
    assert KEY.fullmatch(secret)
    assert api_key_authenticate(secret) is not None
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    # and the log says where it is, not what it is
    assert secret not in log.getvalue()
    assert f"written to {key_file}" in log.getvalue()

    # and the next run rotates it: the previous key stops working
    call_command("seed_demo", "--key-file", str(key_file), stdout=StringIO())
    assert api_key_authenticate(secret) is None
    assert len(_live_demo_keys()) == 1


def test_a_terminal_is_shown_the_key():
    # when a developer runs it in a terminal (as ./tollgate up does)
    primary, replica = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "seed_demo"], cwd=ROOT, stdout=replica,
        stderr=subprocess.PIPE, env={**os.environ, "DATABASE_URL": database_url()})
    os.close(replica)
    output = b""
    while True:
        try:
            chunk = os.read(primary, 4096)
        except OSError:  # the terminal closes when the command exits
            break
        if not chunk:
            break
        output += chunk
    os.close(primary)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()

    # then the terminal shows a key that works
    secret = KEY.search(output.decode()).group(0)
    assert api_key_authenticate(secret) is not None
