"""OpenAI's Responses API (``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``)
through the official ``openai`` SDK against a live gateway and simulated engines: the usage
the SDK sees equals the stored event (cached tokens the engine's), the stream has OpenAI's
typed events in sequence, ``previous_response_id`` continues a stored conversation of the
caller's organization only, and bad input is refused in OpenAI's shape with its param."""

from __future__ import annotations

import asyncio
import json
import signal
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from decimal import Decimal

import httpx
import openai
import pytest
from django.db.models import Sum
from django.utils import timezone

from billing_platform.gateway import response_store
from billing_platform.gateway.models import StoredResponse
from billing_platform.gateway.responses import inference_request, parse_responses
from billing_platform.gateway.tasks import responses_expire
from engine_adapter.sim.testing import start_sim
from metering.models import UsageEvent
from plans import admission, quotas
from tests.conftest import wait_until
from tests.gateway.conftest import drain_usage, register_engine
from tests.gateway.test_openai_api import LONG, _event, _key

# the gateway of these tests keeps stored responses 7 days (the default is 30)
RETENTION_DAYS = 7


@pytest.fixture
def gateway_env() -> dict[str, str]:
    return {"TOLLGATE_RESPONSES_RETENTION_DAYS": str(RETENTION_DAYS)}


def _client(gateway, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=secret, max_retries=0)


def _same_usage(usage, event: UsageEvent) -> None:
    assert (usage.input_tokens, usage.input_tokens_details.cached_tokens,
            usage.output_tokens, usage.total_tokens) == (
        event.prompt_tokens, event.cached_tokens, event.completion_tokens,
        event.prompt_tokens + event.completion_tokens)
    assert usage.output_tokens_details.reasoning_tokens == 0


def test_create_sync_and_async_usage_equals_the_stored_event(live_gateway):
    key, secret = _key()

    # sync: a natural stop well inside the bound (the simulator stops after 24-96 tokens)
    raw = _client(live_gateway, secret).responses.with_raw_response.create(
        model="small", input="Say hi", instructions="You are terse.",
        max_output_tokens=200, metadata={"ticket": "T-1"}, temperature=0.5)
    response = raw.parse()
    event = _event(raw.headers["x-request-id"])
    assert response.object == "response" and response.status == "completed"
    assert response.id == f"resp_{event.request_id[4:]}"
    assert response.output_text and response.output[0].type == "message"
    assert response.output[0].content[0].type == "output_text"
    assert (response.instructions, response.metadata, response.temperature,
            response.service_tier) == ("You are terse.", {"ticket": "T-1"}, 0.5, "default")
    _same_usage(response.usage, event)
    assert event.status == "ok" and event.api_key_id == key.pk and event.amount > 0

    # async: stopped at the bound, as OpenAI says it
    async def create():
        async with openai.AsyncOpenAI(base_url=f"{live_gateway.url}/v1", api_key=secret,
                                      max_retries=0) as client:
            return await client.responses.with_raw_response.create(
                model="small", input=[{"role": "user", "content": [
                    {"type": "input_text", "text": "Tell "}, {"type": "input_text",
                                                             "text": "a story"}]}],
                max_output_tokens=5)

    raw = asyncio.run(create())
    short = raw.parse()
    assert (short.status, short.incomplete_details.reason) == ("incomplete",
                                                               "max_output_tokens")
    assert short.usage.output_tokens == 5 and short.output_text
    _same_usage(short.usage, _event(raw.headers["x-request-id"]))


def test_stream_has_typed_events_in_sequence_and_the_final_usage(live_gateway):
    _key_obj, secret = _key()
    client = _client(live_gateway, secret)

    with client.responses.stream(model="small", input=LONG, max_output_tokens=200) as stream:
        events = list(stream)
        final = stream.get_final_response()
        request_id = stream._response.headers["x-request-id"]

    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas and set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == "".join(deltas) == events[-4].text
    assert final.id == events[0].response.id and final.status == "completed"
    _same_usage(final.usage, _event(request_id))

    # at the bound the stream ends in response.incomplete, usage and all
    raw = httpx.post(f"{live_gateway.url}/v1/responses", timeout=30,
                     headers={"Authorization": f"Bearer {secret}"},
                     json={"model": "small", "input": "Go on", "max_output_tokens": 3,
                           "stream": True})
    names = [line[7:] for line in raw.text.splitlines() if line.startswith("event: ")]
    assert names[-1] == "response.incomplete" and "response.completed" not in names
    last = json.loads([line for line in raw.text.splitlines() if line.startswith("data: ")
                       ][-1][6:])
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["usage"]["output_tokens"] == 3
    assert _event(raw.headers["x-request-id"]).completion_tokens == 3


def test_previous_response_id_continues_the_organizations_stored_conversation(live_gateway):
    _key_obj, secret = _key()
    client = _client(live_gateway, secret)
    _other, other_secret = _key()
    other = _client(live_gateway, other_secret)

    # given a stored response over a long prompt
    first = client.responses.create(model="small", input=LONG, max_output_tokens=8)
    # when the next one continues it
    raw = client.responses.with_raw_response.create(
        model="small", input="And then?", previous_response_id=first.id, max_output_tokens=4)
    second = raw.parse()
    # then the engine got the whole conversation: the earlier prompt and answer, now cached
    assert second.previous_response_id == first.id and second.instructions is None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 100
    _same_usage(second.usage, _event(raw.headers["x-request-id"]))
    third = client.responses.create(model="small", input="Last", max_output_tokens=2,
                                    previous_response_id=second.id)
    assert third.usage.input_tokens > second.usage.input_tokens

    # GET answers the Response as it was created, and its own input items, paged
    got = client.responses.retrieve(first.id)
    assert (got.id, got.output_text, got.usage.output_tokens) == (
        first.id, first.output_text, first.usage.output_tokens)
    turns = client.responses.create(model="small", max_output_tokens=2, input=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
        {"role": "user", "content": "Bye"}])
    items = client.responses.input_items.list(turns.id, limit=2)
    assert [(i.role, i.content[0].text) for i in items.data] == [("user", "Bye"),
                                                                  ("assistant", "Hello")]
    assert items.has_more
    everything = list(client.responses.input_items.list(turns.id, order="asc", limit=1))
    assert [i.content[0].text for i in everything] == ["Be brief.", "Hi", "Hello", "Bye"]
    with pytest.raises(openai.NotFoundError):
        other.responses.input_items.list(turns.id)

    # another organization: its id is not found, for reading, deleting and continuing alike
    events_before = UsageEvent.objects.count()
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as chained:
        other.responses.create(model="small", input="x", previous_response_id=first.id)
    assert chained.value.param == "previous_response_id"
    assert UsageEvent.objects.count() == events_before  # refused before any engine
    assert StoredResponse.objects.filter(public_id=first.id).exists()

    # store=false: answered, metered, never retrievable nor continued
    unstored = client.responses.create(model="small", input="x", store=False,
                                       max_output_tokens=2)
    assert unstored.store is False and unstored.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="small", input="x", previous_response_id=unstored.id)

    # DELETE: gone, and the responses that continued it keep their own turns
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(second.id)
    assert client.responses.retrieve(third.id).id == third.id
    after = client.responses.create(model="small", input="Again", max_output_tokens=2,
                                    previous_response_id=third.id)
    assert after.usage.input_tokens < third.usage.input_tokens  # the chain starts at third

    # retention: past its expiry a response is not found, and the beat task deletes it once
    StoredResponse.objects.filter(public_id=first.id).update(
        expires_at=timezone.now() - timedelta(seconds=1))
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    assert responses_expire() == 1
    assert responses_expire() == 0
    assert not StoredResponse.objects.filter(public_id=first.id).exists()
    kept = StoredResponse.objects.get(public_id=third.id)
    assert kept.expires_at - kept.created_at == timedelta(days=RETENTION_DAYS)


def test_bad_input_is_refused_in_openais_shape_with_its_param(live_gateway):
    _key_obj, secret = _key()
    client = _client(live_gateway, secret)
    refused = {
        "input[0].content[0].type": {"input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
        "input[0].type": {"input": [{"type": "function_call_output", "call_id": "c",
                                     "output": "x"}]},
        "input[0].role": {"input": [{"role": "tool", "content": "x"}]},
        "input": {"input": []},
        "tools": {"input": "x", "tools": [{"type": "function", "name": "f",
                                           "parameters": {}}]},
        "reasoning": {"input": "x", "reasoning": {"effort": "high"}},
        "max_output_tokens": {"input": "x", "max_output_tokens": 0},
        "temperature": {"input": "x", "temperature": 3},
        "metadata": {"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}},
        "service_tier": {"input": "x", "service_tier": "scale"},
        "previous_response_id": {"input": "x", "previous_response_id": 7},
    }
    for param, body in refused.items():
        with pytest.raises(openai.BadRequestError) as bad:
            client.responses.create(model="small", **body)
        assert bad.value.param == param, (param, bad.value.body)
        assert bad.value.body["type"] == "invalid_request_error"
    unknown = httpx.post(f"{live_gateway.url}/v1/responses",
                         headers={"Authorization": f"Bearer {secret}"},
                         json={"model": "small", "input": "x", "session_params": {"id": 1}})
    assert unknown.status_code == 400
    assert unknown.json()["error"]["code"] == "unknown_parameter"
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="gpt-9", input="x")
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="small", input="x",
                                previous_response_id="resp_" + "0" * 32)
    assert not UsageEvent.objects.exists()  # nothing reached an engine, nothing was metered

    # more than the model's context, in the input or the bound: the engine's refusal, stored
    # nowhere
    for body in ({"input": "word " * 40_000}, {"input": "x", "max_output_tokens": 100_000}):
        with pytest.raises(openai.BadRequestError) as too_long:
            client.responses.create(model="small", **body)
        assert too_long.value.code == "context_length_exceeded"
    assert not StoredResponse.objects.exists()


def test_200_concurrent_continued_responses_never_exceed_a_hard_budget(live_gateway):
    # given a hard budget, and a stored response whose conversation every request continues
    # (so each prompt is the rebuilt conversation, which admission must bound in full)
    key, secret = _key()
    org, project = key.project.organization, key.project
    budget = Decimal("0.003")
    quotas.budget_set(organization=org, amount=budget, hard=True)
    client = _client(live_gateway, secret)
    first = client.responses.create(model="small", input="hello there " * 20,
                                    max_output_tokens=8)
    body = {"model": "small", "input": "and then?", "previous_response_id": first.id,
            "max_output_tokens": 20}
    chain = response_store.stored_response_chain(org_id=org.id, public_id=first.id)
    req = inference_request(parse_responses(body), chain.messages)
    assert req.prompt_bound > first.usage.input_tokens + first.usage.output_tokens
    policy = admission.quota_policy_load(organization_id=org.id, project_id=project.id,
                                         key_id=key.id, model="small")
    worst = admission.from_micro(admission.worst_case_micro(
        policy.pricing, tier="default", zone=org.data_zone, max_output=20,
        prompt_tokens=req.prompt_bound))

    def post(_i=None) -> httpx.Response:
        return httpx.post(f"{live_gateway.url}/v1/responses", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {secret}"})

    # when 200 arrive at once, then more one by one until one is refused
    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(post, range(200)))
    for _ in range(100):
        answers.append(last := post())
        if last.status_code == 429:
            break

    # then every refusal is the spend limit, and the rated spend (the first response's
    # included) is at most the budget and within one worst case of it
    codes = Counter(r.status_code for r in answers)
    assert {200, 429} <= set(codes) <= {200, 429, 502} and codes[502] <= 5, codes
    assert {r.json()["error"]["code"] for r in answers if r.status_code == 429} == {
        "organization_spend_limit_exceeded"}
    assert last.status_code == 429
    ids = [r.headers["x-request-id"] for r in answers if r.status_code == 200]
    wait_until(lambda: (drain_usage(), UsageEvent.objects.filter(request_id__in=ids).count()
                        == len(ids))[1], timeout=30, what="all events ingested")
    spend = UsageEvent.objects.filter(organization=org).aggregate(s=Sum("amount"))["s"]
    assert budget - worst < spend <= budget, (spend, budget, worst, len(ids))
    assert StoredResponse.objects.filter(organization=org).count() == len(ids) + 1


def test_a_stream_cut_short_is_metered_as_delivered_and_not_stored(live_gateway):
    _key_obj, secret = _key()
    auth = {"Authorization": f"Bearer {secret}"}
    slow = start_sim(served_model_name="slow", decode_tokens_per_s=40)
    doomed = start_sim(served_model_name="doomed", decode_tokens_per_s=40)
    try:
        register_engine(slow, pool="slow-us", region="us-east", zone="us")
        register_engine(doomed, pool="doomed-us", region="us-east", zone="us")
        for model in ("slow", "doomed"):
            wait_until(lambda m=model: httpx.get(f"{live_gateway.url}/v1/models/{m}",
                                                 headers=auth).status_code == 200,
                       timeout=5, what="fleet refresh")

        # the engine dies mid-stream: an error event, then response.failed; nothing stored
        body = {"model": "doomed", "input": "go", "max_output_tokens": 400, "stream": True}
        kinds = []
        with httpx.stream("POST", f"{live_gateway.url}/v1/responses", json=body,
                          headers=auth, timeout=30) as r:
            request_id = r.headers["x-request-id"]
            for line in r.iter_lines():
                if line.startswith("data: "):
                    kinds.append(json.loads(line[6:])["type"])
                    if kinds.count("response.output_text.delta") == 3:
                        doomed.process.send_signal(signal.SIGKILL)
        assert kinds[-2:] == ["error", "response.failed"]
        event = _event(request_id)
        assert event.status == "engine_error" and event.completion_tokens >= 3
        assert not StoredResponse.objects.filter(request_id=request_id).exists()

        # the client goes mid-stream: what was delivered is metered; nothing stored
        body = {"model": "slow", "input": "go", "max_output_tokens": 400, "stream": True}
        with httpx.stream("POST", f"{live_gateway.url}/v1/responses", json=body,
                          headers=auth, timeout=30) as r:
            request_id = r.headers["x-request-id"]
            deltas = 0
            for line in r.iter_lines():
                deltas += line.startswith("event: response.output_text.delta")
                if deltas >= 8:
                    break
        event = _event(request_id)
        assert event.status == "client_aborted" and 8 <= event.completion_tokens < 400
        assert not StoredResponse.objects.filter(request_id=request_id).exists()
    finally:
        slow.stop()
        doomed.stop()
