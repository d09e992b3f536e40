"""``/api/v1/finance/`` reports over HTTP: who may read them (a platform finance permission,
404 for everyone else), the CSV equals the JSON table, and bad parameters are DRF 400s."""

from __future__ import annotations

import csv
import io

import pytest
from rest_framework.test import APIClient

from billing_platform.accounts.choices import Role
from tests.factories import MembershipFactory, UserFactory, make_key
from tests.finance.test_reports import ledger  # noqa: F401 - the ledger the reports read
from tests.invoicing.conftest import DEC, OCT

pytestmark = pytest.mark.django_db

ENDPOINTS = ("revenue", "receivables", "credits", "customers")


def _url(name: str) -> str:
    return f"/api/v1/finance/{name}/"


def _signed_in(user) -> APIClient:
    client = APIClient()
    client.force_login(user)
    return client


def _outsiders() -> dict[str, APIClient]:
    """Everyone who is not platform finance: each must get 404 (nothing says it exists)."""
    owner = MembershipFactory(role=Role.OWNER)
    finance_member = MembershipFactory(role=Role.FINANCE)
    admin_member = MembershipFactory(role=Role.ADMIN)
    from tests.factories import ProjectFactory

    _, secret = make_key(ProjectFactory(organization=owner.organization),
                         scopes=["inference", "admin", "usage:read"])
    key_client = APIClient()
    key_client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    return {"anonymous": APIClient(), "org owner": _signed_in(owner.user),
            "org finance member": _signed_in(finance_member.user),
            "org admin": _signed_in(admin_member.user),
            "staff without the group": _signed_in(UserFactory(is_staff=True)),
            "an org's admin API key": key_client}


@pytest.mark.parametrize("name", ENDPOINTS)
def test_everyone_but_platform_finance_gets_404(name):
    for who, client in _outsiders().items():
        for query in ("", "?format=csv", "?start=2026-01-01&end=2026-02-01"):
            reply = client.get(_url(name) + query)
            assert reply.status_code == 404, (who, query, reply.status_code)
            assert reply.json() == {"detail": "Not found."}, who


@pytest.mark.parametrize("name", ENDPOINTS)
def test_an_analyst_and_a_controller_read_every_report(name, analyst_client, controller_client):
    for client in (analyst_client, controller_client):
        reply = client.get(_url(name))
        assert reply.status_code == 200, reply.content
        body = reply.json()
        assert (body["object"], body["report"], body["data"]) == ("finance_report", name, [])


def _csv(reply) -> list[list[str]]:
    assert reply.status_code == 200, reply.content
    assert reply["Content-Type"].startswith("text/csv")
    return list(csv.reader(io.StringIO(reply.content.decode())))


def _as_cells(rows: list[dict]) -> list[list[str]]:
    return [["" if v is None else str(v) for v in row.values()] for row in rows]


@pytest.mark.parametrize(("name", "query"), [
    ("revenue", {}), ("revenue", {"currency": "usd", "token_class": "input"}),
    ("receivables", {}), ("credits", {"start": "2026-10-01", "end": "2026-12-01"}),
    ("customers", {}), ("customers", {"table": "months"}),
    ("customers", {"table": "movements"}),
])
def test_the_csv_is_the_json_table(ledger, analyst_client, name, query):  # noqa: F811
    query = {"start": OCT.date().isoformat(), "end": DEC.date().isoformat(), **query}
    body = analyst_client.get(_url(name), query).json()
    table = _csv(analyst_client.get(_url(name), {**query, "format": "csv"}))
    assert body["data"], "the ledger has rows for this report"
    assert table[0] == list(body["data"][0])
    assert table[1:] == _as_cells(body["data"])


def test_revenue_over_http_is_the_reports_figures(ledger, analyst_client):  # noqa: F811
    body = analyst_client.get(_url("revenue"), {"start": "2026-10-01", "end": "2026-12-01",
                                                "organization": ledger.a.public_id}).json()
    assert body["filter"]["organization"] == ledger.a.public_id
    assert [(t["period"], t["currency"], t["billed"], t["accrued"]) for t in body["totals"]] == [
        ("2026-10-01", "USD", "2.00", "0.00"), ("2026-11-01", "USD", "0.00", "0.20")]
    receivables = analyst_client.get(_url("receivables"), {"limit": 1}).json()
    assert (receivables["count"], len(receivables["data"]), receivables["has_more"]) == (
        3, 1, True)
    assert {s["currency"]: s["open"] for s in receivables["summaries"]} == {
        "USD": "2.50", "EUR": "2.70"}


@pytest.mark.parametrize(("name", "query", "field"), [
    ("revenue", {"start": "2026-13-01"}, "start"),
    ("revenue", {"start": "yesterday"}, "start"),
    ("revenue", {"start": "2026-03-01", "end": "2026-02-01"}, "end"),
    ("revenue", {"start": "2026-03-01", "end": "2026-03-01"}, "end"),
    ("revenue", {"start": "2000-01-01", "end": "2099-01-01"}, "end"),  # past 5 years
    ("revenue", {"start": "1066-10-14", "end": "1066-10-15"}, "start"),
    ("revenue", {"unit": "week"}, "unit"),
    ("revenue", {"currency": "US"}, "currency"),
    ("revenue", {"currency": "U$D"}, "currency"),
    ("revenue", {"organization": "org_doesnotexist"}, "organization"),
    ("revenue", {"organization": "x" * 500}, "organization"),
    ("revenue", {"token_class": "cache_write"}, "token_class"),
    ("revenue", {"plan_kind": "free"}, "plan_kind"),
    ("revenue", {"model": "m" * 201}, "model"),
    ("receivables", {"limit": "0"}, "limit"),
    ("receivables", {"limit": "100000"}, "limit"),
    ("receivables", {"offset": "-1"}, "offset"),
    ("receivables", {"bucket": "120+"}, "bucket"),
    ("receivables", {"stage": "hopeless"}, "stage"),
    ("credits", {"kind": "gift"}, "kind"),
    ("customers", {"limit": "abc"}, "limit"),
    ("customers", {"table": "everything"}, "table"),
    ("customers", {"organization": "org_x"}, "organization"),
])
def test_bad_parameters_are_drf_400s_naming_the_parameter(analyst_client, name, query, field):
    for fmt in ({}, {"format": "csv"}):  # a CSV request gets its error as JSON too
        reply = analyst_client.get(_url(name), {**query, **fmt})
        assert reply.status_code == 400, (query, reply.content)
        assert reply["Content-Type"].startswith("application/json")
        assert field in reply.json(), reply.json()


def test_an_unknown_format_is_a_404_and_the_schema_lists_every_report(analyst_client):
    assert analyst_client.get(_url("revenue"), {"format": "xml"}).status_code == 404
    schema = analyst_client.get("/api/v1/schema/", {"format": "json"}).json()
    for name in ENDPOINTS:
        operation = schema["paths"][f"/api/v1/finance/{name}/"]["get"]
        assert "text/csv" in operation["responses"]["200"]["content"]
        assert {"start", "end", "format"} <= {p["name"] for p in operation["parameters"]}
