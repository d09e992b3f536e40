"""Hostile tenants against admission's worst case, through the official openai SDK, a live
gateway and simulated engines: the output bound the engine honours is the one reserved, fields
the gateway cannot bound are refused before any engine sees them, every prompt-bearing field
counts, a hard budget is reached to within one request's worst case and never passed, nothing
unpriced is served, and a model offered only in another zone looks like no model at all.
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import anthropic
import httpx
import openai
import pytest
from django.db.models import Sum

from billing_platform.accounts.choices import DataZone
from billing_platform.gateway.batch import runner
from billing_platform.gateway.batch import services as batch_services
from billing_platform.gateway.models import Batch, BatchLine
from engine_adapter.sim.testing import FAST_RATES, start_sim
from metering.models import UsageEvent
from plans import admission, limits, quotas
from tests.conftest import wait_until
from tests.factories import OrganizationFactory, ProjectFactory, make_key, make_price_book
from tests.gateway.conftest import drain_usage, register_engine, start_gateway, stop_gateway
from tests.gateway.test_batch_api import fast_stack, upload

MICRO = Decimal("0.000001")
# Prices in whole micro-units per token and cached tokens at the input price, so every
# request costs a whole number of micro-units: Redis's spend and the rated events agree to
# the last digit, and "within one worst case" is exact. "banded" is the same model with a
# band 100x dearer far above any prompt here.
SMALL = {"model": "small", "input": "1.00", "cached_input": "1.00", "output": "2.00"}
BANDED = {**SMALL, "model": "banded",
          "bands": [{"above_prompt_tokens": 100_000, "input": "100.00",
                     "cached_input": "100.00", "output": "200.00"}]}
FREE = {"model": "free", "input": "0", "output": "0"}  # explicitly priced at zero
EMBED = {"model": "embed", "input": "100.00", "cached_input": "100.00", "output": "0"}
MODELS = ("small", "banded", "free", "unpriced")  # "unpriced" has an engine and no price
EMBEDDING_MODELS = ("embed",)
HI = [{"role": "user", "content": "hello there"}]


@pytest.fixture
def gateway(transactional_db, tmp_path, settings, metering_stream):
    settings.FILES_DIR = str(tmp_path / "files")  # batch input files, shared with the gateway
    make_price_book(prices=[SMALL, BANDED, FREE, EMBED])
    sims = {m: start_sim(served_model_name=m, max_running_requests=256,
                         is_embedding=m in EMBEDDING_MODELS, **FAST_RATES)
            for m in (*MODELS, *EMBEDDING_MODELS)}
    for model, sim in sims.items():
        register_engine(sim, pool=f"{model}-us", region="us-east", zone="us",
                        extra_args=["--is-embedding"] if model in EMBEDDING_MODELS else [])
    gw = start_gateway(tmp_path, env={**metering_stream, "TOLLGATE_FILES_DIR": settings.FILES_DIR})
    gw.sims = sims
    yield gw
    stop_gateway(gw)
    for sim in sims.values():
        sim.stop()


def _tenant(zone: str = DataZone.GLOBAL):
    org = OrganizationFactory(data_zone=zone)
    project = ProjectFactory(organization=org)
    key, secret = make_key(project=project, scopes=["inference"])
    return org, key, secret


def _client(gw, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=secret, max_retries=0)


def _engine_requests(gw, model: str = "small") -> int:
    return httpx.get(f"{gw.sims[model].base_url}/sim/stats").json()["requests"]


def _spend(org) -> Decimal:
    return UsageEvent.objects.filter(organization=org).aggregate(s=Sum("amount"))["s"] or 0


def _ingested(ids: list[str]) -> None:
    wait_until(lambda: (drain_usage(), UsageEvent.objects.filter(request_id__in=ids).count()
                        == len(ids))[1], timeout=60, what=f"{len(ids)} events ingested")


def _reserved_tokens(headers, tpm: int) -> int:
    """What the admission took from a fresh token bucket of ``tpm``: prompt bound + output."""
    return tpm - int(headers["x-ratelimit-remaining-tokens"])


# --- the output bound ------------------------------------------------------------------------

OVERSHOOT = {  # (endpoint, SDK arguments): the field the engine honours says 2000
    "completions": {"prompt": "Once upon a time", "max_tokens": 2000,
                    "extra_body": {"max_completion_tokens": 1, "ignore_eos": True}},
    "chat": {"messages": HI, "max_completion_tokens": 2000,
             "extra_body": {"max_tokens": 1, "ignore_eos": True}},
}


def _create(client: openai.OpenAI, endpoint: str, **kwargs):
    api = client.completions if endpoint == "completions" else client.chat.completions
    return api.with_raw_response.create(model="small", **kwargs)


@pytest.mark.parametrize("endpoint", list(OVERSHOOT))
def test_a_small_max_completion_tokens_beside_a_large_max_tokens_cannot_pass_a_hard_budget(
        gateway, endpoint):
    # given a hard budget of 0.01, about two requests of 2000 output tokens
    org, _key, secret = _tenant()
    budget = Decimal("0.01")
    quotas.budget_set(organization=org, amount=budget, hard=True)
    client = _client(gateway, secret)

    # when 50 requests at once each say "1" in one output field and "2000" in the other
    def attack(_i):
        try:
            return _create(client, endpoint, **OVERSHOOT[endpoint])
        except openai.APIStatusError as exc:
            return exc

    with ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(attack, range(50)))

    # then the served ones generated the 2000 they were reserved for, the rest were refused
    # at the spend limit, and what was billed never passes the budget
    served = [o for o in outcomes if not isinstance(o, openai.APIStatusError)]
    refused = [o for o in outcomes if isinstance(o, openai.APIStatusError)]
    assert served and refused
    assert {o.parse().usage.completion_tokens for o in served} == {2000}
    assert {(o.status_code, o.code) for o in refused} == {
        (429, "organization_spend_limit_exceeded")}
    _ingested([o.headers["x-request-id"] for o in served])
    assert _spend(org) <= budget, (_spend(org), len(served))


@pytest.mark.parametrize(("endpoint", "kwargs", "generated"), [
    ("completions", {"prompt": "Once", "max_tokens": 40,
                     "extra_body": {"max_completion_tokens": 3}}, 40),
    ("completions", {"prompt": "Once", "extra_body": {"max_completion_tokens": 30}}, 30),
    ("chat", {"messages": HI, "max_completion_tokens": 40, "max_tokens": 3}, 40),
    ("chat", {"messages": HI, "max_completion_tokens": 3, "max_tokens": 40}, 3),
    ("chat", {"messages": HI, "max_tokens": 30}, 30),
])
def test_the_reserve_covers_what_the_engine_generates_whichever_fields_are_sent(
        gateway, endpoint, kwargs, generated):
    # given a key with a token bucket, so the admission's estimate shows in the headers
    _org, key, secret = _tenant()
    limits.quota_limit_set(organization=key.project.organization, api_key=key, tpm=100_000)
    body = {**kwargs, "extra_body": {**kwargs.get("extra_body", {}), "ignore_eos": True}}

    raw = _create(_client(gateway, secret), endpoint, **body)

    # then the engine generated exactly the one bound, and admission reserved at least that
    usage = raw.parse().usage
    assert usage.completion_tokens == generated
    assert _reserved_tokens(raw.headers, 100_000) >= usage.prompt_tokens + generated


def test_batch_lines_with_a_lower_second_output_field_cannot_pass_a_hard_budget(
        transactional_db, tmp_path, settings, metering_stream):
    # given a batch of 50 completion lines that say "1" and "2000", and a hard budget that
    # holds about five of them at the batch price
    settings.BATCH_HOST_CPU_CEILING = 1.0  # other tests share this machine's CPUs
    stack_gen = fast_stack(tmp_path, settings, metering_stream)
    stack = next(stack_gen)
    try:
        org, _key, _secret = _tenant()
        _batch_key, secret = make_key(project=org.projects.first(),
                                      scopes=["inference", "batch"])
        client = _client(stack.gateway, secret)
        budget = Decimal("0.01")
        quotas.budget_set(organization=org, amount=budget, hard=True)
        lines = [{"custom_id": f"c-{i}", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "small", "prompt": f"Story {i}:", "max_tokens": 2000,
                           "max_completion_tokens": 1, "ignore_eos": True}}
                 for i in range(50)]
        created = client.batches.create(input_file_id=upload(client, lines),
                                        endpoint="/v1/completions", completion_window="24h")
        batch = batch_services.batch_validate(
            batch_id=Batch.objects.get(public_id=created.id).pk)
        assert batch.status == "in_progress"

        # when the runner works through it
        deadline = time.monotonic() + 120
        while (Batch.objects.get(pk=batch.pk).status == "in_progress"
               and time.monotonic() < deadline):
            runner.batch_run(batch_id=batch.pk, slice_s=2)

        # then the lines that ran generated their 2000 tokens, the budget stopped the rest,
        # and the batch's billed spend never passes the budget
        done = BatchLine.objects.filter(batch=batch, state="completed")
        assert 0 < done.count() < 50
        assert {line.response["usage"]["completion_tokens"] for line in done} == {2000}
        _ingested([line.request_id for line in done])
        assert _spend(org) <= budget, (_spend(org), done.count())
    finally:
        next(stack_gen, None)


# --- fields the gateway does not pass on -----------------------------------------------------

ENGINE_ONLY = {  # SGLang fields a tenant could use to reach past its bounds or its tenancy
    "bootstrap_host": "10.0.0.9", "bootstrap_port": 8998, "bootstrap_room": 7,
    "session_params": {"id": "s-1", "offset": 0}, "session_id": "s-1", "routed_dp_rank": 1,
    "data_parallel_rank": 1, "return_meta_info": True, "custom_params": {"x": 1},
    "lora_path": "/etc/passwd", "return_hidden_states": True, "cache_salt": "victim",
    "extra_key": "victim", "rid": "someone-elses-id", "priority": 1000, "best_of": 5,
    "custom_logit_processor": "x",
}


@pytest.mark.parametrize("field", sorted(ENGINE_ONLY))
def test_engine_fields_outside_the_allow_list_are_refused_before_any_engine(gateway, field):
    _org, _key, secret = _tenant()
    client = _client(gateway, secret)
    before = _engine_requests(gateway)
    for endpoint, kwargs in (("chat", {"messages": HI}), ("completions", {"prompt": "Once"})):
        with pytest.raises(openai.BadRequestError) as refused:
            _create(client, endpoint, max_tokens=2,
                    extra_body={field: ENGINE_ONLY[field]}, **kwargs)
        assert refused.value.code == "unknown_parameter"
        assert refused.value.param == field
    assert _engine_requests(gateway) == before  # the engine never saw them
    assert not UsageEvent.objects.exists()


def test_input_ids_on_chat_are_refused_before_any_engine(gateway):
    _org, _key, secret = _tenant()
    before = _engine_requests(gateway)
    with pytest.raises(openai.BadRequestError) as refused:
        _client(gateway, secret).chat.completions.create(
            model="small", messages=HI, max_tokens=2, extra_body={"input_ids": [1] * 5000})
    assert refused.value.param == "input_ids"
    assert _engine_requests(gateway) == before


def test_what_reaches_the_engine_is_the_allow_list_and_one_output_field():
    from billing_platform.gateway.validation import (
        CHAT_FIELDS,
        COMPLETION_FIELDS,
        parse_chat,
        parse_completion,
    )

    # informational OpenAI fields are accepted and not passed on; the output bound travels in
    # exactly the field the endpoint's engine honours
    chat = parse_chat({"model": "small", "messages": HI, "max_tokens": 9, "user": "u",
                       "metadata": {"a": "b"}, "store": False, "top_k": 4,
                       "stream": True, "stream_options": {"include_usage": True},
                       "service_tier": "flex"})
    assert set(chat.engine_body) <= CHAT_FIELDS | {"max_completion_tokens"}
    assert chat.engine_body["max_completion_tokens"] == chat.max_output == 9
    assert "max_tokens" not in chat.engine_body and "user" not in chat.engine_body
    assert chat.engine_body["top_k"] == 4
    completion = parse_completion({"model": "small", "prompt": "x", "max_tokens": 9,
                                   "max_completion_tokens": 1})
    assert set(completion.engine_body) <= COMPLETION_FIELDS | {"max_tokens"}
    assert completion.engine_body["max_tokens"] == completion.max_output == 9
    assert "max_completion_tokens" not in completion.engine_body


def test_informational_openai_fields_are_accepted(gateway):
    _org, _key, secret = _tenant()
    done = _client(gateway, secret).chat.completions.create(
        model="small", messages=HI, max_tokens=2, user="end-user-1", store=False,
        metadata={"job": "x"})
    assert done.usage.completion_tokens == 2


# --- the prompt bound --------------------------------------------------------------------------

LONG_TOOL = [{"type": "function", "function": {
    "name": "lookup", "description": "Look the answer up. " * 300,
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


def test_tools_count_in_the_prompt_bound(gateway):
    # given a key whose token bucket holds 3,000 tokens
    _org, key, secret = _tenant()
    limits.quota_limit_set(organization=key.project.organization, api_key=key, tpm=3000)
    client = _client(gateway, secret)
    before = _engine_requests(gateway)

    # when a one-word message carries a tool definition of 6,000 bytes
    with pytest.raises(openai.RateLimitError) as too_large:
        client.chat.completions.create(model="small", messages=HI, max_tokens=5,
                                       tools=LONG_TOOL)

    # then its estimate is larger than the bucket: refused, and no engine saw it
    assert "Request too large" in too_large.value.body["message"]
    assert _engine_requests(gateway) == before
    # a short tool still runs, and its estimate holds the tool's bytes
    short = [{"type": "function", "function": {"name": "now", "description": "Time now."}}]
    raw = client.chat.completions.with_raw_response.create(
        model="small", messages=HI, max_tokens=5, tools=short)
    assert _reserved_tokens(raw.headers, 3000) > len(str(short)) + 5


def test_tool_calls_in_past_messages_count_in_the_prompt_bound(gateway):
    _org, key, secret = _tenant()
    limits.quota_limit_set(organization=key.project.organization, api_key=key, tpm=3000)
    messages = [*HI, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "lookup", "arguments": '{"q": "' + "x" * 6000 + '"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
    with pytest.raises(openai.RateLimitError) as too_large:
        _client(gateway, secret).chat.completions.create(model="small", messages=messages,
                                                         max_tokens=5)
    assert "Request too large" in too_large.value.body["message"]


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 64}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "file", "file": {"file_id": "file-1"}},
])
def test_content_parts_without_a_bound_are_refused_before_any_engine(gateway, part):
    _org, _key, secret = _tenant()
    before = _engine_requests(gateway)
    with pytest.raises(openai.BadRequestError) as refused:
        _client(gateway, secret).chat.completions.create(
            model="small", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "text", "text": "what is this?"}, part]}])
    assert refused.value.param == "messages[0].content[1].type"
    assert _engine_requests(gateway) == before


def test_a_token_array_prompt_is_refused_before_any_engine(gateway):
    _org, _key, secret = _tenant()
    before = _engine_requests(gateway)
    with pytest.raises(openai.BadRequestError) as refused:
        _client(gateway, secret).completions.create(model="small", prompt=[1] * 5000,
                                                    max_tokens=2)
    assert refused.value.param == "prompt"
    assert _engine_requests(gateway) == before


# --- the hard budget is reached, never passed ------------------------------------------------

TOKENS = 30


def _true_worst(kind: str) -> Decimal:
    """One request's worst case: its prompt bound and full output, at the base prices (the
    100x band starts at 100,000 prompt tokens, which these prompts can never reach); an
    embedding's is its input's bound alone."""
    if kind == "embedding":
        return admission.prompt_token_bound("hello there", 1) * Decimal(EMBED["input"]) * MICRO
    bound = admission.prompt_token_bound(
        "hello there" if kind == "completion" else "user: hello there", 1)
    return (bound * Decimal(BANDED["input"]) + TOKENS * Decimal(BANDED["output"])) * MICRO


def _one_request(gateway, secret: str, kind: str):
    """One request of ``kind`` through its official SDK; a refusal raises ``Refused``."""
    if kind == "messages":
        try:
            return anthropic.Anthropic(base_url=gateway.url, api_key=secret, max_retries=0
                                       ).messages.with_raw_response.create(
                model="banded", max_tokens=TOKENS, messages=HI)
        except anthropic.APIStatusError as exc:  # Anthropic's errors name a type, no code
            raise Refused(exc.status_code, exc.body["error"]["type"], exc.response) from exc
    client = _client(gateway, secret)
    try:
        if kind == "embedding":
            return client.embeddings.with_raw_response.create(model="embed", input="hello there")
        if kind == "completion":
            return client.completions.with_raw_response.create(
                model="banded", prompt="hello there", max_tokens=TOKENS,
                extra_body={"ignore_eos": True})
        return client.chat.completions.with_raw_response.create(
            model="banded", messages=HI, max_tokens=TOKENS, extra_body={"ignore_eos": True})
    except openai.APIStatusError as exc:
        raise Refused(exc.status_code, exc.code, exc.response) from exc


class Refused(Exception):
    def __init__(self, status: int, code: str | None, response: httpx.Response) -> None:
        super().__init__(status, code)
        self.status, self.code, self.response = status, code, response


# What a refusal for the month, and an engine failure, are called on each surface.
SPEND_REFUSALS = {"messages": {(429, "rate_limit_error"), (502, "api_error")}}
OPENAI_REFUSALS = {(429, "organization_spend_limit_exceeded"), (502, "engine_error")}


@pytest.mark.parametrize(("kind", "threads"), [
    ("chat", 32), ("chat", 1), ("embedding", 32), ("completion", 32), ("messages", 32)],
    ids=["200-parallel", "sequential", "embeddings-200-parallel",
         "completions-200-parallel", "anthropic-messages-200-parallel"])
def test_spend_reaches_a_hard_budget_to_within_one_worst_case_and_never_passes_it(
        gateway, kind, threads):
    # given a model with a 100x band for prompts over 100,000 tokens (or an embedding model
    # at 100 per million input tokens), and a hard budget of 0.01: about 145 requests of 30
    # output tokens at the base prices (about 33 embeddings)
    org, _key, secret = _tenant()
    budget = Decimal("0.01")
    quotas.budget_set(organization=org, amount=budget, hard=True)

    # when 200 callers at once (or one, again and again) send until the budget refuses them
    # for the month, retrying the refusals that only say "retry in a second" (others'
    # reservations), as a client does
    def caller(until_refused: bool):
        ids, refusals = [], Counter()
        for _ in range(1000):
            try:
                raw = _one_request(gateway, secret, kind)
            except Refused as exc:
                refusals[(exc.status, exc.code)] += 1
                if exc.status == 429 and int(exc.response.headers["retry-after"]) > 60:
                    return ids, refusals, True
                time.sleep(0.02)
                continue
            ids.append(raw.headers["x-request-id"])
            if not until_refused:
                break
        return ids, refusals, False

    if threads > 1:
        with ThreadPoolExecutor(threads) as pool:
            results = list(pool.map(lambda _i: caller(False), range(200)))
        if not any(refused for _ids, _r, refused in results):
            results.append(caller(True))  # 200 did not reach it: go on until refused
    else:
        results = [caller(True)]

    # then the budget refused for the month, every refusal was the spend limit, and the billed
    # spend is at most the budget and less than one request's true worst case below it
    ids = [i for r in results for i in r[0]]
    refusals = sum((r[1] for r in results), Counter())
    assert any(r[2] for r in results)
    assert set(refusals) <= SPEND_REFUSALS.get(kind, OPENAI_REFUSALS)
    _ingested(ids)
    spend = _spend(org)
    worst = _true_worst(kind)
    assert spend <= budget, spend
    assert spend > budget - worst, (spend, budget, worst, len(ids))


# --- nothing is served that cannot be billed -------------------------------------------------

def test_a_model_without_a_price_is_refused_and_a_zero_price_is_served(gateway):
    _org, _key, secret = _tenant()
    client = _client(gateway, secret)

    # an engine serves "unpriced", but no price book prices it: refused, OpenAI-shaped
    for create in (lambda: client.chat.completions.create(model="unpriced", messages=HI,
                                                          max_tokens=2),
                   lambda: client.completions.create(model="unpriced", prompt="x",
                                                     max_tokens=2)):
        with pytest.raises(openai.NotFoundError) as refused:
            create()
        assert refused.value.code == "model_not_found"
        assert refused.value.param == "model"
        assert refused.value.body["type"] == "invalid_request_error"
        assert "no price" in refused.value.body["message"]
    assert _engine_requests(gateway, "unpriced") == 0

    # "free" is priced at zero: served, and its event is rated (at zero), not dead-lettered
    raw = client.chat.completions.with_raw_response.create(model="free", messages=HI,
                                                           max_tokens=2)
    assert raw.parse().usage.completion_tokens == 2
    _ingested([raw.headers["x-request-id"]])
    event = UsageEvent.objects.get(request_id=raw.headers["x-request-id"])
    assert event.amount == 0 and event.price_version_id is not None


def test_a_batch_of_an_unpriced_model_fails_validation(gateway):
    org, _key, _secret = _tenant()
    _batch_key, secret = make_key(project=org.projects.first(), scopes=["batch"])
    client = _client(gateway, secret)
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "unpriced", "messages": HI, "max_tokens": 2}}]
    created = client.batches.create(input_file_id=upload(client, lines),
                                    endpoint="/v1/chat/completions", completion_window="24h")
    batch = batch_services.batch_validate(batch_id=Batch.objects.get(public_id=created.id).pk)
    assert batch.status == "failed"
    assert [e["code"] for e in batch.errors] == ["model_not_found"]
    assert _engine_requests(gateway, "unpriced") == 0


# --- the zone error ------------------------------------------------------------------------

def test_a_model_offered_only_in_another_zone_looks_like_no_model(gateway):
    # given "free" served only in us-east, "small" in the EU too, and an EU organization
    eu_only = start_sim(served_model_name="small", **FAST_RATES)
    try:
        register_engine(eu_only, pool="small-eu", region="eu-west", zone="eu")
        _org, _key, secret = _tenant(DataZone.EU)
        client = _client(gateway, secret)

        # when it asks for "free" (served in the US only) and for a model that exists nowhere
        def refusal(model):
            with pytest.raises(openai.NotFoundError) as refused:
                client.chat.completions.create(model=model, messages=HI, max_tokens=2)
            return refused.value

        elsewhere, nowhere = refusal("free"), refusal("no-such-model")

        # then both answers are the same words: nothing names a zone, a region or the US
        assert elsewhere.body == {**nowhere.body, "message": nowhere.body["message"].replace(
            "no-such-model", "free")}
        text = elsewhere.body["message"].lower()
        assert not any(w in text for w in ("zone", "region", "us-east", " us", "(us)"))
    finally:
        eu_only.stop()
