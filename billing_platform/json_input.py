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
import json
import math
import re
from collections.abc import Mapping
from typing import IO, Any

from django.conf import settings
from rest_framework import parsers
from rest_framework.exceptions import ParseError

MAX_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class NotJSON(ValueError):
    """The document is not JSON the platform accepts (a ``ValueError``, as malformed JSON is)."""


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NotJSON(f"The number {text[:40]} is out of range.")
    return value


def _constant(name: str) -> float:
    raise NotJSON(f"{name} is not a JSON value.")


def _refusal(value: Any, *, strings: bool) -> str | None:
    """Return why ``value`` is refused (nested too deep; with ``strings``, a lone surrogate in
    a string or key), or None. Iterative: no recursion, whatever the depth."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                return "JSON strings must be Unicode text; a lone \\u surrogate escape is not."
            continue
        if depth > MAX_DEPTH:
            return f"JSON nested deeper than {MAX_DEPTH} levels is not accepted."
        if isinstance(node, dict):
            children: list[Any] = [*node, *node.values()] if strings else [*node.values()]
        else:
            children = node
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, dict | list) or (strings and isinstance(child, str)))
    return None


def json_loads(raw: bytes | str) -> Any:
    """Parse a client's JSON; raise ValueError if it is malformed, holds a number that is not
    finite or a string that is not Unicode text, or nests deeper than ``MAX_DEPTH``."""
    try:
        value = json.loads(raw, parse_float=_finite, parse_constant=_constant)
    except RecursionError:
        raise NotJSON(f"JSON nested deeper than {MAX_DEPTH} levels is not accepted.") from None
    # a lone surrogate can only come as an escape (raw ones are not UTF-8): look for strings
    # holding one only when the text has such an escape
    escapes = _SURROGATE_ESCAPE.search(
        raw if isinstance(raw, bytes) else raw.encode(errors="surrogatepass"))
    if isinstance(value, dict | list | str) and (
            reason := _refusal(value, strings=escapes is not None)):
        raise NotJSON(reason)
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
