"""Quota leases against the real Redis: a busy policy's requests are admitted in the process from
a share of its limits taken in one script call, and Redis ends where admitting each request
alone would have left it: every request counted once, every budget's spend exact, nothing left
reserved, no limit passed (near a limit leases shrink away), and what requests still in flight
hold stays reserved when a lease ends before they do."""

from __future__ import annotations

import asyncio
import random
import uuid
from dataclasses import replace
from decimal import Decimal

import pytest
from prometheus_client import REGISTRY

from billing_platform.redis_conn import get_aredis
from plans import admission
from plans.admission import lease
from plans.admission.runtime import _carry_lease, _Reloading
from plans.pricing import ModelPricing, PriceSet

PROMPT, MAX_OUTPUT = 100, 50  # each request's bounds
USED = {"prompt_tokens": 90, "cached_tokens": 10, "completion_tokens": 40}  # what each used


def _policy(*, rpm: int = 10**6, budget: str | None = "1000", org: int | None = None
            ) -> admission.QuotaPolicy:
    org = org or random.randrange(10**9, 2 * 10**9)  # ids no real org has
    prices = PriceSet(Decimal("0.50"), Decimal("0.05"), Decimal("1.50"), Decimal("0.50"))
    pricing = ModelPricing(version_id=1, currency="USD", model="m", base=prices, bands=(),
                           tier={}, zone={})
    budgets = () if budget is None else (admission.BudgetRule(
        budget_id=org, scope="organization", limit=Decimal(budget), hard=True,
        spent_seed=Decimal("0"), suspended=False),)
    return admission.QuotaPolicy(
        org_id=org, project_id=org, key_id=org, rpm=((f"o{org}", rpm), (f"k{org}", rpm)),
        tpm=((f"k{org}", 10**9),), budgets=budgets, pricing=pricing, allowed_regions=None)


WORST = admission.worst_case_micro(_policy().pricing, tier="default", zone="global",
                                   prompt_tokens=PROMPT, max_output=MAX_OUTPUT)
ACTUAL = admission.actual_micro(_policy().pricing, tier="default", zone="global", **USED)


async def _admit(policy: admission.QuotaPolicy) -> admission.Ticket | None:
    try:
        return await admission.aadmit(policy, request_id=f"req_{uuid.uuid4().hex}",
                                      tier="default", zone="global", prompt_tokens=PROMPT,
                                      max_output=MAX_OUTPUT)
    except admission.QuotaExceeded:
        return None


async def _burst(policy: admission.QuotaPolicy, n: int) -> list[admission.Ticket | None]:
    return list(await asyncio.gather(*(_admit(policy) for _ in range(n))))


async def _settle(tickets: list[admission.Ticket | None]) -> None:
    await asyncio.gather(*(admission.asettle(t, **USED) for t in tickets if t is not None))


async def _state(policy: admission.QuotaPolicy) -> dict:
    """Redis's view of the policy's organization: requests counted per rate key, the budget,
    the reservations."""
    r = get_aredis()
    rate = {}
    for key, _rpm, _tpm in policy.rate_scopes:
        h = await r.hgetall(key)
        seconds = sum(int(v) for f, v in h.items() if f.isdigit())
        rate[key] = (int(h.get("n", 0)), seconds)
    budget = {}
    if policy.budgets:
        budget = await r.hgetall(policy.budget_keys(admission.month_tag())[0])
    return {"rate": rate, "budget": budget,
            "reservations": await r.zrange(admission.reservations_key(policy.org_id), 0, -1)}


async def _cleanup(policy: admission.QuotaPolicy) -> None:
    r = get_aredis()
    keys = [k async for k in r.scan_iter(match=f"tg:q:{{o{policy.org_id}}}:*")]
    if keys:
        await r.delete(*keys)


async def _quiesce() -> int:
    """Give back every lease, and let what settlements sent without waiting reach Redis."""
    given_back = await admission.aclose_leases()
    await asyncio.sleep(0.05)
    return given_back


def _decisions() -> dict[str, float]:
    """``tollgate_admission_seconds``'s count per outcome (this process's, as /metrics has it)."""
    return {o: REGISTRY.get_sample_value("tollgate_admission_seconds_count", {"outcome": o})
            or 0.0 for o in ("admitted", "leased")}


def _delta(before: dict[str, float]) -> dict[str, int]:
    return {o: int(v - before[o]) for o, v in _decisions().items()}


async def _evalsha_calls() -> int:
    stats = await get_aredis().info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def test_a_burst_is_admitted_from_leases_and_redis_ends_as_if_each_came_alone():
    n = 300

    async def run():
        policy = _policy()
        try:
            calls = await _evalsha_calls()
            tickets = await _burst(policy, n)
            await _settle(tickets)
            given_back = await _quiesce()
            calls = await _evalsha_calls() - calls
            return tickets, given_back, calls, await _state(policy)
        finally:
            await _cleanup(policy)

    tickets, given_back, calls, state = asyncio.run(run())
    assert all(t is not None for t in tickets)
    leased = [t for t in tickets if t.lease is not None]
    assert len(leased) > n // 2 and given_back >= 1
    # far fewer script calls than requests (each call carries one tick's operations)
    assert calls < n // 10, calls
    # each request counted once, in one second's bucket, under every rate key
    assert set(state["rate"].values()) == {(n, n)}
    # spend exact to the micro-unit, nothing left reserved
    assert state["budget"] == {"spent": str(n * ACTUAL), "reserved": "0"}
    assert state["reservations"] == []
    # every request saw its own remaining count, as if admitted alone
    remaining = sorted(int(t.headers["x-ratelimit-remaining-requests"]) for t in tickets)
    assert remaining == list(range(10**6 - n, 10**6))


def test_the_metrics_tell_decisions_from_a_lease_apart_from_those_taken_in_redis():
    # given a busy policy: a burst's requests all wait for its lease to be taken in Redis
    async def run():
        policy = _policy()
        try:
            first = _decisions()
            burst = await _burst(policy, 100)
            after_burst = _delta(first)
            # when more come one after another while the lease lasts
            then = _decisions()
            one_by_one = [await _admit(policy) for _ in range(20)]
            after_sequence = _delta(then)
            await _settle(burst + one_by_one)
            await _quiesce()
            return after_burst, after_sequence
        finally:
            await _cleanup(policy)

    after_burst, after_sequence = asyncio.run(run())
    # then the burst counts as admitted (it waited for Redis), the sequence as leased (it did
    # not; one may open the next second's lease), every decision once
    assert after_burst == {"admitted": 100, "leased": 0}
    assert sum(after_sequence.values()) == 20 and after_sequence["leased"] >= 18


@pytest.mark.parametrize("limit", ["rpm", "budget"])
def test_near_a_limit_leases_shrink_away_and_the_limit_holds_exactly(limit):
    allowed = 150
    n = 300

    async def run():
        if limit == "rpm":
            policy = _policy(rpm=allowed)
        else:  # a budget with room for exactly ``allowed`` worst cases
            policy = _policy(budget=str(Decimal(allowed * WORST + WORST // 2) / 10**6))
        try:
            tickets = await _burst(policy, n)
            admitted = [t for t in tickets if t is not None]
            await _settle(admitted)
            await _quiesce()
            return tickets, await _state(policy)
        finally:
            await _cleanup(policy)

    tickets, state = asyncio.run(run())
    admitted = [t for t in tickets if t is not None]
    assert len(admitted) == allowed
    assert any(t.lease is not None for t in admitted)  # leases served part of the burst
    assert set(state["rate"].values()) == {(allowed, allowed)}
    assert state["budget"]["reserved"] == "0"
    assert state["budget"]["spent"] == str(allowed * ACTUAL)


def test_two_holders_of_one_key_never_pass_its_limit_together():
    # two gateway processes: two policy objects of one key, each with leases of its own
    allowed = 240

    async def run():
        a = _policy(rpm=allowed)
        b = _policy(rpm=allowed, org=a.org_id)
        try:
            first = await asyncio.gather(_burst(a, 150), _burst(b, 150))
            await _quiesce()  # what leases held unused is counted no more
            # sent one at a time, the rest of the limit is admitted and no more
            rest = [await _admit(a) for _ in range(allowed)]
            await _quiesce()
            return [t for ts in first for t in ts], rest, await _state(a)
        finally:
            await _cleanup(a)

    first, rest, state = asyncio.run(run())
    admitted = sum(t is not None for t in first) + sum(t is not None for t in rest)
    assert admitted == allowed
    assert set(state["rate"].values()) == {(allowed, allowed)}


def test_a_limit_under_64_is_never_leased_so_holders_of_one_key_admit_it_exactly():
    # an RPM of 60 split over two processes' bursts: no lease ever holds part of it unused
    async def run():
        a = _policy(rpm=60)
        b = _policy(rpm=60, org=a.org_id)
        try:
            return await asyncio.gather(_burst(a, 80), _burst(b, 80))
        finally:
            await _cleanup(a)

    first, second = asyncio.run(run())
    admitted = [t for t in first + second if t is not None]
    assert len(admitted) == 60
    assert all(t.lease is None for t in admitted)


def test_requests_in_flight_keep_their_reservations_when_their_lease_ends():
    n = 120

    async def run():
        policy = _policy()
        try:
            tickets = await _burst(policy, n)
            leased = [t for t in tickets if t and t.lease is not None]
            unleased = [t for t in tickets if t and t.lease is None]
            await _settle(unleased + leased[:20])
            await asyncio.sleep(1.1)  # a lease ends with its second
            during = await _state(policy)
            await _settle(leased[20:])
            await asyncio.sleep(0.05)  # the last settlement's giveback is sent, not waited for
            return len(leased), during, await _state(policy)
        finally:
            await _cleanup(policy)

    leased, during, after = asyncio.run(run())
    in_flight = leased - 20
    assert in_flight > 0
    # what the requests in flight may still cost stays reserved (under members that expire),
    # and what the settled ones spent is added
    assert during["budget"]["reserved"] == str(in_flight * WORST)
    assert during["budget"]["spent"] == str((n - in_flight) * ACTUAL)
    assert sum(int(m.split()[-1]) for m in during["reservations"]) == in_flight * WORST
    assert after["budget"] == {"spent": str(n * ACTUAL), "reserved": "0"}
    assert after["reservations"] == []
    assert set(after["rate"].values()) == {(n, n)}


def test_with_leases_turned_off_every_request_is_decided_in_redis(monkeypatch):
    monkeypatch.setattr(lease, "LEASE_MAX", 0)  # TOLLGATE_QUOTA_LEASE_MAX=0

    async def run():
        policy = _policy()
        try:
            tickets = await _burst(policy, 100)
            await _settle(tickets)
            return tickets, await _state(policy)
        finally:
            await _cleanup(policy)

    before = _decisions()
    tickets, state = asyncio.run(run())
    assert all(t is not None and t.lease is None for t in tickets)
    assert _delta(before) == {"admitted": 100, "leased": 0}
    assert state["budget"] == {"spent": str(100 * ACTUAL), "reserved": "0"}


def test_the_web_process_gives_its_leases_back_when_it_shuts_down():
    from billing_platform.gateway.asgi import lifespan

    async def run():
        policy = _policy()
        inbox: asyncio.Queue = asyncio.Queue()
        sent: list[str] = []

        async def send(message):
            sent.append(message["type"])

        server = asyncio.create_task(lifespan(inbox.get, send))  # as uvicorn runs it
        try:
            await inbox.put({"type": "lifespan.startup"})
            # at the start of a Redis second, so that its leases live on after the burst
            _secs, micros = await get_aredis().time()
            await asyncio.sleep(1.02 - micros / 1e6)
            tickets = await _burst(policy, 100)  # leases taken, most of them left unused
            await _settle(tickets)
            held = await _state(policy)
            await inbox.put({"type": "lifespan.shutdown"})
            await asyncio.wait_for(server, 5)
            assert all(t is not None for t in tickets)
            return held, sent, await _state(policy)
        finally:
            await _cleanup(policy)

    held, sent, after = asyncio.run(run())
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    # while the process ran, its leases held more than it used ...
    assert any(n > 100 for n, _s in held["rate"].values())
    assert int(held["budget"]["reserved"]) > 0
    # ... and at shutdown it gave all of that back
    assert set(after["rate"].values()) == {(100, 100)}
    assert after["budget"] == {"spent": str(100 * ACTUAL), "reserved": "0"}
    assert after["reservations"] == []


def test_a_reloaded_policy_keeps_its_lease_unless_its_terms_changed():
    # given a busy policy holding a lease, cached as the gateway caches policies, whose reloads
    # read it back with more spend seeded (terms unchanged), then with a lower RPM limit
    first = _policy()
    org = first.org_id
    seeded = replace(first, budgets=tuple(replace(b, spent_seed=Decimal("3")) for b in
                                          first.budgets))
    lowered = replace(first, rpm=((f"o{org}", 10**5), (f"k{org}", 10**5)))
    loads = iter([first, seeded, lowered])
    cache = _Reloading(lambda: next(loads), _carry_lease)

    async def reload() -> admission.QuotaPolicy:
        cache.items["k"] = (cache.items["k"][0] - admission.POLICY_TTL_S - 1,
                            cache.items["k"][1])
        await cache.get("k")  # the stale one, while the reload runs
        while cache.loading:
            await asyncio.sleep(0.001)
        return await cache.get("k")

    async def run():
        try:
            policy = await cache.get("k")
            tickets = await _burst(policy, 50)
            assert tickets[-1].lease is not None
            # when it is reloaded unchanged, its next request is admitted from the lease
            # (or, the lease's second over, a new one the demand it carried asks for)
            again = await reload()
            assert again is seeded
            kept = await _admit(again)
            # and when it is reloaded with another limit, the lease is given back at once
            # and the new terms start afresh: the next request is decided in Redis
            changed = await reload()
            assert changed is lowered
            await asyncio.sleep(0.01)  # the giveback reaches Redis
            counted = (await _state(first))["rate"]
            fresh = await _admit(changed)
            await _settle([*tickets, kept, fresh])
            await _quiesce()
            return kept, counted, fresh, await _state(first)
        finally:
            await _cleanup(first)

    kept, counted, fresh, state = asyncio.run(run())
    assert kept.lease is not None
    # the lease's unused requests no longer count: only the 51 admitted ones do
    assert {n for n, _seconds in counted.values()} == {51}
    assert fresh.lease is None
    # every request counted once, spend exact, nothing left reserved
    assert set(state["rate"].values()) == {(52, 52)}
    assert state["budget"] == {"spent": str(52 * ACTUAL), "reserved": "0"}
    assert state["reservations"] == []


def test_a_steadily_busy_policy_takes_its_next_lease_ahead_and_never_waits_for_redis():
    # given a busy policy (a burst took its first lease, sized for the burst's demand)
    async def run():
        policy = _policy()
        try:
            burst = await _burst(policy, 20)
            before = _decisions()
            # when it sends one request a millisecond for 1.3 s: past the end of a second
            # (and of its first lease's requests, sized for less than this rate)
            loop = asyncio.get_running_loop()
            start, steady = loop.time(), []
            while loop.time() - start < 1.3:
                steady.append(await _admit(policy))
                await asyncio.sleep(0.001)
            decided = _delta(before)
            await _settle(burst + steady)
            await _quiesce()
            return len(steady), decided, await _state(policy)
        finally:
            await _cleanup(policy)

    n, decided, state = asyncio.run(run())
    # then each of its next leases was taken before the one in use ended or ran out: no
    # request waited for Redis (on a loaded machine, a loop stalled past a lease's end may
    # make one wait at each of the two seconds' ends 1.3 s can span; the tree before made 6
    # of ~1,100 wait)
    assert decided["admitted"] <= 2 and sum(decided.values()) == n, (n, decided)
    # and Redis ends as if each request came alone: counted once, spend exact, none reserved
    total = 20 + n
    assert {count for count, _seconds in state["rate"].values()} == {total}
    assert state["budget"] == {"spent": str(total * ACTUAL), "reserved": "0"}
    assert state["reservations"] == []
