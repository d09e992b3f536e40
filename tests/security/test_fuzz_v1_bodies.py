"""Fuzz the bodies of /v1 (issue 15, item 7): whatever a client sends, the gateway answers
with a non-5xx, and every refusal in OpenAI's error shape.

Hypothesis builds request bodies the way a careless or hostile client would: every known field
with a value of any JSON type, unknown fields, odd unicode (lone surrogates, NUL, emoji), long
strings, numbers past 64 bits, NaN and Infinity, non-object bodies, bytes that are not JSON and
JSON nested deeper than any parser's stack. They go over HTTP to a live gateway (uvicorn, the
real ASGI app) in front of simulated engines, with a real key. Hypothesis is derandomized and
its example counts bounded, so the suite is deterministic.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from billing_platform.gateway.anthropic import ERROR_TYPES as ANTHROPIC_ERROR_TYPES
from engine_adapter.sim.testing import FAST_RATES, start_sim
from tests.factories import OrganizationFactory, ProjectFactory, make_key, make_price_book
from tests.gateway.conftest import register_engine, start_gateway, stop_gateway

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "small"
# No shrinking: a failure shows the example as found (derandomized, so it recurs), and CI's
# time stays bounded whatever fails.
FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=False,
                phases=(Phase.explicit, Phase.generate),
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclass
class V1:
    url: str
    http: httpx.Client
    file_id: str  # a valid batch input file of this key's organization

    def post(self, path: str, content: bytes, **kwargs: Any) -> httpx.Response:
        return self.http.post(f"{self.url}{path}", content=content,
                              headers={"Content-Type": "application/json"}, **kwargs)


@pytest.fixture
def v1(transactional_db, tmp_path, settings, metering_stream) -> Iterator[V1]:
    """A live gateway with one fast simulated engine of ``small``, and a key for it."""
    settings.FILES_DIR = str(tmp_path / "files")
    make_price_book(prices=[{"model": MODEL, "input": "0.50", "output": "1.50"}])
    sim = start_sim(served_model_name=MODEL, **FAST_RATES)
    register_engine(sim, pool=f"{MODEL}-us", region="us-east", zone="us")
    gateway = start_gateway(tmp_path, env={**metering_stream,
                                           "TOLLGATE_FILES_DIR": settings.FILES_DIR})
    _key, secret = make_key(ProjectFactory(organization=OrganizationFactory()),
                            scopes=["inference", "batch"])
    http = httpx.Client(headers={"Authorization": f"Bearer {secret}"}, timeout=60)
    line = {"custom_id": "1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}}
    uploaded = http.post(f"{gateway.url}/v1/files", data={"purpose": "batch"},
                         files={"file": ("in.jsonl", json.dumps(line).encode() + b"\n")})
    assert uploaded.status_code == 200, uploaded.text
    try:
        yield V1(gateway.url, http, uploaded.json()["id"])
    finally:
        http.close()
        stop_gateway(gateway)
        sim.stop()


def assert_survives(response: httpx.Response) -> None:
    """No 5xx; a refusal is OpenAI's ``{"error": {"message", "type", "param", "code"}}``."""
    assert response.status_code < 500, (response.request.content[:2000], response.text[:2000])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str)
        assert set(error) >= {"message", "type", "param", "code"}


# --- strategies -------------------------------------------------------------------------------

# Unicode text (control characters, NUL, emoji, any plane); and strings that are not text:
# lone surrogates, which json.dumps writes as \ud800 escapes.
TEXT = st.text(max_size=40)
NOT_TEXT = st.builds(lambda head, lone, tail: head + lone + tail, TEXT,
                     st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), TEXT)
LONG_TEXT = st.integers(0, 200_000).map(lambda n: "Tollgate " * (n // 9))
NUMBERS = (st.integers(-2**70, 2**70) | st.floats(allow_nan=True, allow_infinity=True)
           | st.sampled_from([0, -1, 2**31, 2**63, 10**30]))
SCALARS = st.none() | st.booleans() | NUMBERS | TEXT
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(TEXT, inner, max_size=4), max_leaves=10)
NESTED = "\x00nested\x00"  # stands for JSON nested deeper than a parser's stack
DEPTHS = st.sampled_from([64, 65, 200, 900, 1_000, 5_000, 100_000])


def nested(depth: int, kind: str) -> str:
    return "[" * depth + "]" * depth if kind == "list" else '{"a":' * depth + "1" + "}" * depth


def raw(body: Any, depth: int, kind: str) -> bytes:
    """Serialize ``body`` as a lax client would (NaN, Infinity), deep nesting spliced in."""
    text = json.dumps(body)
    return text.replace(json.dumps(NESTED), nested(depth, kind)).encode("utf-8", "surrogatepass")


SAMPLING = {
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "max_tokens": st.integers(1, 48), "max_completion_tokens": st.integers(1, 48),
    "temperature": st.floats(0, 2), "top_p": st.floats(0, 1) | NUMBERS,
    "n": st.integers(-1, 4) | st.sampled_from([128, 129]) | NUMBERS,
    "seed": NUMBERS, "stop": TEXT | st.lists(TEXT, max_size=4),
    "logit_bias": st.dictionaries(st.integers(0, 2**20).map(str) | TEXT, NUMBERS, max_size=3),
    "logprobs": st.booleans() | st.integers(-1, 6), "frequency_penalty": st.floats(-2, 2) | NUMBERS,
    "presence_penalty": st.floats(-2, 2) | NUMBERS,
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
    "service_tier": st.sampled_from(["auto", "default", "priority", "flex", "scale"]),
    "user": TEXT, "metadata": st.dictionaries(TEXT, TEXT, max_size=3), "store": st.booleans(),
    "top_k": st.integers(-1, 100) | NUMBERS, "min_p": st.floats(0, 1),
    "stop_token_ids": st.lists(st.integers(0, 2**40), max_size=3), "ignore_eos": st.booleans(),
}
CHAT_FIELDS = {**SAMPLING, "top_logprobs": st.integers(-1, 21),
               "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function":
                   st.fixed_dictionaries({"name": TEXT, "parameters": JSON})}), max_size=2),
               "tool_choice": st.sampled_from(["auto", "none", "required"]),
               "parallel_tool_calls": st.booleans(),
               "chat_template_kwargs": st.dictionaries(TEXT, JSON, max_size=2),
               "reasoning_effort": st.sampled_from(["low", "medium", "high"]) | TEXT}
COMPLETION_FIELDS = {**SAMPLING, "echo": st.booleans(), "suffix": TEXT}
ANYTHING = JSON | st.just(NESTED) | LONG_TEXT | NOT_TEXT


def _slots(value: Any, path: tuple = ()) -> Iterator[tuple]:
    """Yield the path of every value inside ``value`` (dict keys and list indexes)."""
    items = value.items() if isinstance(value, dict) else enumerate(value) \
        if isinstance(value, list) else ()
    for key, child in items:
        yield (*path, key)
        yield from _slots(child, (*path, key))


def _at(value: Any, path: tuple) -> Any:
    for key in path:
        value = value[key]
    return value


@st.composite
def _mutated(draw: st.DrawFn, well_formed: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    """A well-formed body with one change anywhere inside: a value of another type (or nested
    too deep), an unknown key, or a key left out."""
    body = copy.deepcopy(draw(well_formed))
    path = draw(st.sampled_from([(), *_slots(body)]))
    how = draw(st.sampled_from(["retype", "retype", "unknown", "missing"]))
    parent, key = (_at(body, path[:-1]), path[-1]) if path else (None, None)
    if how == "retype" and parent is not None:
        parent[key] = draw(ANYTHING)
    elif how == "missing" and isinstance(parent, dict):
        del parent[key]
    else:
        target = _at(body, path)
        if isinstance(target, dict):
            target[draw(TEXT)] = draw(ANYTHING)
    return body


def hostile(required: dict[str, st.SearchStrategy], optional: dict[str, st.SearchStrategy]
            ) -> st.SearchStrategy[dict[str, Any]]:
    """Bodies of an endpoint: well-formed ones with edge values (more than half), and ones
    with one change anywhere inside (``_mutated``)."""
    well_formed = st.fixed_dictionaries(required, optional=optional).map(_streaming)
    return st.one_of(well_formed, well_formed, _mutated(well_formed))


def _streaming(body: dict[str, Any]) -> dict[str, Any]:
    """``stream_options`` come with ``stream: true``, as a client sends them."""
    return {**body, "stream": True} if "stream_options" in body else body


PART = st.fixed_dictionaries({"type": st.just("text"),
                              "text": TEXT | LONG_TEXT})
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant"]),
     "content": TEXT | LONG_TEXT | st.lists(PART, min_size=1, max_size=3)},
    optional={"name": TEXT})
CHAT = hostile({"model": st.just(MODEL), "messages": st.lists(MESSAGE, min_size=1, max_size=3)},
               CHAT_FIELDS)
COMPLETION = hostile({"model": st.just(MODEL),
                      "prompt": TEXT.filter(bool) | LONG_TEXT | st.lists(TEXT, max_size=2)},
                     COMPLETION_FIELDS)


def bodies(objects: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[bytes]:
    """Mostly objects of the endpoint's shape; also other JSON, non-JSON bytes, deep nests."""
    kinds = st.sampled_from(["list", "dict"])
    shaped = st.builds(raw, objects, DEPTHS, kinds)
    other = st.builds(raw, ANYTHING, DEPTHS, kinds)
    return st.one_of(*[shaped] * 8, other, st.binary(max_size=64))


# --- the fuzz ---------------------------------------------------------------------------------

@settings(FUZZ, max_examples=300)
@given(body=bodies(CHAT))
@example(body=b'{"model": "small", "messages": [{"role": "user", "content": [{"type": []}]}]}')
def test_chat_completion_bodies_never_get_a_5xx(v1, body):
    assert_survives(v1.post("/v1/chat/completions", body))


@settings(FUZZ, max_examples=150)
@given(body=bodies(COMPLETION))
def test_completion_bodies_never_get_a_5xx(v1, body):
    assert_survives(v1.post("/v1/completions", body))


# Anthropic's Messages API: its own fields, and errors in its own shape
MESSAGES_FIELDS = {
    "system": TEXT | LONG_TEXT | st.lists(PART, min_size=1, max_size=2),
    "stop_sequences": st.lists(TEXT, max_size=3), "temperature": st.floats(0, 1) | NUMBERS,
    "top_p": st.floats(0, 1) | NUMBERS, "top_k": st.integers(-1, 100) | NUMBERS,
    "stream": st.booleans(), "metadata": st.fixed_dictionaries({"user_id": TEXT}),
    "service_tier": st.sampled_from(["auto", "standard_only", "priority"]),
}
TURN = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                              "content": TEXT | LONG_TEXT | st.lists(PART, min_size=1,
                                                                    max_size=3)})
MESSAGES = hostile({"model": st.just(MODEL), "max_tokens": st.integers(1, 48),
                    "messages": st.lists(TURN, min_size=1, max_size=3)}, MESSAGES_FIELDS)


def assert_survives_anthropic(response: httpx.Response) -> None:
    """No 5xx; a refusal is Anthropic's ``{"type": "error", "error": {"type", "message"}}``."""
    assert response.status_code < 500, (response.request.content[:2000], response.text[:2000])
    if response.status_code >= 400:
        body = response.json()
        assert body["type"] == "error", body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
        assert body["error"]["type"] in set(ANTHROPIC_ERROR_TYPES.values()), body


@settings(FUZZ, max_examples=150)
@given(body=bodies(MESSAGES))
def test_anthropic_messages_bodies_never_get_a_5xx(v1, body):
    assert_survives_anthropic(v1.post("/v1/messages", body))


# Anthropic's count_tokens: the turns and system of a Messages body, nothing else
COUNT_TOKENS = hostile({"model": st.just(MODEL), "messages": st.lists(TURN, min_size=1,
                                                                      max_size=3)},
                       {"system": MESSAGES_FIELDS["system"]})


@settings(FUZZ, max_examples=100)
@given(body=bodies(COUNT_TOKENS))
def test_anthropic_count_tokens_bodies_never_get_a_5xx(v1, body):
    response = v1.post("/v1/messages/count_tokens", body)
    assert_survives_anthropic(response)
    if response.status_code == 200:
        assert isinstance(response.json()["input_tokens"], int)


# OpenAI's Responses API: a string or message items, and its own fields
RESPONSE_PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "input_text", "output_text", "input_image"]),
     "text": TEXT | LONG_TEXT})
RESPONSE_ITEM = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "developer", "assistant"]),
     "content": TEXT | LONG_TEXT | st.lists(RESPONSE_PART, min_size=1, max_size=3)},
    optional={"type": st.sampled_from(["message", "message", "function_call"])})
RESPONSES_FIELDS = {
    "instructions": TEXT | LONG_TEXT, "max_output_tokens": st.integers(1, 48),
    "temperature": st.floats(0, 2) | NUMBERS, "top_p": st.floats(0, 1) | NUMBERS,
    "service_tier": st.sampled_from(["auto", "default", "priority", "flex", "scale"]),
    "metadata": st.dictionaries(TEXT, TEXT, max_size=17), "store": st.booleans(),
    "stream": st.booleans(), "user": TEXT,
    "previous_response_id": st.just("resp_" + "0" * 32) | TEXT,
    "tools": st.just([]) | JSON, "tool_choice": st.sampled_from(["auto", "none", "required"]),
    "text": st.just({"format": {"type": "text"}}) | JSON,
    "truncation": st.sampled_from(["disabled", "auto"]), "include": st.just([]) | JSON,
    "reasoning": JSON,
}
RESPONSES = hostile({"model": st.just(MODEL),
                     "input": TEXT | LONG_TEXT | st.lists(RESPONSE_ITEM, min_size=1,
                                                         max_size=3)},
                    RESPONSES_FIELDS)


@settings(FUZZ, max_examples=150)
@given(body=bodies(RESPONSES))
@example(body=b'{"model": "small", "input": "a\\u0000b", "instructions": "\\u0000"}')
def test_responses_bodies_never_get_a_5xx(v1, body):
    response = v1.post("/v1/responses", body)
    assert_survives(response)
    if response.status_code == 200:
        text = response.text
        if text.startswith("event:"):  # a stream: its first event carries the Response
            text = text.split("data: ", 1)[1].split("\n", 1)[0]
        created = json.loads(text)
        created = created.get("response", created)
        # a stored answer is retrievable, whatever its text held (NUL included)
        got = v1.http.get(f"{v1.url}/v1/responses/{created['id']}")
        assert got.status_code == (200 if created["store"] else 404), got.text[:500]


# n choices, logprobs and user (issue 20 item 4): well-formed bodies are answered with n
# choices whose logprob entries add up to the usage's completion tokens, and the stored event
# carries the same counts and the user
N_BODY = st.fixed_dictionaries(
    {"model": st.just(MODEL), "messages": st.lists(MESSAGE, min_size=1, max_size=2),
     "n": st.integers(1, 4), "max_tokens": st.integers(1, 12), "logprobs": st.just(True)},
    optional={"top_logprobs": st.integers(0, 5), "seed": st.integers(0, 2**31),
              "stop": st.lists(st.sampled_from(["the", ".", "and", " cache"]),
                               max_size=2),
              "user": st.text(st.characters(exclude_characters="\t\n\r\\\x00"),
                              min_size=1, max_size=256)})


@settings(FUZZ, max_examples=40)
@given(body=N_BODY)
def test_n_choices_with_logprobs_are_answered_and_metered_exactly(v1, body):
    from metering.models import UsageEvent
    from tests.gateway.conftest import drain_usage

    response = v1.post("/v1/chat/completions", json.dumps(body).encode("utf-8",
                                                                          "surrogatepass"))
    assert_survives(response)
    if response.status_code != 200:  # a prompt past the context, say: refused, not served
        return
    answer = json.loads(response.text)
    assert [c["index"] for c in answer["choices"]] == list(range(body["n"]))
    generated = sum(len(c["logprobs"]["content"]) for c in answer["choices"])
    assert answer["usage"]["completion_tokens"] == generated <= body["n"] * body["max_tokens"]
    drain_usage()
    event = UsageEvent.objects.get(request_id=response.headers["x-request-id"])
    assert (event.prompt_tokens, event.completion_tokens) == (
        answer["usage"]["prompt_tokens"], generated)
    assert event.end_user == (body.get("user") or None)


BATCH_LINE = hostile({"custom_id": TEXT, "method": st.just("POST"),
                      "url": st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
                      "body": CHAT}, {})


@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_batch_and_file_bodies_never_get_a_5xx(v1, data):
    # a batch file of odd lines, under an odd name and purpose
    lines = data.draw(st.lists(st.builds(raw, BATCH_LINE | ANYTHING, DEPTHS,
                                         st.sampled_from(["list", "dict"]))
                               | st.binary(max_size=40), max_size=4), label="lines")
    name = data.draw(st.just("in.jsonl") | TEXT.map(lambda t: t + ".jsonl") | TEXT,
                     label="filename")
    purpose = data.draw(st.just("batch") | TEXT, label="purpose")
    uploaded = v1.http.post(f"{v1.url}/v1/files", data={"purpose": purpose},
                            files={"file": (name, b"\n".join(lines))})
    assert_survives(uploaded)
    # a batch over it, or over the known good file
    file_id = uploaded.json()["id"] if uploaded.status_code == 200 else v1.file_id
    batch = data.draw(bodies(hostile(
        {"input_file_id": st.just(file_id) | TEXT,
         "endpoint": st.sampled_from(["/v1/chat/completions", "/v1/completions",
                                      "/v1/embeddings"]),
         "completion_window": st.just("24h") | TEXT},
        {"metadata": st.dictionaries(TEXT, TEXT, max_size=3)})), label="batch")
    assert_survives(v1.post("/v1/batches", batch))
    # the lists, with odd query parameters
    query = data.draw(st.fixed_dictionaries({}, optional={
        "limit": TEXT | NUMBERS.map(str), "after": TEXT, "order": TEXT,
        "purpose": TEXT}),
        label="query")
    for path in ("/v1/files", "/v1/batches"):
        assert_survives(v1.http.get(f"{v1.url}{path}", params=query))


# --- what the fuzz is after, named (one gateway each: a live gateway costs seconds to start) ---

def test_deeply_nested_json_is_a_400_in_openais_shape(v1):
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/batches"):
        # 65: one past the bound; 900: within Python's parser's stack; 100,000: past it
        for depth in (65, 900, 100_000):
            # given a body nested deeper than the gateway accepts
            body = b'{"model": "small", "metadata": ' + nested(depth, "list").encode() + b"}"
            # when it is posted
            response = v1.post(path, body)
            # then it is refused as invalid, in OpenAI's shape
            assert response.status_code == 400, (path, depth, response.text[:500])
            assert_survives(response)
            assert response.json()["error"]["type"] == "invalid_request_error"


def test_json_that_is_not_i_json_is_a_400(v1):
    # numbers JSON has no room for, and a string that is not Unicode text (Python's parser
    # takes all five; the engine request could carry none of them)
    for value in ("NaN", "Infinity", "-Infinity", "1e400", '"\\ud800"'):
        # given a body with one of them
        body = ('{"model": "small", "messages": [{"role": "user", "content": "hi"}], '
                f'"top_p": {value}}}').encode()
        # when it is posted
        response = v1.post("/v1/chat/completions", body)
        # then it is refused as invalid, in OpenAI's shape, before any engine sees it
        assert response.status_code == 400, (value, response.text[:500])
        assert_survives(response)
