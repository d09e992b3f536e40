"""The Alerts & webhooks page in a real headless Chromium, under the console's CSP, against a
live web process and a real Celery worker: add an endpoint and copy its secret, send a test
event and see it delivered in the log, set a budget with a threshold on the settings page and
see its alert delivered in the log. Screenshots at desktop and phone widths."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest

from billing_platform.redis_conn import get_redis
from plans import admission, quotas, webhooks
from plans.models import Budget, BudgetAlert
from tests.console.browser import BROWSER_MARKS, in_thread, member_who_signs_in, shoot, sign_in
from tests.gateway.conftest import start_gateway, stop_gateway

pytestmark = BROWSER_MARKS

PRIVATE_OK = {"TOLLGATE_WEBHOOK_ALLOW_PRIVATE_ADDRESSES": "1"}  # the receiver is on this host


@pytest.fixture
def web(tmp_path):
    server = start_gateway(tmp_path, env=PRIVATE_OK)
    yield server
    stop_gateway(server)


@pytest.fixture
def owner_org():
    """The owner alerts@example.com's organization, made before the browser starts (Django
    refuses queries beside Playwright's event loop)."""
    return member_who_signs_in("alerts@example.com").organization


def _log_text(page) -> str:
    return page.inner_text("#deliveries")


def _reload_until(page, done, what: str, tries: int = 60) -> None:
    for _ in range(tries):
        if done():
            return
        page.wait_for_timeout(1000)
        page.reload()
    raise AssertionError(f"{what}; the log shows: {_log_text(page)}")


def test_an_endpoint_gets_a_test_event_and_a_budget_alert_seen_in_the_log(
        owner_org, web, receivers, celery_worker_process, settings, page):
    settings.WEBHOOK_ALLOW_PRIVATE_ADDRESSES = True
    receiver = receivers()
    org = owner_org
    celery_worker_process(queues="quota", env={**PRIVATE_OK,
                                               "TOLLGATE_BUDGET_WEBHOOK_BACKOFF_S": "1"})
    sign_in(page, web.url, "alerts@example.com")

    # the owner adds an endpoint from the navigation and copies its secret, shown once
    page.click("text=Alerts & webhooks")
    page.fill("#id_url", receiver.url)
    page.fill("#id_description", "ops alerts")
    page.click("text=Add endpoint")
    secret = page.inner_text("#new-secret").strip()
    assert secret.startswith("whsec_")
    page.click("#copy-secret")
    assert page.evaluate("navigator.clipboard.readText()") == secret

    # sends a test event: htmx swaps the log in place and it refreshes itself while the
    # delivery is pending, until it shows it delivered (no reload)
    page.click("text=Send test event")
    page.wait_for_selector("#delivery-log .note")
    page.wait_for_selector("#deliveries .status-delivered", timeout=60_000)
    assert page.url.endswith("/console/alerts/")
    assert "webhook.test" in _log_text(page)
    page.goto(f"{web.url}/console/alerts/")  # opened again, the page never shows the secret
    assert secret not in page.content() and "Delivered" in _log_text(page)
    _status, headers, body = receiver.posts[0]
    assert webhooks.verify_webhook(secret=secret, body=body, header=headers["Tollgate-Signature"])

    # sets a 2.00 budget alerting at 50 % on the settings page
    page.click("text=Limits & budgets")
    page.fill("#id_amount", "2.00")
    page.fill("#id_thresholds", "50")
    page.click("text=Save budget")
    page.wait_for_selector("text=Budget saved.")

    # its spend passes 50 % and the budget sweep runs (what the beat does every minute)
    def overspend() -> list[int]:
        budget = Budget.objects.get(organization=org)
        key = admission.budget_key(org.id, budget.id, budget.created_at)
        get_redis().hset(key, "spent", admission.to_micro(Decimal("1.10")))
        quotas.budget_reconcile(budget=budget)  # or the worker's, enqueued by the save, fires
        return list(BudgetAlert.objects.filter(budget=budget).values_list("threshold",
                                                                          flat=True))

    assert in_thread(overspend) == [50]

    # the alert is in the log, delivered, and on the page's alerts table
    page.click("text=Alerts & webhooks")
    _reload_until(page, lambda: _log_text(page).count("Delivered") == 2, "the budget alert")
    assert "budget.threshold_reached" in _log_text(page)
    assert "50 %" in page.inner_text("#budget-alerts")
    alert = json.loads(receiver.posts[-1][2])
    assert alert["type"] == "budget.threshold_reached" and alert["data"]["threshold"] == 50
    page.click("#deliveries details summary")
    shoot(page, "alerts", "#deliveries")
