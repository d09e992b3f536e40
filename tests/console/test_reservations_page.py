"""Console Reservations page (issue 19 item 4): utilization per hour computed by hand from
usage events recorded through metering's real path, another organization's reservation never
shown nor usable, roles, malformed input, and buying, renewing or requesting once per form key.

The offering of every test: llama-70b in us-east, 10,000 normalized tokens a minute per unit,
cached burndown 0, output burndown 4 (normalized = uncached + output x 4); 2.50 a unit-hour,
1,500.00 a unit-month. The reservation: 2 units (20,000 a minute, 1,200,000 an hour), hourly,
48 terms, from H0 = three hours before the current hour.
"""

from __future__ import annotations

import re
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from billing_platform.accounts.choices import Role
from billing_platform.audit.models import AuditEvent
from plans import services
from plans.models import Reservation
from tests.factories import MembershipFactory, make_billed_org, make_offering, make_price_book
from tests.invoicing.conftest import record

URL = "/console/reservations/"


def make_world():
    """Return (org, reservation, owner, H0), the usage of the module's docstring recorded."""
    make_price_book(prices=[{"model": "llama-70b", "input": "0.88", "output": "0.88"},
                            {"model": "m-small", "input": "0.10", "output": "0.20"}])
    offering = make_offering(model="llama-70b", code="l70", name="Llama 70B unit",
                             tokens_per_minute_per_unit=10_000, cache_burndown="0",
                             output_burndown="4", hourly_unit_price="2.50",
                             monthly_unit_price="1500.00")
    now = timezone.now()
    h0 = now.replace(minute=0, second=0, microsecond=0) - timedelta(hours=3)
    org = make_billed_org(name="Reserved Co", created_at=h0 - timedelta(days=1))
    reservation = services.reservation_create(organization=org, offering=offering, units=2,
                                              term="hourly", term_count=48, starts_at=h0)
    prov = {"model": "llama-70b", "region": "us-east", "capacity_source": "provisioned"}
    spill = {**prov, "capacity_source": "spillover"}
    # H0, minute 5: 600 uncached + 200 x 4 = 1,400 and 2,000 + 500 x 4 = 4,000: 5,400 in the
    # minute; a spilled 1,400 beside them
    record(org, "p1", h0 + timedelta(minutes=5), prompt_tokens=1_000, cached_tokens=400,
           completion_tokens=200, **prov)
    record(org, "p2", h0 + timedelta(minutes=5, seconds=10), prompt_tokens=2_000,
           completion_tokens=500, **prov)
    record(org, "s1", h0 + timedelta(minutes=5, seconds=30), prompt_tokens=1_000,
           cached_tokens=400, completion_tokens=200, **spill)
    # H0, minute 20: 1,000
    record(org, "p3", h0 + timedelta(minutes=20), prompt_tokens=1_000, **prov)
    # H0 + 2 h: 200 + 50 x 4 = 400 used, 100 + 25 x 4 = 200 spilled
    record(org, "p4", h0 + timedelta(hours=2, minutes=1), prompt_tokens=300, cached_tokens=100,
           completion_tokens=50, **prov)
    record(org, "s2", h0 + timedelta(hours=2, minutes=2), prompt_tokens=100,
           completion_tokens=25, **spill)
    # not the reservation's: on-demand traffic of the model, another model's spillover
    record(org, "o1", h0 + timedelta(minutes=5), model="llama-70b", region="us-east",
           prompt_tokens=9_999)
    record(org, "o2", h0 + timedelta(minutes=5), model="m-small", region="us-east",
           capacity_source="spillover", prompt_tokens=9_999)
    owner = MembershipFactory(organization=org, role=Role.OWNER).user
    return org, reservation, owner, h0


@pytest.fixture
def world(db):
    return make_world()


def table_rows(html: str) -> dict[str, list[str]]:
    """Return the utilization table's rows: hour (ISO) -> the cells after the hour."""
    rows = {}
    for hour, body in re.findall(r'<tr data-hour="([^"]+)">(.*?)</tr>', html, re.S):
        cells = [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td>(.*?)</td>",
                                                                        body, re.S)]
        rows[hour] = cells[1:]
    return rows


def _text(html: str, element_id: str) -> str:
    match = re.search(rf'id="{element_id}">([^<]*)<', html)
    assert match, element_id
    return match.group(1)


def _key(html: str, form_id: str) -> str:
    form = html[html.index(f'id="{form_id}"'):]
    match = re.search(r'name="idempotency_key" value="([0-9a-f]+)"', form)
    assert match
    return match.group(1)


def test_utilization_per_hour_computed_by_hand(world, client):
    """H0: used 1,400 + 4,000 + 1,000 = 6,400 of 1,200,000 (0.5 %), busiest minute 5,400 of
    20,000 (27.0 %), spillover 1,400 of 7,800 (17.9 %). H0 + 1 h: nothing. H0 + 2 h: 400 used,
    200 spilled (33.3 %). The current hour: nothing yet."""
    _org, reservation, owner, h0 = world
    client.force_login(owner)

    response = client.get(URL)

    html = response.content.decode()
    assert response.status_code == 200
    rows = table_rows(html)
    iso = [(h0 + timedelta(hours=k)).isoformat() for k in range(4)]
    assert list(rows) == iso  # the term began at H0; the range runs through the current hour
    # reserved/min, busiest, busiest %, reserved/hour, used, used %, spillover, share
    assert rows[iso[0]] == ["20000", "5400", "27.0%", "1200000", "6400", "0.5%", "1400",
                            "17.9%"]
    assert rows[iso[1]] == ["20000", "0", "0.0%", "1200000", "0", "0.0%", "0", "—"]
    assert rows[iso[2]] == ["20000", "400", "2.0%", "1200000", "400", "0.0%", "200", "33.3%"]
    # totals: 6,800 used of 4,800,000; 1,600 spilled of 8,400 = 19.0 %
    assert (_text(html, "total-used"), _text(html, "total-reserved")) == ("6800", "4800000")
    assert _text(html, "total-peak") == "5400"
    assert _text(html, "total-spillover") == "1600"
    assert _text(html, "total-spillover-share") == "19.0%"
    # the reservation's row: units, term, renewal, status, fee 2 x 2.50 x 48 = 240.00
    row = html[html.index(f'id="row-{reservation.public_id}"'):]
    row = row[:row.index("</tr>")]
    for text in ("Llama 70B unit", "48 \N{MULTIPLICATION SIGN} hourly", "Active",
                 "Does not renew automatically", "240.00 USD", f"{h0:%Y-%m-%d %H:%M} UTC"):
        assert text in row, text
    # the chart's data is the table's
    assert 'role="img"' in html and 'aria-label="Normalized tokens per hour' in html
    assert '"data": [6400, 0, 400, 0]' in html and '"data": [1400, 0, 200, 0]' in html


def test_seven_days_by_hour_and_a_bad_range(world, client):
    _org, reservation, owner, _h0 = world
    client.force_login(owner)

    week = client.get(URL, {"range": "7d", "reservation": reservation.public_id})
    bad = client.get(URL, {"range": "forever"})

    # the term began at H0, so a week shows the same four hours
    assert week.status_code == 200
    assert len(table_rows(week.content.decode())) == 4
    # a bad range is a form message on the page (the default range shown), not a 500
    assert bad.status_code == 400
    assert "Select a valid choice" in bad.content.decode()
    assert len(table_rows(bad.content.decode())) == 4


def test_another_organizations_reservation_is_never_shown_or_usable(world, client, settings):
    _org, _reservation, owner, h0 = world
    other_offering = make_offering(model="llama-70b", code="l70-b")
    other = make_billed_org(name="Other Co")
    theirs = services.reservation_create(organization=other, offering=other_offering, units=5,
                                         term="monthly", starts_at=h0)
    record(other, "x1", h0 + timedelta(minutes=5), model="llama-70b", region="us-east",
           capacity_source="provisioned", prompt_tokens=77_777)
    client.force_login(owner)

    page = client.get(URL).content.decode()
    by_id = client.get(URL, {"reservation": theirs.public_id})
    key = _key(page, "renew-form")
    renew = client.post(URL, {"action": "renew", "reservation": theirs.public_id,
                              "term_count": "1", "idempotency_key": key})
    settings.RESERVATIONS_SELF_SERVE = True
    renew_self = client.post(URL, {"action": "renew", "reservation": theirs.public_id,
                                   "term_count": "1", "idempotency_key": key})

    assert theirs.public_id not in page and "77777" not in page
    assert by_id.status_code == 404
    for answer in (renew, renew_self):
        assert answer.status_code == 400
        assert "Select a valid choice" in answer.content.decode()
    assert Reservation.objects.filter(organization=other).count() == 1
    assert not AuditEvent.objects.filter(action__startswith="reservation.", target=theirs
                                         .public_id).exclude(action="reservation.create")


@pytest.mark.parametrize("role", [Role.DEVELOPER, Role.VIEWER])
def test_a_role_without_org_write_cannot_buy_or_request(world, client, settings, role):
    org, reservation, _owner, _h0 = world
    member = MembershipFactory(organization=org, role=role).user
    client.force_login(member)
    html = client.get(URL).content.decode()
    assert 'id="buy-form"' not in html and "Owners and admins" in html

    for self_serve in (False, True):
        settings.RESERVATIONS_SELF_SERVE = self_serve
        buy = client.post(URL, {"action": "buy", "offering": "l70", "units": "1",
                                "term": "hourly", "term_count": "1",
                                "idempotency_key": "a" * 32})
        renew = client.post(URL, {"action": "renew", "reservation": reservation.public_id,
                                  "term_count": "1", "idempotency_key": "b" * 32})
        assert (buy.status_code, renew.status_code) == (403, 403)
        assert "cannot buy or renew" in buy.content.decode()

    assert Reservation.objects.filter(organization=org).count() == 1
    assert not AuditEvent.objects.filter(organization_id=org.pk, action__in=[
        "reservation.request", "reservation.renew"]).exists()


def test_a_request_to_staff_sent_twice_with_one_key_is_recorded_once(world, client):
    """Self-serve is off by default: the form sends a request, an audit row staff read; nothing
    is reserved. 3 units x 1,500.00 x 2 months = 9,000.00 at today's prices."""
    org, _reservation, owner, _h0 = world
    client.force_login(owner)
    page = client.get(URL).content.decode()
    assert "Send request" in page and "Reserve</button>" not in page
    form = {"action": "buy", "offering": "l70", "units": "3", "term": "monthly",
            "term_count": "2", "note": "for the launch", "idempotency_key": _key(page,
                                                                                "buy-form")}

    first = client.post(URL, form)
    second = client.post(URL, form, follow=True)

    assert first.status_code == 302 and first["Location"] == URL
    (row,) = AuditEvent.objects.filter(action="reservation.request", organization_id=org.pk)
    assert row.actor_user_id == owner.pk
    assert row.after["units"] == 3 and row.after["offering"] == "l70"
    assert Decimal(row.after["fee"]) == Decimal("9000.00")
    assert Reservation.objects.filter(organization=org).count() == 1  # nothing reserved
    html = second.content.decode()
    assert "already sent" in html
    requests = html[html.index('id="requests"'):]
    assert row.public_id in requests and "9000.00 USD" in requests


def test_self_serve_buy_and_renew_each_once_per_key(world, client, settings):
    """Self-serve: 1 unit for 2 hours = 2 x 2.50 = 5.00; renewing the 48-hour reservation for
    24 more hours starts where it ends: 2 x 2.50 x 24 = 120.00."""
    settings.RESERVATIONS_SELF_SERVE = True
    org, reservation, owner, _h0 = world
    client.force_login(owner)
    page = client.get(URL).content.decode()
    assert "Reserve</button>" in page
    buy = {"action": "buy", "offering": "l70", "units": "1", "term": "hourly",
           "term_count": "2", "idempotency_key": _key(page, "buy-form")}
    renew = {"action": "renew", "reservation": reservation.public_id, "term_count": "24",
             "idempotency_key": _key(page, "renew-form")}

    for _ in range(2):
        assert client.post(URL, buy).status_code == 302
        assert client.post(URL, renew).status_code == 302

    rows = list(Reservation.objects.filter(organization=org).order_by("created_at"))
    assert len(rows) == 3
    bought = next(r for r in rows if r.units == 1)
    renewal = next(r for r in rows if r.pk not in (reservation.pk, bought.pk))
    assert bought.fee == Decimal("5.00")
    assert (renewal.starts_at, renewal.units, renewal.fee) == (reservation.ends_at, 2,
                                                                Decimal("120.00"))
    creates = AuditEvent.objects.filter(action="reservation.create", organization_id=org.pk,
                                        actor_user_id=owner.pk)
    assert creates.count() == 2
    (renewed,) = AuditEvent.objects.filter(action="reservation.renew", organization_id=org.pk)
    assert renewed.target == reservation.public_id
    assert renewed.after["renewal"] == renewal.public_id


def test_malformed_purchase_input_is_a_form_message(world, client, settings):
    settings.RESERVATIONS_SELF_SERVE = True
    org, _reservation, owner, _h0 = world
    client.force_login(owner)
    key = _key(client.get(URL).content.decode(), "buy-form")

    cases = [{"offering": "nope", "units": "1", "term": "hourly", "term_count": "1"},
             {"offering": "l70", "units": "-4", "term": "hourly", "term_count": "1"},
             {"offering": "l70", "units": "1", "term": "weekly", "term_count": "1"},
             {"offering": "l70", "units": "1", "term": "hourly", "term_count": "x"}]
    answers = [client.post(URL, {"action": "buy", "idempotency_key": key, **case})
               for case in cases]
    unknown = client.post(URL, {"action": "steal"})
    damaged = client.post(URL, {"action": "buy", "offering": "l70", "units": "1",
                                "term": "hourly", "term_count": "1"})

    for answer in [*answers, unknown, damaged]:
        assert answer.status_code == 400
    assert "out of date or damaged" in damaged.content.decode()
    assert Reservation.objects.filter(organization=org).count() == 1


def test_a_renewal_request_names_the_reservation_and_is_recorded_once(world, client):
    """Renewal requested (self-serve off): 2 units x 2.50 x 24 hours = 120.00; nothing made."""
    org, reservation, owner, _h0 = world
    client.force_login(owner)
    page = client.get(URL).content.decode()
    form = {"action": "renew", "reservation": reservation.public_id, "term_count": "24",
            "idempotency_key": _key(page, "renew-form")}

    answers = [client.post(URL, form) for _ in range(2)]

    assert [a.status_code for a in answers] == [302, 302]
    (row,) = AuditEvent.objects.filter(action="reservation.request", organization_id=org.pk)
    assert (row.target, row.after["renews"]) == (reservation.public_id, reservation.public_id)
    assert (row.after["units"], row.after["term"], row.after["term_count"]) == (2, "hourly", 24)
    assert Decimal(row.after["fee"]) == Decimal("120.00")
    assert Reservation.objects.filter(organization=org).count() == 1
