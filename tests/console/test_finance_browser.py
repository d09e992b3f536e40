"""The /finance/ workspace in a real headless Chromium, under the console's CSP, against a live
web process, a real Celery worker and the Stripe stand-in (through the official library).

A finance controller signs in, reads each report (its chart drawn by the vendored Chart.js),
downloads each CSV and finds the table in it, previews and runs a close, issues a refund credit
note on an invoice paid through Stripe, and sees the refund succeed in Stripe and the credit
note taken off billed revenue in receivables. An analyst sees no operation form and a forged
POST (with a valid CSRF token) is a 404; an organization's own member gets 404 on /finance/.
"""

from __future__ import annotations

import csv
from datetime import timedelta
from decimal import Decimal

import pytest

from billing_platform.finance.permissions import ANALYST_GROUP, CONTROLLER_GROUP
from billing_platform.invoicing import services, stripe_client
from tests.console.browser import (
    BROWSER_MARKS,
    PASSWORD,
    in_thread,
    member_who_signs_in,
    open_october_invoice,
    sign_in,
    stripe_env,
)
from tests.factories import make_billed_org
from tests.finance.conftest import finance_user
from tests.gateway.conftest import start_gateway, stop_gateway
from tests.invoicing.conftest import NOV, record
from tests.invoicing.test_invoice_payments import _set_default_card

pytestmark = BROWSER_MARKS

REPORTS = ("Revenue", "Receivables", "Credits", "Customers")


def _user(group: str, email: str):
    user = finance_user(group, email=email)
    user.set_password(PASSWORD)
    user.save()
    return user


@pytest.fixture
def finance_world(stripe_settings, localstripe_url, celery_worker_process, tmp_path):
    """An October invoice paid through Stripe, an organization whose November is due, the
    three kinds of user, a worker for the refund task and the web process, all before the
    browser starts. Yields (base URL, the paid invoice, its PaymentIntent id)."""
    env = stripe_env(localstripe_url)
    # October: a 200.00 reservation fee, charged on a card and settled as Stripe reports it
    paid = open_october_invoice("Paid Co")
    _set_default_card(paid.organization, "pm_card_visa")
    assert services.invoice_charge(invoice_id=paid.id) == "succeeded"
    assert services.payments_sync(older_than=timedelta(0)) == 1
    paid.refresh_from_db()
    assert (paid.status, paid.total) == ("paid", Decimal("200.0000"))
    intent_id = paid.payments.get().stripe_payment_intent_id
    due = make_billed_org(name="Due Co", created_at=NOV)
    record(due, "nov-1", NOV + timedelta(days=9), prompt_tokens=2_000_000,
           completion_tokens=250_000)
    _user(CONTROLLER_GROUP, "controller@platform.example.com")
    _user(ANALYST_GROUP, "analyst@platform.example.com")
    member_who_signs_in("owner@due.example.com", organization=due)
    worker = celery_worker_process(queues="billing", env=env)
    server = start_gateway(tmp_path, env=env)
    yield server.url, paid, intent_id, worker
    stop_gateway(server)


def table(page, selector: str) -> list[list[str]]:
    return page.eval_on_selector_all(
        f"{selector} tr", "rows => rows.map(r => [...r.cells].map(c => c.textContent.trim()))")


def summary(page, currency: str, column: str) -> str:
    header, *rows = table(page, "#summaries")
    (row,) = [r for r in rows if r[header.index("currency")] == currency]
    return row[header.index(column)]


def test_finance_controller_analyst_and_member_in_chromium(finance_world, page, tmp_path):
    base, paid, intent_id, worker = finance_world
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.accept()))

    # --- the controller signs in and lands on the finance workspace (no organization) ---
    sign_in(page, base, "controller@platform.example.com")
    assert page.url == f"{base}/finance/reports/revenue/"

    # reads each report: its chart is drawn, and its CSV download is the table
    for name in REPORTS:
        page.click(f"nav.subnav >> text={name}")
        page.wait_for_selector("canvas#chart[data-drawn=true]")
        assert page.evaluate("document.getElementById('chart').chart.data.labels.length") > 0
        shown = table(page, "#report-table")
        with page.expect_download() as download:
            page.click("#csv-link")
        with open(download.value.path(), newline="") as f:
            rows = list(csv.reader(f))
        assert rows[0] == shown[0], name
        assert rows[1:] == ([] if shown[1:] == [["Nothing in this range."]] else shown[1:]), name
    page.screenshot(path=str(tmp_path / "customers.png"), full_page=True)

    # revenue shows the paid invoice's 200.00 billed in October
    page.click("nav.subnav >> text=Revenue")
    header, *rows = table(page, "#totals")
    october = [r for r in rows if r[0] == "2026-10-01" and r[1] == "USD"]
    assert [r[header.index("billed")] for r in october] == ["200.00"]

    # previews the close (nothing due is invoiced yet), then runs it
    page.click("nav.subnav >> text=Close period")
    page.click("#close-preview button")
    preview = page.inner_text("#preview")
    assert "Due Co" in preview and "would create" in preview
    previewed = page.locator("#preview tbody tr").count()
    page.fill("#op-close input[name=reason]", "month end")
    page.click("#op-close button")
    page.wait_for_selector(".messages li.success")
    assert f"Closed: {previewed} invoice(s) created" in page.inner_text(".messages")
    assert any("Close these periods now" in d for d in dialogs)

    # receivables before the credit note: what was billed in the last 90 days, in USD
    page.click("nav.subnav >> text=Receivables")
    billed_before = Decimal(summary(page, "USD", "billed_90_days"))
    assert "Due Co" in page.inner_text("#report-table")

    # issues a credit note on the paid invoice, refunded through Stripe
    page.click("nav.subnav >> text=Invoices")
    page.fill("#i-number", paid.number)
    page.click("#invoice-filters button")
    page.click(f"tr[data-invoice='{paid.public_id}'] a >> text={paid.number}")
    assert page.inner_text("#invoice-status") == "paid"
    page.fill("#op-credit-note input[name=amount]", "50.00")
    page.check("#op-credit-note input[name=outcome][value=refund]")
    page.fill("#op-credit-note input[name=reason]", "outage credit")
    page.click("#op-credit-note button")
    page.wait_for_selector(".messages li.success")
    assert "refunded through Stripe" in page.inner_text(".messages")

    # the worker sends the refund: the page shows it succeeded (reloaded until it has)
    for _ in range(150):
        status = page.inner_text("tr[data-refund] .refund-status")
        if status == "succeeded":
            break
        page.wait_for_timeout(200)
        page.reload()
    assert status == "succeeded", f"refund still {status} (worker log: {worker.log_path})"

    # and Stripe has it, once, 50.00 against the invoice's PaymentIntent
    refunds = stripe_client.client().v1.refunds.list({"payment_intent": intent_id}).data
    assert [(r.amount, r.currency, r.status) for r in refunds] == [(5000, "usd", "succeeded")]
    assert page.get_attribute("tr[data-refund]", "data-refund") == refunds[0].id

    # audited with the controller and the reason
    def audit_rows():
        from billing_platform.audit.models import AuditEvent

        return [(r.actor_label, r.after.get("reason"), r.after.get("outcome"))
                for r in AuditEvent.objects.filter(action="credit_note.create")]

    assert in_thread(audit_rows) == [("controller@platform.example.com", "outage credit",
                                      "refund")]

    # and receivables: the credit note is netted from what was billed
    page.click("nav.subnav >> text=Receivables")
    assert Decimal(summary(page, "USD", "billed_90_days")) == billed_before - Decimal("50.00")

    # --- an analyst reads the same invoice and gets no form; a forged POST is a 404 ---
    sign_in(page, base, "analyst@platform.example.com")
    page.goto(f"{base}/finance/invoices/{paid.public_id}/")
    assert page.locator("form[id^=op-]").count() == 0
    assert page.locator("nav.subnav >> text=Close period").count() == 0
    token = next(c["value"] for c in page.context.cookies() if c["name"] == "csrftoken")
    for path, form in ((f"/finance/invoices/{paid.public_id}/credit-note/",
                        {"amount": "10.00", "outcome": "refund"}),
                       (f"/finance/invoices/{paid.public_id}/void/", {}),
                       ("/finance/close/", {"step": "run"})):
        forged = page.request.post(f"{base}{path}", headers={"X-CSRFToken": token}, form={
            "reason": "forged", "idempotency_key": "f" * 32, **form})
        assert forged.status == 404, path
    assert len(stripe_client.client().v1.refunds.list({"payment_intent": intent_id}).data) == 1

    # --- an organization's owner finds no finance workspace ---
    sign_in(page, base, "owner@due.example.com")
    assert page.url == f"{base}/console/"
    assert "Finance" not in page.inner_text("header")
    for path in ("/finance/", "/finance/reports/revenue/", f"/finance/invoices/{paid.public_id}/"):
        assert page.goto(f"{base}{path}").status == 404, path
