"""Constrained output in the simulator, as SGLang's grammar backend gives it: JSON for
``response_format`` (``json_schema``, ``json_object``) and forced tool calls (``tools`` with
``tool_choice`` ``required`` or a named function, the JSON-array path SGLang takes when its
tool-call parser has no structural tag of its own, as the dev fleet's pool runs it).

Real SGLang decodes any model under the grammar, so even random weights answer text that fits
the schema; the simulator writes such a text itself: a value drawn from the schema, the same
for the same prompt and seed. It is then decoded token by token like any completion (the
engine's pacing, the output bound): cut off by ``max_tokens`` it is what SGLang answers then,
the unfinished text with ``finish_reason`` ``length`` (and no tool call).

Schemas: ``type`` object (``properties``, ``required``), array (``items``, ``minItems``,
``maxItems``), string (``enum``, ``const``, ``minLength``, ``maxLength``), integer and number
(``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum``), boolean, null, and
``enum``/``const``/``anyOf``/``oneOf`` anywhere; what else a schema says is not drawn from.
"""

from __future__ import annotations

import hashlib
import json
import random
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine_adapter.sim.tokenizer import word

MAX_DEPTH = 8  # nesting drawn at most; deeper schemas get their simplest value
# A schema may ask for more than any answer holds (the output bound cuts it there, as on
# SGLang): the drawn text stops growing past these.
MAX_STRING, MAX_ITEMS = 2048, 64


@dataclass(frozen=True)
class ToolCall:
    """A forced call as the engine writes it: ``[{"name": ..., "parameters": ...}]``."""

    name: str
    arguments: str  # the parameters' JSON, as OpenAI's ``function.arguments``
    call_id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    @property
    def text(self) -> str:
        return f'[{{"name": {json.dumps(self.name)}, "parameters": {self.arguments}}}]'

    @property
    def arguments_at(self) -> int:
        """Where the arguments start in ``text``."""
        return len(self.text) - len(self.arguments) - 2


@dataclass(frozen=True)
class Constrained:
    """What a request's grammar makes the engine write: the text, and the call it is."""

    text: str
    tool_call: ToolCall | None = None


def _rng(server_seed: int, request_seed: int | None, prompt_ids: Sequence[int]) -> random.Random:
    material = f"json:{server_seed}:{request_seed}:" + ",".join(map(str, prompt_ids))
    return random.Random(hashlib.sha256(material.encode()).digest())  # noqa: S311 - not crypto


def _number(schema: dict[str, Any], rng: random.Random, *, integer: bool) -> int | float:
    low = schema.get("minimum", schema.get("exclusiveMinimum", 0 if integer else 0.0))
    high = schema.get("maximum", schema.get("exclusiveMaximum", low + 100))
    if integer:
        lo = int(low) + (1 if "exclusiveMinimum" in schema and "minimum" not in schema else 0)
        hi = int(high) - (1 if "exclusiveMaximum" in schema and "maximum" not in schema else 0)
        return rng.randint(lo, max(lo, hi))
    return round(rng.uniform(float(low), float(high)), 3)


def _string(schema: dict[str, Any], rng: random.Random) -> str:
    least = min(int(schema.get("minLength", 1)), MAX_STRING)
    most = min(max(least, int(schema.get("maxLength", 24))), MAX_STRING)
    text = ""
    while len(text) < least:
        text = f"{text} {word(rng.randrange(1000))}".strip()
    while len(text) < most and rng.random() < 0.5:
        text = f"{text} {word(rng.randrange(1000))}"
    return text[:most]


def sample(schema: Any, rng: random.Random, depth: int = 0) -> Any:
    """Return a value that ``schema`` allows (see the module for what is drawn from)."""
    if not isinstance(schema, dict):
        return {}
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return rng.choice(schema["enum"])
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            return sample(options[0], rng, depth)
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        props = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        if depth >= MAX_DEPTH:
            props = {k: v for k, v in props.items() if k in required}
        return {name: sample(sub, rng, depth + 1) for name, sub in props.items()
                if name in required or rng.random() < 0.5}
    if kind == "array":
        least = min(int(schema.get("minItems", 0 if depth >= MAX_DEPTH else 1)), MAX_ITEMS)
        most = min(max(least, int(schema.get("maxItems", least + 2))), MAX_ITEMS)
        return [sample(schema.get("items") or {}, rng, depth + 1)
                for _ in range(rng.randint(least, most))]
    if kind == "string":
        return _string(schema, rng)
    if kind in ("integer", "number"):
        return _number(schema, rng, integer=kind == "integer")
    if kind == "boolean":
        return rng.random() < 0.5
    return None


def _forced_tool(body: dict[str, Any]) -> dict[str, Any] | None:
    """Return the function a forced call must be of, or None when no call is forced."""
    tools = [t.get("function") for t in body.get("tools") or ()
             if isinstance(t, dict) and isinstance(t.get("function"), dict)]
    choice = body.get("tool_choice")
    if not tools or choice in (None, "auto", "none"):
        return None
    if choice == "required":
        return tools[0]
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    return next((t for t in tools if t.get("name") == name), None)


def tool_choice_error(body: dict[str, Any]) -> str | None:
    """Return SGLang's refusal of a ``tool_choice`` its tools cannot satisfy, or None."""
    choice = body.get("tool_choice")
    tools = body.get("tools") or []
    if choice == "required" and not tools:
        return "Tools cannot be empty if tool choice is set to required."
    if isinstance(choice, dict):
        if not tools:
            return "Tools cannot be empty if tool choice is set to a specific tool."
        name = (choice.get("function") or {}).get("name")
        if not any(isinstance(t, dict) and (t.get("function") or {}).get("name") == name
                   for t in tools):
            return f"Tool '{name}' not found in tools list."
    return None


def constrained(body: dict[str, Any], *, server_seed: int, request_seed: int | None,
                prompt_ids: Sequence[int]) -> Constrained | None:
    """Return what the grammar of a chat body makes the engine write, or None (free text)."""
    rng = _rng(server_seed, request_seed, prompt_ids)
    function = _forced_tool(body)
    if function is not None:
        arguments = json.dumps(sample(function.get("parameters") or {"type": "object"}, rng))
        call = ToolCall(str(function.get("name")), arguments)
        return Constrained(call.text, call)
    fmt = body.get("response_format")
    if not isinstance(fmt, dict):
        return None
    if fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema") or {"type": "object"}
        return Constrained(json.dumps(sample(schema, rng)))
    if fmt.get("type") == "json_object":
        return Constrained(json.dumps({"answer": _string({}, rng)}))
    return None
