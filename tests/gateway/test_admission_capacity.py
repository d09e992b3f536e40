"""Provisioned capacity and token-plan credits at admission: a request that fits the
reservation's burndown is ``provisioned`` (and runs in its region), the rest spills over to
on-demand or is refused by the reservation's policy; a blocking token plan with no credits
left answers 429 ``plan_quota_exhausted``."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import httpx
from django.db.models import Sum

from metering.models import UsageEvent
from plans import services as plan_services
from plans.models import TokenPlanUsage
from tests.conftest import wait_until
from tests.factories import (
    OrganizationFactory,
    ProjectFactory,
    make_key,
    make_offering,
    make_token_plan,
)
from tests.gateway.conftest import drain_usage


def _chat(gateway, secret: str, max_tokens: int = 300) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {secret}"},
                      json={"model": "small", "max_tokens": max_tokens, "ignore_eos": True,
                            "messages": [{"role": "user", "content": "hi"}]})


def _org_with_units(policy: str):
    org = OrganizationFactory()
    _key, secret = make_key(project=ProjectFactory(organization=org), scopes=["inference"])
    offering = make_offering(model="small", region="us-east", tokens_per_minute_per_unit=1000,
                             output_burndown="1")
    plan_services.reservation_create(organization=org, offering=offering, units=1,
                                     term="monthly", overflow_policy=policy)
    return org, secret


def test_provisioned_until_the_burndown_is_used_then_spillover(live_gateway):
    # given one unit of 1,000 normalized tokens per minute in us-east
    _org, secret = _org_with_units("spillover")

    # when requests of up to ~320 normalized tokens each arrive, until one spills over
    responses = []
    for _ in range(12):
        responses.append(_chat(live_gateway, secret))
        if responses[-1].headers.get("x-tollgate-capacity") == "spillover":
            break

    # then the first ones fit the reservation (and run in its region), then it spills over
    assert {r.status_code for r in responses} == {200}
    marks = [r.headers.get("x-tollgate-capacity") for r in responses]
    assert marks[-1] == "spillover" and set(marks[:-1]) == {"provisioned"}
    assert 3 <= len(marks) - 1 <= 4, marks  # 1,000 tokens/min hold about three requests
    assert {r.headers["x-tollgate-region"] for r in responses[:-1]} == {"us-east"}
    ids = [r.headers["x-request-id"] for r in responses]

    def ingested():
        drain_usage()
        return UsageEvent.objects.filter(request_id__in=ids).count() == len(ids)

    wait_until(ingested, timeout=10, what="events ingested")
    sources = dict(UsageEvent.objects.filter(request_id__in=ids)
                   .values_list("request_id", "capacity_source"))
    assert [sources[i] for i in ids] == marks


def test_a_reservation_that_rejects_overflow_answers_429(live_gateway):
    _org, secret = _org_with_units("reject")
    assert _chat(live_gateway, secret, max_tokens=900).status_code == 200
    refused = _chat(live_gateway, secret, max_tokens=900)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert refused.headers["x-tollgate-capacity"] == "provisioned"
    assert int(refused.headers["retry-after"]) >= 1


def test_a_blocking_token_plan_is_never_overdrawn_under_concurrency(live_gateway):
    # given a token plan that blocks at 200 credits a period (1 credit per token)
    org = OrganizationFactory()
    _key, secret = make_key(project=ProjectFactory(organization=org), scopes=["inference"])
    plan = make_token_plan(cap_policy="block", credits_per_period="200", window_credits=None,
                           coefficients=[{"model": "small", "token_class": t, "coefficient": "1"}
                                         for t in ("input", "cached_input", "output")])
    sub = plan_services.subscription_create(organization=org, plan=plan,
                                            starts_at=datetime(2026, 1, 1, tzinfo=UTC))

    # when 30 requests arrive at once, then more until one is refused
    with ThreadPoolExecutor(10) as pool:
        responses = list(pool.map(lambda _: _chat(live_gateway, secret, max_tokens=20),
                                  range(30)))
    for _ in range(20):
        responses.append(_chat(live_gateway, secret, max_tokens=20))
        if responses[-1].status_code == 429:
            break

    # then refusals say plan_quota_exhausted, and the credits rated never exceed the plan's
    assert responses[-1].status_code == 429
    assert {r.json()["error"]["code"] for r in responses if r.status_code == 429} == {
        "plan_quota_exhausted"}
    assert "retry-after" in responses[-1].headers
    ids = [r.headers["x-request-id"] for r in responses if r.status_code == 200]

    def rated():
        drain_usage()
        return TokenPlanUsage.objects.filter(subscription=sub).count() == len(ids)

    wait_until(rated, timeout=15, what="every admitted request rated against the plan")
    used = TokenPlanUsage.objects.filter(subscription=sub).aggregate(
        plan=Sum("plan_credits"), over=Sum("overage_credits"))
    worst = 24 + 20  # prompt bound of "user: hi" + max_tokens, at 1 credit per token
    assert used["over"] == 0
    assert 200 - worst < used["plan"] <= 200, used
