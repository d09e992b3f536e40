"""The /finance/ pages through Django's test client, against the real database: who sees them
(404 for everyone but the platform's finance team, no forms for an analyst, a forged POST is a
404 that changes nothing), what each report page shows (its CSV equals its table), and every
hostile input a form or filter may get (a form message and a 400, nothing written).
"""

from __future__ import annotations

import csv
import io
import re
from datetime import timedelta
from decimal import Decimal
from html.parser import HTMLParser

import pytest

from billing_platform.accounts.choices import Role
from billing_platform.audit.models import AuditEvent
from billing_platform.finance.permissions import ANALYST_GROUP, CONTROLLER_GROUP
from billing_platform.idempotency.models import IdempotentRequest
from billing_platform.invoicing import services
from billing_platform.invoicing.models import Invoice, PendingInvoiceItem
from plans.models import CreditGrant
from tests.factories import MembershipFactory, UserFactory, make_billed_org, make_price_book
from tests.finance.conftest import finance_user
from tests.invoicing.conftest import NOV, OCT, record

pytestmark = pytest.mark.django_db

REPORTS = ("revenue", "receivables", "credits", "customers")


class Tables(HTMLParser):
    """Every <table id=...> of a page as rows of cell texts (header row first)."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self._table: str | None = None
        self._cell: list[str] | None = None
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        if tag == "table" and dict(attrs).get("id"):
            self._table = dict(attrs)["id"]
            self.tables[self._table] = []
        elif self._table and tag == "tr":
            self.tables[self._table].append([])
        elif self._table and tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None and self._table:
            self.tables[self._table][-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def form_key(html: str, form_id: str) -> str:
    """Return the idempotency key the page put in the form ``form_id``."""
    form = html[html.index(f'id="{form_id}"'):]
    return re.search(r'name="idempotency_key" value="([0-9a-f]+)"', form).group(1)


@pytest.fixture
def books(db):
    make_price_book(prices=[{"model": "m-small", "input": "1.00", "output": "2.00"}])
    make_price_book(currency="EUR", prices=[
        {"model": "m-small", "input": "0.90", "output": "1.80"}])


@pytest.fixture
def ledger(books):
    """October closed for two organizations (USD with 20 % tax, EUR): two open invoices."""
    usd = make_billed_org(name="Dollar Co", tax_rate="0.2000")
    eur = make_billed_org(name="Euro GmbH", currency="EUR")
    record(usd, "u1", OCT + timedelta(days=3), prompt_tokens=4_000_000,
           completion_tokens=500_000)
    record(eur, "e1", OCT + timedelta(days=4), prompt_tokens=2_000_000)
    services.period_close_run(now=NOV + timedelta(hours=2), enqueue_payments=False)
    return {"usd": usd, "eur": eur,
            "usd_invoice": Invoice.objects.get(organization=usd, kind="invoice"),
            "eur_invoice": Invoice.objects.get(organization=eur, kind="invoice")}


@pytest.fixture
def analyst(client, ledger):
    client.force_login(finance_user(ANALYST_GROUP))
    return client


@pytest.fixture
def controller(client, ledger):
    user = finance_user(CONTROLLER_GROUP, email="controller@platform.example.com")
    client.force_login(user)
    client.user = user
    return client


def pages(ledger) -> list[str]:
    inv, org = ledger["usd_invoice"].public_id, ledger["usd"].public_id
    return ["/finance/", *(f"/finance/reports/{r}/" for r in REPORTS),
            "/finance/reports/revenue/?format=csv", "/finance/invoices/",
            f"/finance/invoices/{inv}/", f"/finance/organizations/{org}/", "/finance/close/"]


def operation_posts(ledger) -> list[str]:
    inv, org = ledger["usd_invoice"].public_id, ledger["usd"].public_id
    return [*(f"/finance/invoices/{inv}/{op}/" for op in (
        "void", "credit-note", "mark-paid", "retry", "pause-dunning", "resume-dunning",
        "write-off")), f"/finance/organizations/{org}/grant/",
        f"/finance/organizations/{org}/item/", "/finance/close/"]


# --- who ---------------------------------------------------------------------------------------

def test_nobody_but_platform_finance_finds_the_pages(client, ledger):
    org_owner = MembershipFactory(organization=ledger["usd"], role=Role.OWNER).user
    org_finance = MembershipFactory(organization=ledger["usd"], role=Role.FINANCE).user
    staff = UserFactory(is_staff=True)
    for user in (None, org_owner, org_finance, staff):
        if user is None:
            client.logout()
        else:
            client.force_login(user)
        for path in pages(ledger):
            assert client.get(path).status_code == 404, (user, path)
        for path in operation_posts(ledger):
            assert client.post(path, {"reason": "x", "idempotency_key": "k"}
                               ).status_code == 404, (user, path)
    # the org's own finance member still reads the org's invoices in the console
    client.force_login(org_finance)
    assert client.get("/console/invoices/").status_code == 200


def test_an_analyst_reads_everything_and_operates_nothing(analyst, ledger):
    invoice = ledger["usd_invoice"]
    for path in pages(ledger)[:-1]:
        response = analyst.get(path, follow=True)
        assert response.status_code == 200, path
        assert b'name="idempotency_key"' not in response.content, path
    # the close page is an operation: not there for an analyst, nor in the navigation
    assert analyst.get("/finance/close/").status_code == 404
    assert b"Close period" not in analyst.get("/finance/invoices/").content

    # when the analyst forges every operation's POST (with a valid-looking body)
    audits = AuditEvent.objects.count()
    for path in operation_posts(ledger):
        response = analyst.post(path, {
            "reason": "forged", "idempotency_key": "0" * 32, "reference": "TR-1",
            "amount": "1.00", "outcome": "credit_balance", "kind": "promotional",
            "description": "fee", "step": "run"})
        assert response.status_code == 404, path

    # then nothing changed
    invoice.refresh_from_db()
    assert (invoice.status, invoice.amount_due) == ("open", Decimal("6.0000"))
    assert AuditEvent.objects.count() == audits
    assert not CreditGrant.objects.exists() and not PendingInvoiceItem.objects.exists()


def test_a_finance_user_without_an_organization_lands_on_finance(client, ledger):
    client.force_login(finance_user(ANALYST_GROUP))
    response = client.get("/console/")
    assert response.status_code == 302 and response.url == "/finance/"
    assert b'href="/finance/"' in client.get("/finance/", follow=True).content


# --- reports -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", REPORTS)
def test_each_report_page_has_a_chart_and_its_csv_equals_its_table(analyst, ledger, name):
    page = analyst.get(f"/finance/reports/{name}/?start=2026-10-01&end=2026-12-01")
    assert page.status_code == 200
    html = page.content.decode()
    # the chart's data is a json_script block and its canvas names it (no inline script)
    assert '<canvas id="chart" data-chart="chart-data"' in html
    assert '<script id="chart-data" type="application/json">' in html
    assert "vendor/chartjs/chart.umd.min.js" in html and "finance_charts.js" in html
    table = Tables(html).tables["report-table"]

    csv_link = re.search(r'id="csv-link" href="([^"]+)"', html).group(1).replace("&amp;", "&")
    exported = analyst.get(f"/finance/reports/{name}/{csv_link}")
    assert exported.status_code == 200 and exported["Content-Type"] == "text/csv"
    rows = list(csv.reader(io.StringIO(exported.content.decode())))
    assert rows[0] == table[0]
    body = table[1:] if table[1:] != [["Nothing in this range."]] else []
    assert rows[1:] == body


@pytest.mark.parametrize("table", ["top", "months", "movements"])
def test_customers_page_shows_and_exports_the_table_asked_for(analyst, ledger, table):
    query = f"start=2026-10-01&end=2026-12-01&table={table}"
    html = analyst.get(f"/finance/reports/customers/?{query}").content.decode()
    shown = Tables(html).tables["report-table"]
    exported = analyst.get(f"/finance/reports/customers/?{query}&format=csv")
    assert list(csv.reader(io.StringIO(exported.content.decode()))) == shown
    expected_header = {"top": "organization", "months": "month", "movements": "month"}
    assert shown[0][0] == expected_header[table]
    assert len(shown) > 1  # the two October invoices make customers, months and movements
    assert "chart-data" in html


def test_revenue_page_shows_each_currencys_billed_total(analyst, ledger):
    html = analyst.get("/finance/reports/revenue/?start=2026-10-01&end=2026-11-01"
                       ).content.decode()
    header, *rows = Tables(html).tables["totals"]
    billed = {r[header.index("currency")]: r[header.index("billed")] for r in rows}
    assert billed == {"USD": "6.00", "EUR": "1.80"}  # the two October invoices' totals


@pytest.mark.parametrize(("query", "message"), [
    ("start=2026-13-01", "start: Date has wrong format"),
    ("start=2026-11-01&end=2026-10-01", "end: Must be after start."),
    ("start=1999-01-01&end=2026-01-01", "start: Must be between"),
    ("start=2010-01-01&end=2026-01-01", "at most"),
    ("unit=fortnight", "unit: "),
    ("currency=US", "currency: "),
    ("organization=org_doesnotexist", "organization: No such organization."),
    ("organization=" + "x" * 5000, "organization: "),
    ("service_tier=%00", "service_tier: "),
])
def test_malformed_revenue_filters_are_form_messages(analyst, query, message):
    response = analyst.get(f"/finance/reports/revenue/?{query}")
    assert response.status_code == 400
    html = response.content.decode()
    assert 'id="filter-errors"' in html and message in html.replace("&quot;", '"')
    assert 'id="report-table"' not in html


def test_receivables_filters_and_csv_refuse_malformed_input(analyst):
    for query in ("bucket=1000", "stage=x", "limit=0", "limit=100000", "offset=-1"):
        response = analyst.get(f"/finance/reports/receivables/?{query}&format=csv")
        assert response.status_code == 400, query
        assert response["Content-Type"].startswith("text/html"), query
    assert analyst.get("/finance/reports/nope/").status_code == 404


def test_receivables_lists_the_open_invoices_with_their_aging(analyst, ledger):
    html = analyst.get("/finance/reports/receivables/").content.decode()
    header, *rows = Tables(html).tables["report-table"]
    by_number = {r[header.index("number")]: r for r in rows}
    assert set(by_number) == {ledger["usd_invoice"].number, ledger["eur_invoice"].number}
    usd = by_number[ledger["usd_invoice"].number]
    assert usd[header.index("amount_due")] == "6.00"
    assert usd[header.index("bucket")] == "0-30"  # due Nov 15, as of Dec


# --- operations --------------------------------------------------------------------------------

def _post_op(client, invoice, op, **data):
    page = client.get(f"/finance/invoices/{invoice.public_id}/").content.decode()
    data.setdefault("idempotency_key", form_key(page, f"op-{op}"))
    return client.post(f"/finance/invoices/{invoice.public_id}/{op}/", data)


def test_void_runs_once_per_form_and_is_audited_with_the_reason(controller, ledger):
    invoice = ledger["eur_invoice"]
    page = controller.get(f"/finance/invoices/{invoice.public_id}/").content.decode()
    key = form_key(page, "op-void")

    # when the controller sends the void form twice (a double click)
    first = controller.post(f"/finance/invoices/{invoice.public_id}/void/",
                            {"reason": "duplicate account", "idempotency_key": key})
    second = controller.post(f"/finance/invoices/{invoice.public_id}/void/",
                             {"reason": "duplicate account", "idempotency_key": key},
                             follow=True)

    # then it is void once, audited once by the controller with the reason
    assert first.status_code == 302
    invoice.refresh_from_db()
    assert invoice.status == "void"
    rows = AuditEvent.objects.filter(action="invoice.void", target=invoice.public_id)
    assert rows.count() == 1 and rows[0].actor_user_id == controller.user.pk
    assert "duplicate account" in str(rows[0].after)
    assert "already sent" in second.content.decode()


def test_operation_forms_refuse_hostile_input_with_form_messages(controller, ledger):
    invoice = ledger["usd_invoice"]
    audits, notes = AuditEvent.objects.count(), Invoice.objects.filter(
        kind="credit_note").count()
    cases = [
        ("credit-note", {"reason": "x", "amount": "abc"}, "Enter a number."),
        ("credit-note", {"reason": "x", "amount": "-5"}, "greater than or equal to 0.01"),
        ("credit-note", {"reason": "x", "amount": "1e999"}, "less than or equal to"),
        ("credit-note", {"reason": "x", "amount": "9999"}, "cannot exceed what remains"),
        ("credit-note", {"reason": "x"}, "Give an amount, or tick the lines"),
        ("credit-note", {"reason": "x", "amount": "1", "lines": ["1"]}, "not both"),
        ("credit-note", {"reason": "x", "lines": ["999"]}, "Select a valid choice"),
        ("credit-note", {"reason": "   ", "amount": "1"}, "This field is required."),
        ("mark-paid", {"reason": "x", "reference": ""}, "This field is required."),
        ("mark-paid", {"reason": "x", "reference": "r" * 201}, "at most 200 characters"),
        ("void", {"reason": "r" * 501}, "at most 500 characters"),
        ("void", {"reason": "x", "idempotency_key": ""}, "This field is required."),
        ("void", {"reason": "x", "idempotency_key": "k" * 300}, "at most 255 characters"),
    ]
    for op, data, message in cases:
        response = _post_op(controller, invoice, op, **data)
        assert response.status_code == 400, (op, data)
        assert message in response.content.decode().replace("&#x27;", "'"), (op, data)
    invoice.refresh_from_db()
    assert (invoice.status, invoice.amount_due) == ("open", Decimal("6.0000"))
    assert AuditEvent.objects.count() == audits
    assert Invoice.objects.filter(kind="credit_note").count() == notes


def test_forged_ids_and_operations_are_404s_or_refusals(controller, ledger):
    invoice = ledger["usd_invoice"]
    assert controller.get("/finance/invoices/in_nope/").status_code == 404
    assert controller.post("/finance/invoices/in_nope/void/",
                           {"reason": "x", "idempotency_key": "a"}).status_code == 404
    assert controller.post(f"/finance/invoices/{invoice.public_id}/explode/",
                           {"reason": "x", "idempotency_key": "a"}).status_code == 404
    assert controller.get(f"/finance/invoices/{invoice.public_id}/void/").status_code == 405
    assert controller.post("/finance/organizations/org_nope/grant/",
                           {"reason": "x"}).status_code == 404
    # an operation the invoice's status does not allow (its form is not offered): the
    # service's refusal is the form's message, and nothing is done
    services.invoice_mark_paid(invoice=invoice, reference="T1", acting_user=None)
    page = controller.get(f"/finance/invoices/{invoice.public_id}/").content.decode()
    assert 'id="op-void"' not in page and 'id="op-credit-note"' in page
    audits = AuditEvent.objects.count()
    for op, refusal in (("void", "A paid invoice cannot be voided."),
                        ("write-off", f"Invoice {invoice.number} is paid; this applies to"),
                        ("pause-dunning", f"Invoice {invoice.number} is paid; this applies to"),
                        ("mark-paid", "A paid invoice cannot be paid.")):
        response = controller.post(f"/finance/invoices/{invoice.public_id}/{op}/", {
            "reason": "x", "reference": "T2", "idempotency_key": op * 4})
        assert response.status_code == 400, op
        form = response.content.decode().split(f'id="op-{op}"')[1].split("</form>")[0]
        assert refusal in form, op
    invoice.refresh_from_db()
    assert invoice.status == "paid" and AuditEvent.objects.count() == audits


def test_credit_note_on_an_open_invoice_reduces_what_is_due(controller, ledger):
    invoice = ledger["usd_invoice"]
    response = _post_op(controller, invoice, "credit-note", reason="goodwill for an outage",
                        amount="2.40")
    assert response.status_code == 302
    invoice.refresh_from_db()
    assert invoice.amount_due == Decimal("3.6000")
    note = Invoice.objects.get(kind="credit_note", corrects=invoice)
    assert note.total == Decimal("-2.4000") and note.memo == "goodwill for an outage"
    page = controller.get(response.url).content.decode()
    assert f"Credit note {note.number} for 2.40 USD" in page and note.number in page


def test_mark_paid_pause_resume_and_write_off_from_their_forms(controller, ledger):
    usd, eur = ledger["usd_invoice"], ledger["eur_invoice"]
    assert _post_op(controller, usd, "pause-dunning", reason="customer disputes usage"
                    ).status_code == 302
    usd.refresh_from_db()
    assert usd.dunning_paused_at is not None
    page = controller.get(f"/finance/invoices/{usd.public_id}/").content.decode()
    assert 'id="op-resume-dunning"' in page and 'id="op-pause-dunning"' not in page
    assert _post_op(controller, usd, "resume-dunning", reason="resolved").status_code == 302
    assert _post_op(controller, usd, "mark-paid", reason="wire received",
                    reference="BANK-REF-778").status_code == 302
    usd.refresh_from_db()
    assert (usd.status, usd.payment_reference) == ("paid", "BANK-REF-778")

    assert _post_op(controller, eur, "write-off", reason="company dissolved").status_code == 302
    eur.refresh_from_db()
    assert eur.status == "uncollectible" and eur.written_off_at is not None
    actions = set(AuditEvent.objects.filter(actor_user=controller.user)
                  .values_list("action", flat=True))
    assert actions >= {"invoice.dunning_pause", "invoice.dunning_resume", "invoice.mark_paid",
                       "invoice.write_off"}


def test_grant_and_one_off_item_from_the_organization_page(controller, ledger):
    org = ledger["eur"]
    page = controller.get(f"/finance/organizations/{org.public_id}/").content.decode()
    grant_key, item_key = form_key(page, "op-grant"), form_key(page, "op-item")
    for _ in range(2):  # sent twice: granted once
        response = controller.post(f"/finance/organizations/{org.public_id}/grant/", {
            "reason": "launch promotion", "kind": "promotional", "amount": "25.00",
            "expires_on": "2027-06-30", "idempotency_key": grant_key})
        assert response.status_code == 302
    (grant,) = CreditGrant.objects.filter(organization=org)
    # the same form key with other values is refused, granting nothing more
    again = controller.post(f"/finance/organizations/{org.public_id}/grant/", {
        "reason": "launch promotion", "kind": "promotional", "amount": "30.00",
        "expires_on": "2027-06-30", "idempotency_key": grant_key})
    assert again.status_code == 400
    assert "already sent with other values" in again.content.decode()
    assert CreditGrant.objects.filter(organization=org).count() == 1
    assert (grant.amount, grant.currency, grant.expires_at.date().isoformat()) == (
        Decimal("25.00"), "EUR", "2027-06-30")
    response = controller.post(f"/finance/organizations/{org.public_id}/item/", {
        "reason": "contract", "description": "Onboarding fee", "amount": "150.00",
        "idempotency_key": item_key})
    assert response.status_code == 302
    (item,) = PendingInvoiceItem.objects.filter(organization=org)
    assert (item.description, item.amount, item.invoice_id) == (
        "Onboarding fee", Decimal("150.0000"), None)

    # hostile input: a form message each, nothing granted
    for data, message in [
        ({"kind": "purchased", "amount": "5"}, "Select a valid choice"),
        ({"kind": "promotional", "amount": "0"}, "greater than or equal to 0.01"),
        ({"kind": "promotional", "amount": "5", "expires_on": "2020-01-01"}, "in the future"),
        ({"kind": "promotional", "amount": "5", "expires_on": "tomorrow"}, "Enter a valid date"),
    ]:
        response = controller.post(f"/finance/organizations/{org.public_id}/grant/", {
            "reason": "x", "idempotency_key": "z" * 32, **data})
        assert response.status_code == 400 and message in response.content.decode(), data
    assert CreditGrant.objects.filter(organization=org).count() == 1


def test_close_preview_writes_nothing_and_the_close_runs_once(controller, ledger):
    # given November ended without its invoices
    invoices, keys = Invoice.objects.count(), IdempotentRequest.objects.count()
    org = ledger["usd"]
    record(org, "u-nov", NOV + timedelta(days=3), prompt_tokens=1_000_000)

    # when the controller previews the close of one organization
    preview = controller.post("/finance/close/", {"step": "preview",
                                                  "organization": org.public_id})
    html = preview.content.decode()
    assert preview.status_code == 200 and "would create 1 invoice" in html
    assert "1.20 USD" in html  # 1M input tokens at 1.00, plus 20 % tax
    assert Invoice.objects.count() == invoices and IdempotentRequest.objects.count() == keys

    # and runs it, twice with the same form
    key = form_key(html, "op-close")
    for _ in range(2):
        response = controller.post("/finance/close/", {
            "step": "run", "organization": org.public_id, "reason": "month end",
            "idempotency_key": key}, follow=True)
        assert response.status_code == 200
    assert "Closed: 1 invoice(s) created (1.20 USD)" in response.content.decode()
    assert Invoice.objects.count() == invoices + 1
    assert AuditEvent.objects.filter(action="period.close").count() == 1

    # hostile: an unknown organization, a run without a reason, a step that is not one
    bad = controller.post("/finance/close/", {"step": "preview", "organization": "org_x"})
    assert bad.status_code == 400 and "No organization org_x" in bad.content.decode()
    bad = controller.post("/finance/close/", {"step": "run", "reason": "",
                                              "idempotency_key": "q" * 32})
    assert bad.status_code == 400 and "This field is required." in bad.content.decode()
    assert controller.post("/finance/close/", {"step": "boom"}).status_code == 400
    assert Invoice.objects.count() == invoices + 1


def test_credit_note_by_lines_and_on_a_paid_invoice_as_credit_balance(controller, ledger):
    eur = ledger["eur_invoice"]
    line = eur.lines.get(position=1)
    assert _post_op(controller, eur, "credit-note", reason="wrong model billed",
                    lines=["1"]).status_code == 302
    eur.refresh_from_db()
    assert eur.amount_due == eur.total - line.amount

    # a paid invoice (by bank transfer): finance chooses; a refund needs a Stripe payment
    usd = ledger["usd_invoice"]
    services.invoice_mark_paid(invoice=usd, reference="T9", acting_user=None)
    page = controller.get(f"/finance/invoices/{usd.public_id}/").content.decode()
    assert 'name="outcome" value="refund"' in page
    refused = _post_op(controller, usd, "credit-note", reason="x", amount="1.00",
                       outcome="refund")
    assert refused.status_code == 400
    assert "was not paid through Stripe" in refused.content.decode()
    missing = _post_op(controller, usd, "credit-note", reason="x", amount="1.00")
    assert missing.status_code == 400 and "This field is required." in missing.content.decode()
    assert _post_op(controller, usd, "credit-note", reason="goodwill", amount="1.00",
                    outcome="credit_balance").status_code == 302
    (grant,) = CreditGrant.objects.filter(organization=usd.organization)
    assert (grant.kind, grant.amount) == ("credit_note", Decimal("1.00"))


def test_retry_charges_now_only_with_a_card_on_file(controller, ledger, stripe_settings):
    invoice = ledger["usd_invoice"]
    # no payment method: the form says what to do, nothing is scheduled
    refused = _post_op(controller, invoice, "retry", reason="customer asked")
    assert refused.status_code == 400 and "has no payment method on file" in (
        refused.content.decode())
    invoice.refresh_from_db()
    assert invoice.next_payment_attempt_at is None

    # with a card: the charge is scheduled now, audited with the reason
    from tests.invoicing.test_invoice_payments import _set_default_card

    _set_default_card(invoice.organization, "pm_card_visa")
    assert _post_op(controller, invoice, "retry", reason="customer asked").status_code == 302
    invoice.refresh_from_db()
    assert invoice.next_payment_attempt_at is not None
    (row,) = AuditEvent.objects.filter(action="invoice.retry_charge", target=invoice.public_id)
    assert row.actor_user_id == controller.user.pk and row.after["reason"] == "customer asked"


def test_invoice_search_finds_across_organizations_and_refuses_unknown_choices(analyst,
                                                                                ledger):
    usd, eur = ledger["usd_invoice"], ledger["eur_invoice"]
    listed = Tables(analyst.get("/finance/invoices/").content.decode()).tables["invoices"]
    assert {r[0] for r in listed[1:]} == {usd.number, eur.number}
    by_org = analyst.get(f"/finance/invoices/?organization={eur.organization.public_id}")
    assert [r[0] for r in Tables(by_org.content.decode()).tables["invoices"][1:]] == [
        eur.number]
    for query in ("status=draft", "status=%3Cscript%3E", "kind=refund"):
        response = analyst.get(f"/finance/invoices/?{query}")
        assert response.status_code == 400 and b"must be one of" in response.content, query
        assert b"<script>" not in response.content
    huge = analyst.get("/finance/invoices/?number=" + "9" * 10_000)
    assert huge.status_code == 200 and b"No invoice matches." in huge.content
