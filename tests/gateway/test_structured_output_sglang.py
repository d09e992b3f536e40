"""Issue 20 item 3, tools and structured output: ``response_format`` and ``tools`` through the
gateway to REAL SGLang on the CPU (tiny random-weight model), with the official ``openai`` SDK.
SGLang's grammar backend (xgrammar) constrains decoding, so even gibberish weights answer JSON
that fits the schema, and a forced tool call (``tool_choice`` ``required`` or a named
function) is a call of a declared tool with arguments that fit its parameters;
``--constrained-json-disable-any-whitespace`` keeps a random model from padding the JSON with
whitespace until it runs out of tokens. The flags are the dev fleet's pool's (``FLAGS``, read
from ``dev.toml``). The usage the SDK sees is the stored event's.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import openai
import pytest

from engine_adapter.sglang_cpu import is_ready
from tests.factories import make_price_book
from tests.gateway.test_openai_api import _event
from tests.real_sglang import gateway_on_real_sglang

pytestmark = pytest.mark.skipif(
    not is_ready(), reason="the SGLang CPU environment is not set up; run "
                           "`python -m engine_adapter.sglang_cpu setup` first")

MODEL = "small"
FLAGS = tuple(next(p for p in tomllib.loads(
    (Path(__file__).parents[2] / "engine_adapter/fleets/dev.toml").read_text())["pools"]
    if p["name"] == "tiny-us")["extra_args"])
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
    with gateway_on_real_sglang(tmp_path, metering_stream, model=MODEL,
                                extra_args=FLAGS) as client:
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


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city over the next days.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "enum": CITIES},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}


def _weather_args(arguments: str) -> bool:
    doc = json.loads(arguments)
    return (set(doc) == {"city", "days"} and doc["city"] in CITIES
            and isinstance(doc["days"], int) and 1 <= doc["days"] <= 7)


def test_forced_tool_calls_are_declared_tools_with_fitting_arguments(transactional_db, tmp_path,
                                                                     metering_stream):
    make_price_book(prices=[{"model": MODEL, "input": "0.50", "output": "1.50"}])
    with gateway_on_real_sglang(tmp_path, metering_stream, model=MODEL,
                                extra_args=FLAGS) as client:
        ask = [{"role": "user", "content": "What is the weather in Oslo this week?"}]

        # a named function, and "required" with two tools to choose from
        for seed, choice in enumerate([
                {"type": "function", "function": {"name": "get_weather"}}, "required"]):
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=ask, tools=[WEATHER_TOOL, TIME_TOOL],
                tool_choice=choice, parallel_tool_calls=False, max_tokens=120, seed=seed)
            answer = raw.parse()
            choice_made = answer.choices[0]
            assert choice_made.finish_reason == "tool_calls", choice_made
            calls = choice_made.message.tool_calls
            assert len(calls) == 1 and calls[0].type == "function" and calls[0].id
            if isinstance(choice, dict):
                assert calls[0].function.name == "get_weather"
                assert _weather_args(calls[0].function.arguments)
            else:
                assert calls[0].function.name in ("get_weather", "get_time")
                json.loads(calls[0].function.arguments)
            # the call's tokens are output tokens, metered from the engine's count
            event = _event(raw.headers["x-request-id"])
            assert (event.prompt_tokens, event.completion_tokens) == (
                answer.usage.prompt_tokens, answer.usage.completion_tokens)
            assert event.completion_tokens > 0 and event.amount > 0

        # streamed: the SDK assembles the call from its deltas
        with client.chat.completions.with_streaming_response.create(
                model=MODEL, messages=ask, tools=[WEATHER_TOOL], stream=True,
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                parallel_tool_calls=False, max_tokens=120, seed=3,
                stream_options={"include_usage": True}) as response:
            chunks = list(response.parse())
        deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or ())]
        assert {d.function.name for d in deltas if d.function and d.function.name} == {
            "get_weather"}
        assert _weather_args("".join(d.function.arguments or "" for d in deltas
                                     if d.function))
        assert chunks[-1].usage.completion_tokens == _event(
            response.headers["x-request-id"]).completion_tokens

        # "none" and no tools: a plain answer, no call
        plain = client.chat.completions.create(
            model=MODEL, messages=ask, tools=[WEATHER_TOOL], tool_choice="none",
            max_tokens=8)
        assert not plain.choices[0].message.tool_calls

        # a call of a tool that was not declared is refused before any engine runs it
        with pytest.raises(openai.BadRequestError) as unknown:
            client.chat.completions.create(
                model=MODEL, messages=ask, tools=[WEATHER_TOOL], max_tokens=8,
                tool_choice={"type": "function", "function": {"name": "rm_rf"}})
        assert "rm_rf" in unknown.value.message
