"""Console invoice pages: list with the upcoming invoice, HTML/PDF/CSV, billing roles only."""

from __future__ import annotations

from datetime import timedelta

import pytest

from billing_platform.accounts.choices import Role
from billing_platform.invoicing import services
from billing_platform.invoicing.models import Invoice
from tests.factories import MembershipFactory, UserFactory, make_billed_org
from tests.invoicing.conftest import NOV, OCT, record


@pytest.fixture
def finance_client(catalog, client):
    org = make_billed_org(name="Console Co")
    record(org, "k1", OCT + timedelta(days=5), prompt_tokens=3_000_000)
    services.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False)
    user = UserFactory()
    MembershipFactory(user=user, organization=org, role=Role.FINANCE)
    client.force_login(user)
    return client, Invoice.objects.get(organization=org)


def test_finance_sees_invoices_and_downloads_them(finance_client):
    client, invoice = finance_client
    page = client.get("/console/invoices/")
    assert page.status_code == 200
    assert invoice.number in page.content.decode() and "Upcoming invoice" in page.content.decode()
    html = client.get(f"/console/invoices/{invoice.public_id}/")
    assert html.status_code == 200 and "3.00" in html.content.decode()
    pdf = client.get(f"/console/invoices/{invoice.public_id}/pdf/")
    assert pdf.status_code == 200 and pdf.content.startswith(b"%PDF")
    csv_page = client.get(f"/console/invoices/{invoice.public_id}/csv/")
    assert csv_page.status_code == 200 and invoice.number in csv_page.content.decode()
    assert client.get("/console/invoices/upcoming/").status_code == 200


def test_developers_and_other_orgs_cannot_see_invoices(finance_client):
    client, invoice = finance_client
    outsider = UserFactory()
    MembershipFactory(user=outsider, organization=make_billed_org(), role=Role.OWNER)
    client.force_login(outsider)
    assert client.get(f"/console/invoices/{invoice.public_id}/").status_code == 404

    developer = UserFactory()
    MembershipFactory(user=developer, organization=invoice.organization, role=Role.DEVELOPER)
    client.force_login(developer)
    # a fresh session: the developer's only org is the invoice's org
    assert client.get("/console/invoices/").status_code == 302
