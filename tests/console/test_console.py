"""Console flows through Django's test client: sign up, create a key, revoke it."""

from __future__ import annotations

import re

import pytest

from billing_platform.accounts.models import ApiKey, Organization
from billing_platform.accounts.selectors import api_key_authenticate
from tests.factories import MembershipFactory

pytestmark = pytest.mark.django_db(transaction=True)


def test_sign_up_create_key_and_revoke(client):
    # when a visitor signs up
    response = client.post("/console/signup/", {
        "email": "ada@example.com", "password": "a-long-passphrase-42", "org_name": "Analytical",
    }, follow=True)
    assert response.status_code == 200
    assert b"Analytical" in response.content
    org = Organization.objects.get(name="Analytical")
    assert org.memberships.get().role == "owner"
    project = org.projects.get()

    # and creates a key
    keys_url = f"/console/projects/{project.public_id}/keys/"
    nonce = re.search(r'name="form_nonce" value="([^"]+)"', client.get(keys_url).content.decode())
    form = {"name": "laptop", "scopes": ["inference"], "form_nonce": nonce.group(1)}
    response = client.post(keys_url, form)
    html = response.content.decode()
    secret = re.search(r'id="new-secret">(tg-[^<]+)<', html).group(1)
    assert 'id="copy-secret"' in html
    assert api_key_authenticate(secret) is not None
    # then the secret is shown once: the next page load does not contain it
    assert secret not in client.get(keys_url).content.decode()
    # and re-sending the same form (a reload) creates no second key
    client.post(keys_url, form)
    assert ApiKey.objects.filter(name="laptop").count() == 1

    # when they revoke it, a confirmation page comes first
    key = ApiKey.objects.get(name="laptop")
    revoke_url = f"/console/projects/{project.public_id}/keys/{key.public_id}/revoke/"
    confirm = client.get(revoke_url)
    assert b"cannot be undone" in confirm.content
    assert api_key_authenticate(secret) is not None  # nothing happened yet
    client.post(revoke_url)
    assert api_key_authenticate(secret) is None
    assert b"revoked" in client.get(keys_url).content


def test_sign_up_errors_are_shown_on_the_form(client):
    MembershipFactory(user__email="taken@example.com")
    response = client.post("/console/signup/", {
        "email": "taken@example.com", "password": "a-long-passphrase-42", "org_name": "X",
    })
    assert b"already exists" in response.content
    response = client.post("/console/signup/", {"email": "new@example.com", "password": "123",
                                                "org_name": "Y"})
    assert b"errorlist" in response.content
    assert not Organization.objects.filter(name__in=["X", "Y"]).exists()


def test_login_logout_and_org_switcher(client):
    first = MembershipFactory(user__email="multi@example.com")
    second = MembershipFactory(user=first.user, role="viewer")
    response = client.post("/console/login/", {"username": "multi@example.com",
                                               "password": "correct horse battery"}, follow=True)
    assert first.organization.name.encode() in response.content
    response = client.post("/console/org/switch/", {"org": second.organization.public_id},
                           follow=True)
    assert b"your role <b>viewer</b>" in response.content
    # a viewer sees no key-creation form
    project = second.organization.projects.create(name="p")
    page = client.get(f"/console/projects/{project.public_id}/keys/")
    assert b"Create a key" not in page.content
    client.post("/console/logout/")
    assert client.get("/console/").status_code == 302


def test_another_orgs_project_is_404_in_the_console(client):
    mine = MembershipFactory()
    theirs = MembershipFactory()
    project = theirs.organization.projects.create(name="secret")
    client.force_login(mine.user)
    assert client.get(f"/console/projects/{project.public_id}/keys/").status_code == 404
