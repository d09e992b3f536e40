"""JSON that clients send, parsed by one rule for every surface: RFC 8259 JSON, nested at
most ``MAX_DEPTH`` deep.

Python's parser is laxer than JSON and recurses once per level, and both break later, far from
the parse: ``NaN``, ``Infinity`` and ``1e400`` (which parses as infinity) are accepted, then
refused by every serializer that follows the RFC (the engine request: a 500); a body nested
some thousands deep raises ``RecursionError`` (not the ``ValueError`` of a malformed body), and
one that parses at a few hundred levels fails wherever it is serialized again (the engine
request, a JSON column, a byte estimate). So such a document is refused where it is parsed,
as malformed input: ``/v1`` bodies and batch lines through ``json_loads``, ``/api`` bodies
through ``JSONParser`` (settings' ``DEFAULT_PARSER_CLASSES``). No request of OpenAI's API or
ours needs more than a few levels; the JSON schemas in ``response_format`` and ``tools`` need
a few dozen at most.
"""

from __future__ import annotations

import codecs
import json
import math
from collections.abc import Mapping
from typing import IO, Any

from django.conf import settings
from rest_framework import parsers
from rest_framework.exceptions import ParseError

MAX_DEPTH = 64


class NotJSON(ValueError):
    """The document is not JSON the platform accepts (a ``ValueError``, as malformed JSON is)."""


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NotJSON(f"The number {text[:40]} is out of range.")
    return value


def _constant(name: str) -> float:
    raise NotJSON(f"{name} is not a JSON value.")


def nests_deeper_than(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Return True if ``value`` has containers nested more than ``limit`` deep (iteratively:
    no recursion, whatever the depth)."""
    stack = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def json_loads(raw: bytes | str) -> Any:
    """Parse a client's JSON; raise ValueError if it is malformed, holds a number that is not
    finite, or nests deeper than ``MAX_DEPTH``."""
    too_deep = NotJSON(f"JSON nested deeper than {MAX_DEPTH} levels is not accepted.")
    try:
        value = json.loads(raw, parse_float=_finite, parse_constant=_constant)
    except RecursionError:
        raise too_deep from None
    if nests_deeper_than(value):
        raise too_deep
    return value


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser by the platform's rule (``json_loads``); what breaks it is a 400."""

    def parse(self, stream: IO[Any], media_type: str | None = None,
              parser_context: Mapping[str, Any] | None = None) -> Any:
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        try:
            return json_loads(codecs.getreader(encoding)(stream).read())
        except ValueError as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
