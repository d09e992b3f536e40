"""Per-end-user budgets at the gateway (issue 20 item 4): a reseller's end users (the ``user`` a
request names) are each held to their hard monthly budget, in the same atomic admission as
every other quota, through the official SDKs against a live gateway, real Redis and a
simulated engine.

Each end user's spend reaches its budget to within one request's worst case and never passes
it, even with many callers at once; other end users, and requests naming none, are served
meanwhile; Anthropic's ``metadata.user_id`` is the same end user; the budget holds after
Redis loses its count (seeded from the rated events); and a batch line beyond its end user's
budget fails alone while the batch goes on.
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import anthropic
import openai
import pytest
from django.db.models import Sum

from billing_platform.gateway.models import BatchLine
from billing_platform.redis_conn import get_redis
from engine_adapter.sim.testing import FAST_RATES, start_sim
from metering.models import UsageEvent
from plans import admission, quotas
from tests.factories import OrganizationFactory, ProjectFactory, make_key, make_price_book
from tests.gateway.conftest import drain_usage, register_engine, start_gateway, stop_gateway
from tests.gateway.test_batch_api import run_here
from tests.security.test_admission_bounds import HI, MICRO, SMALL, TOKENS, _ingested

DEFAULT = Decimal("0.002")  # each end user's, about 25 requests
VIP = Decimal("0.004")


@pytest.fixture
def gateway(transactional_db, tmp_path, settings, metering_stream):
    settings.FILES_DIR = str(tmp_path / "files")
    settings.BATCH_HOST_CPU_CEILING = 1.0  # other tests share this machine's CPUs
    make_price_book(prices=[SMALL])
    sim = start_sim(served_model_name="small", max_running_requests=256, **FAST_RATES)
    register_engine(sim, pool="small-us", region="us-east", zone="us")
    gw = start_gateway(tmp_path, env={**metering_stream, "TOLLGATE_FILES_DIR": settings.FILES_DIR})
    yield gw
    stop_gateway(gw)
    sim.stop()


@pytest.fixture
def reseller(gateway):
    """An organization with a default budget for each end user and a larger one for "vip"."""
    org = OrganizationFactory()
    _key, secret = make_key(project=ProjectFactory(organization=org),
                            scopes=["inference", "batch"])
    quotas.end_user_budget_set(organization=org, end_user=None, amount=DEFAULT,
                               acting_user=None)
    quotas.end_user_budget_set(organization=org, end_user="vip", amount=VIP, acting_user=None)
    time.sleep(admission.POLICY_TTL_S)  # the gateway's cached policy reads them back
    return org, openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=secret, max_retries=0), \
        anthropic.Anthropic(base_url=gateway.url, api_key=secret, max_retries=0)


def _worst() -> Decimal:
    bound = admission.prompt_token_bound("user: hello there", 1)
    return (bound * Decimal(SMALL["input"]) + TOKENS * Decimal(SMALL["output"])) * MICRO


def _spend(org, end_user: str) -> Decimal:
    return UsageEvent.objects.filter(organization=org, end_user=end_user).aggregate(
        s=Sum("amount"))["s"] or Decimal(0)


def _until_refused(client: openai.OpenAI, end_user: str, callers: int):
    """Send as ``callers`` clients at once until the month's refusal; return the served ids,
    the refusals by (status, code) and the month's refusal."""
    def caller(_: int):
        ids, refusals = [], Counter()
        for _attempt in range(400):
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model="small", messages=HI, max_tokens=TOKENS, user=end_user,
                    extra_body={"ignore_eos": True})
            except openai.APIStatusError as exc:
                refusals[(exc.status_code, exc.code)] += 1
                if exc.status_code == 429 and int(exc.response.headers["retry-after"]) > 60:
                    return ids, refusals, exc
                time.sleep(0.02)  # others' reservations: "retry in a second"
                continue
            ids.append(raw.headers["x-request-id"])
        return ids, refusals, None

    with ThreadPoolExecutor(callers) as pool:
        results = list(pool.map(caller, range(callers)))
    ids = [i for r in results for i in r[0]]
    final = next(r[2] for r in results if r[2] is not None)
    return ids, sum((r[1] for r in results), Counter()), final


def test_each_end_user_spends_up_to_its_budget_and_no_further(reseller):
    org, client, claude = reseller

    # when 16 callers at once send for one end user until it is refused for the month
    ids, refusals, final = _until_refused(client, "alice", callers=16)

    # then every refusal was that end user's limit, naming it, and its spend is within one
    # worst case below the default budget and never above it
    assert set(refusals) == {(429, "end_user_spend_limit_exceeded")}
    assert "alice" in final.message
    _ingested(ids)
    spend = _spend(org, "alice")
    assert DEFAULT - _worst() < spend <= DEFAULT, spend

    # meanwhile another end user, and a request naming none, are served
    assert client.chat.completions.create(model="small", messages=HI, max_tokens=4,
                                          user="bob").usage.completion_tokens > 0
    assert client.chat.completions.create(model="small", messages=HI,
                                          max_tokens=4).usage.completion_tokens > 0
    # Anthropic's metadata.user_id is the same end user: refused too (the same worst case as
    # the refused requests: what is left is less than that), in Anthropic's shape
    with pytest.raises(anthropic.RateLimitError) as refused:
        claude.messages.create(model="small", max_tokens=TOKENS, messages=HI,
                               metadata={"user_id": "alice"})
    assert "alice" in refused.value.body["error"]["message"]

    # an end user with a budget of its own gets that one
    vip_ids, _refusals, _final = _until_refused(client, "vip", callers=4)
    _ingested(vip_ids)
    assert VIP - _worst() < _spend(org, "vip") <= VIP


def test_the_limit_holds_after_redis_loses_the_count(reseller):
    org, client, _claude = reseller
    ids, _refusals, _final = _until_refused(client, "carol", callers=4)
    _ingested(ids)
    before = _spend(org, "carol")

    # when Redis loses the end user's count (a flush, a failover)
    budget = quotas.end_user_budgets_of(organization=org).get(end_user__isnull=True)
    rule = admission.end_user_rule(budget_id=budget.id, limit=DEFAULT, end_user="carol")
    key = admission.rule_key(org.id, rule, admission.month_tag())
    assert get_redis().delete(key) == 1

    # then the next request is still refused: the count is seeded from the rated events
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model="small", messages=HI, max_tokens=TOKENS,
                                       user="carol")
    assert refused.value.code == "end_user_spend_limit_exceeded"
    drain_usage()
    assert _spend(org, "carol") == before


def test_batch_lines_beyond_an_end_users_budget_fail_alone(reseller):
    # given an end user whose budget cannot cover one line's worst case, even at batch prices
    org, client, _claude = reseller
    quotas.end_user_budget_set(organization=org, end_user="dave", amount=Decimal("0.000001"),
                               acting_user=None)
    time.sleep(admission.POLICY_TTL_S)

    lines = [{"custom_id": f"{user}-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "small", "messages": HI, "max_tokens": 4, "user": user}}
             for i in range(3) for user in ("dave", "erin")]
    batch = run_here(client, lines, "/v1/chat/completions")

    outcome = {x.custom_id: (x.state, x.status_code) for x in
               BatchLine.objects.filter(batch=batch)}
    assert outcome == {**{f"dave-{i}": ("failed", 429) for i in range(3)},
                       **{f"erin-{i}": ("completed", 200) for i in range(3)}}
    assert batch.status == "completed"
    refusal = BatchLine.objects.filter(batch=batch, custom_id="dave-0").get().response
    assert refusal["error"]["code"] == "end_user_spend_limit_exceeded"
    drain_usage()
    assert _spend(org, "dave") == 0 and _spend(org, "erin") > 0
