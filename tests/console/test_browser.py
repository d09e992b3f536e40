"""The console in a real headless Chromium: sign up, create a key (shown once, copy button),
revoke it after the confirmation page, and see the gateway refuse it.
"""

from __future__ import annotations

import re

import httpx
import pytest

from tests.console.conftest import CHROMIUM

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (the test command "
                       "installs Debian's chromium where it can: apt-get install chromium)"),
    pytest.mark.django_db(transaction=True),
]


def test_sign_up_create_copy_and_revoke_a_key_in_chromium(live_console, page, tmp_path):
    base = live_console.url
    page.goto(f"{base}/console/signup/")
    page.fill("#id_email", "grace@example.com")
    page.fill("#id_password", "a-long-passphrase-42")
    page.fill("#id_org_name", "Hopper Labs")
    page.click("button[type=submit]")
    page.wait_for_url(f"{base}/console/")
    assert "Hopper Labs" in page.content()

    page.click("text=Projects & keys")
    page.click("text=API keys →")
    page.fill("#id_name", "laptop")
    page.click("text=Create key")
    secret = page.inner_text("#new-secret").strip()
    assert re.fullmatch(r"tg-[a-z0-9]{12}_[A-Za-z0-9_-]+", secret)
    page.click("#copy-secret")
    page.wait_for_function("document.getElementById('copy-secret').textContent === 'Copied'")
    assert page.evaluate("navigator.clipboard.readText()") == secret
    page.screenshot(path=str(tmp_path / "keys.png"))

    auth = {"Authorization": f"Bearer {secret}"}
    assert httpx.get(f"{base}/v1/models", headers=auth).status_code == 200

    page.reload()  # re-sends the POST: no second key, and the secret is not shown again
    assert secret not in page.content()
    assert page.locator("text=laptop").count() == 1
    page.click("text=Revoke")
    assert "cannot be undone" in page.content()
    page.click("text=Yes, revoke this key")
    page.wait_for_selector("text=stopped working immediately")
    assert httpx.get(f"{base}/v1/models", headers=auth).status_code == 401


@pytest.fixture
def running_batch(transactional_db, tmp_path, settings, metering_stream):
    """A member (ada@example.com) whose organization has a batch in progress, created with
    the SDK; yields (console base URL, SDK client, batch id). Set up before the browser:
    Playwright's sync API runs an event loop, and Django refuses queries beside one."""
    import openai

    from billing_platform.gateway.batch import services as batch_services
    from billing_platform.gateway.models import Batch
    from tests.factories import MembershipFactory, ProjectFactory, make_key
    from tests.gateway.test_batch_api import fast_stack, request_line, upload

    for stack in fast_stack(tmp_path, settings, metering_stream):
        member = MembershipFactory(user__email="ada@example.com")
        member.user.set_password("a-long-passphrase-42")
        member.user.save()
        _key, secret = make_key(project=ProjectFactory(organization=member.organization),
                                scopes=["batch"])
        sdk = openai.OpenAI(base_url=f"{stack.gateway.url}/v1", api_key=secret,
                            max_retries=0)
        created = sdk.batches.create(
            input_file_id=upload(sdk, [request_line(i) for i in range(3)]),
            endpoint="/v1/chat/completions", completion_window="24h")
        batch_services.batch_validate(batch_id=Batch.objects.get(public_id=created.id).pk)
        yield stack.gateway.url, sdk, created.id


def test_cancel_a_running_batch_from_the_batches_page_in_chromium(running_batch, page,
                                                                   tmp_path):
    base, sdk, batch_id = running_batch

    # when the member signs in, opens Batches and cancels the batch, confirming the dialog
    page.goto(f"{base}/console/login/")
    page.fill("#id_username", "ada@example.com")
    page.fill("#id_password", "a-long-passphrase-42")
    page.click("button[type=submit]")
    page.click("text=Batches")
    row = page.locator(f"tr[data-batch='{batch_id}']")
    assert "in_progress" in row.inner_text() and "0 completed, 0 failed of 3" in row.inner_text()
    dialogs = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.accept()))
    row.locator("text=Cancel").click()
    page.wait_for_selector(f"text=Batch {batch_id} is cancelled")
    page.screenshot(path=str(tmp_path / "batches.png"))

    # then the browser asked first, and the API reports the batch cancelled
    assert dialogs and batch_id in dialogs[0]
    assert "cancelled" in page.locator(f"tr[data-batch='{batch_id}']").inner_text()
    assert sdk.batches.retrieve(batch_id).status == "cancelled"
