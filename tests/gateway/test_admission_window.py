"""A blocking token plan's rolling window, enforced in the one atomic admission step: concurrent
requests never overshoot it, and a window Redis has not seen yet starts from the ledger.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import httpx
from django.db.models import Sum

from plans import services as plan_services
from plans.models import TokenPlanUsage
from plans.periods import period_bounds
from tests.conftest import wait_until
from tests.factories import OrganizationFactory, ProjectFactory, make_key, make_token_plan
from tests.gateway.conftest import drain_usage

WORST = 24 + 20  # prompt bound of "user: hi" + max_tokens, at 1 credit per token


def _chat(gateway, secret: str) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {secret}"},
                      json={"model": "small", "max_tokens": 20, "ignore_eos": True,
                            "messages": [{"role": "user", "content": "hi"}]})


def _windowed_plan_org():
    """An org on a blocking plan: 200 credits per 5 hours, 100,000 per period."""
    org = OrganizationFactory()
    _key, secret = make_key(project=ProjectFactory(organization=org), scopes=["inference"])
    plan = make_token_plan(cap_policy="block", credits_per_period="100000",
                           window_credits="200", window_hours=5,
                           coefficients=[{"model": "small", "token_class": t, "coefficient": "1"}
                                         for t in ("input", "cached_input", "output")])
    sub = plan_services.subscription_create(organization=org, plan=plan,
                                            starts_at=datetime(2026, 1, 1, tzinfo=UTC))
    return sub, secret


def _refusals(responses: list[httpx.Response]) -> list[dict]:
    return [r.json()["error"] for r in responses if r.status_code == 429]


def test_concurrent_requests_never_overshoot_the_rolling_window(live_gateway):
    # given a blocking plan whose 5-hour window (200 credits) binds long before its period
    sub, secret = _windowed_plan_org()

    # when 30 requests arrive at once, then more until one is refused
    with ThreadPoolExecutor(10) as pool:
        responses = list(pool.map(lambda _: _chat(live_gateway, secret), range(30)))
    for _ in range(20):
        responses.append(_chat(live_gateway, secret))
        if responses[-1].status_code == 429:
            break

    # then every refusal is plan_quota_exhausted for the window
    assert responses[-1].status_code == 429
    errors = _refusals(responses)
    assert {e["code"] for e in errors} == {"plan_quota_exhausted"}
    assert all("5-hour window" in e["message"] for e in errors), errors
    assert int(responses[-1].headers["retry-after"]) >= 1
    ids = [r.headers["x-request-id"] for r in responses if r.status_code == 200]

    def rated():
        drain_usage()
        return TokenPlanUsage.objects.filter(subscription=sub).count() == len(ids)

    wait_until(rated, timeout=15, what="every admitted request rated against the plan")
    used = TokenPlanUsage.objects.filter(subscription=sub).aggregate(
        plan=Sum("plan_credits"), over=Sum("overage_credits"))
    # and the credits consumed stay within one request's worst case below the window's cap
    assert used["over"] == 0
    assert 200 - WORST < used["plan"] <= 200, used


def test_the_window_starts_from_the_ledger_and_forgets_what_left_it(live_gateway):
    # given a ledger holding 1,000 credits from 6 hours ago (outside the window) and 150
    # from an hour ago (inside it)
    sub, secret = _windowed_plan_org()
    now = datetime.now(tz=UTC)
    for hours_ago, credits in ((6, "1000"), (1, "150")):
        at = now - timedelta(hours=hours_ago)
        TokenPlanUsage.objects.create(
            subscription=sub, request_id=f"req_{uuid.uuid4().hex}", event_time=at,
            period_start=period_bounds(sub.billing_anchor, at)[0],
            plan_credits=Decimal(credits), pack_credits=Decimal("0"),
            overage_credits=Decimal("0"))

    # when two requests follow each other
    first = _chat(live_gateway, secret)
    second = _chat(live_gateway, secret)

    # then the first fits what the window has left (50 credits) and the second does not
    assert first.status_code == 200, first.text
    assert second.status_code == 429
    assert second.json()["error"]["code"] == "plan_quota_exhausted"
