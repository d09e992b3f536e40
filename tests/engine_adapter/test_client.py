"""EngineClient against simulated engines over real HTTP: relay, usage, retries, aborts."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import urllib.request
from decimal import Decimal

import pytest

from engine_adapter.client import EngineClient
from engine_adapter.router import Router
from engine_adapter.sim.testing import FAST_RATES
from engine_adapter.types import EngineError, EngineInfo, low_priority_share

LONG = "The quick brown fox jumps over the lazy dog near the riverbank. " * 30


def _info(sim, engine_id: str = "e0", region: str = "us-east") -> EngineInfo:
    return EngineInfo(engine_id=engine_id, pool="p", model=sim.model, region=region,
                      url=sim.base_url, gpu_hourly_cost=Decimal("3.60"), gpus=2)


def _stats(sim) -> dict:
    with urllib.request.urlopen(f"{sim.base_url}/sim/stats", timeout=5) as r:  # noqa: S310
        return json.loads(r.read())


async def _chat(client: EngineClient, model: str, content: str, *, stream: bool = False,
                namespace: str = "org-a", max_tokens: int = 8):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": stream}
    chunks = []
    async with client.call(model=model, path="/v1/chat/completions", body=body,
                           namespace=namespace, prompt_text=content) as call:
        if stream:
            chunks = [c async for c in call.chunks()]
    return call, chunks


def test_non_streaming_and_streaming_usage_come_from_the_engine(sim_factory):
    sim = sim_factory(served_model_name="m1", **FAST_RATES)
    client = EngineClient(Router([_info(sim)]))

    async def scenario():
        call, _ = await _chat(client, "m1", "hello there")
        streamed, chunks = await _chat(client, "m1", "hello again", stream=True)
        await client.aclose()
        return call, streamed, chunks

    call, streamed, chunks = asyncio.run(scenario())
    assert call.body["usage"]["completion_tokens"] == call.result.completion_tokens == 8
    assert call.result.prompt_tokens == call.body["usage"]["prompt_tokens"] > 0
    assert call.result.status == "ok" and call.result.ttft_ms is not None
    # usage was requested even though the caller did not ask: the last chunk carries it
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert streamed.result.completion_tokens == 8 and streamed.result.status == "ok"


def test_cache_salt_is_per_tenant_so_prefix_hits_never_cross(sim_factory):
    sim = sim_factory(served_model_name="m1", **FAST_RATES)
    client = EngineClient(Router([_info(sim)]))

    async def scenario():
        a1, _ = await _chat(client, "m1", LONG, namespace="org-a")
        a2, _ = await _chat(client, "m1", LONG, namespace="org-a")
        b1, _ = await _chat(client, "m1", LONG, namespace="org-b")
        await client.aclose()
        return a1.result, a2.result, b1.result

    a1, a2, b1 = asyncio.run(scenario())
    assert a1.cached_tokens == 0
    assert a2.cached_tokens >= a2.prompt_tokens - 1 > 100
    assert b1.cached_tokens == 0  # org B's identical prompt gets no hit from org A's cache


def test_failure_before_first_byte_is_retried_on_another_engine(sim_factory):
    broken = sim_factory(served_model_name="m1", error_rate=1.0, **FAST_RATES)
    good = sim_factory(served_model_name="m1", **FAST_RATES)
    router = Router([_info(broken, "bad"), _info(good, "good")], policy="round_robin")
    client = EngineClient(router)

    async def scenario():
        results = [(await _chat(client, "m1", f"q{i}"))[0].result for i in range(4)]
        await client.aclose()
        return results

    results = asyncio.run(scenario())
    assert all(r.status == "ok" and r.engine.engine_id == "good" for r in results)
    assert any(r.attempts == 2 for r in results)
    assert router.inflight("bad") == router.inflight("good") == 0


def test_engine_dying_mid_stream_gives_an_error_and_keeps_delivered_tokens(sim_factory):
    sim = sim_factory(served_model_name="m1", fail_after_tokens=3, **FAST_RATES)
    client = EngineClient(Router([_info(sim)]))

    async def scenario():
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 20, "stream": True}
        got = []
        call = client.call(model="m1", path="/v1/chat/completions", body=body,
                           namespace="o", prompt_text="x")
        with pytest.raises(EngineError):
            async with call:
                async for chunk in call.chunks():
                    got.append(chunk)
        await client.aclose()
        return call.result, got

    result, got = asyncio.run(scenario())
    assert result.status == "engine_error"
    assert 1 <= len([c for c in got if c["choices"]]) <= 4


def test_non_streaming_failure_mid_body_gives_back_the_slot_and_in_flight_count(sim_factory):
    # given a client with one engine connection, and an engine that drops the connection
    # half way through its non-streaming answer
    sim = sim_factory(served_model_name="m1", fail_after_tokens=3, **FAST_RATES)
    router = Router([_info(sim)])
    client = EngineClient(router, max_connections=1)

    async def scenario():
        # when a request fails mid-body
        with pytest.raises(EngineError, match="failed while answering") as failed:
            await _chat(client, "m1", "cut me off", max_tokens=8)
        inflight = router.inflight("e0")
        # then the next one gets the connection slot at once (a leaked slot would make it
        # wait the pool's 10 s timeout and fail)
        await asyncio.to_thread(urllib.request.urlopen, urllib.request.Request(  # noqa: S310
            f"{sim.base_url}/sim/faults", data=b'{"fail_after_tokens": null}',
            headers={"Content-Type": "application/json"}), timeout=5)
        async with asyncio.timeout(5):
            second, _ = await _chat(client, "m1", "whole answer", max_tokens=4)
        await client.aclose()
        return failed.value, inflight, second.result

    error, inflight, second = asyncio.run(scenario())
    assert inflight == 0 and router.inflight("e0") == 0
    assert second.status == "ok" and second.completion_tokens == 4
    assert error.__cause__ is not None


def test_cancelled_non_streaming_call_gives_back_the_slot_and_aborts_the_engine(sim_factory):
    # given a slow engine and a client with one engine connection
    sim = sim_factory(served_model_name="m1", decode_tokens_per_s=50,
                      prefill_tokens_per_s=100000)
    router = Router([_info(sim)])
    client = EngineClient(router, max_connections=1)

    async def scenario():
        # when a non-streaming call is cancelled (its client went away) while the engine runs it
        pending = asyncio.create_task(_chat(client, "m1", "a long answer", max_tokens=500))
        await asyncio.to_thread(_wait, lambda: _stats(sim)["running"] == 1)
        held = router.inflight("e0")
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        released = router.inflight("e0")
        # then the slot is free for the next request at once
        async with asyncio.timeout(5):
            second, _ = await _chat(client, "m1", "short", max_tokens=2)
        await client.aclose()
        return held, released, second.result

    held, released, second = asyncio.run(scenario())
    assert (held, released) == (1, 0)
    assert second.status == "ok"
    _wait(lambda: _stats(sim)["aborted"] == 1)  # the engine stopped the abandoned request


def test_client_disconnect_aborts_the_engine_request(sim_factory):
    sim = sim_factory(served_model_name="m1", max_running_requests=1,
                      decode_tokens_per_s=50, prefill_tokens_per_s=100000)
    client = EngineClient(Router([_info(sim)]))

    async def scenario():
        body = {"messages": [{"role": "user", "content": "tell me"}], "max_tokens": 500,
                "stream": True}
        async with client.call(model="m1", path="/v1/chat/completions", body=body,
                               namespace="o", prompt_text="tell me") as call:
            n = 0
            async for _chunk in call.chunks():
                n += 1
                if n == 5:
                    break  # the client went away
        # the engine slot is free again: a second request is served at once
        second, _ = await _chat(client, "m1", "next", max_tokens=2)
        await client.aclose()
        return call.result, second.result

    aborted, second = asyncio.run(scenario())
    assert aborted.status == "client_aborted"
    # continuous usage stats: the tokens delivered before the disconnect are known exactly
    assert aborted.prompt_tokens > 0
    assert 4 <= aborted.completion_tokens < 500
    assert second.status == "ok"
    assert _stats(sim).get("aborted", 0) >= 1


def test_a_finished_stream_hands_its_engine_connection_to_the_next_request(sim_factory):
    # given streamed requests that each run to [DONE]
    sim = sim_factory(served_model_name="m1", **FAST_RATES)
    client = EngineClient(Router([_info(sim)]))

    async def scenario():
        results = []
        for i in range(3):
            call, _ = await _chat(client, "m1", f"stream {i}", stream=True)
            results.append(call.result)
            # then the connection went back to the pool instead of being closed
            assert client._http.idle_connections() == 1
        await client.aclose()
        return results

    results = asyncio.run(scenario())
    assert [r.status for r in results] == ["ok"] * 3
    assert all(r.completion_tokens == 8 for r in results)


def test_live_loads_give_batch_the_share_interactive_traffic_leaves(sim_factory):
    # given two engines with 8 slots each, one running two long interactive requests, and a
    # third engine that is down
    busy = sim_factory(served_model_name="m1", max_running_requests=8,
                       decode_tokens_per_s=50, prefill_tokens_per_s=100000)
    idle = sim_factory(served_model_name="m1", max_running_requests=8)
    gone = EngineInfo(engine_id="gone", pool="p", model="m1", region="us-east",
                      url="http://127.0.0.1:9", gpu_hourly_cost=Decimal("1"), gpus=1)
    engines = [_info(busy, "busy"), _info(idle, "idle"), gone]
    client = EngineClient(Router(engines[:1]))

    async def scenario():
        body = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 200,
                "stream": True}
        calls = [client.call(model="m1", path="/v1/chat/completions", body=body,
                             namespace="o", prompt_text="go on") for _ in range(2)]
        for call in calls:
            await call.__aenter__()
        await asyncio.to_thread(lambda: _wait(lambda: _stats(busy)["running"] == 2))
        loads = await client.aloads(engines, timeout=0.5)
        for call in calls:
            await call.__aexit__(None, None, None)
        await client.aclose()
        return loads

    loads = asyncio.run(scenario())

    # then the scrape sees each engine's running requests and its cap, and none for the dead one
    assert loads["busy"].running == 2 and loads["busy"].max_running == 8
    assert loads["idle"].running == 0 and loads["gone"] is None
    # a quarter of 2 x 8 slots is 4; interactive traffic uses 2 of them
    assert low_priority_share(loads.values(), fraction=0.25, ours=0) == 2
    # the caller's own requests are counted by the engines too: they are not interactive
    assert low_priority_share(loads.values(), fraction=0.25, ours=2) == 4
    # any queue on an engine: it offers nothing
    queued = dataclasses.replace(loads["busy"], queued=1)
    assert low_priority_share([queued, loads["idle"]], fraction=0.25, ours=0) == 2


def _wait(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)
