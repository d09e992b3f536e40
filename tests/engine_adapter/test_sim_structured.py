"""The simulator's constrained output (``sim/structured.py``) on its own: values drawn from a
schema fit it, the same prompt and seed draw the same, and a hostile schema is either drawn
from or refused as the app refuses it (never an exception the server would answer 500 with)."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_adapter.sim.structured import constrained, sample

REFUSED = (TypeError, ValueError, AttributeError, KeyError, RecursionError)  # as app.py


@pytest.mark.parametrize(("schema", "fits"), [
    ({"type": "integer", "minimum": 3, "maximum": 5}, lambda v: v in (3, 4, 5)),
    ({"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 2}, lambda v: v == 1),
    ({"type": "string", "minLength": 30, "maxLength": 40},
     lambda v: isinstance(v, str) and 30 <= len(v) <= 40),
    ({"enum": ["a", "b"]}, lambda v: v in ("a", "b")),
    ({"const": {"x": 1}}, lambda v: v == {"x": 1}),
    ({"type": ["null", "boolean"]}, lambda v: isinstance(v, bool)),
    ({"anyOf": [{"type": "number", "minimum": 1, "maximum": 2}, {"type": "string"}]},
     lambda v: 1 <= v <= 2),
    ({"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
     lambda v: len(v) == 2 and all(isinstance(x, bool) for x in v)),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
      "required": ["a"]}, lambda v: isinstance(v["a"], int) and set(v) <= {"a", "b"}),
])
def test_drawn_values_fit_their_schema(schema, fits):
    for seed in range(20):
        assert fits(sample(schema, random.Random(seed))), schema


def test_the_same_prompt_and_seed_draw_the_same_call():
    body = {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}],
        "tool_choice": "required"}
    one = constrained(body, server_seed=1, request_seed=7, prompt_ids=[5, 6])
    two = constrained(body, server_seed=1, request_seed=7, prompt_ids=[5, 6])
    assert one.tool_call.arguments == two.tool_call.arguments
    assert json.loads(one.text) == [{"name": "f", "parameters": json.loads(
        one.tool_call.arguments)}]
    assert one.text[one.tool_call.arguments_at:].startswith(one.tool_call.arguments)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.just(10**12)
                    | st.floats(allow_nan=False)
                    | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.sampled_from(["type", "properties", "required",
                                                       "items", "enum", "minimum",
                                                       "maxLength", "minLength",
                                                       "minItems", "anyOf", "x"]),
                                      inner, max_size=4), max_leaves=12)


@settings(derandomize=True, max_examples=300, deadline=None, database=None)
@given(schema=JSON)
def test_a_hostile_schema_is_drawn_from_or_refused(schema):
    # (sizes past any answer, like minLength 10**12, are drawn up to a cap, not forever)
    body = {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    try:
        answer = constrained(body, server_seed=0, request_seed=None, prompt_ids=[1])
    except REFUSED:
        return
    json.loads(answer.text)  # whatever was drawn is JSON
