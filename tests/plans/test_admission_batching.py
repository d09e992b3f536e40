"""The admission client against the real Redis: calls made in one event-loop tick share one
pipeline and each still runs its own atomic script (an RPM limit holds exactly), a lone call
skips the pipeline, and both recover when Redis has lost its script cache."""

from __future__ import annotations

import asyncio
import random
import uuid
from decimal import Decimal

import pytest

from billing_platform.redis_conn import get_aredis
from plans import admission
from plans.pricing import ModelPricing, PriceSet


def _policy(rpm: int) -> admission.QuotaPolicy:
    org = random.randrange(10**9, 2 * 10**9)  # ids no real org has
    prices = PriceSet(Decimal("0.50"), Decimal("0.05"), Decimal("1.50"), Decimal("0.50"))
    pricing = ModelPricing(version_id=1, currency="USD", model="m", base=prices, bands=(),
                           tier={}, zone={})
    return admission.QuotaPolicy(
        org_id=org, project_id=org, key_id=org, rpm=((f"k{org}", rpm),),
        tpm=((f"k{org}", 10**9),), budgets=(), pricing=pricing, allowed_regions=None)


async def _admit(policy: admission.QuotaPolicy) -> admission.Ticket | None:
    try:
        return await admission.aadmit(policy, request_id=f"req_{uuid.uuid4().hex}",
                                      tier="default", zone="global", prompt_tokens=10,
                                      max_output=10)
    except admission.QuotaExceeded:
        return None


async def _cleanup(policy: admission.QuotaPolicy) -> None:
    r = get_aredis()
    keys = [k async for k in r.scan_iter(match=f"tg:q:{{o{policy.org_id}}}:*")]
    if keys:
        await r.delete(*keys)


def test_admissions_made_in_one_tick_are_each_answered_and_the_limit_holds_exactly():
    async def run() -> list:
        policy = _policy(rpm=10)
        try:
            return await asyncio.gather(*(_admit(policy) for _ in range(25)))
        finally:
            await _cleanup(policy)

    tickets = asyncio.run(run())
    assert sum(t is not None for t in tickets) == 10


@pytest.mark.parametrize("concurrent", [1, 5])
def test_admission_recovers_when_redis_lost_its_scripts(concurrent):
    async def run() -> list:
        policy = _policy(rpm=100)
        try:
            assert await _admit(policy) is not None  # scripts loaded
            await get_aredis().script_flush()  # as after a Redis restart
            return await asyncio.gather(*(_admit(policy) for _ in range(concurrent)))
        finally:
            await _cleanup(policy)

    tickets = asyncio.run(run())
    assert len(tickets) == concurrent and all(t is not None for t in tickets)
