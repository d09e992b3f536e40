"""Issue 20 item 3, structured output: ``response_format`` through the gateway to REAL SGLang on
the CPU (tiny random-weight model), with the official ``openai`` SDK. SGLang's grammar backend
(xgrammar) constrains decoding, so even gibberish weights answer JSON that fits the schema;
``--constrained-json-disable-any-whitespace`` (the dev fleet's pool runs with it too) keeps a
random model from padding the JSON with whitespace until it runs out of tokens. The usage the
SDK sees is the stored event's.
"""

from __future__ import annotations

import json

import openai
import pytest

from engine_adapter.sglang_cpu import is_ready
from tests.factories import make_price_book
from tests.gateway.conftest import register_engine, start_gateway, stop_gateway
from tests.gateway.test_batch_sglang import RealEngine
from tests.gateway.test_openai_api import _event, _key
from tests.real_sglang import real_sglang

pytestmark = pytest.mark.skipif(
    not is_ready(), reason="the SGLang CPU environment is not set up; run "
                           "`python -m engine_adapter.sglang_cpu setup` first")

MODEL = "small"
CITIES = ["Paris", "Oslo", "Lima"]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": CITIES}, "sunny": {"type": "boolean"},
                   "temp": {"type": "integer", "minimum": -40, "maximum": 50}},
    "required": ["city", "sunny", "temp"],
    "additionalProperties": False,
}


def _fits(doc: object) -> bool:
    """Whether ``doc`` is what SCHEMA allows, and nothing else."""
    return (isinstance(doc, dict) and set(doc) == {"city", "sunny", "temp"}
            and doc["city"] in CITIES and isinstance(doc["sunny"], bool)
            and isinstance(doc["temp"], int) and not isinstance(doc["temp"], bool)
            and -40 <= doc["temp"] <= 50)


def test_json_schema_answers_fit_the_schema_through_the_gateway(transactional_db, tmp_path,
                                                                metering_stream):
    make_price_book(prices=[{"model": MODEL, "input": "0.50", "output": "1.50"}])
    gateway = None
    with real_sglang(tmp_path / "sglang.log", served_model_name=MODEL,
                     extra_args=("--constrained-json-disable-any-whitespace",)) as base_url:
        try:
            register_engine(RealEngine(base_url, MODEL), pool="real-us",  # type: ignore[arg-type]
                            region="us-east", zone="us")
            gateway = start_gateway(tmp_path, env=metering_stream)
            _key_obj, secret = _key()
            client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=secret, max_retries=0)

            for seed in range(3):
                raw = client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": f"Weather report {seed}"}],
                    max_tokens=200, temperature=1.0, seed=seed,
                    response_format={"type": "json_schema", "json_schema": {
                        "name": "weather", "schema": SCHEMA, "strict": True}})
                answer = raw.parse()
                choice = answer.choices[0]
                assert choice.finish_reason == "stop", choice
                assert _fits(json.loads(choice.message.content)), choice.message.content
                event = _event(raw.headers["x-request-id"])
                assert (event.prompt_tokens, event.completion_tokens) == (
                    answer.usage.prompt_tokens, answer.usage.completion_tokens)

            loose = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Any JSON"}], max_tokens=100,
                temperature=0, response_format={"type": "json_object"})
            assert isinstance(json.loads(loose.choices[0].message.content), dict)
        finally:
            if gateway is not None:
                stop_gateway(gateway)
