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
