"""Console data-residency page: requests per region counted from the organization's own usage
events, judged by the zone recorded on each; the proof (CSV and JSON) states the same figures
as the page, lists every event outside its zone (or says none), and carries a digest anyone can
recompute; other organizations' events, forged parameters and roles without billing access get
nothing; a bad range is a form message."""

from __future__ import annotations

import csv
import hashlib
import io
import json
from datetime import UTC, datetime, timedelta
from html.parser import HTMLParser

import pytest

from billing_platform.accounts.choices import DataZone, Role
from engine_adapter.models import Pool
from metering import events, services
from tests.factories import MembershipFactory, OrganizationFactory, make_price_book

pytestmark = pytest.mark.django_db(transaction=True)

OCT = datetime(2026, 10, 1, tzinfo=UTC)
OCTOBER = {"start": "2026-10-01", "through": "2026-10-31"}
URL = "/console/residency/"


def record(org, request_id: str, region: str, *, at: datetime = OCT + timedelta(days=3),
           prompt: int = 100, completion: int = 10, **fields) -> None:
    """Record one usage event of ``org`` through the metering service (its zone, unless
    ``data_zone`` says otherwise, is filled from the org as ingest does)."""
    event = {"request_id": request_id, "org_id": org.id,
             "project_id": org.projects.order_by("id").first().id, "model": "res-model",
             "region": region, "event_time": at, "prompt_tokens": prompt,
             "cached_tokens": 0, "completion_tokens": completion, **fields}
    assert services.usage_events_record([events.normalize(event, check_age=False)],
                                        origin="test").recorded


def fleet() -> None:
    """Pools of the fleet: EU in eu-west and eu-central (one retired from the spec), US in
    us-east."""
    for name, region, zone, in_spec in (("res-eu-1", "eu-west", "eu", True),
                                        ("res-eu-2", "eu-central", "eu", False),
                                        ("res-us-1", "us-east", "us", True)):
        Pool.objects.create(name=name, model="res-model", region=region, zone=zone,
                            launch="sim", in_spec=in_spec)


@pytest.fixture
def world():
    """An EU org with October usage in its two EU regions and one event that reached no
    engine; another EU org and a US org with usage of their own in the same month."""
    make_price_book(prices=[{"model": "res-model", "input": "1.00", "output": "2.00"}])
    fleet()
    member = MembershipFactory(organization=OrganizationFactory(data_zone=DataZone.EU))
    org = member.organization
    org.projects.create(name="Main")
    for i in range(3):
        record(org, f"w{i}", "eu-west", prompt=100 + i, completion=10)
    for i in range(2):
        record(org, f"c{i}", "eu-central", prompt=50, completion=5)
    record(org, "n0", "", prompt=7, completion=0, status="engine_error")
    neighbour = MembershipFactory(organization=OrganizationFactory(data_zone=DataZone.EU))
    neighbour.organization.projects.create(name="Theirs")
    record(neighbour.organization, "w0", "eu-west", prompt=900_000)
    record(neighbour.organization, "x1", "us-east", prompt=900_000)  # their violation
    yank = MembershipFactory(organization=OrganizationFactory(data_zone=DataZone.US))
    yank.organization.projects.create(name="US")
    record(yank.organization, "u1", "us-east", prompt=800_000)
    return {"member": member, "org": org, "neighbour": neighbour, "yank": yank}


class Page(HTMLParser):
    """The cells of ``#region-table``'s body, the text of elements with an id, and the
    ``json_script`` blocks."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self.ids: dict[str, str] = {}
        self.scripts: dict[str, str] = {}
        self._open: list[str | None] = []
        self._tbody = self._cell = False
        self._table: str | None = None
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self._table = attrs.get("id")
        if tag == "tbody" and self._table == "region-table":
            self._tbody = True
        elif self._tbody and tag == "tr":
            self.rows.append([])
        elif self._tbody and tag == "td":
            self._cell = True
            self.rows[-1].append("")
        if tag == "script" and attrs.get("type") == "application/json":
            self.scripts[attrs["id"]] = ""
        if tag not in ("br", "input", "meta", "link", "img"):
            self._open.append(attrs.get("id"))
            if attrs.get("id"):
                self.ids[attrs["id"]] = ""

    def handle_endtag(self, tag):
        if tag == "tbody":
            self._tbody = False
        if tag == "td":
            self._cell = False
        if self._open and tag not in ("br", "input", "meta", "link", "img"):
            self._open.pop()

    def handle_data(self, data):
        if self._cell:
            self.rows[-1][-1] += data.strip()
        for element in self._open:
            if element:
                if element in self.scripts:
                    self.scripts[element] += data
                else:
                    self.ids[element] += data

    def table(self) -> dict[tuple[str, str], tuple[str, int, int, int, int]]:
        """(region label, zone) -> (in zone, requests, input, output, total tokens)."""
        return {(r[0], r[1]): (r[2], *map(int, r[3:7])) for r in self.rows if len(r) == 7}

    def chart(self) -> dict:
        return json.loads(self.scripts["region-data"])


def open_page(client, params: dict | None = None) -> tuple[int, Page, str]:
    response = client.get(URL, params or {})
    html = response.content.decode()
    return response.status_code, Page(html), html


def proof_json(client, params: dict) -> dict:
    response = client.get(URL, {**params, "format": "json"})
    assert response.status_code == 200, response
    assert response.streaming  # written as it is read, however long the range
    assert "attachment" in response["Content-Disposition"]
    return json.loads(b"".join(response.streaming_content))


def proof_csv(client, params: dict) -> list[list[str]]:
    response = client.get(URL, {**params, "format": "csv"})
    assert response.status_code == 200, response
    assert response.streaming
    return list(csv.reader(io.StringIO(b"".join(response.streaming_content).decode())))


def csv_sections(rows: list[list[str]]) -> tuple[dict[str, str], list[list[str]], list[list[str]]]:
    """The CSV proof's header (field -> value), its region rows and its outside-events rows."""
    blanks = [i for i, r in enumerate(rows) if not r]
    head = dict(rows[1:blanks[0]])
    return head, rows[blanks[0] + 2:blanks[1]], rows[blanks[1] + 2:]


def test_requests_per_region_from_the_orgs_own_events(client, world):
    # given the EU org's member, signed in
    client.force_login(world["member"].user)

    # when the page is opened for October
    status, page, html = open_page(client, OCTOBER)

    # then the table counts its own events per region, nobody else's
    assert status == 200
    assert page.table() == {
        ("(no engine reached)", "eu"): ("yes", 1, 7, 0, 7),
        ("eu-central", "eu"): ("yes", 2, 100, 10, 110),
        ("eu-west", "eu"): ("yes", 3, 303, 30, 333),
    }
    assert page.ids["total-events"].strip() == "6"
    assert page.ids["outside"].strip() == "none"
    assert "outside-table" not in page.ids
    assert page.ids["zone"].strip() == "European Union"
    # the zone says what it allows: its regions, from every pool of the zone, retired ones too
    assert "only in eu-central, eu-west" in page.ids["zone-allows"]
    assert "900000" not in html and "800000" not in html

    # and the chart draws the table's numbers
    chart = page.chart()
    drawn = {label: (requests, tokens) for label, requests, tokens in zip(
        chart["labels"], chart["datasets"][0]["data"], chart["datasets"][1]["data"],
        strict=True)}
    assert drawn == {label: (n, total) for (label, _), (_, n, _, _, total)
                     in page.table().items()}


def test_the_proof_states_the_pages_figures_and_says_none_outside(client, world):
    client.force_login(world["member"].user)
    _, page, _ = open_page(client, OCTOBER)

    # the JSON proof
    proof = proof_json(client, OCTOBER)
    assert proof["organization"] == world["org"].public_id
    assert proof["zone"] == "eu" and proof["zone_allows"] == ["eu-central", "eu-west"]
    assert proof["start"] == "2026-10-01T00:00:00+00:00"
    assert proof["end"] == "2026-11-01T00:00:00+00:00"
    assert proof["generated_at"]
    assert proof["total_events"] == 6 == int(page.ids["total-events"])
    assert proof["events_outside_zone"] == 0 and proof["outside_events"] == []
    assert {(r["region"] or "(no engine reached)", r["zone_recorded"]):
            ("yes" if r["in_zone"] else "NO", r["events"], r["prompt_tokens"],
             r["completion_tokens"], r["total_tokens"]) for r in proof["regions"]} \
        == page.table()
    # the digest is SHA-256 of the text it states, and the page shows the same one
    assert proof["digest_sha256"] == hashlib.sha256(proof["digest_text"].encode()).hexdigest()
    assert proof["digest_sha256"] == page.ids["digest"].strip()
    assert "events=6\n" in proof["digest_text"] and "events_outside_zone=0\n" in \
        proof["digest_text"]

    # the CSV proof says the same, and "none" where the events outside would be listed
    head, regions, outside = csv_sections(proof_csv(client, OCTOBER))
    assert head["organization"] == world["org"].public_id
    assert head["total_events"] == "6" and head["events_outside_zone"] == "0"
    assert head["digest_sha256"] == proof["digest_sha256"]
    assert head["start"] == proof["start"] and head["end"] == proof["end"]
    assert [[r["region"], r["zone_recorded"], str(r["in_zone"]).lower(), str(r["events"]),
             str(r["prompt_tokens"]), str(r["completion_tokens"]), str(r["total_tokens"])]
            for r in proof["regions"]] == regions
    assert outside == [["none"]]

    # regenerated, the same range gives the same digest (the generation time is not in it)
    assert proof_json(client, OCTOBER)["digest_sha256"] == proof["digest_sha256"]


def test_an_event_outside_its_recorded_zone_is_listed_in_the_proof(client, world):
    # given an event of the EU org that ran in us-east, recorded under zone eu
    org = world["org"]
    at = OCT + timedelta(days=9, hours=4)
    record(org, "stray-1", "us-east", at=at, prompt=40, completion=4)
    # and one recorded while the org was global (the zone stored on it), also in us-east
    record(org, "global-era", "us-east", at=at, data_zone="global")
    # when the org's zone is now set to global, that changes nothing: each event keeps its own
    org.data_zone = DataZone.GLOBAL
    org.save(update_fields=["data_zone"])
    client.force_login(world["member"].user)

    status, page, _ = open_page(client, OCTOBER)
    assert status == 200
    table = page.table()
    assert table[("us-east (eu)", "eu")] == ("NO", 1, 40, 4, 44)
    assert table[("us-east (global)", "global")][0] == "yes"
    assert page.ids["outside"].strip() == "1"
    assert "stray-1" in page.ids["outside-table"] and "global-era" not in \
        page.ids["outside-table"]
    assert page.ids["zone"].strip() == "Global"

    proof = proof_json(client, OCTOBER)
    assert proof["zone"] == "global" and proof["zone_allows"] == "every region"
    assert proof["total_events"] == 8 and proof["events_outside_zone"] == 1
    assert proof["outside_events"] == [{"request_id": "stray-1",
                                        "event_time": at.isoformat(),
                                        "region": "us-east", "zone_recorded": "eu"}]
    assert proof["digest_sha256"] == page.ids["digest"].strip()
    head, _, outside = csv_sections(proof_csv(client, OCTOBER))
    assert head["events_outside_zone"] == "1"
    assert outside == [["stray-1", at.isoformat(), "us-east", "eu"]]


def test_the_default_range_is_this_month_and_past_months_are_offered(client, world):
    now = datetime.now(UTC)
    record(world["org"], "today", "eu-west", at=now, prompt=5, completion=1)
    client.force_login(world["member"].user)

    status, page, html = open_page(client)
    assert status == 200
    assert page.table() == {("eu-west", "eu"): ("yes", 1, 5, 1, 6)}
    assert f'value="{now:%Y-%m}-01"' in html
    # October is one click away
    assert "?start=2026-10-01&amp;through=2026-10-31" in html
    assert proof_json(client, {})["total_events"] == 1


def test_forged_organization_parameters_change_nothing(client, world):
    client.force_login(world["member"].user)
    _, mine, _ = open_page(client, OCTOBER)
    theirs = world["neighbour"].organization
    for forged in ({"organization": theirs.public_id}, {"org": theirs.public_id},
                   {"org_id": str(theirs.id)}, {"organization_id": str(theirs.id)}):
        status, page, _ = open_page(client, {**OCTOBER, **forged})
        assert status == 200
        assert page.table() == mine.table()
        proof = proof_json(client, {**OCTOBER, **forged})
        assert proof["organization"] == world["org"].public_id
        assert proof["total_events"] == 6 and proof["events_outside_zone"] == 0

    # and the neighbour sees its own events only, its own violation among them
    client.force_login(world["neighbour"].user)
    proof = proof_json(client, OCTOBER)
    assert proof["organization"] == theirs.public_id
    assert proof["total_events"] == 2
    assert [e["request_id"] for e in proof["outside_events"]] == ["x1"]


@pytest.mark.parametrize("role", [Role.DEVELOPER, Role.VIEWER])
def test_a_member_without_billing_access_is_refused(client, world, role):
    member = MembershipFactory(organization=world["org"], role=role)
    client.force_login(member.user)
    for params in (OCTOBER, {**OCTOBER, "format": "json"}, {**OCTOBER, "format": "csv"}):
        response = client.get(URL, params)
        assert response.status_code == 302 and response["Location"] == "/console/"
        assert world["org"].public_id not in response.content.decode()


@pytest.mark.parametrize("role", [Role.FINANCE, Role.ADMIN])
def test_finance_and_admins_read_it(client, world, role):
    client.force_login(MembershipFactory(organization=world["org"], role=role).user)
    assert proof_json(client, OCTOBER)["total_events"] == 6


def test_signed_out_it_asks_to_sign_in(client, world):
    response = client.get(URL, {**OCTOBER, "format": "json"})
    assert response.status_code == 302 and "/login/" in response["Location"]


@pytest.mark.parametrize(("params", "message"), [
    ({"start": "yesterday", "through": "2026-10-31"}, "Enter a valid date."),
    ({"start": "2026-10-31", "through": "2026-10-01"}, "The last day is before the first."),
    ({"start": "2025-01-01", "through": "2026-10-31"}, "A range is at most 366 days."),
    ({"start": "9999-12-01", "through": "9999-12-31"}, "too far in the future"),
    ({"start": "2026-13-01", "through": "2026-10-31"}, "Enter a valid date."),
    ({"start": "", "through": ""}, "This field is required."),
    ({**OCTOBER, "format": "xml"}, "The proof's format is csv or json."),
])
def test_a_bad_range_is_a_form_message(client, world, params, message):
    client.force_login(world["member"].user)
    for extra in ({}, {"format": "json"}):
        response = client.get(URL, {**extra, **params})
        assert response.status_code == 400
        page = Page(response.content.decode())
        assert message in page.ids["range-errors"]
        assert "region-table" not in page.ids
