"""Provisioned capacity is real: a pool's reserved share is held back from on-demand traffic,
and requests admitted on a reservation reach the engine at the highest priority.

One simulated engine of ``small`` in us-east with two running slots, slow enough (20 tokens/s
per request) that a long stream stays in flight while the test sends its next request. A
reservation of 1,000 normalized tokens per minute (output burndown 1) holds one of the two
slots (a slot serves at least 60 x 20 x 1 = 1,200 normalized tokens a minute), leaving one to
on-demand traffic. Nothing here is timed: a request is known to be in flight once its first
chunk arrived, and it runs for minutes unless closed; a request is known to be queued once the
engine says so.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from decimal import Decimal

import httpx
import pytest

from billing_platform.gateway.capacity import held_slots
from engine_adapter.services import fleet_health_check
from engine_adapter.sim.testing import start_sim
from plans import services as plan_services
from tests.conftest import wait_until
from tests.factories import OrganizationFactory, ProjectFactory, make_key, make_offering
from tests.gateway.conftest import register_engine, start_gateway, stop_gateway

REGIONS = {"us": ("us-east", "us"), "eu": ("eu-west", "eu")}


@contextmanager
def _pool(tmp_path, metering_stream, *, slots: int, env: dict | None = None,
          regions: tuple[str, ...] = ("us",)):
    from tests.factories import make_price_book

    make_price_book(prices=[{"model": "small", "input": "0.50", "output": "1.50"}])
    sims = {}
    try:
        for name in regions:
            sims[name] = start_sim(served_model_name="small", max_running_requests=slots,
                                   decode_tokens_per_s=20, prefill_tokens_per_s=1_000_000)
            region, zone = REGIONS[name]
            register_engine(sims[name], pool=f"small-{name}", region=region, zone=zone)
        fleet_health_check(restart=False)  # records the running caps, as the beat does
        gateway = start_gateway(tmp_path, env={**metering_stream, **(env or {})})
        gateway.sims = sims
        try:
            yield gateway
        finally:
            stop_gateway(gateway)
    finally:
        for sim in sims.values():
            sim.stop()


@pytest.fixture
def slow_pool(transactional_db, tmp_path, metering_stream):
    """A gateway in front of one slow two-slot engine of ``small`` (us-east)."""
    with _pool(tmp_path, metering_stream, slots=2) as gateway:
        yield gateway


@pytest.fixture
def two_regions(transactional_db, tmp_path, metering_stream):
    """Two slow two-slot engines of ``small``: us-east and eu-west."""
    with _pool(tmp_path, metering_stream, slots=2, regions=("us", "eu")) as gateway:
        yield gateway


@pytest.fixture
def one_slot_no_hold_back(transactional_db, tmp_path, metering_stream):
    """One slow one-slot engine, behind a gateway that holds nothing back (priority only)."""
    with _pool(tmp_path, metering_stream, slots=1,
               env={"TOLLGATE_PROVISIONED_HOLD_BACK": "0"}) as gateway:
        yield gateway


def _secret(org) -> str:
    _key, secret = make_key(project=ProjectFactory(organization=org), scopes=["inference"])
    return secret


def _reserve(org) -> None:
    offering = make_offering(model="small", region="us-east", tokens_per_minute_per_unit=1000,
                             output_burndown="1")
    plan_services.reservation_create(organization=org, offering=offering, units=1,
                                     term="monthly")


def _body(max_tokens: int, **extra) -> dict:
    return {"model": "small", "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": "hi"}], **extra}


def _chat(gateway, secret: str, max_tokens: int = 3, headers: dict | None = None,
          **extra) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {secret}", **(headers or {})},
                      json=_body(max_tokens, **extra))


@contextmanager
def _in_flight(gateway, secret: str) -> Iterator[httpx.Response]:
    """A streamed request that holds an engine slot (minutes of output) until the block ends."""
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {secret}"},
                      json=_body(5000, stream=True)) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # it runs
        yield response


def _engine_stats(gateway) -> dict:
    return httpx.get(f"{gateway.sims['us'].base_url}/sim/stats").json()


def _engine_priority(gateway, request_id: str) -> int:
    order = _engine_stats(gateway)["start_order"]
    return next(s["priority"] for s in order if s["rid"] == request_id)


def test_a_reserved_slot_is_held_back_from_on_demand_traffic(slow_pool):
    # given org A holds a reservation on the pool, org B has none
    holder, other = OrganizationFactory(), OrganizationFactory()
    _reserve(holder)
    holder_secret, other_secret = _secret(holder), _secret(other)

    # when B's on-demand request holds the pool's one on-demand slot
    with _in_flight(slow_pool, other_secret):
        refused = _chat(slow_pool, other_secret)
        # and B forges the capacity header
        forged = _chat(slow_pool, other_secret, headers={"x-tollgate-capacity": "provisioned"})
        served = _chat(slow_pool, holder_secret)

    # then B's next requests are refused as OpenAI refuses, saying why and when to retry
    for response in (refused, forged):
        assert response.status_code == 429
        error = response.json()["error"]
        assert error["code"] == "pool_at_capacity"
        assert error["type"] and "reserved" in error["message"]
        assert int(response.headers["retry-after"]) >= 1
        assert "x-tollgate-capacity" not in response.headers
    # while A's request runs on its reserved slot, at once, at the reservation's priority
    assert served.status_code == 200
    assert served.headers["x-tollgate-capacity"] == "provisioned"
    assert _engine_priority(slow_pool, served.headers["x-request-id"]) == 20


def test_without_a_reservation_on_demand_requests_are_not_refused(slow_pool):
    # given no reservation on the pool
    org = OrganizationFactory()
    secret = _secret(org)

    # when one request is in flight and more arrive than the engine has slots
    with _in_flight(slow_pool, secret):
        responses = [_chat(slow_pool, secret) for _ in range(3)]

    # then they all run (queued at the engine when it is full), at the default priority
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert {_engine_priority(slow_pool, r.headers["x-request-id"]) for r in responses} == {0}


def test_a_forged_header_or_priority_buys_no_reserved_priority(slow_pool):
    # given org A's reservation, and org B sending what a provisioned request would look like
    holder, other = OrganizationFactory(), OrganizationFactory()
    _reserve(holder)

    secret = _secret(other)

    # when B's request fits the on-demand share, or names an engine priority of its own
    response = _chat(slow_pool, secret, headers={"x-tollgate-capacity": "provisioned"},
                     service_tier="priority")
    own_priority = _chat(slow_pool, secret, priority=100)

    # then the engine priority is not the client's to set
    assert own_priority.status_code == 400
    assert own_priority.json()["error"]["code"] == "unknown_parameter"
    # and the request is served as on-demand traffic: never on A's reservation or priority
    assert response.status_code == 200
    assert "x-tollgate-capacity" not in response.headers
    assert _engine_priority(slow_pool, response.headers["x-request-id"]) == 10  # its tier's


def test_spillover_runs_at_on_demand_priority(slow_pool):
    # given a reservation of 1,000 normalized tokens a minute
    holder = OrganizationFactory()
    _reserve(holder)

    # when its holder sends a prompt larger than the whole burndown
    spilled = httpx.post(f"{slow_pool.url}/v1/chat/completions", timeout=60,
                         headers={"Authorization": f"Bearer {_secret(holder)}"},
                         json={"model": "small", "max_tokens": 3, "ignore_eos": True,
                               "messages": [{"role": "user", "content": "word " * 300}]})

    # then it spills over to on-demand, at the default priority
    assert spilled.status_code == 200
    assert spilled.headers["x-tollgate-capacity"] == "spillover"
    assert _engine_priority(slow_pool, spilled.headers["x-request-id"]) == 0


def test_a_provisioned_request_starts_before_on_demand_ones_queued_ahead_of_it(
        one_slot_no_hold_back):
    gateway = one_slot_no_hold_back
    holder, other = OrganizationFactory(), OrganizationFactory()
    _reserve(holder)
    holder_secret, other_secret = _secret(holder), _secret(other)

    with ThreadPoolExecutor(4) as pool:
        # given the engine's one slot busy, and two on-demand requests queued behind it
        with _in_flight(gateway, other_secret):
            queued = [pool.submit(_chat, gateway, other_secret) for _ in range(2)]
            wait_until(lambda: _engine_stats(gateway)["queued"] == 2, timeout=30,
                       what="two on-demand requests queued at the engine")
            # when a provisioned request arrives after them, and then the slot frees
            provisioned = pool.submit(_chat, gateway, holder_secret)
            wait_until(lambda: _engine_stats(gateway)["queued"] == 3, timeout=30,
                       what="the provisioned request queued too")
        responses = [f.result() for f in [provisioned, *queued]]

    # then the engine starts the provisioned request first
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert responses[0].headers["x-tollgate-capacity"] == "provisioned"
    order = [s["rid"] for s in _engine_stats(gateway)["start_order"]]
    ids = [r.headers["x-request-id"] for r in responses]
    assert order.index(ids[0]) < min(order.index(i) for i in ids[1:])


def test_on_demand_runs_where_its_share_is_not_used_up(two_regions):
    # given a reservation holding one of us-east's two slots, and a request of an org of
    # the us zone holding the other
    holder, us_org, global_org = (OrganizationFactory(), OrganizationFactory(data_zone="us"),
                                  OrganizationFactory())
    _reserve(holder)
    us_secret, global_secret = _secret(us_org), _secret(global_org)
    with _in_flight(two_regions, us_secret) as first:
        assert first.headers["x-tollgate-region"] == "us-east"

        # when an org of the global zone (either region) sends requests, and the us org too
        responses = [_chat(two_regions, global_secret) for _ in range(3)]
        us_refused = _chat(two_regions, us_secret)

    # then the global org's run in eu-west, which has no reservation; the us org, which may
    # run only in us-east, is refused: none takes us-east's held slot
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert {r.headers["x-tollgate-region"] for r in responses} == {"eu-west"}
    assert us_refused.status_code == 429
    assert us_refused.json()["error"]["code"] == "pool_at_capacity"


def test_the_health_probe_records_what_a_pool_holds_back_by(slow_pool):
    # given an engine that has run a request (a decode rate of its own to report)
    from engine_adapter.models import EngineInstance

    assert _chat(slow_pool, _secret(OrganizationFactory())).status_code == 200

    # when the health probe runs
    fleet_health_check(restart=False)

    # then the engine's load says its running cap and one request's decode rate (20 tokens/s
    # at most: the simulator paces each token at 1/20 s, a busy machine only slows it)
    load = EngineInstance.objects.get(engine_id="small-us-0").load
    assert load["max_running"] == 2
    assert 0 < load["decode_tokens_per_s"] <= 20.5


def test_held_slots_of_reservations():
    # one slot at 20 tokens/s serves 60 x 20 x R normalized tokens a minute
    assert held_slots(((1000, Decimal("1")),), slots=8, decode_tokens_per_s=20) == 1
    assert held_slots(((5000, Decimal("1")),), slots=8, decode_tokens_per_s=20) == 5
    assert held_slots(((5000, Decimal("4")),), slots=8, decode_tokens_per_s=20) == 2
    assert held_slots(((10, Decimal("1")), (10, Decimal("1"))), slots=8,
                      decode_tokens_per_s=20) == 2  # each reservation at least one slot
    assert held_slots(((10**9, Decimal("1")),), slots=8, decode_tokens_per_s=20) == 8
    assert held_slots(((10, Decimal("0")),), slots=8, decode_tokens_per_s=20) == 8
