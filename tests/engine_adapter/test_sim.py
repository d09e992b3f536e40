"""The engine simulator must behave like SGLang where the platform can tell.

Billing, the router and fault handling are tested against the simulator, so these tests pin
down what those depend on: OpenAI/SGLang response shapes (through the official SDK), usage and
``cached_tokens``, per-salt cache isolation, LRU eviction, priority order under a running cap,
aborts, every injected fault and the Prometheus metrics. All over real HTTP to a real process.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_adapter.sim.testing import FAST_RATES as FAST
from engine_adapter.sim.testing import SimProcess
from engine_adapter.sim.tokenizer import encode, render_chat


@pytest.fixture(autouse=True)
def _clean_redis() -> None:
    """Override the root autouse Redis cleanup here: the simulator uses no Redis and no DB."""


def _client(sim: SimProcess, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{sim.base_url}/v1", api_key="x", max_retries=0, **kwargs)


def _long_prompt(words: int = 120) -> str:
    tag = uuid.uuid4().hex
    return f"{tag} " + " ".join(f"word{i}" for i in range(words))


def _cached(usage: Any) -> int:
    details = usage.prompt_tokens_details
    return details.cached_tokens if details is not None else 0


def _stats(sim: SimProcess) -> dict[str, Any]:
    return httpx.get(f"{sim.base_url}/sim/stats").json()


def _metrics(sim: SimProcess) -> dict[str, float]:
    text = httpx.get(f"{sim.base_url}/metrics").text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model_name") == sim.model and "le" not in sample.labels:
                values[sample.name] = sample.value
    return values


def _set_faults(sim: SimProcess, **faults: Any) -> None:
    httpx.post(f"{sim.base_url}/sim/faults", json=faults).raise_for_status()


def _wait_for(condition: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    """Poll ``condition`` until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)
    return value


# --- OpenAI-compatible surface ----------------------------------------------------------------


def test_chat_completion_through_openai_sdk_counts_tokens_and_repeats(sim: SimProcess) -> None:
    # given
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    client = _client(sim)

    # when
    first = client.chat.completions.create(model=sim.model, messages=messages, max_tokens=8)
    again = client.chat.completions.create(model=sim.model, messages=messages, max_tokens=8)

    # then
    assert first.object == "chat.completion"
    assert first.model == sim.model
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].message.content
    assert first.choices[0].finish_reason == "length"
    assert first.usage is not None
    assert first.usage.prompt_tokens == len(encode(render_chat(messages)))
    assert first.usage.completion_tokens == 8
    assert first.usage.total_tokens == first.usage.prompt_tokens + 8
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.id != first.id


def test_completion_honours_max_tokens_stop_and_rid(sim: SimProcess) -> None:
    client = _client(sim)
    prompt = _long_prompt(10)
    no_eos = {"ignore_eos": True}
    full = client.completions.create(
        model=sim.model, prompt=prompt, max_tokens=30, extra_body=no_eos
    )
    assert full.object == "text_completion"
    assert full.usage is not None
    assert full.usage.completion_tokens == 30
    words = full.choices[0].text.split()
    stop_word = words[len(words) // 2]

    stopped = client.completions.create(
        model=sim.model, prompt=prompt, max_tokens=30, stop=[stop_word],
        extra_body={"rid": "my-request-1", **no_eos},
    )  # fmt: skip

    assert stopped.id == "my-request-1"
    assert stopped.choices[0].finish_reason == "stop"
    assert stop_word not in stopped.choices[0].text
    assert full.choices[0].text.startswith(stopped.choices[0].text)
    assert stopped.usage is not None
    assert stopped.usage.completion_tokens < 30


def test_streaming_chat_with_include_usage_ends_with_usage_chunk(sim: SimProcess) -> None:
    client = _client(sim)
    messages = [{"role": "user", "content": _long_prompt(5)}]
    plain = client.chat.completions.create(model=sim.model, messages=messages, max_tokens=12)

    chunks = list(
        client.chat.completions.create(
            model=sim.model, messages=messages, max_tokens=12, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) == 12
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens  # type: ignore[union-attr]
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_completion_sends_sse_frames_and_done(sim: SimProcess) -> None:
    body = {"model": sim.model, "prompt": _long_prompt(3), "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{sim.base_url}/v1/completions", json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert len(lines) == 4 + 1 + 1  # four tokens, the finish chunk, [DONE]


def test_bad_requests_get_sglang_error_json(sim: SimProcess) -> None:
    client = _client(sim)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=sim.model, messages=[{"role": "user", "content": "x"}], n=0
        )
    resp = httpx.post(f"{sim.base_url}/v1/chat/completions", content=b"{not json")
    assert resp.status_code == 400
    assert resp.json()["object"] == "error"
    assert resp.json()["code"] == 400
    assert set(resp.json()) == {"object", "message", "type", "param", "code"}


def test_info_and_health_endpoints(sim: SimProcess) -> None:
    assert [m.id for m in _client(sim).models.list().data] == [sim.model]
    info = httpx.get(f"{sim.base_url}/get_server_info").json()
    assert info["simulated"] is True
    assert info["max_running_requests"] == 8
    assert httpx.get(f"{sim.base_url}/get_model_info").json()["is_generation"] is True
    assert httpx.get(f"{sim.base_url}/health").status_code == 200
    assert httpx.get(f"{sim.base_url}/health_generate").status_code == 200


# --- native /generate -----------------------------------------------------------------------


def test_native_generate_returns_text_and_meta_info(sim: SimProcess) -> None:
    text = _long_prompt(20)
    body = {"text": text, "sampling_params": {"max_new_tokens": 6}, "rid": "native-1"}
    first = httpx.post(f"{sim.base_url}/generate", json=body).json()
    by_ids = httpx.post(
        f"{sim.base_url}/generate",
        json={"input_ids": encode(text), "sampling_params": {"max_new_tokens": 6}},
    ).json()

    meta = first["meta_info"]
    assert meta["id"] == "native-1"
    assert meta["prompt_tokens"] == len(encode(text))
    assert meta["completion_tokens"] == 6
    assert meta["cached_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["e2e_latency"] >= 0
    assert by_ids["text"] == first["text"]
    assert by_ids["meta_info"]["cached_tokens"] == meta["prompt_tokens"] - 1


def test_native_generate_streams_cumulative_text(sim: SimProcess) -> None:
    body = {"text": _long_prompt(4), "sampling_params": {"max_new_tokens": 5}, "stream": True}
    with httpx.stream("POST", f"{sim.base_url}/generate", json=body) as resp:
        frames = [line[len("data: ") :] for line in resp.iter_lines() if line]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    texts = [c["text"] for c in chunks]
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(texts))
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert chunks[-1]["meta_info"]["completion_tokens"] == 5


# --- prefix cache -------------------------------------------------------------------------------


def test_repeated_long_prompt_reports_cached_tokens(sim: SimProcess) -> None:
    client = _client(sim)
    messages = [{"role": "user", "content": _long_prompt()}]
    # A fresh namespace, so not even the chat template's "<|im_start|>user" is cached yet.
    salt = {"cache_salt": uuid.uuid4().hex}

    first = client.chat.completions.create(
        model=sim.model, messages=messages, max_tokens=4, extra_body=salt
    )
    second = client.chat.completions.create(
        model=sim.model, messages=messages, max_tokens=4, extra_body=salt
    )

    assert first.usage is not None
    assert second.usage is not None
    assert _cached(first.usage) == 0
    assert first.usage.prompt_tokens_details is None  # as SGLang: no details when 0 cached
    # The whole prompt is cached, but the last token is always recomputed.
    assert _cached(second.usage) == second.usage.prompt_tokens - 1


def test_cache_salts_never_share_hits(sim: SimProcess) -> None:
    client = _client(sim)
    messages = [{"role": "user", "content": _long_prompt()}]

    def cached(**extra: Any) -> int:
        resp = client.chat.completions.create(
            model=sim.model, messages=messages, max_tokens=2, extra_body=extra
        )
        return _cached(resp.usage)

    salt_a, salt_b = f"a-{uuid.uuid4().hex}", f"b-{uuid.uuid4().hex}"

    assert cached(cache_salt=salt_a) == 0
    assert cached(cache_salt=salt_a) > 100
    assert cached(cache_salt=salt_b) == 0
    assert cached(extra_key=salt_a) == 0
    # The default namespace shares only the chat template's "<|im_start|>user\n" with earlier
    # tests, never the salted prompt.
    assert cached() < 10
    assert cached(cache_salt=salt_b) > 100


def test_lru_eviction_under_small_token_capacity(sim_factory: Callable[..., SimProcess]) -> None:
    # given room for two ~100-token prompts but not three
    sim = sim_factory(max_total_tokens=300, **FAST)
    client = _client(sim)
    prompts = {name: f"{name} " + " ".join([f"{name}{i}" for i in range(49)]) for name in "ABC"}

    def cached(name: str) -> int:
        resp = client.completions.create(model=sim.model, prompt=prompts[name], max_tokens=5)
        assert resp.usage is not None
        assert resp.usage.prompt_tokens == 99
        return _cached(resp.usage)

    assert cached("A") == 0
    assert cached("B") == 0
    assert cached("A") == 98  # A is now the most recently used

    # when a third prompt needs room
    assert cached("C") == 0

    # then the least recently used one (B) was evicted, A survived
    assert cached("A") == 98
    assert cached("B") == 0
    cache = _stats(sim)["cache"]
    assert cache["evicted_tokens"] > 0
    assert cache["tree_tokens"] <= 300


def test_flush_cache_drops_hits(sim: SimProcess) -> None:
    body = {"text": _long_prompt(30), "sampling_params": {"max_new_tokens": 1}}
    httpx.post(f"{sim.base_url}/generate", json=body)
    assert httpx.post(f"{sim.base_url}/flush_cache").status_code == 200
    again = httpx.post(f"{sim.base_url}/generate", json=body).json()
    assert again["meta_info"]["cached_tokens"] == 0


# --- scheduling, aborts, metrics ----------------------------------------------------------------


def test_priority_orders_starts_and_metrics_show_queue(
    sim_factory: Callable[..., SimProcess],
) -> None:
    sim = sim_factory(max_running_requests=1, decode_tokens_per_s=200)
    seen: dict[str, float] = {}

    async def scenario() -> int:
        async with httpx.AsyncClient(base_url=sim.base_url, timeout=60) as client:

            async def send(rid: str, priority: int, tokens: int) -> dict[str, Any]:
                body = {
                    "text": rid,
                    "rid": rid,
                    "priority": priority,
                    "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
                }
                response = await client.post("/generate", json=body)
                response.raise_for_status()
                return response.json()

            # a blocker that runs until the test aborts it, however slow the machine is
            blocker = asyncio.create_task(send("blocker", 0, 30_000))  # 150 s, aborted
            await asyncio.to_thread(_wait_for, lambda: _stats(sim)["running"] == 1)
            waiting = []
            for queued, (rid, priority) in enumerate((("low", 0), ("high", 10), ("mid", 5))):
                waiting.append(asyncio.create_task(send(rid, priority, 1)))
                # arrival order low, high, mid: wait until each one is queued
                await asyncio.to_thread(_wait_for, lambda n=queued + 1: _stats(sim)["queued"] == n)
            seen.update(await asyncio.to_thread(_metrics, sim))
            (await client.post("/abort_request", json={"rid": "blocker"})).raise_for_status()
            blocked, *served = await asyncio.gather(blocker, *waiting)
            assert [r["meta_info"]["completion_tokens"] for r in served] == [1, 1, 1]
            return blocked["meta_info"]["completion_tokens"]

    blocker_tokens = asyncio.run(scenario())

    assert seen["sglang:num_running_reqs"] == 1
    assert seen["sglang:num_queue_reqs"] == 3
    order = [entry["rid"] for entry in _stats(sim)["start_order"]]
    assert order == ["blocker", "high", "mid", "low"]
    after = _metrics(sim)
    assert after["sglang:num_queue_reqs"] == 0
    # (a non-streaming request's tokens are counted when it is decoded in one go, so the
    # aborted blocker counts more than the part it answered before the abort)
    assert after["sglang:generation_tokens_total"] >= blocker_tokens + 3
    assert after["sglang:prompt_tokens_total"] == 4
    assert after["sglang:num_requests_total"] == 4


def test_non_streaming_request_holds_its_slot_for_its_decode_time(
    sim_factory: Callable[..., SimProcess],
) -> None:
    # A non-streaming request wakes once, at its end: the timing, the running slot and the
    # counts must still be those of a request decoded token by token.
    # (slow enough that the slot is seen taken on a loaded machine: 1 s or more)
    sim = sim_factory(max_running_requests=4, decode_tokens_per_s=20)
    body = {"model": sim.model, "max_tokens": 40, "temperature": 0,
            "messages": [{"role": "user", "content": "Count slowly."}]}
    with httpx.Client(base_url=sim.base_url, timeout=10) as client:
        streamed = client.post("/v1/chat/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}}).text

    async def scenario() -> tuple[dict[str, Any], bool, float]:
        async with httpx.AsyncClient(base_url=sim.base_url, timeout=60) as client:
            started = time.monotonic()
            pending = asyncio.create_task(client.post("/v1/chat/completions", json=body))
            await asyncio.to_thread(_wait_for, lambda: _stats(sim)["running"] == 1)
            held = not pending.done()  # its slot is taken while its client still waits
            answer = (await pending).json()
            return answer, held, time.monotonic() - started

    answer, held, took = asyncio.run(scenario())
    completion = answer["usage"]["completion_tokens"]
    assert answer["choices"][0]["finish_reason"] in ("stop", "length")
    assert completion >= 20 and held
    # never sooner than its tokens take to decode (a lower bound: a loaded machine only adds)
    assert took >= completion / 20 * 0.9  # one token per 50 ms, as when streamed
    pieces = [json.loads(line[6:]) for line in streamed.splitlines()
              if line.startswith("data: {")]
    assert "".join(p["choices"][0]["delta"].get("content") or "" for p in pieces
                   if p["choices"]) == answer["choices"][0]["message"]["content"]
    assert pieces[-1]["usage"]["completion_tokens"] == completion
    assert _stats(sim)["running"] == 0


def test_client_disconnect_mid_stream_aborts_and_frees_slot(
    sim_factory: Callable[..., SimProcess],
) -> None:
    sim = sim_factory(max_running_requests=1, decode_tokens_per_s=50)
    body = {"model": sim.model, "prompt": "tell me a long story", "max_tokens": 500,
            "stream": True}  # fmt: skip

    with httpx.stream("POST", f"{sim.base_url}/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        assert _stats(sim)["running"] == 1
    # leaving the block closed the connection after one token of 500

    _wait_for(lambda: _stats(sim)["aborted"] == 1)
    assert _stats(sim)["running"] == 0
    quick = _client(sim).completions.create(model=sim.model, prompt="next", max_tokens=2)
    assert quick.usage is not None
    assert quick.usage.completion_tokens == 2
    # the slot was free: the next request ran while the aborted one stayed aborted, not after
    # its 500 tokens
    stats = _stats(sim)
    assert (stats["completed"], stats["aborted"]) == (1, 1)
    assert stats["generation_tokens"] < 500


def test_client_disconnect_before_a_non_streaming_answer_aborts_it(
    sim_factory: Callable[..., SimProcess],
) -> None:
    # given a non-streaming request that would decode for 10 s
    sim = sim_factory(max_running_requests=1, decode_tokens_per_s=50)
    body = {"model": sim.model, "prompt": "tell me a long story", "max_tokens": 500}

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=sim.base_url, timeout=30) as client:
            pending = asyncio.create_task(client.post("/v1/completions", json=body))
            await asyncio.to_thread(_wait_for, lambda: _stats(sim)["running"] == 1)
            pending.cancel()  # when its client goes away
            with contextlib.suppress(asyncio.CancelledError):
                await pending

    asyncio.run(scenario())
    # then it counts as aborted, not completed, and its slot is free
    _wait_for(lambda: _stats(sim)["aborted"] == 1)
    stats = _stats(sim)
    assert stats["completed"] == 0 and stats["running"] == 0
    assert stats["generation_tokens"] < 500


def test_abort_request_by_rid_stops_generation(sim_factory: Callable[..., SimProcess]) -> None:
    sim = sim_factory(decode_tokens_per_s=50)

    async def scenario() -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=sim.base_url, timeout=10) as client:
            body = {
                "text": "go",
                "rid": "victim",
                "sampling_params": {"max_new_tokens": 500, "ignore_eos": True},
            }
            pending = asyncio.create_task(client.post("/generate", json=body))
            await asyncio.to_thread(_wait_for, lambda: _stats(sim)["generation_tokens"] > 0)
            # A request that is not streamed counts its tokens when it starts and keeps, when
            # aborted, those due by then (one per 20 ms here): an abort inside the first 20 ms
            # rightly leaves none, so some tokens' time passes first.
            await asyncio.sleep(0.2)
            (await client.post("/abort_request", json={"rid": "victim"})).raise_for_status()
            return (await pending).json()

    result = asyncio.run(scenario())

    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < result["meta_info"]["completion_tokens"] < 500
    assert _stats(sim)["aborted"] == 1


# --- fault injection ----------------------------------------------------------------------------


def test_error_rate_one_returns_500_before_any_output(sim: SimProcess) -> None:
    _set_faults(sim, error_rate=1.0)
    try:
        with pytest.raises(openai.InternalServerError) as caught:
            _client(sim).chat.completions.create(
                model=sim.model, messages=[{"role": "user", "content": "x"}], stream=True
            )
        assert caught.value.status_code == 500
        resp = httpx.post(f"{sim.base_url}/generate", json={"text": "x"})
        assert resp.status_code == 500
        assert resp.json()["type"] == "InternalServerError"
    finally:
        _set_faults(sim, error_rate=0.0)
    assert httpx.post(f"{sim.base_url}/generate", json={"text": "x"}).status_code == 200


def test_error_rate_flag_at_launch(sim_factory: Callable[..., SimProcess]) -> None:
    sim = sim_factory(error_rate=1.0, **FAST)
    assert httpx.post(f"{sim.base_url}/generate", json={"text": "x"}).status_code == 500
    assert _stats(sim)["errors_injected"] == 1
    assert httpx.get(f"{sim.base_url}/health").status_code == 200


def test_stall_delays_first_byte_past_client_timeout(sim: SimProcess) -> None:
    _set_faults(sim, stall_s=1.0)
    try:
        # a client that waits less than the stall for the first byte gives up (only reading
        # is timed: a slow connect on a loaded box is not the stall)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{sim.base_url}/generate", json={"text": "x"},
                       timeout=httpx.Timeout(30, read=0.3))
        # and one that waits longer is answered: a delay, not a hang
        assert httpx.post(f"{sim.base_url}/generate", json={"text": "x"},
                          timeout=30).status_code == 200
    finally:
        _set_faults(sim, stall_s=0.0)
    assert httpx.get(f"{sim.base_url}/sim/faults").json()["stall_s"] == 0.0


def test_fail_after_tokens_cuts_the_stream(sim: SimProcess) -> None:
    _set_faults(sim, fail_after_tokens=3)
    body = {"model": sim.model, "prompt": _long_prompt(3), "max_tokens": 20, "stream": True}
    received: list[str] = []
    try:
        with (
            pytest.raises(httpx.RemoteProtocolError),
            httpx.stream("POST", f"{sim.base_url}/v1/completions", json=body) as resp,
        ):
            received.extend(line for line in resp.iter_lines() if line)
        with pytest.raises(httpx.RemoteProtocolError):
            httpx.post(f"{sim.base_url}/v1/completions", json={**body, "stream": False})
    finally:
        _set_faults(sim, fail_after_tokens=None)
    assert len(received) == 3
    assert "data: [DONE]" not in received


def test_crash_after_kills_the_process_on_nth_request(
    sim_factory: Callable[..., SimProcess],
) -> None:
    sim = sim_factory(crash_after=2, **FAST)
    assert httpx.post(f"{sim.base_url}/generate", json={"text": "one"}).status_code == 200

    with pytest.raises(httpx.TransportError):
        httpx.post(f"{sim.base_url}/generate", json={"text": "two"})

    assert sim.wait_exit(timeout_s=5) == 17
    assert not sim.is_alive()


# --- health probes --------------------------------------------------------------------------


def test_health_generate_probe_of_an_idle_engine_counts_nowhere(
    sim_factory: Callable[..., SimProcess],
) -> None:
    # given an idle engine that has served one request
    sim = sim_factory(**FAST)
    assert httpx.post(f"{sim.base_url}/generate", json={"text": "x"}).status_code == 200
    before = _stats(sim)
    # when it is probed, then it answers 200, and the probe is in no count or metric
    assert httpx.get(f"{sim.base_url}/health_generate", timeout=5).status_code == 200
    after = _stats(sim)
    assert {k: after[k] for k in ("requests", "completed", "prompt_tokens",
                                  "generation_tokens")} == {
        k: before[k] for k in ("requests", "completed", "prompt_tokens", "generation_tokens")}


def test_health_generate_of_a_busy_engine_is_answered_by_its_running_work(
    sim_factory: Callable[..., SimProcess],
) -> None:
    # given an engine whose one running slot holds a 10 s generation
    sim = sim_factory(max_running_requests=1, decode_tokens_per_s=50)
    body = {"model": sim.model, "prompt": "a long story", "max_tokens": 500, "stream": True}
    with httpx.stream("POST", f"{sim.base_url}/v1/completions", json=body) as resp:
        lines = resp.iter_lines()  # kept: a dropped iterator closes the stream (an abort)
        assert next(lines).startswith("data: ")
        # when it is probed, then the probe is answered while that work still runs: it was not
        # queued behind it (as SGLang's)
        assert httpx.get(f"{sim.base_url}/health_generate", timeout=30).status_code == 200
        stats = _stats(sim)
        assert (stats["running"], stats["queued"], stats["completed"]) == (1, 0, 0)


def test_hang_fault_accepts_connections_but_never_generates(
    sim_factory: Callable[..., SimProcess], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # given an engine whose health probe gives up after 0.5 s (SGLang's own setting)
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "0.5")
    sim = sim_factory(**FAST)
    assert httpx.get(f"{sim.base_url}/health_generate", timeout=5).status_code == 200

    # when its scheduler hangs
    _set_faults(sim, hang=True)
    assert httpx.get(f"{sim.base_url}/sim/faults").json()["hang"] is True

    # then the process still answers /health and /metrics, but generates nothing
    assert httpx.get(f"{sim.base_url}/health", timeout=2).status_code == 200
    assert httpx.get(f"{sim.base_url}/metrics", timeout=2).status_code == 200
    assert httpx.get(f"{sim.base_url}/health_generate", timeout=5).status_code == 503
    assert "Health check failed" in sim.log_text()

    async def scenario() -> tuple[int, dict[str, Any]]:
        async with httpx.AsyncClient(base_url=sim.base_url, timeout=10) as client:
            pending = asyncio.create_task(client.post(
                "/v1/completions", json={"model": sim.model, "prompt": "x", "max_tokens": 3}))
            await asyncio.to_thread(_wait_for, lambda: _stats(sim)["requests"] == 1)
            await asyncio.sleep(0.3)
            assert not pending.done()  # accepted, never answered
            # when the hang clears, then the waiting request runs and the probe passes
            await client.post("/sim/faults", json={"hang": False})
            answer = await pending
            probe = await client.get("/health_generate")
            return probe.status_code, answer.json()

    probe, answer = asyncio.run(scenario())
    assert probe == 200
    assert answer["usage"]["completion_tokens"] == 3


def test_hang_flag_at_launch_and_bad_hang_value(sim_factory: Callable[..., SimProcess]) -> None:
    sim = sim_factory(hang=True, **FAST)
    assert httpx.get(f"{sim.base_url}/sim/faults").json()["hang"] is True
    with pytest.raises(httpx.ReadTimeout):
        httpx.get(f"{sim.base_url}/health_generate", timeout=0.5)
    bad = httpx.post(f"{sim.base_url}/sim/faults", json={"hang": "yes"})
    assert bad.status_code == 400 and bad.json()["param"] == "hang"
