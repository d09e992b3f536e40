"""Constrained output side by side: real SGLang (the tiny model on this CPU, with the dev
fleet's tiny-us flags: xgrammar, no free JSON whitespace, the "glm" tool-call parser) and the
simulator answer ``response_format`` and forced tool calls alike: JSON that fits the schema,
OpenAI's ``tool_calls`` of a declared tool with fitting arguments (whole, and streamed as
deltas), ``finish_reason`` ``tool_calls``, the unfinished text when ``max_tokens`` cuts it, and
SGLang's 400 for a ``tool_choice`` the tools cannot satisfy.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine_adapter.sglang_cpu import is_ready
from tests.real_sglang import side_by_side

pytestmark = pytest.mark.skipif(
    not is_ready(), reason="run `python -m engine_adapter.sglang_cpu setup` first")

MODEL = "tiny"
KINDS = ["sglang", "sim"]
FLAGS = tuple(next(p for p in tomllib.loads(
    (Path(__file__).parents[2] / "engine_adapter/fleets/dev.toml").read_text())["pools"]
    if p["name"] == "tiny-us")["extra_args"])
CITIES = ["Paris", "Oslo", "Lima"]
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "enum": CITIES},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "sunny": {"type": "boolean"}},
           "required": ["city", "days", "sunny"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC"]}},
             "required": ["zone"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(autouse=True)
def _clean_redis() -> None:
    """Override the root conftest's Redis cleanup: these tests touch neither Redis nor the DB."""


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Iterator[dict[str, str]]:
    with side_by_side(tmp_path_factory.mktemp("sglang-structured"), model=MODEL,
                      extra_args=FLAGS) as urls:
        yield urls


def _chat(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions",
                      json={"model": MODEL, "messages": ASK, "max_tokens": 120, "seed": 1,
                            "parallel_tool_calls": False, **body}, timeout=120)


def _weather(doc: object) -> bool:
    return (isinstance(doc, dict) and set(doc) == {"city", "days", "sunny"}
            and doc["city"] in CITIES and isinstance(doc["days"], int)
            and 1 <= doc["days"] <= 7 and isinstance(doc["sunny"], bool))


@pytest.mark.parametrize("kind", KINDS)
def test_json_schema_and_json_object_answers(engines, kind):
    answer = _chat(engines[kind], response_format={"type": "json_schema", "json_schema": {
        "name": "weather", "schema": WEATHER}}).json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop" and _weather(json.loads(choice["message"]["content"]))
    assert answer["usage"]["completion_tokens"] > 0
    # any object: greedy, on a prompt where the tiny model closes it soon (a random model
    # may write one long string until the bound, and then the answer is cut as any other)
    loose = _chat(engines[kind], response_format={"type": "json_object"}, temperature=0,
                  max_tokens=100, messages=[{"role": "user", "content": "Any JSON"}]
                  ).json()["choices"][0]
    assert loose["finish_reason"] == "stop"
    assert isinstance(json.loads(loose["message"]["content"]), dict)


@pytest.mark.parametrize("kind", KINDS)
def test_forced_tool_calls_whole_and_streamed(engines, kind):
    url = engines[kind]
    for choice_made in (NAMED, "required"):
        answer = _chat(url, tools=TOOLS, tool_choice=choice_made).json()
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        calls = choice["message"]["tool_calls"]
        assert len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"]
        assert not choice["message"]["content"]
        name = calls[0]["function"]["name"]
        arguments = json.loads(calls[0]["function"]["arguments"])
        assert (name, _weather(arguments)) == ("get_weather", True) or (
            choice_made == "required" and name == "get_time" and arguments == {"zone": "UTC"})

    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": ASK, "max_tokens": 120, "seed": 2, "stream": True,
            "tools": TOOLS, "tool_choice": NAMED, "parallel_tool_calls": False}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    deltas = [d for c in chunks for ch in c["choices"]
              for d in (ch["delta"].get("tool_calls") or ())]
    assert deltas[0]["function"]["name"] == "get_weather" and deltas[0]["id"]
    assert _weather(json.loads("".join(d["function"].get("arguments") or "" for d in deltas)))
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"]
            if ch["finish_reason"]] == ["tool_calls"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_call_cut_short_and_impossible_tool_choices(engines, kind):
    url = engines[kind]
    cut = _chat(url, tools=TOOLS, tool_choice=NAMED, max_tokens=3).json()["choices"][0]
    assert cut["finish_reason"] == "length" and not cut["message"].get("tool_calls")
    assert cut["message"]["content"]  # the unfinished text, as written
    unknown = _chat(url, tools=TOOLS, tool_choice={"type": "function",
                                                   "function": {"name": "rm_rf"}})
    assert unknown.status_code == 400 and "rm_rf" in unknown.text
    assert _chat(url, tool_choice="required").status_code == 400  # no tools to call
