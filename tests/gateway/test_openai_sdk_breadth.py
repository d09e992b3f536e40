"""Issue 20 items 4 and 5 through the official ``openai`` SDK against a live gateway and
simulated engines: ``n`` choices (usage as OpenAI reports it: the prompt once, completions
summed, and the stored event equal to it), ``logprobs``/``top_logprobs``, ``stop`` and
``seed`` passed through, ``user`` stored on the event and grouped by in ``/api/v1/usage``,
and a reasoning model's ``reasoning_tokens`` (the engine's count, billed as output)."""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import openai
import pytest

from plans import admission, quotas
from tests.conftest import wait_until
from tests.factories import make_key
from tests.gateway.conftest import register_engine
from tests.gateway.test_openai_api import _client, _event, _key
from tests.security.test_admission_bounds import (  # noqa: F401 (the fixture)
    MICRO,
    SMALL,
    _ingested,
    _spend,
    _tenant,
    gateway,
)

HI = [{"role": "user", "content": "Say hi"}]
PRICE_IN, PRICE_OUT = Decimal("0.50"), Decimal("1.50")  # live_gateway's price book


def _priced(prompt: int, completion: int) -> Decimal:
    return (prompt * PRICE_IN + completion * PRICE_OUT) / Decimal(1_000_000)


def test_n_choices_bill_the_prompt_once_and_every_choice(live_gateway):
    key, secret = _key()
    raw = _client(live_gateway, secret).chat.completions.with_raw_response.create(
        model="small", messages=HI, n=3, max_tokens=5, extra_body={"ignore_eos": True})
    completion = raw.parse()

    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert all(c.message.content and c.finish_reason == "length" for c in completion.choices)
    # choices are sampled apart: not three copies of one text
    assert len({c.message.content for c in completion.choices}) > 1
    usage = completion.usage
    assert usage.completion_tokens == 15
    assert usage.total_tokens == usage.prompt_tokens + 15
    event = _event(raw.headers["x-request-id"])
    assert (event.prompt_tokens, event.completion_tokens, event.cached_tokens) == (
        usage.prompt_tokens, 15, usage.prompt_tokens_details.cached_tokens)
    assert event.cached_tokens == 0 and event.amount == _priced(usage.prompt_tokens, 15)
    assert event.api_key_id == key.pk


def test_n_choices_stream_by_index_and_legacy_completions_take_n(live_gateway):
    _key_obj, secret = _key()
    client = _client(live_gateway, secret)
    texts: dict[int, str] = {}
    usage = None
    with client.chat.completions.with_streaming_response.create(
            model="small", messages=HI, n=2, max_tokens=4, stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True}) as response:
        request_id = response.headers["x-request-id"]
        for chunk in response.parse():
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if chunk.usage:
                usage = chunk.usage
    assert sorted(texts) == [0, 1] and all(texts.values())
    assert usage is not None and usage.completion_tokens == 8
    event = _event(request_id)
    assert (event.prompt_tokens, event.completion_tokens) == (usage.prompt_tokens, 8)

    raw = client.completions.with_raw_response.create(
        model="small", prompt="Once upon a time", n=2, max_tokens=3,
        extra_body={"ignore_eos": True})
    legacy = raw.parse()
    assert [c.index for c in legacy.choices] == [0, 1]
    assert legacy.usage.completion_tokens == 6
    assert _event(raw.headers["x-request-id"]).completion_tokens == 6


def test_logprobs_come_back_in_openais_shape(live_gateway):
    _key_obj, secret = _key()
    client = _client(live_gateway, secret)
    chat = client.chat.completions.create(model="small", messages=HI, max_tokens=4,
                                          logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    for token in content:
        assert token.logprob <= 0 and token.bytes == list(token.token.encode())
        assert len(token.top_logprobs) == 2
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob

    legacy = client.completions.create(model="small", prompt="Once", max_tokens=3, logprobs=1,
                                       extra_body={"ignore_eos": True})
    lp = legacy.choices[0].logprobs
    assert "".join(lp.tokens) == legacy.choices[0].text and len(lp.token_logprobs) == 3
    assert lp.text_offset[0] == 0 and all(len(top) == 1 for top in lp.top_logprobs)


def test_seed_repeats_a_choice_and_stop_ends_it(live_gateway):
    _key_obj, secret = _key()
    client = _client(live_gateway, secret)

    def ask(**kwargs):
        return client.chat.completions.create(model="small", messages=HI, max_tokens=12,
                                              **kwargs).choices[0]

    first, again, other = ask(seed=7), ask(seed=7), ask(seed=8)
    assert first.message.content == again.message.content != other.message.content
    stop_word = first.message.content.split()[2]
    stopped = ask(seed=7, stop=[stop_word])
    assert stopped.finish_reason == "stop"
    assert stop_word not in stopped.message.content
    assert first.message.content.startswith(stopped.message.content)


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"n": 0}, "n"), ({"n": 129}, "n"), ({"extra_body": {"n": "3"}}, "n"),
    ({"user": "x" * 257}, "user"), ({"user": "line\nbreak"}, "user"),
    ({"extra_body": {"user": 5}}, "user"),
])
def test_bad_n_and_user_are_refused_with_the_param(live_gateway, kwargs, param):
    _key_obj, secret = _key()
    with pytest.raises(openai.BadRequestError) as caught:
        _client(live_gateway, secret).chat.completions.create(
            model="small", messages=HI, max_tokens=2, **kwargs)
    assert caught.value.param == param
    assert caught.value.body["param"] == param


def test_user_is_stored_and_grouped_in_the_usage_api(live_gateway, api_client):
    key, secret = _key()
    client = _client(live_gateway, secret)
    ids = []
    for user, tokens in (("alice", 3), ("alice", 4), ("bob", 5), (None, 2)):
        extra = {"user": user} if user else {}
        raw = client.chat.completions.with_raw_response.create(
            model="small", messages=HI, max_tokens=tokens, extra_body={"ignore_eos": True},
            **extra)
        ids.append(raw.headers["x-request-id"])
    events = [_event(i) for i in ids]
    assert [e.end_user for e in events] == ["alice", "alice", "bob", None]

    # another organization's requests under the same user name are not in this one's sums
    _other_key, other_secret = _key()
    _event(_client(live_gateway, other_secret).chat.completions.with_raw_response.create(
        model="small", messages=HI, max_tokens=9, user="alice").headers["x-request-id"])

    _k, reader = make_key(project=key.project, scopes=["usage:read"])
    day = events[0].event_time.date()
    reply = api_client.get("/api/v1/usage", {"group_by": "user", "start": day.isoformat()},
                           HTTP_AUTHORIZATION=f"Bearer {reader}")
    assert reply.status_code == 200, reply.content
    by_user = {row["user"]: row for row in reply.json()["data"]}
    assert set(by_user) == {"alice", "bob", None}
    assert (by_user["alice"]["requests"], by_user["alice"]["completion_tokens"]) == (2, 7)
    assert by_user["bob"]["completion_tokens"] == 5 and by_user[None]["requests"] == 1
    for user, row in by_user.items():
        mine = [e for e in events if e.end_user == user]
        assert row["prompt_tokens"] == sum(e.prompt_tokens for e in mine)
        assert Decimal(row["amount"]) == sum(e.amount for e in mine)
    # the user grouping reads events: its range is bounded
    too_long = api_client.get("/api/v1/usage", {"group_by": "user", "start": "2026-01-01",
                                                "end": "2026-03-01"},
                              HTTP_AUTHORIZATION=f"Bearer {reader}")
    assert too_long.status_code == 400 and too_long.json()["code"] == "usage_range_too_large"


def test_reasoning_tokens_are_the_engines_count_and_billed_as_output(live_gateway):
    from engine_adapter.sim.testing import FAST_RATES, start_sim

    # given a reasoning model (SGLang's reasoning parser) that thinks 4 tokens first
    sim = start_sim(served_model_name="slow", sim_reasoning_tokens=4, **FAST_RATES)
    try:
        register_engine(sim, pool="slow-us", region="us-east", zone="us")
        _key_obj, secret = _key()
        client = _client(live_gateway, secret)

        def ask():
            try:
                return client.chat.completions.with_raw_response.create(
                    model="slow", messages=HI, max_tokens=10, extra_body={"ignore_eos": True})
            except openai.NotFoundError:
                return None  # the gateway has not refreshed its fleet yet

        raw = wait_until(ask, timeout=10, what="the reasoning engine in the fleet")
        completion = raw.parse()
        usage = completion.usage
        assert usage.completion_tokens == 10
        assert usage.completion_tokens_details.reasoning_tokens == 4
        message = completion.choices[0].message
        assert message.model_extra["reasoning_content"] and message.content
        event = _event(raw.headers["x-request-id"])
        assert event.completion_tokens == 10  # reasoning is output, priced as output
        assert event.reasoning_tokens == 4  # ...and stored as the engine counted it
        assert event.amount == _priced(event.prompt_tokens, 10)

        # the Responses API reports the same count, from the same stored event
        answer = client.responses.with_raw_response.create(model="slow", input="Hi",
                                                           max_output_tokens=10)
        details = answer.parse().usage.output_tokens_details
        assert details.reasoning_tokens == 4
        assert _event(answer.headers["x-request-id"]).reasoning_tokens == 4

        with client.chat.completions.with_streaming_response.create(
                model="slow", messages=HI, max_tokens=6, stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True}) as response:
            chunks = list(response.parse())
        final = chunks[-1].usage
        assert final.completion_tokens_details.reasoning_tokens == 4
        assert _event(response.headers["x-request-id"]).reasoning_tokens == 4
        thought = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or ""
                          for c in chunks if c.choices)
        assert thought == message.model_extra["reasoning_content"]
    finally:
        sim.stop()


def test_n_choices_cannot_pass_a_hard_budget_200_parallel(gateway):  # noqa: F811
    # given a hard budget of 0.01: about 50 requests of 3 choices x 30 output tokens
    org, _key_obj, secret = _tenant()
    budget = Decimal("0.01")
    quotas.budget_set(organization=org, amount=budget, hard=True)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=secret, max_retries=0)

    # when 200 callers at once send until the budget refuses them for the month, retrying
    # the refusals that only say "retry in a second" (others' reservations), as a client does
    def caller(_i):
        ids, refusals = [], Counter()
        for _ in range(1000):
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model="small", messages=[{"role": "user", "content": "hello there"}],
                    n=3, max_tokens=30, extra_body={"ignore_eos": True})
            except openai.APIStatusError as exc:
                refusals[(exc.status_code, exc.code)] += 1
                if exc.status_code == 429 and int(exc.response.headers["retry-after"]) > 60:
                    return ids, refusals, True
                time.sleep(0.02)
                continue
            assert raw.parse().usage.completion_tokens == 90
            ids.append(raw.headers["x-request-id"])
            return ids, refusals, False
        return ids, refusals, False

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(caller, range(200)))

    # then the budget refused for the month, every refusal was the spend limit, and the billed
    # spend is at most the budget and within one request's worst case of it (had admission
    # reserved one choice's output, ~145 requests would have been served: 0.027)
    ids = [i for r in results for i in r[0]]
    refusals = sum((r[1] for r in results), Counter())
    assert any(r[2] for r in results)
    assert set(refusals) <= {(429, "organization_spend_limit_exceeded"), (502, "engine_error")}
    _ingested(ids)
    spend = _spend(org)
    worst = (admission.prompt_token_bound("user: hello there", 1) * Decimal(SMALL["input"])
             + 90 * Decimal(SMALL["output"])) * MICRO
    assert spend <= budget, (spend, len(ids))
    assert spend > budget - worst, (spend, budget, worst, len(ids))
