"""Many gateway processes route as one: the same engine for a prefix whichever process a request
lands on, the load bound computed on every process's requests, and a conversation's next turn
sent where another process placed its previous one (shared through real Redis)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

import pytest
import redis
from django.conf import settings

from engine_adapter.load_share import STALE_S, LoadShare
from engine_adapter.router import Router
from engine_adapter.types import EngineInfo

SYSTEM = "You are the support assistant of the Initech billing desk; answer briefly. " * 6


def _engines(n: int) -> list[EngineInfo]:
    return [EngineInfo(engine_id=f"e{i}", pool="p", model="m", region="r",
                       url=f"http://127.0.0.1:{9000 + i}") for i in range(n)]


def test_a_new_prefix_goes_to_the_same_engine_from_every_process():
    # given four processes' routers, each with a history of its own (other tenants' traffic),
    # and each with the others' counts of requests routed, as load_share exchanges them
    routers = [Router(_engines(8)) for _ in range(4)]
    for i, r in enumerate(routers):
        for n in range(i * 3):
            r.release(r.choose(model="m", namespace=f"other-{i}-{n}", prompt=SYSTEM
                               ).engine.engine_id)
    rates = [r.routed_rates() for r in routers]
    for i, r in enumerate(routers):
        peers: dict[str, float] = {}
        for j, theirs in enumerate(rates):
            for engine_id, v in theirs.items():
                peers[engine_id] = peers.get(engine_id, 0.0) + v * (j != i)
        r.observe_peers({}, peers)
    for tenant in range(30):
        prompt = f"tenant {tenant}: " + SYSTEM
        # when each process routes the same tenant's prompt, never having seen it
        chosen = [r.choose(model="m", namespace=f"org-{tenant}", prompt=prompt).engine.engine_id
                  for r in routers]
        # then they all pick one engine, so its KV cache serves the later turns
        assert len(set(chosen)) == 1, f"tenant {tenant}: {chosen}"
        for r, engine_id in zip(routers, chosen, strict=True):
            r.release(engine_id)


def test_new_prefixes_of_many_tenants_still_spread_over_the_pool():
    router = Router(_engines(8))
    engines = set()
    for tenant in range(64):
        d = router.choose(model="m", namespace=f"org-{tenant}", prompt=SYSTEM)
        engines.add(d.engine.engine_id)
        router.release(d.engine.engine_id)
    assert len(engines) == 8  # rendezvous ranks differ per tenant: no engine is everyone's


def test_other_processes_in_flight_requests_count_towards_the_bound():
    # given the engine a tenant's prefix ranks first, busy with another process's requests
    router = Router(_engines(4))
    first = router.choose(model="m", namespace="org", prompt=SYSTEM).engine.engine_id
    router.release(first)
    # when the peers report 12 requests in flight there (and nothing elsewhere)
    router.observe_peers({first: 12})
    # then this process sends the tenant elsewhere: bound x mean load is under 13
    assert router.choose(model="m", namespace="org", prompt=SYSTEM).engine.engine_id != first


@pytest.fixture
def share_key() -> str:
    key = f"tg:router:test:{uuid.uuid4().hex[:8]}"
    yield key
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete(key, f"{key}:routes", *client.scan_iter(f"{{{key}}}:at:*"))


def test_processes_exchange_in_flight_counts_through_redis(share_key):
    # given two processes' routers sharing one Redis, and a third that went quiet long ago
    a, b = Router(_engines(2)), Router(_engines(2))
    share_a = LoadShare(a, settings.REDIS_URL, key=share_key)
    share_b = LoadShare(b, settings.REDIS_URL, key=share_key)
    r = redis.Redis.from_url(settings.REDIS_URL, decode_responses=True)
    r.hset(share_key, "gone:0", json.dumps({"t": 0, "n": {"e1": 50}}))

    async def scenario() -> None:
        # when A holds three requests on one engine and both exchange
        for _ in range(3):
            a.choose(model="m", namespace="org", prompt=SYSTEM, exclude={"e1"})
        await share_a.exchange()
        await share_b.exchange()
        # then B counts A's three requests on that engine, and not the silent process's 50
        assert b.load("e0") == 3 and b.load("e1") == 0
        # and the requests A routed there count towards B's rate bound too
        assert b.rate("e0") == pytest.approx(3, abs=0.01) and b.rate("e1") == 0
        # and when A's requests end, B sees it at the next exchange
        for _ in range(3):
            a.release("e0")
        await share_a.exchange()
        await share_b.exchange()
        assert b.load("e0") == 0

    asyncio.run(scenario())
    assert "gone:0" not in r.hgetall(share_key)  # forgotten, not only ignored


def test_the_next_turn_goes_where_another_process_placed_the_previous_one(share_key):
    # given process B, which sent the tenant's system prompt to one engine with a conversation
    a, b = Router(_engines(2)), Router(_engines(2))
    share_a = LoadShare(a, settings.REDIS_URL, key=share_key)
    share_b = LoadShare(b, settings.REDIS_URL, key=share_key)
    other = SYSTEM + "<user>What is on my last invoice?\n"
    first = b.choose(model="m", namespace="org", prompt=other).engine.engine_id
    b.release(first)
    turn_1 = SYSTEM + ("<user>Why was I charged twice for the same batch job last month, once "
                       "on the 3rd and again on the 4th, with the same number of tokens?\n")
    turn_2 = turn_1 + "<assistant>The batch was retried once.\n<user>Refund the second one.\n"

    async def scenario() -> str:
        share_a.note_activity()
        share_b.note_activity()
        # and process A, which placed a conversation's first turn on the other engine (the
        # first one was busy then)
        a.observe_peers({first: 10})
        placed = a.choose(model="m", namespace="org", prompt=turn_1).engine.engine_id
        assert placed != first
        a.release(placed)
        a.observe_peers({})
        deadline = time.monotonic() + 5
        while b.routed_hints() == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        # when the conversation's second turn reaches process B
        return b.choose(model="m", namespace="org", prompt=turn_2).engine.engine_id

    # then B sends it where turn 1 is cached, not where its own index has the system prompt
    assert asyncio.run(scenario()) != first


def test_a_lookup_before_routing_finds_the_previous_turn_placed_by_another_process(share_key):
    # given process B, whose own index has the tenant's system prompt on one engine, and which
    # reads no placements stream (a process too busy to have read it yet)
    a, b = Router(_engines(3)), Router(_engines(3))
    share_a = LoadShare(a, settings.REDIS_URL, key=share_key)
    # (waiting for the lookup as long as it takes: a loaded machine's Redis may be slow)
    share_b = LoadShare(b, settings.REDIS_URL, key=share_key, lookup_wait_s=30)
    first = b.choose(model="m", namespace="org", prompt=SYSTEM + "<user>Hello\n").engine.engine_id
    b.release(first)
    turn_1 = SYSTEM + "<user>Why was I charged twice for the same batch job last month?\n"
    turn_2 = turn_1 + "<assistant>The batch was retried once.\n<user>Refund the second one.\n"

    async def scenario() -> tuple[str, str, int]:
        # and process A, which placed the conversation's first turn on another engine
        placed = a.choose(model="m", namespace="org", prompt=turn_1,
                          exclude={first}).engine.engine_id
        a.release(placed)
        await share_a._publish_routes()
        await share_a.exchange()
        await share_b.exchange()  # B learns that another process shares the key
        hints_before = b.routed_hints()
        # when B looks the second turn's prompt up before routing it
        await share_b.lookup(namespace="org", prompt=turn_2)
        assert b.routed_hints() > hints_before
        return placed, b.choose(model="m", namespace="org", prompt=turn_2).engine.engine_id, \
            hints_before

    placed, chosen, hints_before = asyncio.run(scenario())
    # then B sends it where turn 1 is cached, though no placement reached it any other way
    assert hints_before == 0
    assert chosen == placed != first


def test_a_slow_lookup_does_not_hold_the_request_and_serves_the_next_turn(share_key):
    # given process B, which waits no time at all for a lookup (as when Redis is slow), and a
    # placement by process A of a conversation's first turn
    a, b = Router(_engines(3)), Router(_engines(3))
    share_a = LoadShare(a, settings.REDIS_URL, key=share_key)
    share_b = LoadShare(b, settings.REDIS_URL, key=share_key, lookup_wait_s=0)
    turn_1 = SYSTEM + "<user>Why was I charged twice for the same batch job last month?\n"

    async def scenario() -> tuple[int, int]:
        a.release(a.choose(model="m", namespace="org", prompt=turn_1).engine.engine_id)
        await share_a._publish_routes()
        await share_a.exchange()
        await share_b.exchange()
        # when B looks the first turn up: it goes on routing before Redis has answered
        await share_b.lookup(namespace="org", prompt=turn_1 + "<user>And again?\n")
        at_once = b.routed_hints()
        await asyncio.gather(*share_b._lookups)  # the lookup went on in the background
        return at_once, b.routed_hints()

    at_once, later = asyncio.run(scenario())
    # then the request did not wait for the answer, and the answer still reached B's router
    assert at_once == 0
    assert later > 0


def test_a_process_alone_makes_no_lookup(share_key):
    # given one process and a placement of its own in Redis
    a = Router(_engines(2))
    share = LoadShare(a, settings.REDIS_URL, key=share_key)

    async def scenario() -> int:
        a.release(a.choose(model="m", namespace="org", prompt=SYSTEM).engine.engine_id)
        await share._publish_routes()
        await share.exchange()  # nobody else shares the key
        await share.lookup(namespace="org", prompt=SYSTEM + "more")
        return a.routed_hints()

    # then it did not ask Redis (its own index knows its placements)
    assert asyncio.run(scenario()) == 0


def test_a_field_older_than_stale_is_not_counted(share_key):
    clock = [1000.0]
    a, b = Router(_engines(1)), Router(_engines(1))
    share_a = LoadShare(a, settings.REDIS_URL, key=share_key, clock=lambda: clock[0])
    share_b = LoadShare(b, settings.REDIS_URL, key=share_key, clock=lambda: clock[0])

    async def scenario() -> None:
        a.choose(model="m", namespace="org", prompt=SYSTEM)
        await share_a.exchange()
        await share_b.exchange()
        assert b.load("e0") == 1
        # A stops exchanging (its process died with the request in flight)
        clock[0] += STALE_S + 0.5
        await share_b.exchange()
        assert b.load("e0") == 0

    asyncio.run(scenario())


def test_redis_down_routes_on_own_counts_and_says_so_once(caplog):
    router = Router(_engines(2))
    router.observe_peers({"e0": 9})
    share = LoadShare(router, "redis://127.0.0.1:1/0", key="tg:router:nowhere")
    caplog.set_level(logging.WARNING, logger="engine_adapter.load_share")

    async def scenario() -> None:
        await share.exchange()
        await share.exchange()

    asyncio.run(scenario())
    assert router.load("e0") == 0  # the peers' last view is dropped, not kept forever
    assert len([r for r in caplog.records if "Redis failed" in r.getMessage()]) == 1
