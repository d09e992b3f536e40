"""Invoice documents and the API: PDF text, CSV sums, list/detail/upcoming, org scoping."""

from __future__ import annotations

import csv
import io
from datetime import timedelta
from decimal import Decimal

import pytest
from pypdf import PdfReader

from billing_platform.accounts.choices import Role
from billing_platform.invoicing import rendering, services
from billing_platform.invoicing.choices import LineKind
from billing_platform.invoicing.models import Invoice, InvoiceLine
from tests.factories import MembershipFactory, UserFactory, make_billed_org
from tests.invoicing.conftest import NOV, OCT, record


@pytest.fixture
def invoiced(catalog):
    org = make_billed_org(name="Docs Co", tax_rate="0.1000")
    record(org, "d1", OCT + timedelta(days=1), prompt_tokens=1_234_567,
           cached_tokens=234_567, completion_tokens=345_678)
    record(org, "d2", OCT + timedelta(days=2), service_tier="priority",
           prompt_tokens=765_432, completion_tokens=12_345)
    services.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False)
    return Invoice.objects.get(organization=org)


def test_pdf_shows_the_number_lines_and_total(invoiced):
    pdf = rendering.invoice_pdf(invoiced, invoiced.organization)
    text = " ".join(page.extract_text() for page in PdfReader(io.BytesIO(pdf)).pages)
    assert invoiced.number in text
    assert "Docs Co" in text
    assert f"{invoiced.total:,.2f}" in text and "USD" in text
    for line in invoiced.lines.all():
        assert f"{line.amount:,.2f}" in text
    assert "priority" in text


def test_csv_sums_to_the_total(invoiced):
    rows = list(csv.DictReader(io.StringIO(rendering.invoice_csv(invoiced))))
    assert len(rows) == invoiced.lines.count() >= 3  # two usage lines and tax
    assert sum(Decimal(r["amount"]) for r in rows) == invoiced.total
    assert {r["invoice"] for r in rows} == {invoiced.number}


def test_api_list_detail_pdf_csv_and_upcoming(invoiced, api_client):
    org = invoiced.organization
    finance = UserFactory()
    MembershipFactory(user=finance, organization=org, role=Role.FINANCE)
    api_client.force_authenticate(finance)
    base = f"/api/v1/organizations/{org.public_id}/invoices/"

    listing = api_client.get(base)
    assert listing.status_code == 200
    assert [i["number"] for i in listing.json()["data"]] == [invoiced.number]
    detail = api_client.get(f"{base}{invoiced.public_id}/").json()
    assert Decimal(detail["total"]) == invoiced.total
    assert sum(Decimal(ln["amount"]) for ln in detail["lines"]) == invoiced.total
    pdf = api_client.get(f"{base}{invoiced.public_id}/pdf/")
    assert pdf.status_code == 200 and pdf["Content-Type"] == "application/pdf"
    assert pdf.content.startswith(b"%PDF")
    assert api_client.get(f"{base}{invoiced.public_id}/csv/").status_code == 200

    record(org, "d3", NOV + timedelta(days=1), prompt_tokens=2_000_000)
    upcoming = api_client.get("/api/v1/invoices/upcoming", {"organization": org.public_id})
    assert upcoming.status_code == 200
    body = upcoming.json()
    assert body["period_start"].startswith("2026-11-01")
    assert Decimal(body["total"]) == Decimal("2.20")  # 2.00 + 10 % tax


def test_other_orgs_and_non_billing_roles_see_nothing(invoiced, api_client):
    org = invoiced.organization
    outsider = UserFactory()
    MembershipFactory(user=outsider, organization=make_billed_org(), role=Role.OWNER)
    api_client.force_authenticate(outsider)
    base = f"/api/v1/organizations/{org.public_id}/invoices/"
    assert api_client.get(base).status_code == 404
    assert api_client.get(f"{base}{invoiced.public_id}/").status_code == 404

    developer = UserFactory()
    MembershipFactory(user=developer, organization=org, role=Role.DEVELOPER)
    api_client.force_authenticate(developer)
    assert api_client.get(base).status_code == 403


def test_a_stored_draft_is_no_document_on_the_api(catalog, api_client):
    # given a draft being prepared by hand (its numbers may still change; no number yet)
    org = make_billed_org(name="Draft Co")
    draft = Invoice.objects.create(organization=org, currency="USD", period_start=OCT,
                                   period_end=NOV)
    InvoiceLine.objects.create(invoice=draft, position=1, kind=LineKind.ADJUSTMENT,
                               description="Onboarding", amount_precise=Decimal("10.00"),
                               amount=Decimal("10.00"))
    owner = UserFactory()
    MembershipFactory(user=owner, organization=org, role=Role.OWNER)
    api_client.force_authenticate(owner)
    base = f"/api/v1/organizations/{org.public_id}/invoices/"

    # then the API serves it as no document at all: not listed, and 404 as JSON, PDF and CSV
    assert api_client.get(base).json()["data"] == []
    for suffix in ("", "pdf/", "csv/"):
        reply = api_client.get(f"{base}{draft.public_id}/{suffix}")
        assert reply.status_code == 404, suffix
    # once finalized it is
    services.invoice_finalize(invoice=draft, enqueue_payment=False)
    assert api_client.get(f"{base}{draft.public_id}/pdf/").status_code == 200


# --- the document's layout ---------------------------------------------------------------------

SELLER = {"SELLER_NAME": "Tollgate Networks Ltd", "SELLER_TAX_ID": "GB123456789",
          "SELLER_ADDRESS": ["1 Long Acre", "London WC2E 9LH", "United Kingdom"],
          "SELLER_EMAIL": "billing@tollgate.example"}


@pytest.fixture
def twelve_lines(catalog, settings):
    """An October invoice of twelve usage lines: 2 models x 2 tiers x 3 token classes, for a
    buyer with a billing profile, at 20 % tax with a 5.00 promotional credit."""
    from billing_platform.accounts import billing_profile
    from plans import services as plan_services

    for name, value in SELLER.items():
        setattr(settings, name, value)
    org = make_billed_org(name="Twelve Co", tax_rate="0.2000")
    billing_profile.organization_billing_profile_update(
        organization=org, acting_user=None, legal_name="Twelve Lines GmbH",
        address_line1="Invalidenstr. 117", postal_code="10115", city="Berlin", country="DE",
        tax_id="DE123456789", billing_email="ap@twelve.example")
    plan_services.credit_grant_create(organization=org, kind="promotional", amount="5.00",
                                      granted_at=OCT)
    n = 0
    for model in ("m-small", "m-big"):
        for tier in ("default", "priority"):
            n += 1
            record(org, f"tw{n}", OCT + timedelta(days=n), model=model, service_tier=tier,
                   prompt_tokens=1_000_000 * n, cached_tokens=250_000 * n,
                   completion_tokens=100_000 * n)
    services.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False)
    invoice = Invoice.objects.get(organization=org)
    assert invoice.lines.filter(kind=LineKind.USAGE).count() == 12
    return invoice


def _pdf_text(invoice) -> tuple[int, str]:
    reader = PdfReader(io.BytesIO(rendering.invoice_pdf(invoice, invoice.organization)))
    return len(reader.pages), "\n".join(page.extract_text() for page in reader.pages)


def test_twelve_lines_fit_one_a4_page_laid_out_as_an_invoice(twelve_lines):
    invoice = twelve_lines
    pages, text = _pdf_text(invoice)

    assert pages == 1
    # seller and buyer
    for part in ("Tollgate Networks Ltd", "1 Long Acre", "London WC2E 9LH", "GB123456789",
                 "Twelve Lines GmbH", "Invalidenstr. 117", "10115 Berlin", "DE123456789",
                 "ap@twelve.example"):
        assert part in text, part
    # number and dates
    assert invoice.number in text
    assert f"{invoice.finalized_at:%Y-%m-%d}" in text and f"{invoice.due_at:%Y-%m-%d}" in text
    assert "2026-10-01 to 2026-10-31" in text
    # lines grouped by model, the unit named once per model, each token class once per group
    assert text.count("per 1M tokens") == 2 + 1  # each model's heading, and the footnote
    assert text.count("m-small") == 1 and text.count("m-big") == 1
    assert text.count("cached input") == 4  # one per model x tier group, not under every line
    assert text.count("1 request") == 4  # the request count once per group
    for line in invoice.lines.filter(kind=LineKind.USAGE):
        assert f"{line.amount:,.2f}" in text
        assert f"{int(line.quantity):,} tokens" in text


def test_the_documents_numbers_are_the_invoices(twelve_lines):
    invoice = twelve_lines
    _, text = _pdf_text(invoice)
    html = rendering.invoice_html(invoice, invoice.organization)
    tax_line = invoice.lines.get(kind=LineKind.TAX)
    # subtotal, the credit before tax, the tax line with its rate and base, total, amount due
    assert invoice.credits_applied == Decimal("5.00")
    assert tax_line.amount == invoice.tax == (
        (invoice.subtotal - Decimal("5.00")) * Decimal("0.2")).quantize(Decimal("0.01"))
    expected = [f"Subtotal {invoice.subtotal:,.2f}", "Credits applied before tax -5.00",
                f"Tax 20 % on {invoice.subtotal - Decimal('5.00'):,.2f} {invoice.tax:,.2f}",
                f"Total {invoice.total:,.2f} USD", f"Amount due {invoice.amount_due:,.2f} USD"]
    flat = " ".join(text.split())
    for figure in expected:
        assert figure in flat, figure
    assert invoice.total == invoice.subtotal - Decimal("5.00") + invoice.tax
    # the HTML is the same document
    for figure in (f"{invoice.subtotal:,.2f}", f"{invoice.tax:,.2f}", f"{invoice.total:,.2f}",
                   "Tax 20 % on", "per 1M tokens", "Twelve Lines GmbH", "GB123456789"):
        assert figure in html, figure


def test_a_paid_invoice_shows_nothing_due_and_a_refund(twelve_lines):
    invoice = twelve_lines
    services.invoice_mark_paid(invoice=invoice, acting_user=None)
    invoice.refresh_from_db()
    doc = rendering.document_of(invoice, invoice.organization)
    assert (doc.amount_paid, doc.amount_due) == (f"{invoice.total:,.2f}", "0.00")
