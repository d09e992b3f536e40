"""Console Plan & credits page (issue 19 item 3): credits left by hand, the change preview as
the invoice bills it, idempotent and audited credit packs and plan changes, roles, other
organizations' ids, malformed input.

The plan of every test: ``test-model`` at 1.00 in / 2.00 out per 1M; credits per token: input
1, cached 0.1, output 3; 1,000 credits a period, 300 in any rolling 5 hours, overage; fee
10.00 (or as the test says). A pack: 500 credits for 5.00.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.core.cache import cache
from django.utils import timezone

from billing_platform.accounts.choices import Role
from billing_platform.audit.models import AuditEvent
from billing_platform.console.plan_views import change_preview
from billing_platform.invoicing import services as invoicing
from billing_platform.invoicing.choices import LineKind
from billing_platform.invoicing.models import Invoice
from billing_platform.invoicing.selectors import upcoming_invoice
from plans import services
from plans.models import CreditPackPurchase, Subscription
from plans.selectors import token_plan_status
from tests.factories import MembershipFactory, make_billed_org, make_price_book, make_token_plan
from tests.invoicing.conftest import record

D = Decimal
OCT = datetime(2026, 10, 1, tzinfo=UTC)
NOV = datetime(2026, 11, 1, tzinfo=UTC)


@pytest.fixture
def book(db):
    return make_price_book(prices=[{"model": "test-model", "input": "1.00", "output": "2.00"}])


def _plans(**basic):
    basic_plan = make_token_plan(code="basic", name="Basic", **basic)
    pro = make_token_plan(code="pro", name="Pro", monthly_fee="31.00",
                          credits_per_period="5000", window_credits="1500")
    services.credit_pack_create(plan=basic_plan, code="p500", name="500 pack", credits="500",
                                price="5.00")
    return basic_plan, pro


@pytest.fixture
def world(book):
    """Now-based: an org on Basic since two days ago (created then, so its open invoice period
    is the plan's first month), three requests in the ledger, an owner. Returns (org, sub,
    owner, now)."""
    now = timezone.now()
    start = now - timedelta(days=2)
    basic, _ = _plans()
    org = make_billed_org(name="Credits Co", created_at=start)
    sub = services.subscription_create(organization=org, plan=basic, starts_at=start)
    # A, 6 h ago: 100 in + 50 out = 100 + 150 = 250 credits (outside the 5-hour window)
    record(org, "a", now - timedelta(hours=6), model="test-model", prompt_tokens=100,
           completion_tokens=50)
    # B, 1 h ago: 40 in + 20 out = 40 + 60 = 100 credits
    record(org, "b", now - timedelta(hours=1), model="test-model", prompt_tokens=40,
           completion_tokens=20)
    # C, 30 min ago: 100 prompt all cached (100 x 0.1 = 10) + 10 out (30) = 40 credits
    record(org, "c", now - timedelta(minutes=30), model="test-model", prompt_tokens=100,
           cached_tokens=100, completion_tokens=10)
    owner = MembershipFactory(organization=org, role=Role.OWNER).user
    return org, sub, owner, now


def _text(html: str, element_id: str) -> str:
    match = re.search(rf'id="{element_id}">([^<]*)<', html)
    assert match, element_id
    return match.group(1)


def _key(html: str) -> str:
    match = re.search(r'name="idempotency_key" value="([0-9a-f]+)"', html)
    assert match
    return match.group(1)


def test_credits_left_in_the_period_and_the_window_computed_by_hand(world, client):
    """Period: 250 + 100 + 40 = 390 used of 1,000: 610 left. Window (now - 5 h, now]: B + C =
    140 of 300: 160 left; B's credits leave it first, 5 h after B (4 h from now). Usable now:
    min(610, 160) = 160, no packs."""
    org, _sub, owner, now = world
    client.force_login(owner)
    html = client.get("/console/plan/").content.decode()
    assert _text(html, "period-left") == "610"
    assert _text(html, "window-left") == "160"
    assert _text(html, "credits-left") == "160"
    assert _text(html, "overage") == "0"
    assert f"credits start freeing up at {(now + timedelta(hours=4)):%Y-%m-%d %H:%M} UTC" in html
    assert 'href="/console/plan/"' in html  # in the navigation
    # the page and /api/v1 read the same selector: the API says the same
    api = client.get(f"/api/v1/organizations/{org.public_id}/subscription/").json()
    assert api["token_plan"]["credits_left"] == "160.000000"
    assert api["token_plan"]["period_used"] == "390.000000"


def test_a_pack_bought_twice_with_one_key_is_bought_once_and_audited(world, client):
    org, sub, owner, _ = world
    client.force_login(owner)
    key = _key(client.get("/console/plan/").content.decode())
    form = {"pack": "p500", "idempotency_key": key}

    # when the same form is sent twice (a double click)
    first = client.post(f"/console/plan/{sub.public_id}/packs/", form)
    second = client.post(f"/console/plan/{sub.public_id}/packs/", form, follow=True)

    # then one pack was bought, once audited with the owner as actor, and credits rose by 500
    assert first.status_code == 302 and first["Location"] == "/console/plan/"
    assert CreditPackPurchase.objects.filter(subscription=sub).count() == 1
    (row,) = AuditEvent.objects.filter(action="credit_pack.purchase", organization_id=org.pk)
    assert row.actor_user_id == owner.pk
    html = second.content.decode()
    assert "This form was already sent" in html and "nothing was done again" in html
    assert _text(html, "credits-left") == "660"  # 160 plan + 500 pack
    # a new form (a new key) buys again
    client.post(f"/console/plan/{sub.public_id}/packs/", {"pack": "p500",
                                                          "idempotency_key": "another-key"})
    assert CreditPackPurchase.objects.filter(subscription=sub).count() == 2


def test_malformed_pack_forms_are_messages_and_write_nothing(world, client):
    _org, sub, owner, _ = world
    client.force_login(owner)
    for form in ({"pack": "no-such-pack", "idempotency_key": "k1"},
                 {"pack": "p500"},  # no key
                 {"pack": "p500", "idempotency_key": "x" * 300}):
        reply = client.post(f"/console/plan/{sub.public_id}/packs/", form)
        assert reply.status_code == 400
        assert 'class="errorlist' in reply.content.decode()
    # an ended subscription: the service refuses, the form says why
    services.subscription_cancel(subscription=sub, at=timezone.now() - timedelta(minutes=1))
    reply = client.post(f"/console/plan/{sub.public_id}/packs/",
                        {"pack": "p500", "idempotency_key": "k2"})
    assert reply.status_code == 400 and "The subscription is not active." in reply.content.decode()
    assert not CreditPackPurchase.objects.exists()
    assert not AuditEvent.objects.filter(action="credit_pack.purchase").exists()


def test_a_developer_cannot_buy_or_change_and_finance_only_reads(world, client):
    org, sub, _owner, _ = world
    for role in (Role.DEVELOPER, Role.FINANCE, Role.VIEWER):
        client.force_login(MembershipFactory(organization=org, role=role).user)
        html = client.get("/console/plan/").content.decode()
        assert _text(html, "credits-left") == "160"  # everyone reads the credits
        assert 'id="pack-form"' not in html and "Upgrade…" not in html
        for url, form in ((f"/console/plan/{sub.public_id}/packs/",
                           {"pack": "p500", "idempotency_key": f"{role}-1"}),
                          (f"/console/plan/{sub.public_id}/change/",
                           {"plan": "pro", "idempotency_key": f"{role}-2", "expected": ""}),
                          (f"/console/plan/{sub.public_id}/cancel/",
                           {"idempotency_key": f"{role}-3", "expected": ""})):
            reply = client.post(url, form)
            assert reply.status_code == 302 and reply["Location"] == "/console/", (role, url)
        assert client.get(f"/console/plan/{sub.public_id}/change/?plan=pro").status_code == 302
    assert not CreditPackPurchase.objects.exists()
    assert Subscription.objects.get(pk=sub.pk).ends_at is None
    assert Subscription.objects.filter(organization=org).count() == 1


def test_another_organizations_subscription_ids_are_404(world, client):
    _org, sub, owner, _ = world
    other = make_billed_org(name="Other Co")
    theirs = services.subscription_create(organization=other, plan=sub.plan,
                                          starts_at=timezone.now() - timedelta(days=1))
    client.force_login(owner)
    assert client.post(f"/console/plan/{theirs.public_id}/packs/",
                       {"pack": "p500", "idempotency_key": "k"}).status_code == 404
    assert client.get(f"/console/plan/{theirs.public_id}/change/?plan=pro").status_code == 404
    assert client.post(f"/console/plan/{theirs.public_id}/change/",
                       {"plan": "pro", "idempotency_key": "k2", "expected": ""}
                       ).status_code == 404
    assert client.get(f"/console/plan/{theirs.public_id}/cancel/").status_code == 404
    assert client.post(f"/console/plan/{theirs.public_id}/cancel/",
                       {"idempotency_key": "k3", "expected": ""}).status_code == 404
    assert not CreditPackPurchase.objects.exists()
    assert Subscription.objects.get(pk=theirs.pk).ends_at is None


# --- the preview is what the invoice bills -------------------------------------------------

def test_the_preview_of_an_upgrade_is_the_prorated_fees_the_invoice_bills(book):
    """Basic (10.00) from Oct 1 on calendar invoices; Pro (31.00) from Oct 11 00:00.

    October has 31 days. Basic covers Oct 1-11 of its month: 10/31 x 10.00 = 3.2258... ->
    3.23. Pro's months run from Oct 11 (Oct 11 - Nov 11: 31 days); it covers Oct 11 - Nov 1,
    21 days: 21/31 x 31.00 = 21.00. October's invoice: 10.00 before, 3.23 + 21.00 = 24.23
    after. Its November invoice (Nov 1 - Nov 11, the rest of Pro's first month) bills 10/31 x
    31.00 = 10.00.
    """
    basic, pro = _plans()
    org = make_billed_org(name="Upgrade Co", created_at=OCT)
    sub = services.subscription_create(organization=org, plan=basic, starts_at=OCT)
    at = OCT + timedelta(days=10)

    def upgrade(when):
        return services.subscription_change(subscription=sub, plan=pro, at=when,
                                            acting_user=None)

    preview = change_preview(organization=org, change=upgrade, at=at)

    assert (preview.period_start, preview.period_end) == (OCT, NOV)
    assert [ln.amount for ln in preview.before] == [D("10.00")]
    assert [ln.amount for ln in preview.after] == [D("3.23"), D("21.00")]
    assert (preview.fees_before, preview.fees_after) == (D("10.00"), D("24.23"))
    assert preview.difference == D("14.23")
    # the preview changed nothing
    assert Subscription.objects.filter(organization=org).count() == 1
    sub.refresh_from_db()
    assert sub.ends_at is None
    assert not AuditEvent.objects.filter(action="subscription.change").exists()

    # when the change is made, the invoice October closes with bills exactly those lines
    new = upgrade(at)
    invoicing.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False)
    october = Invoice.objects.get(organization=org, period_start=OCT)
    fees = [ln.amount for ln in october.lines.filter(kind=LineKind.PLAN_FEE).order_by("position")]
    assert fees == [D("3.23"), D("21.00")]
    # the billing cycle stays (as Stripe keeps it): November is a calendar month of Pro
    november = upcoming_invoice(organization=org)
    assert (november.target.period_start, november.target.period_end) == (
        NOV, datetime(2026, 12, 1, tzinfo=UTC))
    assert [ln.amount for ln in november.lines if ln.kind == LineKind.PLAN_FEE] == [D("31.00")]
    (row,) = AuditEvent.objects.filter(action="subscription.change")
    assert row.before["plan"] == "basic" and row.after["plan"] == "pro"
    assert row.after["ended"] == sub.public_id and row.target == new.public_id


def test_a_preview_while_the_last_period_is_not_closed_says_so(book):
    """October has ended but is not closed: the open invoice is October's, which a change on
    Nov 5 does not touch (Basic covers all of October either way)."""
    basic, pro = _plans()
    org = make_billed_org(name="Late Co", created_at=OCT)
    sub = services.subscription_create(organization=org, plan=basic, starts_at=OCT)
    preview = change_preview(organization=org, at=OCT.replace(month=11, day=5), change=(
        lambda at: services.subscription_change(subscription=sub, plan=pro, at=at,
                                                acting_user=None)))
    assert preview.later_period and (preview.period_start, preview.period_end) == (OCT, NOV)
    assert preview.fees_before == preview.fees_after == D("10.00")


def test_a_change_moves_unused_pack_credits_and_refuses_what_it_cannot_do(book):
    basic, pro = _plans()
    org = make_billed_org(name="Packs Co", created_at=OCT)
    sub = services.subscription_create(organization=org, plan=basic, starts_at=OCT)
    pack = basic.credit_packs.get()
    bought = services.credit_pack_purchase(subscription=sub, pack=pack,
                                           at=OCT + timedelta(days=1), acting_user=None)
    at = OCT + timedelta(days=10)

    for plan, message in ((basic, "already on this plan"),):
        with pytest.raises(Exception, match=message):
            services.subscription_change(subscription=sub, plan=plan, at=at, acting_user=None)
    euro = make_token_plan(code="euro", name="Euro", currency="EUR")
    with pytest.raises(Exception, match="billed in EUR"):
        services.subscription_change(subscription=sub, plan=euro, at=at, acting_user=None)
    with pytest.raises(Exception, match="not in force"):
        services.subscription_change(subscription=sub, plan=pro, at=OCT - timedelta(days=1),
                                     acting_user=None)

    new = services.subscription_change(subscription=sub, plan=pro, at=at, acting_user=None)
    bought.refresh_from_db()
    assert bought.subscription_id == new.pk
    assert token_plan_status(subscription=new, at=at + timedelta(hours=1)
                             ).pack_credits_left == D("500")
    (row,) = AuditEvent.objects.filter(action="subscription.change")
    assert row.after["credit_packs_moved"] == [bought.public_id]


def test_switching_plans_back_and_forth_hands_out_no_fresh_credits(book):
    """Basic: 1,000 a period, 300 a window; Pro: 5,000, 1,500. 250 + 100 credits used on Basic
    (the second inside the window), then Basic -> Pro -> Basic: each plan starts where the
    last one stood, as the same share of its caps (35 % of the period, 100 of 300 of the
    window), so the round trip ends where it began and the next request is rated against it."""
    basic, pro = _plans()
    org = make_billed_org(name="Switch Co", created_at=OCT)
    sub = services.subscription_create(organization=org, plan=basic, starts_at=OCT)
    at = OCT + timedelta(days=10, hours=12)
    # 100 in + 50 out = 250 credits, 6 h before; 40 in + 20 out = 100 credits, 1 h before
    record(org, "a", at - timedelta(hours=6), model="test-model", prompt_tokens=100,
           completion_tokens=50)
    record(org, "b", at - timedelta(hours=1), model="test-model", prompt_tokens=40,
           completion_tokens=20)

    to_pro = services.subscription_change(subscription=sub, plan=pro, at=at, acting_user=None)
    on_pro = token_plan_status(subscription=to_pro, at=at + timedelta(minutes=1))
    assert (on_pro.period_used, on_pro.window_used) == (D("1750"), D("500"))  # x 5
    back = services.subscription_change(subscription=to_pro, plan=basic,
                                        at=at + timedelta(minutes=2), acting_user=None)
    on_basic = token_plan_status(subscription=back, at=at + timedelta(minutes=3))
    assert (on_basic.period_used, on_basic.window_used) == (D("350"), D("100"))
    assert on_basic.plan_credits_left == D("200")  # the window's 300 less 100, as before

    # the next request (300 in = 300 credits) gets the 200 left in the window; 100 is overage
    record(org, "c", at + timedelta(minutes=4), model="test-model", prompt_tokens=300)
    after = token_plan_status(subscription=back, at=at + timedelta(minutes=5))
    assert (after.period_used, after.window_used, after.overage_credits) == (
        D("550"), D("300"), D("100"))
    rows = AuditEvent.objects.filter(action="subscription.change").order_by("id")
    assert [r.after["period_credits_carried"] for r in rows] == ["1750.000000", "350.000000"]


# --- the console flow: preview, confirm once, refused when the figures moved ----------------

def _confirm(client, url: str, form: dict) -> tuple:
    """GET the preview, POST its confirm form; once again if a cent moved in between (the
    fees are prorated by the second, so a cent boundary may fall between the two)."""
    for _ in range(2):
        html = client.get(url).content.decode()
        expected = re.search(r'name="expected" value="([^"]*)"', html).group(1)
        data = {**form, "idempotency_key": _key(html), "expected": expected}
        reply = client.post(url.split("?")[0], data)
        if reply.status_code == 302:
            return html, data, reply
    raise AssertionError(reply.content.decode())


def test_upgrade_then_cancel_through_the_console(world, client):
    org, sub, owner, _ = world
    client.force_login(owner)

    # the preview shows both plans' prorated fees; nothing changes until confirmed
    html = client.get(f"/console/plan/{sub.public_id}/change/?plan=pro").content.decode()
    assert "Basic → Pro" in html and 'id="fees-after"' in html and "prorated" in html
    assert Subscription.objects.filter(organization=org).count() == 1

    html, data, reply = _confirm(client, f"/console/plan/{sub.public_id}/change/?plan=pro",
                                 {"plan": "pro"})
    assert reply["Location"] == "/console/plan/"
    new = Subscription.objects.get(organization=org, ends_at__isnull=True)
    assert new.plan.code == "pro"
    # billed as previewed: the upcoming invoice's plan fees are the confirmed ones
    fees = [ln.amount for ln in upcoming_invoice(organization=org).lines
            if ln.kind == LineKind.PLAN_FEE]
    assert ",".join(map(str, fees)) == data["expected"]
    # the same form again changes nothing
    again = client.post(f"/console/plan/{sub.public_id}/change/", data, follow=True)
    assert "This form was already sent" in again.content.decode()
    assert Subscription.objects.filter(organization=org).count() == 2
    assert AuditEvent.objects.filter(action="subscription.change",
                                     actor_user_id=owner.pk).count() == 1
    # the page now shows Pro, where Basic stood: 390 of 1,000 used is 1,950 of 5,000
    page = client.get("/console/plan/").content.decode()
    assert "Pro <code>pro</code>" in page and _text(page, "period-left") == "3,050"
    assert "Downgrade…" in page and "Upgrade…" not in page  # Basic is the cheaper one

    # figures that differ from the invoice's are refused, and the change is previewed again
    stale = client.post(f"/console/plan/{new.public_id}/cancel/",
                        {"idempotency_key": "stale", "expected": "999.99"})
    assert stale.status_code == 400
    assert "changed since your preview" in stale.content.decode()
    assert Subscription.objects.get(pk=new.pk).ends_at is None

    _confirm(client, f"/console/plan/{new.public_id}/cancel/", {})
    assert Subscription.objects.get(pk=new.pk).ends_at is not None
    assert AuditEvent.objects.filter(action="subscription.cancel").count() == 1
    page = client.get("/console/plan/").content.decode()
    assert "No plan: every request is billed on-demand" in page
    # and subscribing again from nothing
    _confirm(client, "/console/plan/subscribe/?plan=basic", {"plan": "basic"})
    assert Subscription.objects.get(organization=org, ends_at__isnull=True).plan.code == "basic"


def test_a_damaged_confirm_form_is_a_message_and_changes_nothing(world, client):
    _org, sub, owner, _ = world
    client.force_login(owner)
    reply = client.post(f"/console/plan/{sub.public_id}/change/", {"plan": "pro",
                                                                    "expected": ""})
    assert reply.status_code == 400
    assert "This form is out of date or damaged" in reply.content.decode()
    assert 'id="preview"' in reply.content.decode()  # previewed again, with a new form
    reply = client.post(f"/console/plan/{sub.public_id}/cancel/", {"expected": "1.00"})
    assert reply.status_code == 400
    assert "This form is out of date or damaged" in reply.content.decode()
    assert Subscription.objects.get(pk=sub.pk).ends_at is None
    assert not AuditEvent.objects.filter(action__startswith="subscription.",
                                         actor_user_id=owner.pk).exists()


def test_changing_an_ended_subscription_is_refused_with_a_message(world, client):
    org, sub, owner, _ = world
    client.force_login(owner)
    services.subscription_cancel(subscription=sub, at=timezone.now() - timedelta(minutes=1))
    preview = client.get(f"/console/plan/{sub.public_id}/change/?plan=pro")
    assert preview.status_code == 400
    assert "The subscription is not in force at that time." in preview.content.decode()
    assert 'id="preview"' not in preview.content.decode()
    reply = client.post(f"/console/plan/{sub.public_id}/change/",
                        {"plan": "pro", "idempotency_key": "k", "expected": ""})
    assert reply.status_code == 400
    assert reply.content.decode().count("The subscription is not in force at that time.") == 1
    assert Subscription.objects.filter(organization=org).count() == 1


def test_unknown_plans_are_a_message(world, client):
    org, sub, owner, _ = world
    client.force_login(owner)
    reply = client.get(f"/console/plan/{sub.public_id}/change/?plan=<script>", follow=True)
    assert "Choose one of the plans offered." in reply.content.decode()
    reply = client.post(f"/console/plan/{sub.public_id}/change/",
                        {"plan": "nope", "idempotency_key": "k", "expected": ""})
    assert reply.status_code == 302
    assert Subscription.objects.filter(organization=org).count() == 1


def test_billing_readers_see_the_advisors_recommendation(client, db):
    from tests.plans.test_plan_advisor import october_on_token_plan_o

    org = october_on_token_plan_o()
    client.force_login(MembershipFactory(organization=org, role=Role.FINANCE).user)
    html = client.get("/console/plan/").content.decode()
    assert 'id="advice"' in html and 'href="/console/plan-advice/"' in html
    assert "would have cost <strong>3.70 USD</strong> instead of 11.73 USD" in html
    assert "a saving of <strong>8.03 USD</strong>" in html
    # the panel's figures are kept a while (the advisor replays the period's every event)
    assert cache.get(f"console:plan-advice:{org.public_id}:2026-10-01T00:00:00+00:00"
                     ).saving == D("8.03")
    assert client.get("/console/plan/").content.decode().count("8.03 USD") == 1
    client.force_login(MembershipFactory(organization=org, role=Role.DEVELOPER).user)
    assert 'id="advice"' not in client.get("/console/plan/").content.decode()
