"""The admission client against the real Redis: calls made in one event-loop tick share script
calls (batches of at most ``MAX_BATCH``) and each still runs on its own (an RPM limit holds
exactly; a failing one fails alone), and the client recovers when Redis has lost its script
cache."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
import uuid
from decimal import Decimal

import pytest

from billing_platform.redis_conn import get_aredis
from plans import admission
from plans.admission.runtime import POLICY_OUTAGE_STALE_S, _Reloading
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
    # more calls than one batch holds: several script calls, in flight together
    calls = 3 * admission.MAX_BATCH + 5

    async def run() -> list:
        policy = _policy(rpm=2 * admission.MAX_BATCH + 1)
        try:
            return await asyncio.gather(*(_admit(policy) for _ in range(calls)))
        finally:
            await _cleanup(policy)

    tickets = asyncio.run(run())
    assert len(tickets) == calls
    assert sum(t is not None for t in tickets) == 2 * admission.MAX_BATCH + 1


def test_an_admission_that_fails_in_redis_fails_alone_in_its_batch():
    from redis.exceptions import ResponseError

    async def run() -> tuple:
        good, bad = _policy(rpm=100), _policy(rpm=100)
        # a key of the wrong type under the bad policy's rate key: its script step errors
        await get_aredis().set(bad.rate_scopes[0][0], "not a hash")
        try:
            return await asyncio.gather(_admit(good), _admit(bad), _admit(good),
                                        return_exceptions=True)
        finally:
            await _cleanup(good)
            await _cleanup(bad)

    first, failed, second = asyncio.run(run())
    assert isinstance(first, admission.Ticket) and isinstance(second, admission.Ticket)
    assert isinstance(failed, ResponseError)
    assert "WRONGTYPE" in str(failed)


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


async def _seed_window(policy: admission.QuotaPolicy, counts_by_age: dict[int, int]) -> int:
    """Write admissions ``age`` seconds ago into the policy's first request window; return
    Redis's current second."""
    r = get_aredis()
    now_s = int((await r.time())[0])
    await r.hset(policy.rate_scopes[0][0], mapping={
        "n": sum(counts_by_age.values()), "lo": now_s - max(counts_by_age),
        **{str(now_s - age): count for age, count in counts_by_age.items()}})
    return now_s


def test_request_buckets_leave_the_window_after_61_seconds_and_are_trimmed():
    """A request window older than a minute is trimmed (a path short tests never reach)."""

    async def run() -> tuple:
        policy = _policy(rpm=3)
        # two admissions 62 s ago (out of the window), one 30 s ago (in it)
        now_s = await _seed_window(policy, {62: 2, 30: 1})
        try:
            first = await _admit(policy)
            second = await _admit(policy)
            third = await _admit(policy)
            fields = await get_aredis().hgetall(policy.rate_scopes[0][0])
            return first, second, third, fields, now_s
        finally:
            await _cleanup(policy)

    first, second, third, fields, now_s = asyncio.run(run())
    # the old bucket no longer counts: two more fit beside the one from 30 s ago
    assert first is not None and second is not None and third is None
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    # and the old bucket is gone from Redis, the oldest counted second is the one 30 s ago
    assert str(now_s - 62) not in fields
    assert int(fields["n"]) == 3 and int(fields["lo"]) == now_s - 30


def test_a_refusal_for_requests_says_when_the_oldest_counted_second_leaves():
    async def run() -> Exception:
        policy = _policy(rpm=1)
        await _seed_window(policy, {40: 1})
        try:
            await admission.aadmit(policy, request_id=f"req_{uuid.uuid4().hex}",
                                   tier="default", zone="global", prompt_tokens=10,
                                   max_output=10)
        except admission.QuotaExceeded as exc:
            return exc
        finally:
            await _cleanup(policy)
        raise AssertionError("admitted past the limit")

    refused = asyncio.run(run())
    assert refused.code == "rate_limit_exceeded"
    # the bucket of 40 s ago counts until 61 s after its start: 20-21 s from now
    assert 20 <= int(refused.headers["retry-after"]) <= 22, refused.headers


def test_a_refused_admission_still_trims_the_window_consistently():
    async def run() -> tuple:
        policy = _policy(rpm=1)
        # one admission 62 s ago (leaving the window) and one 30 s ago (in it)
        now_s = await _seed_window(policy, {62: 1, 30: 1})
        try:
            refused = await _admit(policy)
            return refused, await get_aredis().hgetall(policy.rate_scopes[0][0]), now_s
        finally:
            await _cleanup(policy)

    refused, fields, now_s = asyncio.run(run())
    assert refused is None  # the one from 30 s ago fills the limit
    # the stored count is the true one, so the key frees up when that bucket leaves
    assert int(fields["n"]) == 1 and int(fields["lo"]) == now_s - 30
    assert str(now_s - 62) not in fields


@pytest.mark.parametrize(("url", "kind"), [
    ("redis://127.0.0.1:6379/0", "Connection"),
    ("rediss://127.0.0.1:6380/0", "SSLConnection"),
    ("unix:///run/redis/redis.sock?db=0", "UnixDomainSocketConnection")])
def test_every_kind_of_redis_url_gets_connections_that_pack_with_hiredis(url, kind):
    import hiredis
    import redis.asyncio as aioredis

    from billing_platform.redis_conn import async_client

    pool = async_client(url).connection_pool
    connection = pool.connection_class(**pool.connection_kwargs)  # not connected
    # the scheme's own connection kind (TLS, socket file) with hiredis' packer
    assert isinstance(connection, getattr(aioredis, kind))
    assert connection.pack_command("EVALSHA", "abc", 1, "k", 2.5) == [
        hiredis.pack_command(("EVALSHA", "abc", 1, "k", 2.5))]


def test_a_stale_policy_is_served_while_one_reload_runs():
    loads: list[str] = []

    def load(**kwargs):
        loads.append(kwargs["tag"])
        return f"policy {len(loads)}"

    cache = _Reloading(load)

    async def run() -> tuple:
        first = await cache.get("k", tag="a")  # nothing cached: waits for the load
        cache.items["k"] = (cache.items["k"][0] - admission.POLICY_TTL_S - 1, first)  # stale
        # ten concurrent requests on the stale entry: all answered at once, one reload
        stale = await asyncio.gather(*(cache.get("k", tag="b") for _ in range(10)))
        while cache.loading:
            await asyncio.sleep(0.01)
        fresh = await cache.get("k", tag="c")
        # far past its TTL an entry is not served: the request waits for the reload
        cache.items["k"] = (cache.items["k"][0] - admission.POLICY_TTL_S
                            - admission.POLICY_STALE_S - 1, fresh)
        waited = await cache.get("k", tag="d")
        return first, stale, fresh, waited

    first, stale, fresh, waited = asyncio.run(run())
    assert first == "policy 1"
    assert stale == ["policy 1"] * 10
    assert fresh == "policy 2" and loads[:2] == ["a", "b"]
    assert waited == "policy 3" and loads == ["a", "b", "d"]


def test_a_failed_reload_keeps_serving_the_old_policy_and_is_tried_again():
    answers = iter(["old", RuntimeError("database down"), "new"])

    def load(**kwargs):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    cache = _Reloading(load)

    async def run() -> list:
        seen = [await cache.get("k")]
        cache.items["k"] = (cache.items["k"][0] - admission.POLICY_TTL_S - 1, "old")
        seen.append(await cache.get("k"))  # stale served; its reload fails
        while cache.loading:
            await asyncio.sleep(0.01)
        seen.append(await cache.get("k"))  # still the old one; a new reload starts
        while cache.loading:
            await asyncio.sleep(0.01)
        seen.append(await cache.get("k"))
        return seen

    assert asyncio.run(run()) == ["old", "old", "old", "new"]


def test_while_reloads_fail_a_policy_is_served_up_to_the_outage_bound_then_the_error():
    # given a cached policy whose reloads fail (PostgreSQL down)
    answers = iter(["old", *([RuntimeError("database down")] * 5)])

    def load(**kwargs):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    cache = _Reloading(load)

    def age(seconds: float) -> None:
        cache.items["k"] = (time.monotonic() - seconds, "old")

    async def run() -> list:
        seen = [await cache.get("k")]
        # when it is past the age at which a request would wait for its reload
        age(admission.POLICY_TTL_S + admission.POLICY_STALE_S + 1)
        seen.append(await cache.get("k"))  # the awaited reload failed: the old one is kept
        seen.append(await cache.get("k"))  # in the outage, no request waits
        # then past the outage bound the reload's error reaches the request
        age(admission.POLICY_TTL_S + POLICY_OUTAGE_STALE_S + 1)
        with pytest.raises(RuntimeError, match="database down"):
            await cache.get("k")
        return seen

    assert asyncio.run(run()) == ["old", "old", "old"]


def test_settlement_gives_back_unused_tokens_to_every_bucket():
    async def run() -> tuple:
        r = get_aredis()
        policy = _policy(rpm=100)
        policy = dataclasses.replace(policy, tpm=((f"o{policy.org_id}", 10_000),))
        key = policy.rate_scopes[-1][0]
        try:
            ticket = await admission.aadmit(policy, request_id=f"req_{uuid.uuid4().hex}",
                                            tier="default", zone="global", prompt_tokens=1000,
                                            max_output=3000)
            taken = float(await r.hget(key, "t"))
            await admission.asettle(ticket, prompt_tokens=900, completion_tokens=100)
            return taken, float(await r.hget(key, "t"))
        finally:
            await _cleanup(policy)

    taken, settled = asyncio.run(run())
    assert 6000 <= taken < 6010  # 4,000 estimated tokens taken (plus a few ms of refill)
    assert settled - taken == 3000  # 1,000 used: 3,000 given back


def test_a_settlement_not_waited_for_counts_for_the_next_admission_of_the_process():
    async def run() -> tuple[str, str]:
        policy = _policy(rpm=100)
        policy = dataclasses.replace(policy, tpm=((f"o{policy.org_id}", 10_000),))
        try:
            first = await admission.aadmit(policy, request_id=f"req_{uuid.uuid4().hex}",
                                           tier="default", zone="global", prompt_tokens=1000,
                                           max_output=3000)
            # when it is settled without waiting (1,000 of its 4,000 tokens used)
            await admission.asettle(first, prompt_tokens=900, completion_tokens=100,
                                    wait=False)
            second = await admission.aadmit(policy, request_id=f"req_{uuid.uuid4().hex}",
                                            tier="default", zone="global", prompt_tokens=1000,
                                            max_output=3000)
            return (first.headers["x-ratelimit-remaining-tokens"],
                    second.headers["x-ratelimit-remaining-tokens"])
        finally:
            await _cleanup(policy)

    first, second = asyncio.run(run())
    # then the next admission saw the 3,000 given back: 10,000 - 1,000 - 4,000 left
    assert 6000 <= int(first) < 6010
    assert 5000 <= int(second) < 5010
