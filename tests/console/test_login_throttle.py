"""The console login is throttled per (username, client address) by django-axes: after the
configured number of failures even the right password is refused, with a clear message on the
form, until the cool-off ends; other users, and the same user elsewhere, are unaffected.
Through the real login form (Django's test client, real database).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from axes.models import AccessAttempt
from django.db.models import F
from django.test import Client

from tests.factories import UserFactory

pytestmark = pytest.mark.django_db(transaction=True)

PASSWORD = "correct horse battery"  # the factory's
LOGIN = "/console/login/"


def _log_in(client: Client, email: str, password: str):
    return client.post(LOGIN, {"username": email, "password": password})


def _fail_until_locked(client: Client, email: str, limit: int) -> None:
    for _ in range(limit):
        response = _log_in(client, email, "not-the-password")
        assert response.status_code in (200, 429)


def test_after_the_limit_the_right_password_is_refused_and_other_users_are_not(settings):
    # given two members and the configured limit
    limit = settings.AXES_FAILURE_LIMIT
    UserFactory(email="victim@example.com")
    UserFactory(email="bystander@example.com")
    attacker = Client(REMOTE_ADDR="203.0.113.7")

    # when one address fails the limit for one user, the first failures say only that
    first = _log_in(attacker, "victim@example.com", "wrong")
    assert first.status_code == 200
    assert b"Please enter a correct email address and password" in first.content
    _fail_until_locked(attacker, "victim@example.com", limit - 1)

    # then the next attempt, with the right password, is refused with the lockout message
    locked = _log_in(attacker, "victim@example.com", PASSWORD)
    assert locked.status_code == 429
    html = locked.content.decode()
    assert "Too many failed login attempts for victim@example.com" in html
    minutes = int(settings.AXES_COOLOFF_TIME.total_seconds() // 60)
    assert f"Try again in {minutes} minutes" in html
    assert 'name="username"' in html  # still the login form
    assert "_auth_user_id" not in attacker.session

    # and another user logs in from the same address
    assert _log_in(attacker, "bystander@example.com", PASSWORD).status_code == 302
    # and the same user from another address too
    assert _log_in(Client(REMOTE_ADDR="198.51.100.2"), "victim@example.com",
                   PASSWORD).status_code == 302


def test_the_lock_ends_after_the_cool_off(settings):
    # given a user locked out from one address
    UserFactory(email="patient@example.com")
    client = Client(REMOTE_ADDR="203.0.113.9")
    _fail_until_locked(client, "patient@example.com", settings.AXES_FAILURE_LIMIT)
    assert _log_in(client, "patient@example.com", PASSWORD).status_code == 429

    # when the cool-off has passed (the recorded failures are moved back past it, rather than
    # the test sleeping for it)
    AccessAttempt.objects.update(
        attempt_time=F("attempt_time") - settings.AXES_COOLOFF_TIME - timedelta(seconds=1))

    # then the right password works again
    assert _log_in(client, "patient@example.com", PASSWORD).status_code == 302


def test_a_success_before_the_limit_resets_the_count(settings):
    UserFactory(email="clumsy@example.com")
    client = Client(REMOTE_ADDR="203.0.113.10")
    _fail_until_locked(client, "clumsy@example.com", settings.AXES_FAILURE_LIMIT - 1)
    assert _log_in(client, "clumsy@example.com", PASSWORD).status_code == 302
    client.logout()
    # a fresh allowance: as many failures again are still short of the lock
    _fail_until_locked(client, "clumsy@example.com", settings.AXES_FAILURE_LIMIT - 1)
    assert _log_in(client, "clumsy@example.com", PASSWORD).status_code == 302
