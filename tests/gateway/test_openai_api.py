"""The /v1 gateway through the official openai SDK against a live server and simulated engines.

Every request's usage event is checked against what the SDK saw: the counts come from the
engine, and each request is recorded exactly once.
"""

from __future__ import annotations

import json
import signal

import httpx
import openai
import pytest

from billing_platform.accounts.choices import DataZone
from engine_adapter.sim.testing import FAST_RATES, start_sim
from metering.models import UsageEvent
from tests.conftest import wait_until
from tests.factories import OrganizationFactory, ProjectFactory, make_key
from tests.gateway.conftest import drain_usage, register_engine

LONG = "Tollgate meters every token exactly once, durably and fast. " * 40


def _client(gateway, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=secret, max_retries=0)


def _key(zone: str = DataZone.GLOBAL, scopes=("inference",)):
    org = OrganizationFactory(data_zone=zone)
    return make_key(project=ProjectFactory(organization=org), scopes=list(scopes))


def _event(request_id: str) -> UsageEvent:
    def recorded():
        drain_usage()
        return UsageEvent.objects.filter(request_id=request_id).first()

    return wait_until(recorded, timeout=10, what=f"the usage event of {request_id}")


def test_chat_non_streaming_usage_equals_the_stored_event(live_gateway):
    key, secret = _key()
    raw = _client(live_gateway, secret).chat.completions.with_raw_response.create(
        model="small", messages=[{"role": "user", "content": "Say hi"}], max_tokens=7)
    completion = raw.parse()
    request_id = raw.headers["x-request-id"]
    assert completion.choices[0].message.content
    assert completion.service_tier == "default"
    assert completion.usage.completion_tokens == 7
    assert completion.usage.prompt_tokens_details.cached_tokens == 0
    event = _event(request_id)
    assert (event.prompt_tokens, event.completion_tokens, event.cached_tokens) == (
        completion.usage.prompt_tokens, completion.usage.completion_tokens, 0)
    assert event.status == "ok" and event.api_key_id == key.pk
    assert event.region in ("us-east", "eu-west") and event.engine
    assert UsageEvent.objects.filter(request_id=request_id).count() == 1


def test_streaming_usage_chunk_only_when_asked_and_cached_tokens_on_repeat(live_gateway):
    _key_obj, secret = _key()
    client = _client(live_gateway, secret)
    chunks = list(client.chat.completions.create(
        model="small", messages=[{"role": "user", "content": LONG}], max_tokens=5,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1])

    quiet = list(client.chat.completions.create(
        model="small", messages=[{"role": "user", "content": LONG}], max_tokens=5, stream=True))
    assert all(c.usage is None for c in quiet) and all(c.choices for c in quiet)

    repeat = client.chat.completions.create(
        model="small", messages=[{"role": "user", "content": LONG}], max_tokens=5)
    assert repeat.usage.prompt_tokens_details.cached_tokens > 100


def test_legacy_completions_streaming_and_not(live_gateway):
    _key_obj, secret = _key()
    client = _client(live_gateway, secret)
    done = client.completions.create(model="small", prompt="Once upon a time", max_tokens=4)
    assert done.choices[0].text and done.usage.completion_tokens == 4
    chunks = list(client.completions.create(model="small", prompt="Once", max_tokens=3,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 3


def test_errors_have_openai_shape_and_status(live_gateway):
    _key_obj, secret = _key()
    client = _client(live_gateway, secret)
    with pytest.raises(openai.AuthenticationError) as bad_key:
        _client(live_gateway, "tg-aaaaaaaaaaaa_" + "x" * 43).models.list()
    assert bad_key.value.code == "invalid_api_key"
    _k, batch_only = _key(scopes=("batch",))
    with pytest.raises(openai.PermissionDeniedError):
        _client(live_gateway, batch_only).chat.completions.create(
            model="small", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user",
                                                                 "content": "x"}])
    assert unknown.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as no_messages:
        client.chat.completions.create(model="small", messages=[])
    assert no_messages.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as tier:
        client.chat.completions.create(model="small", service_tier="turbo",
                                       messages=[{"role": "user", "content": "x"}])
    assert tier.value.param == "service_tier"
    # an error the engine finds (SGLang's own error shape) reaches the client with its message
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as too_long:
            client.chat.completions.create(model="small", max_tokens=100_000, stream=stream,
                                           messages=[{"role": "user", "content": "x"}])
        assert too_long.value.code == "context_length_exceeded"
        assert "maximum context length of 32768 tokens" in too_long.value.message
    huge = httpx.post(f"{live_gateway.url}/v1/chat/completions",
                      headers={"Authorization": f"Bearer {secret}"},
                      content=b"{" + b" " * (9 * 1024 * 1024) + b"}")
    assert huge.status_code == 413
    assert huge.json()["error"]["code"] == "request_too_large"
    garbage = httpx.post(f"{live_gateway.url}/v1/chat/completions",
                         headers={"Authorization": f"Bearer {secret}"}, content=b"{nope")
    assert garbage.status_code == 400 and garbage.json()["error"]["type"] == (
        "invalid_request_error")
    assert not UsageEvent.objects.exists()  # nothing reached an engine, nothing was metered


def test_models_are_those_of_the_callers_zone(live_gateway, tmp_path):
    big = start_sim(served_model_name="big-us-only", **FAST_RATES)
    try:
        register_engine(big, pool="big-us", region="us-east", zone="us")
        _k, eu = _key(DataZone.EU)
        _k, us = _key(DataZone.US)
        wait_until(lambda: "big-us-only" in [m.id for m in _client(live_gateway, us)
                                             .models.list()], timeout=5, what="fleet refresh")
        assert [m.id for m in _client(live_gateway, eu).models.list()] == ["small"]
        assert _client(live_gateway, us).models.retrieve("big-us-only").id == "big-us-only"
        # the EU org is told what it would be told of a model that does not exist: nothing
        # says that the model runs in another zone, or where
        elsewhere = _not_found(_client(live_gateway, eu), "big-us-only")
        nowhere = _not_found(_client(live_gateway, eu), "no-such-model")
        assert elsewhere.status_code == nowhere.status_code == 404
        assert elsewhere.body == {**nowhere.body, "message": nowhere.body["message"].replace(
            "no-such-model", "big-us-only")}
        words = set(elsewhere.body["message"].lower().replace(".", " ").split())
        assert not {"us", "zone", "region", "us-east"} & words, words
    finally:
        big.stop()


def test_models_list_only_priced_models_with_when_they_were_first_priced(live_gateway):
    """/v1/models offers what a request would be served: a model an engine runs but the
    organization's price book does not price is not listed (and is refused), and each listed
    model's ``created`` is when its book first priced it, whatever versions came later."""
    from datetime import UTC, datetime

    from plans import services as plan_services
    from plans.models import PriceBook
    from tests.factories import PRICES_FROM

    book = PriceBook.objects.get(is_default=True, currency="USD")
    plan_services.price_version_create(  # a later version (copies the first): same "created"
        price_book=book, effective_from=datetime(2026, 3, 1, tzinfo=UTC), allow_backdate=True,
        prices=[{"model": "small", "input": "0.40", "output": "1.20"}])
    free = start_sim(served_model_name="unpriced", **FAST_RATES)
    try:
        register_engine(free, pool="unpriced-us", region="us-east", zone="us")
        _k, secret = _key()
        client = _client(live_gateway, secret)
        refused = wait_until(lambda: "no price in force" in _not_found(client, "unpriced")
                             .message and _not_found(client, "unpriced"), timeout=5,
                             what="fleet refresh")
        assert refused.code == "model_not_found"

        listed = {m.id: m for m in client.models.list()}
        assert "unpriced" not in listed and "small" in listed
        assert listed["small"].created == int(PRICES_FROM.timestamp())
        assert listed["small"].model_extra["endpoints"] == [
            "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
            "/v1/batches"]
        assert client.models.retrieve("small").created == listed["small"].created
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("unpriced")
    finally:
        free.stop()


def _not_found(client: openai.OpenAI, model: str) -> openai.NotFoundError:
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])
    return refused.value


def test_eu_request_with_eu_engines_down_is_503_and_never_runs_in_the_us(live_gateway):
    from engine_adapter.choices import EngineStatus
    from engine_adapter.models import EngineInstance

    EngineInstance.objects.filter(pool__region="eu-west").update(status=EngineStatus.UNHEALTHY)
    _k, eu = _key(DataZone.EU)
    client = _client(live_gateway, eu)
    us_before = httpx.get(f"{live_gateway.sims['us'].base_url}/sim/stats").json()["requests"]
    wait_until(lambda: _status(client) == 503, timeout=5, what="the fleet view to refresh")
    # retryable, and it names nothing outside the caller's zone
    with pytest.raises(openai.InternalServerError) as down:
        client.chat.completions.create(model="small", messages=[{"role": "user",
                                                                 "content": "x"}])
    assert down.value.status_code == 503 and down.value.response.headers["retry-after"]
    assert "us-east" not in down.value.body["message"] and " us" not in down.value.body[
        "message"]
    us_after = httpx.get(f"{live_gateway.sims['us'].base_url}/sim/stats").json()["requests"]
    assert us_after == us_before
    assert not UsageEvent.objects.filter(region="us-east").exists()


def _status(client: openai.OpenAI) -> int:
    try:
        client.chat.completions.create(model="small", messages=[{"role": "user",
                                                                 "content": "x"}])
    except openai.APIStatusError as exc:
        return exc.status_code
    return 200


def test_engine_failure_before_output_is_502_and_an_unbilled_event(live_gateway):
    for sim in live_gateway.sims.values():
        httpx.post(f"{sim.base_url}/sim/faults", json={"error_rate": 1.0})
    _k, secret = _key()
    raw = httpx.post(f"{live_gateway.url}/v1/chat/completions",
                     headers={"Authorization": f"Bearer {secret}"},
                     json={"model": "small", "messages": [{"role": "user", "content": "x"}]})
    assert raw.status_code == 502 and raw.json()["error"]["type"] == "server_error"
    event = _event(raw.headers["x-request-id"])
    assert event.status == "engine_error"
    assert event.prompt_tokens == event.completion_tokens == 0


def test_client_disconnect_mid_stream_records_the_delivered_tokens(live_gateway):
    for sim in live_gateway.sims.values():
        httpx.post(f"{sim.base_url}/sim/faults", json={"stall_s": 0})
    _k, secret = _key()
    slow = start_sim(served_model_name="slow", decode_tokens_per_s=40)
    try:
        register_engine(slow, pool="slow-us", region="us-east", zone="us")
        body = {"model": "slow", "messages": [{"role": "user", "content": "go"}],
                "max_tokens": 400, "stream": True}
        wait_until(lambda: httpx.get(f"{live_gateway.url}/v1/models/slow", headers={
            "Authorization": f"Bearer {secret}"}).status_code == 200, timeout=5,
            what="fleet refresh")
        with httpx.stream("POST", f"{live_gateway.url}/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {secret}"}, timeout=30) as r:
            request_id = r.headers["x-request-id"]
            received = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    received += bool(json.loads(line[6:])["choices"][0]["delta"].get("content"))
                if received >= 8:
                    break
        event = _event(request_id)
        assert event.status == "client_aborted"
        assert received <= event.completion_tokens < 400
        assert event.prompt_tokens > 0
    finally:
        slow.stop()


def test_engine_killed_mid_stream_gives_a_clean_error_and_an_engine_error_event(live_gateway):
    _k, secret = _key()
    doomed = start_sim(served_model_name="doomed", decode_tokens_per_s=40)
    register_engine(doomed, pool="doomed-us", region="us-east", zone="us")
    wait_until(lambda: httpx.get(f"{live_gateway.url}/v1/models/doomed", headers={
        "Authorization": f"Bearer {secret}"}).status_code == 200, timeout=5, what="refresh")
    body = {"model": "doomed", "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 400, "stream": True}
    frames = []
    with httpx.stream("POST", f"{live_gateway.url}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {secret}"}, timeout=30) as r:
        request_id = r.headers["x-request-id"]
        for line in r.iter_lines():
            if line.startswith("data: "):
                frames.append(line[6:])
                if len(frames) == 5:
                    doomed.process.send_signal(signal.SIGKILL)
    assert frames[-1] == "[DONE]"
    assert "error" in json.loads(frames[-2])
    event = _event(request_id)
    assert event.status == "engine_error"
    assert event.completion_tokens >= 4
