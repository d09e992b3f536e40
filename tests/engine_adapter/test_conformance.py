"""The simulator keeps faith with real SGLang: the same scenario, the same shapes and the same
cached-token behaviour from both (real SGLang on this CPU with the tiny model; the simulator as
its own process). Plus the fleet manager restarting a killed real engine.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from io import StringIO

import httpx
import pytest
from django.core.management import call_command

from engine_adapter import services
from engine_adapter.choices import EngineStatus
from engine_adapter.metrics import parse_engine_counters, parse_engine_load
from engine_adapter.models import EngineInstance
from engine_adapter.sglang_cpu import is_ready, resolve_paths
from engine_adapter.sim.testing import FAST_RATES, start_sim
from tests.conftest import wait_until
from tests.real_sglang import real_sglang

pytestmark = pytest.mark.skipif(
    not is_ready(), reason="run `python -m engine_adapter.sglang_cpu setup` first")

MODEL = "tiny-llama"
LONG = " ".join(f"word{i % 97} is number {i}." for i in range(45))


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Iterator[dict[str, str]]:
    log = tmp_path_factory.mktemp("sglang") / "sglang.log"
    sim = start_sim(served_model_name=MODEL, **FAST_RATES)
    try:
        with real_sglang(log, served_model_name=MODEL, timeout=180) as url:
            yield {"sglang": url, "sim": sim.base_url}
    finally:
        sim.stop()


def _chat(url: str, content: str, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, "temperature": 0, **extra}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()


def _stream(url: str, content: str, *, n: int = 1, ignore_eos: bool = False, **options
            ) -> list[dict]:
    import json

    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, "stream": True, "stream_options": options}
    if n > 1:
        body["n"] = n
    if ignore_eos:
        body["ignore_eos"] = True
    frames = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                frames.append(json.loads(line[6:]))
    return frames


@pytest.mark.parametrize("kind", ["sglang", "sim"])
def test_same_response_shapes(engines, kind):
    body = _chat(engines[kind], "hello")
    assert {"id", "object", "created", "model", "choices", "usage"} <= body.keys()
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert {"index", "message", "finish_reason"} <= choice.keys()
    assert choice["message"]["role"] == "assistant"
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["completion_tokens"] <= 4

    frames = _stream(engines[kind], "hello", include_usage=True)
    assert all(f["object"] == "chat.completion.chunk" for f in frames)
    assert frames[-1]["choices"] == [] and frames[-1]["usage"]["completion_tokens"] >= 1
    assert all(f.get("usage") is None for f in frames[:-1])

    # continuous usage stats: token chunks carry the usage so far (the gateway relies on it)
    frames = _stream(engines[kind], "hello", include_usage=True, continuous_usage_stats=True)
    assert any(f["choices"] and f.get("usage") for f in frames)


@pytest.mark.parametrize("kind", ["sglang", "sim"])
def test_same_n_choices_logprobs_and_usage(engines, kind):
    # n choices (issue 20 item 4): the prompt counted once, the completions summed, logprobs
    # in OpenAI's shape, and a stream that interleaves the choices by index
    url = engines[kind]
    one = _chat(url, "hello", max_tokens=3, ignore_eos=True)["usage"]
    body = _chat(url, "hello", n=2, max_tokens=3, ignore_eos=True, logprobs=True,
                 top_logprobs=2)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (one["prompt_tokens"], 6)
    for choice in body["choices"]:
        content = choice["logprobs"]["content"]
        assert len(content) == 3
        for token in content:
            assert {"token", "logprob", "bytes", "top_logprobs"} <= token.keys()
            assert len(token["top_logprobs"]) == 2
            assert {"token", "logprob", "bytes"} <= token["top_logprobs"][0].keys()

    r = httpx.post(f"{url}/v1/completions", json={
        "model": MODEL, "prompt": "hello", "n": 2, "max_tokens": 3, "ignore_eos": True,
        "temperature": 0, "logprobs": 1}, timeout=120)
    r.raise_for_status()
    legacy = r.json()
    assert [c["index"] for c in legacy["choices"]] == [0, 1]
    assert legacy["usage"]["completion_tokens"] == 6
    lp = legacy["choices"][0]["logprobs"]
    assert {"text_offset", "token_logprobs", "tokens", "top_logprobs"} <= lp.keys()
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 3

    frames = _stream(url, "hello", include_usage=True, n=2, ignore_eos=True)
    assert {c["index"] for f in frames for c in f["choices"]} == {0, 1}
    assert frames[-1]["choices"] == [] and frames[-1]["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("kind", ["sglang", "sim"])
def test_same_cached_token_behaviour(engines, kind):
    url = engines[kind]
    httpx.post(f"{url}/flush_cache", timeout=30)
    salt = f"conf-{kind}"
    first = _chat(url, LONG, cache_salt=salt)["usage"]
    second = _chat(url, LONG, cache_salt=salt)["usage"]
    other = _chat(url, LONG, cache_salt=salt + "-other")["usage"]
    cached = [(u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
              for u in (first, second, other)]
    assert first["prompt_tokens"] > 100
    assert cached[0] == 0
    assert cached[1] == second["prompt_tokens"] - 1  # all but the last token, as SGLang does
    assert cached[2] == 0  # another salt never hits


@pytest.mark.parametrize("kind", ["sglang", "sim"])
def test_metrics_the_router_reads_are_exported(engines, kind):
    text = httpx.get(f"{engines[kind]}/metrics", timeout=10).text
    load = parse_engine_load(text)
    assert {"running", "queued", "token_usage"} <= load.keys()
    assert "sglang:num_requests_total" in text or "sglang:prompt_tokens_total" in text


@pytest.mark.parametrize("kind", ["sglang", "sim"])
def test_usage_counters_move_by_what_the_finished_requests_reported(engines, kind):
    # Reconciliation sets these counters against the metered usage: both engines must count
    # each finished request once, with the tokens its answer reported, and health probes not.
    url = engines[kind]
    before = parse_engine_counters(httpx.get(f"{url}/metrics", timeout=10).text)
    usages = [_chat(url, f"count me {i}", max_tokens=3 + i, ignore_eos=True)["usage"]
              for i in range(2)]
    usages.append(_stream(url, "count me too", include_usage=True)[-1]["usage"])
    httpx.get(f"{url}/health_generate", timeout=60).raise_for_status()
    after = parse_engine_counters(httpx.get(f"{url}/metrics", timeout=10).text)

    assert before is not None and after is not None
    assert after.requests - before.requests == 3
    assert after.prompt_tokens - before.prompt_tokens == sum(u["prompt_tokens"] for u in usages)
    assert after.generation_tokens - before.generation_tokens == sum(
        u["completion_tokens"] for u in usages)
    assert after.cached_tokens - before.cached_tokens == sum(
        (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for u in usages)
    # and both measured what cost-to-serve weighs requests by
    assert after.prefill_seconds > before.prefill_seconds
    assert after.uncached_prompt_tokens > before.uncached_prompt_tokens
    assert after.tpot_requests > before.tpot_requests and after.tpot_seconds > 0


@pytest.mark.django_db(transaction=True)
def test_fleet_restarts_a_killed_real_sglang_engine(tmp_path, monkeypatch):
    monkeypatch.setenv("TOLLGATE_ROOT", str(resolve_paths().root))
    spec = tmp_path / "fleet.toml"
    spec.write_text('[regions]\nus-east = "us"\n[[pools]]\nname = "real"\n'
                    f'model = "{MODEL}"\nregion = "us-east"\nlaunch = "sglang"\n'
                    'model_path = "@sglang-cpu-model"\n')
    try:
        call_command("fleet", "up", "--spec", str(spec), "--timeout", "240", stdout=StringIO())
        engine = EngineInstance.objects.get(engine_id="real-0")
        assert engine.status == EngineStatus.HEALTHY
        assert _chat(engine.url, "hi")["usage"]["prompt_tokens"] > 0
        os.killpg(engine.pid, signal.SIGKILL)
        wait_until(lambda: not services.pid_alive(engine.pid), timeout=20, what="the kill")
        assert services.fleet_health_check()["real-0"] == "restarted"
        wait_until(lambda: services.fleet_health_check(restart=False)["real-0"] == "healthy",
                   timeout=240, what="the restarted SGLang engine to be healthy")
        fresh = EngineInstance.objects.get(engine_id="real-0")
        assert fresh.restarts == 1 and fresh.pid != engine.pid
        assert _chat(fresh.url, "hi again")["choices"]
    finally:
        services.fleet_down(progress=lambda _m: None)
