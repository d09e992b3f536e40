"""Anthropic's Messages API (``POST /v1/messages``) through the official ``anthropic`` SDK
against a live gateway and simulated engines: the usage the SDK sees equals the stored event
(cached prompt tokens apart, as Anthropic counts them), the stream has Anthropic's events,
errors have Anthropic's shape, and the request is rated like any other."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from metering.models import UsageEvent
from tests.gateway.test_openai_api import LONG, _event, _key


def _client(gateway, secret: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url, api_key=secret, max_retries=0)


def test_message_usage_equals_the_stored_event_and_is_rated(live_gateway):
    key, secret = _key()
    client = _client(live_gateway, secret)

    raw = client.messages.with_raw_response.create(
        model="small", max_tokens=7, system="You are terse.", metadata={"user_id": "alice"},
        messages=[{"role": "user", "content": "Say hi"}])
    message = raw.parse()

    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 7
    event = _event(raw.headers["x-request-id"])
    assert message.id == f"msg_{event.request_id[4:]}"
    assert (message.usage.input_tokens + message.usage.cache_read_input_tokens,
            message.usage.cache_read_input_tokens, message.usage.output_tokens) == (
        event.prompt_tokens, event.cached_tokens, event.completion_tokens)
    assert event.status == "ok" and event.api_key_id == key.pk and event.amount > 0
    assert event.end_user == "alice"  # metadata.user_id: the end user, as chat's user

    # a repeated long prompt: the engine's cached tokens are read apart from the input
    for _ in range(2):
        again = client.messages.create(model="small", max_tokens=3,
                                       messages=[{"role": "user", "content": LONG}])
    assert again.usage.cache_read_input_tokens > 100
    assert again.usage.input_tokens < again.usage.cache_read_input_tokens


def test_stream_has_anthropics_events_and_the_final_usage(live_gateway):
    _key_obj, secret = _key()
    client = _client(live_gateway, secret)

    with client.messages.stream(model="small", max_tokens=5,
                                messages=[{"role": "user", "content": "Once"}]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
        request_id = stream.response.headers["x-request-id"]

    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "text" in kinds  # the SDK's text events, from content_block_delta
    assert final.content[0].text and final.stop_reason == "max_tokens"
    event = _event(request_id)
    assert (final.usage.input_tokens + final.usage.cache_read_input_tokens,
            final.usage.output_tokens) == (event.prompt_tokens, event.completion_tokens)


def test_stop_sequences_and_errors_in_anthropics_shape(live_gateway):
    _key_obj, secret = _key()
    client = _client(live_gateway, secret)

    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="gpt-9", max_tokens=5,
                               messages=[{"role": "user", "content": "x"}])
    assert unknown.value.body["type"] == "error"
    assert unknown.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as missing:
        client.messages.create(model="small", max_tokens=0,
                               messages=[{"role": "user", "content": "x"}])
    assert missing.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as image:
        client.messages.create(model="small", max_tokens=5, messages=[{
            "role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert "image" in image.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as tools:
        client.messages.create(model="small", max_tokens=5, tools=[{
            "name": "t", "input_schema": {"type": "object"}}],
            messages=[{"role": "user", "content": "x"}])
    assert "tools" in tools.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as bad_key:
        _client(live_gateway, "tg-aaaaaaaaaaaa_" + "x" * 43).messages.create(
            model="small", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert bad_key.value.body["error"]["type"] == "authentication_error"
    garbage = httpx.post(f"{live_gateway.url}/v1/messages", content=b"{nope",
                         headers={"x-api-key": secret, "anthropic-version": "2023-06-01"})
    assert garbage.status_code == 400 and garbage.json()["type"] == "error"
    assert not UsageEvent.objects.exists()  # nothing reached an engine, nothing was metered

    # a stop sequence the engine matched is named as Anthropic names it
    # (the simulator's text has spaces between its words)
    stopped = client.messages.create(model="small", max_tokens=50, stop_sequences=[" "],
                                     messages=[{"role": "user", "content": "Write"}])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", " ")
    assert stopped.usage.output_tokens < 50


def test_count_tokens_is_the_prompt_a_create_call_sends_and_is_free(live_gateway):
    key, secret = _key()
    client = _client(live_gateway, secret)
    turns = [{"role": "user", "content": "Say hi"},
             {"role": "assistant", "content": [{"type": "text", "text": "Hi."}]},
             {"role": "user", "content": "And again, at more length please."}]

    counted = client.messages.with_raw_response.count_tokens(
        model="small", system="You are terse.", messages=turns)
    assert counted.headers["request-id"].startswith("req_")
    tokens = counted.parse().input_tokens
    # the count is the engine's, of the prompt a create call with the same turns sends
    raw = client.messages.with_raw_response.create(model="small", max_tokens=3,
                                                   system="You are terse.", messages=turns)
    message = raw.parse()
    assert tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert tokens == _event(raw.headers["x-request-id"]).prompt_tokens
    assert tokens > client.messages.count_tokens(model="small", messages=turns[:1]).input_tokens
    # ...and counting is free: the create call is the key's only usage event
    assert list(UsageEvent.objects.filter(api_key=key).values_list("request_id", flat=True)) \
        == [raw.headers["x-request-id"]]


@pytest.mark.parametrize(("body", "status", "kind", "words"), [
    ({"model": "gpt-9"}, 404, "not_found_error", "gpt-9"),
    ({"max_tokens": 5}, 400, "invalid_request_error", "max_tokens"),
    ({"tools": [{"name": "t", "input_schema": {"type": "object"}}]}, 400,
     "invalid_request_error", "tools"),
    ({"messages": []}, 400, "invalid_request_error", "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "invalid_request_error", "role"),
    ({"system": 7}, 400, "invalid_request_error", "system"),
    ({"messages": [{"role": "user", "content": "x" * 9_000_000}]}, 413, "request_too_large",
     "exceeds"),
])
def test_count_tokens_refuses_bad_bodies_in_anthropics_shape(live_gateway, body, status, kind,
                                                             words):
    _key_obj, secret = _key()
    sent = {"model": "small", "messages": [{"role": "user", "content": "x"}], **body}
    reply = httpx.post(f"{live_gateway.url}/v1/messages/count_tokens", json=sent,
                       headers={"x-api-key": secret, "anthropic-version": "2023-06-01"})
    assert reply.status_code == status, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert words in error["error"]["message"]


def test_count_tokens_needs_a_key_with_the_inference_scope(live_gateway):
    from tests.factories import OrganizationFactory, ProjectFactory, make_key

    body = {"model": "small", "messages": [{"role": "user", "content": "x"}]}
    url = f"{live_gateway.url}/v1/messages/count_tokens"
    anonymous = httpx.post(url, json=body)
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["type"] == "authentication_error"
    _read_key, read_only = make_key(
        project=ProjectFactory(organization=OrganizationFactory()), scopes=["usage:read"])
    refused = httpx.post(url, json=body, headers={"x-api-key": read_only})
    assert refused.status_code == 403
    assert refused.json()["error"]["type"] == "permission_error"
    wrong_method = httpx.get(url, headers={"x-api-key": read_only})
    assert wrong_method.status_code == 405
