"""Console usage explorer: any range, filters, grouping; its table, chart and CSV equal
``/api/v1/usage`` for the same query; bounds and hostile input are form messages."""

from __future__ import annotations

import csv
import io
import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from html.parser import HTMLParser

import pytest

from billing_platform.accounts.choices import Role
from metering import events, services
from tests.factories import MembershipFactory, make_key, make_price_book

pytestmark = pytest.mark.django_db(transaction=True)

OCT = datetime(2026, 10, 1, tzinfo=UTC)


def _record(org, request_id: str, project=None, **fields) -> None:
    event = {"request_id": request_id, "org_id": org.id,
             "project_id": (project or org.projects.order_by("id").first()).id,
             "model": "page-model", "region": "us-east", "event_time": datetime.now(UTC),
             "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0, **fields}
    assert services.usage_events_record([events.normalize(event, check_age=False)],
                                        origin="test").recorded


class _Tables(HTMLParser):
    """The cells of a page's ``#usage-table`` (an amount cell as its exact ``data-exact``, as
    the CSV has it; ``shown``: the amounts as the page shows them) and the JSON of its
    ``json_script`` blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self.shown: list[str] = []
        self._exact: str | None = None
        self.scripts: dict[str, str] = {}
        self._in_table = False
        self._cell: list[str] | None = None
        self._script: str | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table" and attrs.get("id") == "usage-table":
            self._in_table = True
        elif self._in_table and tag == "tr":
            self.rows.append([])
        elif self._in_table and tag in ("td", "th"):
            self._cell = []
            self._exact = attrs.get("data-exact")
        elif tag == "script" and attrs.get("type") == "application/json":
            self._script = attrs["id"]
            self.scripts[self._script] = ""

    def handle_endtag(self, tag):
        if tag == "table":
            self._in_table = False
        elif tag in ("td", "th") and self._cell is not None:
            text = "".join(self._cell).strip()
            if self._exact is not None:
                self.shown.append(text)
            self.rows[-1].append(text if self._exact is None else self._exact)
            self._cell = None
        elif tag == "script":
            self._script = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        if self._script is not None:
            self.scripts[self._script] += data


def _page(client, params: dict) -> tuple[int, str, _Tables]:
    response = client.get("/console/usage/", params)
    html = response.content.decode()
    parsed = _Tables()
    parsed.feed(html)
    return response.status_code, html, parsed


def _csv(client, params: dict) -> list[list[str]]:
    response = client.get("/console/usage/", {**params, "format": "csv"})
    assert response.status_code == 200
    assert response.streaming  # generated row by row, however long the range
    return list(csv.reader(io.StringIO(b"".join(response.streaming_content).decode())))


def _api(client, org, params: dict) -> dict:
    response = client.get("/api/v1/usage", {"organization": org.public_id, **params})
    assert response.status_code == 200, response.content
    return response.json()


@pytest.fixture
def world():
    """An org with two projects, two keys, two models, tiers, regions and outcomes, in a past
    month (October) and this one; and another org with usage of its own."""
    make_price_book(prices=[{"model": "page-model", "input": "2.00", "cached_input": "0.50",
                             "output": "8.00"},
                            {"model": "small-model", "input": "0.10", "output": "0.40"}])
    member = MembershipFactory()
    org = member.organization
    web = org.projects.create(name="Web")
    batch = org.projects.create(name="Batch jobs")
    web_key, _ = make_key(web, name="web key")
    batch_key, _ = make_key(batch, name="nightly")
    day = OCT + timedelta(days=4, hours=9)
    _record(org, "o1", web, api_key_id=web_key.id, event_time=day, prompt_tokens=1000,
            cached_tokens=400, completion_tokens=100)
    _record(org, "o2", web, api_key_id=web_key.id, event_time=day + timedelta(hours=2),
            model="small-model", region="eu-west", prompt_tokens=300, completion_tokens=50,
            status="engine_error")
    _record(org, "o3", batch, api_key_id=batch_key.id, event_time=day + timedelta(days=3),
            service_tier="batch", prompt_tokens=5000, completion_tokens=700)
    _record(org, "o4", batch, api_key_id=batch_key.id, event_time=day + timedelta(days=3),
            service_tier="flex", prompt_tokens=200, completion_tokens=20,
            status="client_aborted")
    _record(org, "n1", web, api_key_id=web_key.id, prompt_tokens=999, completion_tokens=9)
    other = MembershipFactory()
    theirs = other.organization.projects.create(name="Theirs")
    their_key, _ = make_key(theirs, name="their key")
    _record(other.organization, "x1", theirs, api_key_id=their_key.id, event_time=day,
            prompt_tokens=777_777)
    return {"member": member, "org": org, "web": web, "batch": batch, "web_key": web_key,
            "batch_key": batch_key, "other": other, "their_project": theirs,
            "their_key": their_key}


OCTOBER = {"start": "2026-10-01", "through": "2026-10-31"}


def _api_rows(api: dict, group_by: list[str]) -> list[tuple]:
    return [(*[str(r[g]) for g in group_by], r["currency"], r["requests"], r["error_requests"],
             r["aborted_requests"], r["prompt_tokens"], r["cached_tokens"],
             r["completion_tokens"], r["total_tokens"], Decimal(r["amount"]))
            for r in api["data"]]


def _table_numbers(rows: list[list[str]], width: int) -> list[tuple]:
    return [(*r[:width], r[width], *map(int, r[width + 1:width + 8]), Decimal(r[width + 8]))
            for r in rows]


@pytest.mark.parametrize(("group", "split"), [
    ("day", "model"), ("hour", ""), ("model", ""), ("project", "key"), ("key", ""),
    ("service_tier", "region"), ("region", "service_tier")])
def test_explorer_table_chart_and_csv_equal_the_api_for_a_past_month(client, world, group,
                                                                     split):
    # given a member reading October (a closed, past month) grouped and split
    client.force_login(world["member"].user)
    params = {**OCTOBER, "group": group, "split": split}

    # when the explorer answers, and the API for the same range and grouping
    status, html, page = _page(client, params)
    group_by = [g for g in (group, split) if g]
    api = _api(client, world["org"], {"start": "2026-10-01", "end": "2026-11-01",
                                      "group_by": ",".join(group_by)})

    # then the table has the API's rows, in its order, number for number
    assert status == 200
    header, *rows = page.rows
    assert header[:len(group_by)] == group_by
    ours = _table_numbers(rows, len(group_by))
    theirs = _api_rows(api, group_by)
    assert len(ours) == len(theirs) == len(api["data"]) > 0
    assert [r[len(group_by):] for r in ours] == [r[len(group_by):] for r in theirs]
    # and the totals: 4 requests, 1 failed, 1 aborted, 6,500 input, 870 output tokens
    assert sum(r[len(group_by) + 1] for r in ours) == 4
    assert sum(r[len(group_by) + 4] for r in ours) == 6500
    # the CSV is the table, header and every cell
    assert _csv(client, params) == page.rows
    # the chart's points sum to the table's (total tokens by default), per group value
    chart = json.loads(page.scripts["usage-chart-data"])
    drawn = sum(Decimal(v) for d in chart["datasets"] for v in d["data"])
    assert drawn == sum(r[len(group_by) + 7] for r in ours) == 7370
    assert "777777" not in html and "Theirs" not in html  # another org's usage never shows


def test_explorer_filters_are_the_apis_filters(client, world):
    # given a member filtering October by project, key, tier, model and region
    client.force_login(world["member"].user)
    cases = [
        ({"project": world["batch"].public_id}, {"project": world["batch"].public_id}),
        ({"key": world["web_key"].public_id}, {"key": world["web_key"].public_id}),
        ({"service_tier": ["batch", "flex"]}, {"service_tier": "batch,flex"}),
        ({"model": "small-model"}, {"model": "small-model"}),
        ({"region": "eu-west"}, {"region": "eu-west"}),
        ({"region": "us-east", "service_tier": "default"},
         {"region": "us-east", "service_tier": "default"}),
    ]
    for console_filter, api_filter in cases:
        # when the explorer and the API answer the same filter
        params = {**OCTOBER, "group": "model", "split": "", **console_filter}
        status, _, page = _page(client, params)
        api = _api(client, world["org"], {"start": "2026-10-01", "end": "2026-11-01",
                                          "group_by": "model", **api_filter})
        # then the same rows
        assert status == 200, console_filter
        assert _table_numbers(page.rows[1:], 1) == _api_rows(api, ["model"]), console_filter
    # and the filters do filter: the batch project is 2 requests, eu-west is the failed one
    _, _, page = _page(client, {**OCTOBER, "group": "project", "split": "",
                                "project": world["batch"].public_id})
    assert [(r[0], r[2]) for r in page.rows[1:]] == [
        (f"Batch jobs ({world['batch'].public_id})", "2")]
    _, _, page = _page(client, {**OCTOBER, "group": "region", "split": "", "region": "eu-west"})
    assert [(r[0], r[2], r[3]) for r in page.rows[1:]] == [("eu-west", "1", "1")]


def test_explorer_default_is_this_month_by_day_and_model_with_exact_amounts(client):
    # given priced usage this month: 3 requests, 1,000,000 input tokens (250,000 cached),
    # 40,000 output; and 30 small requests of a cheap model
    make_price_book(prices=[{"model": "page-model", "input": "2.00",
                             "cached_input": "0.50", "output": "8.00"},
                            {"model": "tiny", "input": "0.10", "output": "0.40"}])
    member = MembershipFactory()
    org = member.organization
    org.projects.create(name="Default project")
    _record(org, "r1", prompt_tokens=500_000, cached_tokens=250_000, completion_tokens=20_000)
    _record(org, "r2", prompt_tokens=250_000, completion_tokens=10_000)
    _record(org, "r3", prompt_tokens=250_000, completion_tokens=10_000)
    for i in range(30):
        _record(org, f"t{i}", model="tiny", prompt_tokens=300, completion_tokens=20)
    client.force_login(member.user)

    # when the member opens the usage page
    status, html, page = _page(client, {})

    # then: (750,000 x 2.00 + 250,000 x 0.50 + 40,000 x 8.00) / 1e6 = 1.945, shown $1.95; the
    # tiny model's 30 x (300 x 0.10 + 20 x 0.40) / 1e6 = 0.00114, shown $0.0011, not "0.00"
    assert status == 200
    header, *rows = page.rows
    assert header[:2] == ["day", "model"]
    amounts = {r[1]: (r[-1], shown) for r, shown in zip(rows, page.shown, strict=True)}
    assert amounts == {"page-model": ("1.945", "$1.95"), "tiny": ("0.00114", "$0.0011")}
    assert 'data-exact="1.94614">$1.95<' in html  # the month's total amount
    rows_csv = _csv(client, {})
    assert sum(Decimal(r[-1]) for r in rows_csv[1:]) == Decimal("1.94614")
    assert sum(int(r[header.index("requests")]) for r in rows_csv[1:]) == 33


@pytest.mark.parametrize(("params", "message"), [
    ({"start": "2025-01-01", "through": "2026-11-30"}, "at most 366 days"),
    ({"start": "2026-13-01"}, "start must be a date"),
    ({"start": "yesterday"}, "start must be a date"),
    ({"start": "2026-10-01", "through": "31/10/2026"}, "through must be a date"),
    ({"start": "2026-10-01", "through": "9999-12-31"}, "through must be a date"),
    ({"start": "0001-01-01", "through": "2026-10-31"}, "at most 366 days"),
    ({"start": "2026-10-05", "through": "2026-10-01"}, "end must be after start"),
    ({"start": "2026-10-01T10:30:00Z"}, "on the hour"),
    ({"group": "colour"}, "group must be one of"),
    ({"metric": "cost_to_serve"}, "metric must be one of"),
    ({"project": "proj_doesnotexist"}, "No such project in this organization"),
    ({"service_tier": ",".join(f"t{i}" for i in range(101))}, "at most 100"),
])
def test_explorer_refuses_malformed_and_unbounded_reads_with_a_form_message(client, world,
                                                                            params, message):
    client.force_login(world["member"].user)
    status, html, page = _page(client, params)
    assert status == 400
    assert message in html
    assert page.rows == []  # no table, no chart: nothing half-answered
    assert "usage-chart-data" not in page.scripts
    assert client.get("/console/usage/", {**params, "format": "csv"}).status_code == 400


def test_explorer_refuses_more_hours_than_one_answer_holds(client, world, settings):
    # given answers bounded to 100 groups (10,000 by default, more hours than 366 days hold)
    settings.METERING_USAGE_MAX_GROUPS = 100
    client.force_login(world["member"].user)
    # when October is asked for by hour (744 hours)
    status, html, page = _page(client, {**OCTOBER, "group": "hour", "split": ""})
    # then a form message says so and what to do
    assert status == 400
    assert "Grouping by hour over this range makes 744 groups" in html
    assert page.rows == []


def test_explorer_reads_a_year_back_within_the_bound(client, world):
    # given usage 340 days ago (a closed period of last year)
    long_ago = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(days=340)
    _record(world["org"], "old", world["web"], event_time=long_ago, prompt_tokens=4242)
    client.force_login(world["member"].user)
    start = (long_ago - timedelta(days=5)).date().isoformat()
    # when the member reads 366 days from then, by model
    through = (long_ago - timedelta(days=5) + timedelta(days=365)).date().isoformat()
    status, _, page = _page(client, {"start": start, "through": through, "group": "model",
                                     "split": ""})
    # then the old usage is there
    assert status == 200
    assert sum(int(r[5]) for r in page.rows[1:]) >= 4242


def test_another_orgs_ids_in_the_filters_are_a_form_message_never_their_data(client, world):
    client.force_login(world["member"].user)
    for params in ({"project": world["their_project"].public_id},
                   {"key": world["their_key"].public_id},
                   {"project": f"{world['web'].public_id},{world['their_project'].public_id}"}):
        status, html, page = _page(client, {**OCTOBER, **params})
        assert status == 400
        assert "in this organization" in html
        assert "777777" not in html and page.rows == []
        csv_response = client.get("/console/usage/", {**OCTOBER, **params, "format": "csv"})
        assert csv_response.status_code == 400
        assert b"777777" not in csv_response.content


def test_a_session_pointing_at_another_org_shows_only_the_members_own(client, world):
    # given the member's session claims the other org (a tampered or stale session)
    client.force_login(world["member"].user)
    session = client.session
    session["console_org"] = world["other"].organization.public_id
    session.save()
    # when the explorer answers
    status, html, page = _page(client, OCTOBER)
    # then it is the member's own organization's usage
    assert status == 200
    assert "777777" not in html
    assert sum(int(r[3]) for r in page.rows[1:]) == 4


def test_every_role_reads_usage_as_the_api_lets_it(client, world):
    # given a viewer (the least role: "read", which /api/v1/usage asks too)
    viewer = MembershipFactory(organization=world["org"], role=Role.VIEWER)
    client.force_login(viewer.user)
    status, _, page = _page(client, {**OCTOBER, "group": "model", "split": ""})
    api = _api(client, world["org"], {"start": "2026-10-01", "end": "2026-11-01",
                                      "group_by": "model"})
    assert status == 200
    assert _table_numbers(page.rows[1:], 1) == _api_rows(api, ["model"])
    # and a signed-in user of no organization is sent to sign up, not shown anything
    outsider = MembershipFactory().user
    outsider.memberships.all().delete()
    client.force_login(outsider)
    assert client.get("/console/usage/").status_code == 302


def test_names_a_tenant_chose_are_text_in_the_table_and_the_chart(client, world):
    # given a project named like markup
    world["web"].name = "<img src=x onerror=alert(1)>"
    world["web"].save()
    client.force_login(world["member"].user)
    # when the explorer groups by project
    status, html, page = _page(client, {**OCTOBER, "group": "project", "split": ""})
    # then the name is escaped text, in the table and in the chart's labels
    assert status == 200
    assert "<img src=x" not in html
    assert f"<img src=x onerror=alert(1)> ({world['web'].public_id})" in [
        r[0] for r in page.rows[1:]]
    chart = json.loads(page.scripts["usage-chart-data"])
    assert f"<img src=x onerror=alert(1)> ({world['web'].public_id})" in chart["labels"]
