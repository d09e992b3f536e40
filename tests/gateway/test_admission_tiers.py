"""Service tiers at the gateway: flex only from spare capacity, priority downgraded when the pool
is saturated (and then billed as default), priority scheduled first by the engine — on the
simulator and on real SGLang (CPU).
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from engine_adapter.models import EngineInstance
from engine_adapter.services import fleet_health_check
from engine_adapter.sim.testing import start_sim
from metering.models import UsageEvent
from tests.conftest import wait_until
from tests.factories import OrganizationFactory, ProjectFactory, make_key, make_price_book
from tests.gateway.conftest import drain_usage, register_engine, start_gateway, stop_gateway
from tests.real_sglang import real_sglang


def _secret() -> str:
    org = OrganizationFactory()
    return make_key(project=ProjectFactory(organization=org), scopes=["inference"])[1]


def _chat(gateway, secret: str, *, model: str = "busy", **body) -> httpx.Response:
    payload = {"model": model, "messages": [{"role": "user", "content": uuid.uuid4().hex}],
               "max_tokens": 5, **body}
    return httpx.post(f"{gateway.url}/v1/chat/completions", json=payload, timeout=60,
                      headers={"Authorization": f"Bearer {secret}"})


@pytest.fixture
def busy_gateway(transactional_db, tmp_path, metering_stream):
    """One engine that runs one request at a time, behind a gateway that calls a pool
    saturated once the queue is as long as the running batch (factor 1)."""
    make_price_book(prices=[{"model": "busy", "input": "0.50", "output": "1.50"}])
    sim = start_sim(served_model_name="busy", max_running_requests=1,
                    prefill_tokens_per_s=1_000_000, decode_tokens_per_s=50)
    register_engine(sim, pool="busy-us", region="us-east", zone="us")
    gateway = start_gateway(tmp_path, env={**metering_stream,
                                           "TOLLGATE_SATURATION_QUEUE_FACTOR": "1"})
    gateway.sims = {"busy": sim}
    yield gateway
    stop_gateway(gateway)
    sim.stop()


def _scrape_until(predicate, what: str) -> None:
    def scraped():
        fleet_health_check(restart=False)
        load = EngineInstance.objects.get(pool__name="busy-us").load
        return predicate(load)

    wait_until(scraped, timeout=15, what=what)
    time.sleep(0.5)  # let the gateway's fleet view (refreshed every 0.2 s) pick it up


def test_flex_is_refused_while_saturated_priority_is_downgraded_and_flex_runs_when_idle(
        busy_gateway):
    secret = _secret()
    # given three default requests: one running, two queued
    threads = [threading.Thread(target=_chat, args=(busy_gateway, secret),
                                kwargs={"max_tokens": 60}) for _ in range(3)]
    for t in threads:
        t.start()
    _scrape_until(lambda load: load.get("queued", 0) >= 2, "the engine to queue requests")

    # when a flex request arrives, then it is refused, not served and not billed
    flex = _chat(busy_gateway, secret, service_tier="flex")
    assert flex.status_code == 429
    assert flex.json()["error"]["code"] == "resource_unavailable"
    assert "retry-after" in flex.headers
    # and a priority request is served, but as (and billed as) default
    prio = _chat(busy_gateway, secret, service_tier="priority")
    assert prio.status_code == 200
    assert prio.json()["service_tier"] == "default"

    for t in threads:
        t.join(timeout=60)
    _scrape_until(lambda load: load.get("queued", 1) == 0 and load.get("running", 1) == 0,
                  "the engine to go idle")
    # when the engine is idle, flex is admitted and served as flex
    served = _chat(busy_gateway, secret, service_tier="flex")
    assert served.status_code == 200, served.text
    assert served.json()["service_tier"] == "flex"

    def events():
        drain_usage()
        return UsageEvent.objects.filter(request_id__in=[
            prio.headers["x-request-id"], served.headers["x-request-id"]]).count() == 2

    wait_until(events, timeout=10, what="events ingested")
    assert not UsageEvent.objects.filter(request_id=flex.headers["x-request-id"]).exists()
    assert UsageEvent.objects.get(request_id=prio.headers["x-request-id"]).service_tier == (
        "default")
    flex_event = UsageEvent.objects.get(request_id=served.headers["x-request-id"])
    assert flex_event.service_tier == "flex"


def _finish_order(gateway, secret: str, *, model: str, path: str, load, running, queued,
                  long_tokens: int, low_tokens: int, extra: dict) -> list[str]:
    """Keep the engine busy with a long default request, queue a short default one behind it,
    then a short priority one; return the order they finished in.

    The long request is streamed and dropped (the engine aborts it) only once both short ones
    are queued, so a slow, loaded machine cannot let it finish first; that needs
    ``long_tokens`` beyond what the engine makes while the two queue (streamed, it is never cut
    by the gateway's first-byte timeout on a loaded box either). A request that fails or
    finishes before both short ones are queued ends the wait at once, saying what happened.

    The low request makes ``low_tokens``, seconds of decoding, so that the order the client
    threads record is not the order they happen to wake up in on a loaded machine (two tiny
    requests could append in either order); where the engine keeps its own record of what it
    started (the simulator's ``start_order``), the caller checks that as well."""
    finished: list[str] = []
    errors: list[str] = []
    release = threading.Event()
    headers = {"Authorization": f"Bearer {secret}"}

    def body(name: str, tier: str, max_tokens: int, **more) -> dict:
        body = {"model": model, "max_tokens": max_tokens, "service_tier": tier, **extra, **more}
        if path.endswith("chat/completions"):
            body["messages"] = [{"role": "user", "content": f"{name} {uuid.uuid4().hex}"}]
        else:
            body["prompt"] = f"{name} {uuid.uuid4().hex}"
        return body

    def run_long() -> None:
        with httpx.stream("POST", f"{gateway.url}{path}", timeout=300, headers=headers,
                          json=body("long", "default", long_tokens, stream=True)) as r:
            if r.status_code != 200:
                errors.append(f"long: {r.status_code} {r.read().decode()}")
                return
            for _ in r.iter_lines():
                if release.is_set():
                    return  # closing the connection aborts the request at the engine
        finished.append("long")

    def run_short(name: str, tier: str, max_tokens: int = 4) -> None:
        r = httpx.post(f"{gateway.url}{path}", json=body(name, tier, max_tokens), timeout=300,
                       headers=headers)
        if r.status_code != 200:
            errors.append(f"{name}: {r.status_code} {r.text}")
            return
        finished.append(name)

    def send(target, *args) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        return thread

    def until(condition, what: str) -> None:
        def check():
            state = load()
            if errors or finished:
                pytest.fail(f"while waiting for {what}: errors {errors}, finished {finished}, "
                            f"engine load {state}\n--- gateway log ---\n{gateway.log()[-3000:]}")
            return condition(state)

        wait_until(check, timeout=60, what=what)

    threads = [send(run_long)]
    try:
        until(lambda s: running(s) == 1, "the long request to run")
        threads.append(send(run_short, "low", "default", low_tokens))
        until(lambda s: queued(s) == 1, "the default request to queue")
        threads.append(send(run_short, "high", "priority"))
        until(lambda s: queued(s) == 2, "the priority request to queue")
    finally:
        release.set()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    return finished


def test_priority_finishes_ahead_of_default_on_a_saturated_simulated_engine(busy_gateway):
    sim = busy_gateway.sims["busy"]
    order = _finish_order(
        busy_gateway, _secret(), model="busy", path="/v1/chat/completions",
        load=lambda: httpx.get(f"{sim.base_url}/sim/stats").json(),
        running=lambda s: s["running"], queued=lambda s: s["queued"], long_tokens=30_000,
        low_tokens=100, extra={"ignore_eos": True})
    assert order.index("high") < order.index("low"), order
    # and the engine's own record agrees: it started the priority request first
    started = httpx.get(f"{sim.base_url}/sim/stats").json()["start_order"]
    assert [s["priority"] for s in started[-2:]] == [10, 0], started


def _real_sglang_ready() -> bool:
    from engine_adapter.sglang_cpu import is_ready

    return is_ready()


@pytest.mark.skipif(not _real_sglang_ready(), reason=(
    "the SGLang CPU environment is not set up (engine_adapter.sglang_cpu.is_ready() is "
    "False); run `python -m engine_adapter.sglang_cpu setup` first"))
def test_priority_finishes_ahead_of_default_on_a_saturated_real_sglang_engine(
        transactional_db, tmp_path, metering_stream):
    # given real SGLang running one request at a time, behind the gateway
    gateway = None
    with real_sglang(Path(tmp_path) / "sglang.log", served_model_name="tiny-llama",
                     timeout=180, extra_args=("--max-running-requests", "1")) as base:
        try:
            make_price_book(prices=[{"model": "tiny-llama", "input": "0.50",
                                     "output": "1.50"}])
            register_engine(SimpleNamespace(model="tiny-llama", base_url=base),
                            pool="tiny-us", region="us-east", zone="us")
            gateway = start_gateway(tmp_path, env=metering_stream)

            # when a default request runs, another default one queues, then a priority one
            def loads() -> dict:
                return httpx.get(f"{base}/v1/loads", timeout=10).json()["loads"][0]

            order = _finish_order(
                gateway, _secret(), model="tiny-llama", path="/v1/completions", load=loads,
                running=lambda s: s["num_running_reqs"], queued=lambda s: s["num_waiting_reqs"],
                long_tokens=1950, low_tokens=400, extra={"ignore_eos": True})
            # then the priority request (SGLang priority 10 vs 0) is served first
            assert order.index("high") < order.index("low"), order
        finally:
            if gateway is not None:
                stop_gateway(gateway)
