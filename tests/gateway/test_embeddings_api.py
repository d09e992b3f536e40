"""Issue 20 item 2: ``POST /v1/embeddings`` through the official ``openai`` SDK against a live
gateway and simulated embedding engines (``--is-embedding`` pools): the vectors as the SDK
reads them (its default base64 and floats), usage equal to the stored event and to the
upcoming invoice, token-id input bounded by the model's vocabulary, ``dimensions`` where the
model can shorten its vectors, the Batch API's ``/v1/embeddings`` lines, and the hostile
tenant's bodies refused before any engine sees them.

Real SGLang's side of the same wire is ``tests/engine_adapter/test_embeddings_sglang.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from decimal import Decimal

import httpx
import openai
import pytest

from billing_platform.accounts.choices import DataZone
from billing_platform.gateway.batch import services as batch_services
from billing_platform.gateway.models import Batch, BatchLine
from billing_platform.invoicing import selectors as invoicing
from engine_adapter.sim.testing import FAST_RATES, start_sim
from metering.models import UsageEvent
from tests.factories import OrganizationFactory, ProjectFactory, make_key, make_price_book
from tests.gateway.conftest import drain_usage, register_engine, start_gateway, stop_gateway
from tests.gateway.test_batch_api import run_here, upload
from tests.gateway.test_openai_api import _event

PRICE = Decimal("0.02")  # per million input tokens
VOCAB = 2**31 - 1  # the simulator's token ids are below it (and a Pool column holds it)
DIM = 64


@pytest.fixture
def gateway(transactional_db, tmp_path, settings, metering_stream) -> Iterator:
    """``small`` (a chat model), ``embed`` (an embedding model whose vectors may be shortened
    and whose vocabulary the fleet knows) and ``embed-text`` (one with neither)."""
    settings.FILES_DIR = str(tmp_path / "files")
    make_price_book(prices=[{"model": "small", "input": "0.50", "output": "1.50"},
                            {"model": "embed", "input": str(PRICE), "output": "0"},
                            {"model": "embed-text", "input": str(PRICE), "output": "0"}])
    sims = {
        "small": start_sim(served_model_name="small", **FAST_RATES),
        "embed": start_sim(served_model_name="embed", is_embedding=True,
                           json_model_override_args='{"is_matryoshka": true}', **FAST_RATES),
        "embed-text": start_sim(served_model_name="embed-text", is_embedding=True,
                                **FAST_RATES),
    }
    register_engine(sims["small"], pool="small-us", region="us-east", zone="us")
    register_engine(sims["embed"], pool="embed-us", region="us-east", zone="us",
                    extra_args=["--is-embedding"], vocab_size=VOCAB)
    register_engine(sims["embed-text"], pool="embed-text-us", region="us-east", zone="us",
                    extra_args=["--is-embedding"])
    gw = start_gateway(tmp_path, env={**metering_stream,
                                      "TOLLGATE_FILES_DIR": settings.FILES_DIR})
    gw.sims = sims
    yield gw
    stop_gateway(gw)
    for sim in sims.values():
        sim.stop()


def _tenant(zone: str = DataZone.GLOBAL, scopes=("inference",)):
    org = OrganizationFactory(data_zone=zone)
    key, secret = make_key(project=ProjectFactory(organization=org), scopes=list(scopes))
    return org, key, secret


def _client(gw, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=secret, max_retries=0)


def _engine_requests(gw, model: str) -> int:
    return httpx.get(f"{gw.sims[model].base_url}/sim/stats").json()["requests"]


def _norm(vector) -> float:
    return math.sqrt(math.fsum(x * x for x in vector))


def test_sdk_embeddings_usage_equals_the_stored_event_and_the_upcoming_invoice(gateway):
    org, key, secret = _tenant()
    client = _client(gateway, secret)
    texts = ["The ledger keeps every token.", "Tenants share no cache."]

    # the SDK asks for base64 by default and decodes it into floats
    raw = client.embeddings.with_raw_response.create(model="embed", input=texts, user="u-7")
    answer = raw.parse()
    assert [d.index for d in answer.data] == [0, 1]
    assert all(len(d.embedding) == DIM and abs(_norm(d.embedding) - 1) < 1e-5
               for d in answer.data)
    assert answer.data[0].embedding != answer.data[1].embedding
    assert answer.model == "embed"  # the caller's name, not the engine's model path
    usage = answer.usage
    assert usage.prompt_tokens > 0 and usage.total_tokens == usage.prompt_tokens

    # the same input as floats: the same vectors, to float32's precision
    floats = client.embeddings.create(model="embed", input=texts, encoding_format="float")
    assert all(abs(a - b) < 1e-6 for a, b in zip(floats.data[1].embedding,
                                                 answer.data[1].embedding, strict=True))

    event = _event(raw.headers["x-request-id"])
    assert (event.prompt_tokens, event.completion_tokens, event.cached_tokens) == (
        usage.prompt_tokens, 0, 0)
    assert event.amount == usage.prompt_tokens * PRICE / 1_000_000
    assert (event.api_key_id, event.model, event.end_user) == (key.pk, "embed", "u-7")

    # the upcoming invoice bills both requests' input tokens on the embedding model's line
    drain_usage()
    billed = sum(ln.quantity for ln in invoicing.upcoming_invoice(organization=org).lines
                 if ln.model == "embed")
    assert billed == 2 * usage.prompt_tokens


def test_token_ids_are_taken_within_the_vocabulary_the_fleet_knows(gateway):
    _org, _key, secret = _tenant()
    client = _client(gateway, secret)

    answer = client.embeddings.create(model="embed", input=[[1001, 1002, 1003], [1004]],
                                      encoding_format="float")
    assert len(answer.data) == 2 and answer.usage.prompt_tokens == 4
    one = client.embeddings.create(model="embed", input=[1001, 1002], encoding_format="float")
    assert len(one.data) == 1 and one.usage.prompt_tokens == 2

    before = _engine_requests(gateway, "embed-text")
    with pytest.raises(openai.BadRequestError) as past:
        client.embeddings.create(model="embed", input=[[1001, VOCAB]])
    assert past.value.body["param"] == "input[0]" and str(VOCAB) in past.value.message
    with pytest.raises(openai.BadRequestError) as unknown:
        client.embeddings.create(model="embed-text", input=[[1001, 1002]])
    assert unknown.value.body["param"] == "input" and "text" in unknown.value.message
    assert _engine_requests(gateway, "embed-text") == before


def test_dimensions_shorten_where_the_model_allows_in_our_words_elsewhere(gateway):
    _org, _key, secret = _tenant()
    client = _client(gateway, secret)

    short = client.embeddings.create(model="embed", input="hello", dimensions=16)
    assert len(short.data[0].embedding) == 16 and abs(_norm(short.data[0].embedding) - 1) < 1e-5

    for model, dims in (("embed-text", 16), ("embed", DIM + 1)):
        with pytest.raises(openai.BadRequestError) as refused:
            client.embeddings.create(model=model, input="hello", dimensions=dims)
        assert refused.value.body["param"] == "dimensions"
        assert f"'{model}'" in refused.value.message
        # the engine's own words name its model path on disk: never relayed
        assert "/" not in refused.value.message.replace("/v1", "")


BAD_BODIES = [
    ({"input": ""}, "input[0]"),
    ({"input": "   "}, "input[0]"),
    ({"input": []}, "input"),
    ({"input": None}, "input"),
    ({"input": ["fine", ""]}, "input[1]"),
    ({"input": ["text", 5]}, "input[0]"),
    ({"input": [[1, 2], "text"]}, "input[1]"),
    ({"input": [[-1]]}, "input[0]"),
    ({"input": [[1.5]]}, "input[0]"),
    ({"input": [[True]]}, "input[0]"),
    ({"input": [[]]}, "input[0]"),
    ({"input": {"text": "x"}}, "input"),
    ({"input": ["x"] * 2049}, "input"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": "8"}, "dimensions"),
    ({"input": "x", "dimensions": True}, "dimensions"),
    ({"input": "x", "stream": True}, "stream"),
    ({"input": "x", "n": 2}, "n"),
    ({"input": "x", "max_tokens": 5}, "max_tokens"),
    ({"input": "x", "service_tier": "priority"}, "service_tier"),
    ({"input": "x", "rid": "someone-elses"}, "rid"),
    ({"input": "x", "priority": 1000}, "priority"),
    ({"input": "x", "user": "a\nb"}, "user"),
    ({"input": "x", "model": 7}, "model"),
]


@pytest.mark.parametrize(("body", "param"), BAD_BODIES,
                         ids=[f"{i}-{p}" for i, (_b, p) in enumerate(BAD_BODIES)])
def test_malformed_bodies_are_refused_before_any_engine(gateway, body, param):
    org, _key, secret = _tenant()
    before = _engine_requests(gateway, "embed")
    response = httpx.post(f"{gateway.url}/v1/embeddings", json={"model": "embed", **body},
                          headers={"Authorization": f"Bearer {secret}"}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert _engine_requests(gateway, "embed") == before
    drain_usage()
    assert not UsageEvent.objects.filter(organization=org).exists()


def test_each_model_answers_only_its_own_endpoints_and_other_zones_see_none(gateway):
    _org, _key, secret = _tenant()
    client = _client(gateway, secret)
    before = {m: _engine_requests(gateway, m) for m in ("small", "embed")}

    with pytest.raises(openai.NotFoundError) as chat_model:
        client.embeddings.create(model="small", input="hello")
    assert chat_model.value.code == "unsupported_model"
    # a generation request would fail an embedding engine's scheduler: never sent
    with pytest.raises(openai.NotFoundError) as embed_model:
        client.chat.completions.create(model="embed", messages=[{"role": "user",
                                                                 "content": "hi"}])
    assert embed_model.value.code == "unsupported_model" and "/v1/embeddings" in (
        embed_model.value.message)
    assert {m: _engine_requests(gateway, m) for m in before} == before

    listed = {m.id: m.model_extra["endpoints"] for m in client.models.list()}
    assert listed["embed"] == ["/v1/embeddings", "/v1/batches"]
    assert "/v1/embeddings" not in listed["small"]

    # an organization in another data zone: the same words as a model that does not exist
    _eu, _key, eu_secret = _tenant(zone=DataZone.EU)
    eu = _client(gateway, eu_secret)
    answers = []
    for model in ("embed", "no-such-model"):
        with pytest.raises(openai.NotFoundError) as hidden:
            eu.embeddings.create(model=model, input="hello")
        answers.append((hidden.value.code, hidden.value.message.replace(model, "M")))
    assert answers[0] == answers[1] and answers[0][0] == "model_not_found"


def test_a_key_without_the_inference_scope_embeds_nothing(gateway):
    _org, _key, secret = _tenant(scopes=("batch",))
    before = _engine_requests(gateway, "embed")
    with pytest.raises(openai.PermissionDeniedError):
        _client(gateway, secret).embeddings.create(model="embed", input="hello")
    assert _engine_requests(gateway, "embed") == before


def test_batch_embeddings_lines_run_and_bill_at_the_batch_tier(gateway, settings):
    settings.BATCH_HOST_CPU_CEILING = 1.0  # other tests share this machine's CPUs
    org, _key, secret = _tenant(scopes=("inference", "batch"))
    client = _client(gateway, secret)
    lines = [{"custom_id": f"e-{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "embed", "input": [f"item {i}", f"label {i}"],
                       "encoding_format": "float"}} for i in range(6)]
    batch = run_here(client, lines, "/v1/embeddings")
    assert batch.status == "completed"

    done = list(BatchLine.objects.filter(batch=batch, state="completed"))
    assert len(done) == 6
    for line in done:
        body = line.response
        assert body["object"] == "list" and body["model"] == "embed"
        assert [len(d["embedding"]) for d in body["data"]] == [DIM, DIM]
    drain_usage()
    events = UsageEvent.objects.filter(organization=org)
    assert events.count() == 6 and {e.service_tier for e in events} == {"batch"}
    assert sorted(e.prompt_tokens for e in events) == sorted(
        line.response["usage"]["prompt_tokens"] for line in done)

    # a batch of embeddings naming a chat model fails validation, never waits to expire
    bad = client.batches.create(
        input_file_id=upload(client, [{**lines[0], "body": {"model": "small",
                                                            "input": "x"}}]),
        endpoint="/v1/embeddings", completion_window="24h")
    failed = batch_services.batch_validate(batch_id=Batch.objects.get(public_id=bad.id).pk)
    assert failed.status == "failed" and "embedding" in failed.errors[0]["message"]
