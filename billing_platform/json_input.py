"""JSON that clients send, parsed by one rule for every surface: I-JSON (RFC 7493: finite
numbers, strings of Unicode text), nested at most ``MAX_DEPTH`` deep.

Python's parser is laxer than JSON and recurses once per level, and both break later, far from
the parse: ``NaN``, ``Infinity`` and ``1e400`` (which parses as infinity) are accepted, then
refused by every serializer that follows the RFC (the engine request: a 500); a string with
a lone surrogate escape (``"\\ud800"``) parses, and then cannot be encoded as UTF-8; a body nested
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
from collections.abc import Mapping
from typing import IO, Any

import orjson
from django.conf import settings
from rest_framework import parsers
from rest_framework.exceptions import ParseError

MAX_DEPTH = 64


class NotJSON(ValueError):
    """The document is not JSON the platform accepts (a ``ValueError``, as malformed JSON is)."""


def _too_deep(value: Any) -> bool:
    """Return whether ``value`` nests deeper than ``MAX_DEPTH``. Iterative: no recursion."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, dict | list))
    return False


def json_loads(raw: bytes | str) -> Any:
    """Parse a client's JSON; raise ValueError if it is malformed, holds a number that is not
    finite or a string that is not Unicode text, or nests deeper than ``MAX_DEPTH``.

    orjson refuses what I-JSON refuses (NaN, Infinity, numbers that overflow a double, lone
    surrogates, escaped or not) in its parse, at several times the standard library's speed
    (which needed a Python call per float and a walk of every string for surrogates); it
    nests up to 1,024 levels, so the depth is checked here, by a walk only when the text has
    more than ``MAX_DEPTH`` brackets at all. Integers past 64 bits come back as floats (the
    request's validation refuses them as it does any such number)."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if str(exc).startswith("depth limit exceeded"):  # orjson's own bound, 1,024 levels
            raise NotJSON(f"JSON nested deeper than {MAX_DEPTH} levels is not accepted."
                          ) from None
        raise NotJSON(str(exc)) from None
    if isinstance(value, dict | list):
        brackets = (raw.count(b"[") + raw.count(b"{") if isinstance(raw, bytes)
                    else raw.count("[") + raw.count("{"))
        if brackets > MAX_DEPTH and _too_deep(value):
            raise NotJSON(f"JSON nested deeper than {MAX_DEPTH} levels is not accepted.")
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
