"""Hostile tenants against the shared gateway: one organization cannot hold more requests in
flight at once than its limit, whatever else it does. A slot is held from authentication to the
response's end (a stream to its last byte, or to the client's disconnect), other organizations
are not touched by one at its limit, staff can give an organization a limit of its own, and a
gateway that dies holding slots cannot lock an organization out: they lapse with their lease.
The slots a busy organization's gateway processes take ahead (pools) keep all of that: they
count, never let it past its limit, grow while all of them are in use and shrink back after,
are renewed while held, given back when idle, when its limit changes or when it is refused at
its limit (their unused slots then serve its retries), and dropped when Redis lost their slots
(their streams then count again). A plain slot Redis lost counts again within a renewal too.

A simulated engine that decodes 20 tokens a second keeps streams open long enough to look at.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from billing_platform.accounts.services import api_key_revoke, organization_update
from billing_platform.redis_conn import get_redis
from engine_adapter.sim.testing import start_sim
from plans.admission.policy import inflight_key
from tests.conftest import wait_until
from tests.factories import OrganizationFactory, ProjectFactory, make_key, make_price_book
from tests.gateway.conftest import LiveGateway, register_engine, start_gateway, stop_gateway


@pytest.fixture
def slow_gateway(transactional_db, tmp_path, metering_stream
                 ) -> Iterator[Callable[..., LiveGateway]]:
    """Start live gateways (with extra settings) in front of one slow engine of ``slow``."""
    make_price_book(prices=[{"model": "slow", "input": "0.50", "output": "1.50"}])
    sim = start_sim(served_model_name="slow", prefill_tokens_per_s=10_000_000,
                    decode_tokens_per_s=20)
    register_engine(sim, pool="slow-us", region="us-east", zone="us")
    started: list[LiveGateway] = []

    def start(**env: str) -> LiveGateway:
        gateway = start_gateway(tmp_path, env={**metering_stream, **env})
        started.append(gateway)
        return gateway

    yield start
    for gateway in started:
        stop_gateway(gateway)
    sim.stop()


def _tenant(**org_fields) -> tuple[object, str]:
    org = OrganizationFactory(**org_fields)
    return org, make_key(project=ProjectFactory(organization=org))[1]


def _ask(gateway: LiveGateway, secret: str) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {secret}"},
                      json={"model": "slow", "max_tokens": 1,
                            "messages": [{"role": "user", "content": "hi"}]})


class Refused(Exception):
    """A stream the gateway did not open; ``response`` is its answer, read."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(response.status_code)
        self.response = response


class Stream:
    """A streaming request read up to its first chunk, then held open (its own connection);
    ``Refused`` if it is not answered 200."""

    def __init__(self, gateway: LiveGateway, secret: str, *, max_tokens: int,
                 **body: object) -> None:
        self.client = httpx.Client(timeout=60)
        request = self.client.build_request(
            "POST", f"{gateway.url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {secret}"},
            json={"model": "slow", "max_tokens": max_tokens, "stream": True,
                  "messages": [{"role": "user", "content": "tell me a story"}], **body})
        self.response = self.client.send(request, stream=True)
        if self.response.status_code != 200:
            self.response.read()
            self.abort()
            raise Refused(self.response)
        self.lines = self.response.iter_lines()
        assert next(self.lines).startswith("data: ")

    def read_to_end(self) -> list[str]:
        rest = list(self.lines)
        self.abort()
        return rest

    def abort(self) -> None:
        self.response.close()
        self.client.close()


def _held(org) -> int:
    return get_redis().zcard(inflight_key(org.id))


def test_an_organization_cannot_hold_more_requests_in_flight_than_its_limit(slow_gateway):
    # given a limit of 2 requests in flight per organization, and an organization staff
    # limited to 1
    gateway = slow_gateway(TOLLGATE_ORG_MAX_CONCURRENT_REQUESTS="2")
    greedy, greedy_key = _tenant()
    small, small_key = _tenant(max_concurrent_requests=1)
    _other, other_key = _tenant()

    # when the greedy tenant holds 2 long streams open and asks a third time
    streams = [Stream(gateway, greedy_key, max_tokens=2000) for _ in range(2)]
    refused = _ask(gateway, greedy_key)

    # then the third is refused at once, in OpenAI's shape, with a distinct code
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "too_many_concurrent_requests"
    assert error["type"] == "rate_limit_error" and "limit of concurrent requests (2)" in (
        error["message"])
    assert refused.headers["retry-after"] == "1"
    assert _held(greedy) == 2
    # and other organizations are served meanwhile, each under its own limit
    assert _ask(gateway, other_key).status_code == 200
    held_by_small = Stream(gateway, small_key, max_tokens=2000)
    assert _ask(gateway, small_key).json()["error"]["code"] == "too_many_concurrent_requests"
    held_by_small.abort()

    # when the greedy tenant drops one stream (a client disconnect)
    streams[0].abort()

    # then its slot is free again: the next request is served
    wait_until(lambda: _held(greedy) == 1, timeout=10, what="the aborted stream's slot")
    assert _ask(gateway, greedy_key).status_code == 200
    streams[1].abort()
    wait_until(lambda: _held(greedy) == 0 and _held(small) == 0, timeout=10,
               what="every slot released")


def test_a_stream_holds_its_slot_to_its_last_byte(slow_gateway):
    # given a limit of 1, and a stream of 20 tokens (about a second at 20 tokens/s)
    gateway = slow_gateway(TOLLGATE_ORG_MAX_CONCURRENT_REQUESTS="1")
    org, secret = _tenant()
    stream = Stream(gateway, secret, max_tokens=20)

    # when the tenant asks again while it streams, and again once it has read it all
    during = _ask(gateway, secret)
    rest = stream.read_to_end()
    wait_until(lambda: _held(org) == 0, timeout=10, what="the finished stream's slot")
    after = _ask(gateway, secret)

    # then the first is refused, the second served
    assert [line for line in rest if line][-1] == "data: [DONE]"
    assert during.status_code == 429
    assert after.status_code == 200


def test_slots_of_a_gateway_that_died_lapse_with_their_lease(slow_gateway):
    # given two gateway processes whose slots live 10 s unless released, a limit of 2, and a
    # tenant holding both through the first
    env = {"TOLLGATE_ORG_MAX_CONCURRENT_REQUESTS": "2", "TOLLGATE_ORG_CONCURRENCY_LEASE_S": "10"}
    successor, crashed = slow_gateway(**env), slow_gateway(**env)
    org, secret = _tenant()
    streams = [Stream(crashed, secret, max_tokens=2000) for _ in range(2)]

    # when the first gateway process is killed (it releases nothing)
    os.kill(crashed.process.pid, signal.SIGKILL)
    crashed.process.wait(timeout=10)
    for stream in streams:
        stream.abort()

    # then its slots still count while their lease runs, and lapse after it
    assert _held(org) == 2
    assert _ask(successor, secret).status_code == 429
    wait_until(lambda: _ask(successor, secret).status_code == 200, timeout=30,
               what="the dead gateway's slots to lapse")


def test_a_key_the_gateway_knows_holds_no_slot_it_is_not_entitled_to(slow_gateway):
    # given a gateway that has served a key (it has the key's principal cached), a limit of 2,
    # and one stream held open with the key
    gateway = slow_gateway(TOLLGATE_ORG_MAX_CONCURRENT_REQUESTS="2")
    org = OrganizationFactory()
    key, secret = make_key(project=ProjectFactory(organization=org))
    assert _ask(gateway, secret).status_code == 200
    stream = Stream(gateway, secret, max_tokens=2000)
    assert _held(org) == 1

    # when others try the key's prefix with secrets of their own
    prefix, _, real = secret.rpartition("_")
    forged = [_ask(gateway, f"{prefix}_{'x' * len(real)}") for _ in range(5)]

    # then they are refused and take nothing from the organization
    assert {r.status_code for r in forged} == {401}
    assert _held(org) == 1

    # when staff lower the organization's limit to 1 (the cached principal said 2)
    organization_update(organization=org, max_concurrent_requests=1)

    # then the new limit refuses a second request at once, which holds nothing either
    refused = _ask(gateway, secret)
    assert refused.json()["error"]["code"] == "too_many_concurrent_requests"
    assert "limit of concurrent requests (1)" in refused.json()["error"]["message"]
    assert _held(org) == 1

    # when the stream ends and the key is revoked
    stream.abort()
    wait_until(lambda: _held(org) == 0, timeout=10, what="the stream's slot")
    api_key_revoke(api_key=key)

    # then every request with it gets 401, and no slot stays taken in its name
    assert [_ask(gateway, secret).status_code for _ in range(3)] == [401] * 3
    wait_until(lambda: _held(org) == 0, timeout=10, what="no slot held by a revoked key")
    # and the organization's other keys are served under its limit as before
    other = make_key(project=ProjectFactory(organization=org))[1]
    assert _ask(gateway, other).status_code == 200


# A busy organization's slots taken ahead by each gateway process (plans.concurrency's pools):
# with a limit of 32, each process's pool starts at 2 slots (1/16 of it) and grows to at most 8
# (1/4 of it).
POOLED = {"TOLLGATE_ORG_MAX_CONCURRENT_REQUESTS": "32"}


def _busy(gateway: LiveGateway, secret: str, n: int = 12) -> None:
    """Send ``n`` requests at once: the organization is busy, the process takes a pool."""
    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(lambda _: _ask(gateway, secret), range(n)))
    assert {r.status_code for r in answers} == {200}


def _open_until_refused(gateways: list[LiveGateway], secret: str, org, attempts: int
                        ) -> tuple[list[Stream], list[httpx.Response]]:
    streams, refused = [], []
    for i in range(attempts):
        gateway = gateways[i % len(gateways)]
        try:
            streams.append(Stream(gateway, secret, max_tokens=2000))
        except Refused as exc:
            refused.append(exc.response)
        assert _held(org) <= 32
    return streams, refused


def test_pooled_slots_never_let_a_busy_organization_past_its_limit(slow_gateway):
    # given two gateway processes and an organization busy on both (each took a pool)
    gateways = [slow_gateway(**POOLED), slow_gateway(**POOLED)]
    org, secret = _tenant()
    for gateway in gateways:
        _busy(gateway, secret)
    assert 2 <= _held(org) <= 16  # the pools' slots, taken ahead, count while nothing runs

    # when it opens streams on both until they are refused
    streams, refused = _open_until_refused(gateways, secret, org, attempts=40)

    # then no more than its limit ran at once (at most a pool's worth less on each process)
    assert 24 <= len(streams) <= 32
    assert {r.json()["error"]["code"] for r in refused} == {"too_many_concurrent_requests"}
    assert _held(org) <= 32
    # and once they end, the idle pools are given back: nothing is held in its name
    for stream in streams:
        stream.abort()
    wait_until(lambda: _held(org) == 0, timeout=15, what="the pools given back when idle")


def test_a_lowered_limit_gives_a_pool_back_at_once(slow_gateway):
    # given a busy organization whose gateway process holds a pool, and one stream from it
    gateway = slow_gateway(**POOLED)
    org, secret = _tenant()
    _busy(gateway, secret)
    first = Stream(gateway, secret, max_tokens=2000)

    # when staff lower its limit to 2
    organization_update(organization=org, max_concurrent_requests=2)

    # then the pool's unused slots no longer count: a second request is served, a third refused
    second = Stream(gateway, secret, max_tokens=2000)
    assert _held(org) == 2
    refused = _ask(gateway, secret)
    assert refused.json()["error"]["code"] == "too_many_concurrent_requests"
    assert "limit of concurrent requests (2)" in refused.json()["error"]["message"]
    first.abort()
    second.abort()
    wait_until(lambda: _held(org) == 0, timeout=10, what="every slot released")


def test_a_pools_unused_slots_go_back_when_its_organization_is_refused_at_its_limit(
        slow_gateway):
    # given two gateway processes, and an organization busy on the first, which holds a pool
    # there with one stream from it in flight (the pool back at its starting size: 2 slots, one
    # of them unused)
    first, second = slow_gateway(**POOLED), slow_gateway(**POOLED)
    org, secret = _tenant()
    _busy(first, secret)
    held_open = Stream(first, secret, max_tokens=400, ignore_eos=True)
    wait_until(lambda: _held(org) == 2, timeout=10, what="the pool back at its starting size")

    # when it opens streams on the second process, retrying after each refusal's retry-after
    streams: list[Stream] = []
    refusals: list[httpx.Response] = []
    deadline = time.monotonic() + 20
    while len(streams) < 31 and time.monotonic() < deadline:
        try:
            streams.append(Stream(second, secret, max_tokens=400, ignore_eos=True))
        except Refused as exc:
            refusals.append(exc.response)
            time.sleep(float(exc.response.headers["retry-after"]))

    # then the first process's unused slot went back once a request was refused: the
    # organization holds exactly its limit of requests in flight, and no more
    assert len(streams) + 1 == 32, (len(streams), len(refusals))
    assert _held(org) == 32
    assert {r.json()["error"]["code"] for r in refusals} == {"too_many_concurrent_requests"}
    with pytest.raises(Refused):
        Stream(second, secret, max_tokens=400, ignore_eos=True)
    for stream in [held_open, *streams]:
        stream.abort()
    wait_until(lambda: _held(org) == 0, timeout=15, what="every slot released")


def _stream_on_a_pool(slow_gateway, *, lease_s: float) -> tuple[LiveGateway, object, str, Stream]:
    """Start a gateway whose slots lapse after ``lease_s`` unless renewed (a pool's are renewed
    every half of it); make an organization busy there and open a 20 s stream from its pool."""
    gateway = slow_gateway(**POOLED, TOLLGATE_ORG_CONCURRENCY_LEASE_S=str(lease_s))
    org, secret = _tenant()
    _busy(gateway, secret)
    return gateway, org, secret, Stream(gateway, secret, max_tokens=400, ignore_eos=True)


def test_a_pooled_slot_held_past_its_lease_still_counts(slow_gateway):
    # given slots that lapse after 3 s unless renewed, and a stream on a busy organization's pool
    _gateway, org, _secret, stream = _stream_on_a_pool(slow_gateway, lease_s=3)
    # (the burst may have grown the pool: it shrinks back to its starting size)
    wait_until(lambda: _held(org) == 2, timeout=10, what="the pool back at its starting size")
    held = _held(org)  # the stream's slot and the pool's other one

    # when the stream runs (read as it comes) for more than two leases
    until = time.monotonic() + 7
    while time.monotonic() < until:
        assert next(stream.lines) != "data: [DONE]"

    # then the pool's slots were renewed while the process held them: they still count
    assert _held(org) == held
    redis_now = get_redis().time()
    now_ms = redis_now[0] * 1000 + redis_now[1] // 1000
    assert all(score > now_ms for _m, score in
               get_redis().zrange(inflight_key(org.id), 0, -1, withscores=True))
    stream.abort()
    wait_until(lambda: _held(org) == 0, timeout=10, what="the pool given back when idle")


def _pooled(org) -> int:
    """Return how many members of the organization's set are pool slots (not a request's)."""
    return sum(m.startswith("pool_") for m in get_redis().zrange(inflight_key(org.id), 0, -1))


def test_a_pool_grows_while_all_of_it_is_in_use_and_shrinks_back_after(slow_gateway):
    # given an organization with a limit of 64 (a pool starts at 4 slots, grows to at most 16)
    # busy on one gateway process
    gateway = slow_gateway(TOLLGATE_ORG_MAX_CONCURRENT_REQUESTS="64")
    org, secret = _tenant()

    # when it holds 20 streams there, opened in waves of concurrent requests
    streams: list[Stream] = []
    for wave in (6, 4, 4, 4, 2):
        with ThreadPoolExecutor(wave) as pool:
            streams += pool.map(lambda _: Stream(gateway, secret, max_tokens=2000),
                                range(wave))

    # then the process's pool grew past its starting size while all of it was in use (its
    # requests took their slots without Redis), never past 1/4 of the limit, and every
    # stream still counts
    assert 8 <= _pooled(org) <= 16
    assert 20 <= _held(org) <= 20 + 16

    # and once all but one have ended, the slots no request needed go back: the pool shrinks
    # to its starting size while the last stream runs, and is given back once it ends
    for stream in streams[:-1]:
        stream.abort()
    wait_until(lambda: _pooled(org) == 4, timeout=10, what="the pool back at its starting size")
    assert _held(org) in (4, 5)  # the pool, and the last stream's slot if it is not of it
    streams[-1].abort()
    wait_until(lambda: _held(org) == 0, timeout=10, what="the pool given back when idle")


def test_a_pool_whose_slots_redis_lost_is_dropped_and_its_stream_counted_again(slow_gateway):
    # given a stream on a busy organization's pool, whose pool is renewed every 2 s
    gateway, org, secret, stream = _stream_on_a_pool(slow_gateway, lease_s=4)

    # when Redis loses the organization's set (as a restart without persistence does)
    get_redis().delete(inflight_key(org.id))

    # then at the pool's next renewal the stream's slot counts again, and the pool's free
    # slots are not handed out any more: the next request takes a slot Redis holds
    wait_until(lambda: _held(org) == 1, timeout=10, what="the stream's slot added back")
    assert _pooled(org) <= 1
    second = Stream(gateway, secret, max_tokens=400, ignore_eos=True)
    assert _held(org) == 2
    stream.abort()
    second.abort()
    wait_until(lambda: _held(org) == 0, timeout=10, what="every slot released")


def test_a_plain_slot_redis_lost_counts_again_within_a_renewal(slow_gateway):
    # given an organization limited to one request in flight, with a stream open on a gateway
    # whose slots are renewed every 2 s (a lease of 4 s)
    gateway = slow_gateway(TOLLGATE_ORG_CONCURRENCY_LEASE_S="4")
    org, secret = _tenant(max_concurrent_requests=1)
    stream = Stream(gateway, secret, max_tokens=400, ignore_eos=True)
    assert _held(org) == 1

    # when Redis loses the organization's set (as a restart without persistence does)
    get_redis().delete(inflight_key(org.id))

    # then the stream's slot counts again at the next renewal, and outlives its lease: a
    # second request is refused while the stream runs, past the first lease's end
    wait_until(lambda: _held(org) == 1, timeout=10, what="the stream's slot added back")
    time.sleep(4)
    refused = _ask(gateway, secret)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "too_many_concurrent_requests"
    stream.abort()
    wait_until(lambda: _held(org) == 0, timeout=10, what="the slot released")
