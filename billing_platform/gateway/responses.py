"""OpenAI's Responses API on the one pipeline: ``POST /v1/responses``.

OpenAI's SDKs and Agents SDK default to this API. A Responses body is translated into the chat
body the engines serve, which ``parse_chat`` then validates into the gateway's request (so the
prompt and output bounds admission reserves come from the one set of rules, and count the whole
rebuilt conversation); ``services.serve`` runs it (admission, routing, metering from the
engine's counts, rating), and ``ResponsesSurface`` words the answer as OpenAI does:

- a Response object (``"object": "response"``, ``output`` with one assistant message item of
  one ``output_text`` part, so the SDK's ``response.output_text`` works); ``status``
  ``completed``, or ``incomplete`` with ``incomplete_details.reason`` ``max_output_tokens``
  when the engine stopped at the bound, as OpenAI answers;
- ``usage``: ``input_tokens`` (cached ones included, as OpenAI counts them),
  ``input_tokens_details.cached_tokens`` (the engine's), ``output_tokens``,
  ``output_tokens_details.reasoning_tokens``, ``total_tokens``: the usage event's counts;
- a stream of typed events, each with its ``event:`` name and a ``sequence_number`` from 0:
  ``response.created``, ``response.in_progress``, ``response.output_item.added``,
  ``response.content_part.added``, ``response.output_text.delta``..., then once the engine
  has finished and the request is metered ``response.output_text.done``,
  ``response.content_part.done``, ``response.output_item.done`` and ``response.completed``
  (``response.incomplete`` at the bound) carrying the whole Response with its usage; an
  engine failure mid-stream is an ``error`` event then ``response.failed``.

The engines' own ``/v1/responses`` (SGLang has one) is not used: it keeps responses in one
engine's memory, for every tenant alike and lost on restart, while ``previous_response_id``
must work across engines and restarts and never across organizations. So the gateway stores
them (``response_store.py``, ``store`` true by default) and rebuilds the conversation a
``previous_response_id`` continues: each earlier response's input turns and its answer, as the
messages of the chat request (``instructions`` apply to one response only, as OpenAI's do).

Accepted: ``model``, ``input`` (a string, or message items whose content is a string or
``input_text`` parts; an assistant turn may replay ``output_text`` parts), ``instructions``,
``max_output_tokens``, ``temperature``, ``top_p``, ``service_tier``, ``metadata`` (OpenAI's
limits: 16 pairs, keys up to 64 and values up to 512 characters), ``store``, ``stream``,
``previous_response_id``, ``user``; and, as the no-ops SDKs send, empty ``tools``,
``tool_choice`` ``auto``/``none``, ``parallel_tool_calls``, ``text`` with the ``text`` format,
``truncation`` ``disabled``, empty ``include``, ``background`` false, ``stream_options``.
Refused with a clear message and param: other item types (function calls, reasoning, ...),
other content parts (images, files, audio), tools, reasoning, background mode and any unknown
field.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson
from django.db import DatabaseError

from billing_platform.accounts.selectors import KeyPrincipal
from billing_platform.errors import InvalidRequest
from billing_platform.gateway import response_store
from billing_platform.gateway.db_connections import in_thread
from billing_platform.gateway.services import Surface
from billing_platform.gateway.validation import InferenceRequest, parse_chat
from engine_adapter.client import EngineCall
from engine_adapter.types import CallResult, EngineError

log = logging.getLogger(__name__)

ROLES = ("user", "system", "developer", "assistant")
SERVICE_TIERS = ("auto", "default", "flex", "priority")
# Content parts whose text is the turn's text, by role (OpenAI's: what a client sends, and
# what a replayed assistant answer carries).
INPUT_PARTS = {"input_text"}
ASSISTANT_PARTS = {"output_text", "input_text"}
ITEM_KEYS = frozenset({"type", "role", "content", "id", "status", "phase"})
PART_KEYS = frozenset({"type", "text", "annotations", "logprobs"})
FIELDS = frozenset({"model", "input", "instructions", "max_output_tokens", "temperature",
                    "top_p", "service_tier", "metadata", "store", "stream",
                    "previous_response_id", "user", "safety_identifier", "prompt_cache_key",
                    "tools", "tool_choice", "parallel_tool_calls", "text", "truncation",
                    "include", "background", "stream_options"})
UNSUPPORTED = {"reasoning": "reasoning", "conversation": "conversations",
               "prompt": "prompt templates", "max_tool_calls": "tools",
               "top_logprobs": "logprobs", "context_management": "context management",
               "prompt_cache_retention": "prompt cache retention"}
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512
MAX_ID = 64


@dataclass(frozen=True)
class ResponsesBody:
    """A validated Responses body: what it asks of the engine and what it echoes back."""

    model: str
    input_items: list[dict[str, str]]      # the turns this response adds: role, text
    instructions: str | None
    previous_response_id: str | None
    store: bool
    stream: bool
    metadata: dict[str, str]
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    service_tier: str
    user: str | None
    chat: dict[str, Any] = field(default_factory=dict)  # the chat fields besides messages


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidRequest(f"Invalid '{name}': expected a number between {low:g} and "
                             f"{high:g}.", param=name)
    return value


def _content(content: Any, role: str, where: str) -> str:
    """Return one item's text: a string, or text parts (anything else is refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"Invalid '{where}': expected a string or an array of content "
                             "parts.", param=where)
    allowed = ASSISTANT_PARTS if role == "assistant" else INPUT_PARTS
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise InvalidRequest(f"Invalid '{at}': expected an object.", param=at)
        kind = part.get("type")
        if kind not in allowed:
            raise InvalidRequest(
                f"Invalid '{at}.type': content parts of type {kind!r} are not supported here "
                f"for role '{role}'; send {' or '.join(sorted(allowed))} parts.",
                param=f"{at}.type", code="unsupported_content")
        for name in part:
            if name not in PART_KEYS:
                raise InvalidRequest(f"Unknown parameter: '{at}.{name}'.",
                                     param=f"{at}.{name}", code="unknown_parameter")
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequest(f"Invalid '{at}.text': expected a string.", param=f"{at}.text")
        texts.append(text)
    return "".join(texts)


def _input_items(value: Any) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequest("Invalid 'input': expected a string or a non-empty array of "
                             "input items.", param="input")
    items = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"Invalid '{where}': expected an object.", param=where)
        kind = item.get("type", "message")
        if kind != "message":
            raise InvalidRequest(
                f"Invalid '{where}.type': input items of type {kind!r} are not supported "
                "here; send message items (role and text content).",
                param=f"{where}.type", code="unsupported_content")
        for name in item:
            if name not in ITEM_KEYS:
                raise InvalidRequest(f"Unknown parameter: '{where}.{name}'.",
                                     param=f"{where}.{name}", code="unknown_parameter")
        role = item.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"Invalid '{where}.role': expected one of "
                                 f"{', '.join(ROLES)}.", param=f"{where}.role")
        items.append({"role": role,
                      "content": _content(item.get("content"), role, f"{where}.content")})
    return items


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if (not isinstance(value, dict) or len(value) > METADATA_PAIRS
            or not all(isinstance(k, str) and len(k) <= METADATA_KEY and isinstance(v, str)
                       and len(v) <= METADATA_VALUE for k, v in value.items())):
        raise InvalidRequest(f"Invalid 'metadata': expected at most {METADATA_PAIRS} pairs of "
                             f"strings, keys up to {METADATA_KEY} and values up to "
                             f"{METADATA_VALUE} characters.", param="metadata")
    return value


def _no_ops(body: dict[str, Any]) -> None:
    """Refuse the fields SDKs send whose non-default values this surface cannot honour."""
    checks = {
        "tools": lambda v: v == [],
        "tool_choice": lambda v: v in ("auto", "none"),
        "parallel_tool_calls": lambda v: isinstance(v, bool),
        "text": lambda v: isinstance(v, dict) and set(v) <= {"format", "verbosity"}
        and v.get("format", {"type": "text"}) == {"type": "text"}
        and v.get("verbosity", "medium") in ("medium", None),
        "truncation": lambda v: v == "disabled",
        "include": lambda v: v == [],
        "background": lambda v: v is False,
        "stream_options": lambda v: isinstance(v, dict)
        and set(v) <= {"include_obfuscation"},
    }
    for name, ok in checks.items():
        if body.get(name) is not None and not ok(body[name]):
            raise InvalidRequest(f"'{name}' with this value is not supported on /v1/responses "
                                 "yet (text answers without tools only); use "
                                 "/v1/chat/completions.", param=name,
                                 code="unsupported_parameter")


def parse_responses(body: Any) -> ResponsesBody:
    """Validate a Responses body (raise InvalidRequest with OpenAI's param)."""
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    for name in body:
        if name in UNSUPPORTED:
            raise InvalidRequest(f"'{name}': {UNSUPPORTED[name]} are not supported on "
                                 "/v1/responses yet.", param=name,
                                 code="unsupported_parameter")
        if name not in FIELDS:
            raise InvalidRequest(f"Unknown parameter: '{name}'.", param=name,
                                 code="unknown_parameter")
    _no_ops(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("Missing required parameter: 'model'.", param="model")
    if "input" not in body:
        raise InvalidRequest("Missing required parameter: 'input'.", param="input")
    items = _input_items(body["input"])
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("Invalid 'instructions': expected a string.", param="instructions")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous
                                 or len(previous) > MAX_ID):
        raise InvalidRequest("Invalid 'previous_response_id': expected a response id.",
                             param="previous_response_id")
    for name in ("store", "stream"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise InvalidRequest(f"Invalid '{name}': expected a boolean.", param=name)
    limit = body.get("max_output_tokens")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)
                              or limit < 1):
        raise InvalidRequest("Invalid 'max_output_tokens': expected a positive integer.",
                             param="max_output_tokens")
    tier = "auto" if body.get("service_tier") is None else body["service_tier"]
    if tier not in SERVICE_TIERS:
        raise InvalidRequest(f"Invalid 'service_tier': expected one of "
                             f"{', '.join(SERVICE_TIERS)}.", param="service_tier")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest("Invalid 'user': expected a string.", param="user")
    chat = {name: body[name] for name in ("user", "safety_identifier", "prompt_cache_key")
            if body.get(name) is not None}
    return ResponsesBody(
        model=model, input_items=items, instructions=instructions,
        previous_response_id=previous, store=body.get("store") is not False,
        stream=body.get("stream") is True, metadata=_metadata(body.get("metadata")),
        max_output_tokens=limit, temperature=_number(body, "temperature", 0, 2),
        top_p=_number(body, "top_p", 0, 1), service_tier=tier, user=user or None, chat=chat)


def inference_request(parsed: ResponsesBody, history: list[dict[str, str]]
                      ) -> InferenceRequest:
    """Return the gateway's request of a Responses body continuing ``history`` (the turns of
    the stored conversation it names, oldest first): its chat body through ``parse_chat``."""
    messages = ([{"role": "system", "content": parsed.instructions}]
                if parsed.instructions is not None else [])
    messages += history + parsed.input_items
    chat: dict[str, Any] = {"model": parsed.model, "messages": messages,
                            "service_tier": parsed.service_tier, **parsed.chat}
    if parsed.max_output_tokens is not None:
        chat["max_tokens"] = parsed.max_output_tokens
    for name in ("temperature", "top_p"):
        if getattr(parsed, name) is not None:
            chat[name] = getattr(parsed, name)
    if parsed.stream:  # the engine's counts come in its last chunk
        chat.update(stream=True, stream_options={"include_usage": True})
    return parse_chat(chat)


def response_usage(result: CallResult | None) -> dict[str, Any]:
    """Return the Responses API's usage object from the engine's counts."""
    prompt = result.prompt_tokens if result else 0
    cached = result.cached_tokens if result else 0
    output = result.completion_tokens if result else 0
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output,
            "output_tokens_details": {
                "reasoning_tokens": getattr(result, "reasoning_tokens", 0) or 0},
            "total_tokens": prompt + output}


def _finish(reason: Any) -> str | None:
    if isinstance(reason, dict):  # SGLang's native form {"type": ...}
        reason = reason.get("type")
    return reason if isinstance(reason, str) else None


def _sse(kind: str, seq: int, data: dict[str, Any]) -> bytes:
    """One server-sent event; an event per token, so orjson (json.dumps was ~3 % of the
    gateway's busy CPU streaming this surface), UTF-8 as chat's frames are."""
    payload = orjson.dumps({"type": kind, "sequence_number": seq, **data},
                           option=orjson.OPT_NON_STR_KEYS)
    return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"


class ResponsesSurface(Surface):
    """OpenAI's Responses wording of one request's answer (see the module); one per request.

    It also stores the finished answer (``store`` true): for a stream when the engine's last
    chunk is in (before ``response.completed`` goes out, so a client may chain on it at once),
    for a plain answer through ``persist`` once ``serve`` returned.
    """

    def __init__(self, parsed: ResponsesBody, *, principal: KeyPrincipal, request_id: str,
                 previous_pk: int | None) -> None:
        self.parsed = parsed
        self.principal = principal
        self.request_id = request_id
        self.previous_pk = previous_pk
        self.created = datetime.now(tz=UTC)
        self.seq = -1
        self.text: list[str] = []
        self.finish: str | None = None
        self.final: dict[str, Any] | None = None
        # a stream's: its Response id, tier and mid-stream failure, for the last frames
        self.response_id = ""
        self.tier = "default"
        self.failure: dict[str, str] | None = None

    # -- the Response object ---------------------------------------------------------------

    def object_id(self, req: InferenceRequest, request_id: str) -> str:
        return f"resp_{request_id}"

    def _message(self, object_id: str, status: str, text: str | None) -> dict[str, Any]:
        content = [] if text is None else [self._part(text)]
        return {"id": f"msg_{object_id[5:]}", "type": "message", "status": status,
                "role": "assistant", "content": content}

    @staticmethod
    def _part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _response(self, object_id: str, *, status: str, tier: str,
                  output: list[dict[str, Any]], usage: dict[str, Any] | None,
                  error: dict[str, Any] | None = None) -> dict[str, Any]:
        p = self.parsed
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": object_id, "object": "response", "created_at": int(self.created.timestamp()),
            "status": status, "background": False, "error": error,
            "incomplete_details": incomplete, "instructions": p.instructions,
            "max_output_tokens": p.max_output_tokens, "max_tool_calls": None,
            "model": p.model, "output": output, "parallel_tool_calls": True,
            "previous_response_id": p.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "service_tier": tier,
            "store": p.store, "temperature": 1.0 if p.temperature is None else p.temperature,
            "text": {"format": {"type": "text"}, "verbosity": "medium"},
            "tool_choice": "auto", "tools": [], "top_logprobs": 0,
            "top_p": 1.0 if p.top_p is None else p.top_p, "truncation": "disabled",
            "usage": usage, "user": p.user, "metadata": p.metadata,
            "completed_at": int(time.time()) if status == "completed" else None,
        }

    def _status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    def _finished(self, call: EngineCall, object_id: str, tier: str) -> dict[str, Any]:
        status = self._status()
        self.final = self._response(
            object_id, status=status, tier=tier,
            output=[self._message(object_id, status, "".join(self.text))],
            usage=response_usage(call.result))
        return self.final

    def body(self, call: EngineCall, req: InferenceRequest, request_id: str, tier: str
             ) -> dict[str, Any]:
        choice = ((call.body or {}).get("choices") or [{}])[0]
        self.text = [(choice.get("message") or {}).get("content") or ""]
        self.finish = _finish(choice.get("finish_reason"))
        return self._finished(call, self.object_id(req, request_id), tier)

    async def persist(self) -> None:
        """Store the finished answer (``store`` true): a failure to store is logged, and the
        answer, served and metered, still goes out."""
        final = self.final
        if not self.parsed.store or final is None:
            return
        try:
            await in_thread(response_store.stored_response_create)(
                org_id=self.principal.org_id, project_id=self.principal.project_id,
                public_id=final["id"], request_id=self.request_id,
                previous_pk=self.previous_pk, model=self.parsed.model,
                input_items=self.parsed.input_items, output_text="".join(self.text),
                usage=final["usage"], body=final, created_at=self.created)
        except DatabaseError as exc:
            log.warning("response %s not stored: %r", final["id"], exc)

    # -- the stream ------------------------------------------------------------------------

    def _event(self, kind: str, **data: Any) -> bytes:
        self.seq += 1
        return _sse(kind, self.seq, data)

    async def frames(self, call: EngineCall, req: InferenceRequest, tier: str,
                     object_id: str) -> AsyncIterator[bytes]:
        self.response_id, self.tier = object_id, tier
        start = self._response(object_id, status="in_progress", tier=tier, output=[],
                               usage=None)
        yield self._event("response.created", response=start)
        yield self._event("response.in_progress", response=start)
        item_id = f"msg_{object_id[5:]}"
        yield self._event("response.output_item.added", output_index=0,
                          item=self._message(object_id, "in_progress", None))
        yield self._event("response.content_part.added", item_id=item_id, output_index=0,
                          content_index=0, part=self._part(""))
        async for chunk in call.chunks():
            for choice in chunk.get("choices") or ():
                delta = (choice.get("delta") or {}).get("content")
                if delta:
                    self.text.append(delta)
                    yield self._event("response.output_text.delta", item_id=item_id,
                                      output_index=0, content_index=0, delta=delta,
                                      logprobs=[])
                if choice.get("finish_reason") is not None:
                    self.finish = _finish(choice["finish_reason"])
        # the engine has finished and counted: the answer is whole
        self._finished(call, object_id, tier)
        await self.persist()

    def error_frame(self, exc: EngineError, seconds: float) -> bytes:
        self.failure = {"code": "server_error",
                        "message": f"{exc} (after {seconds:.1f}s of streaming)"}
        return self._event("error", code=exc.code, param=None,
                           message=self.failure["message"])

    def end_frames(self, call: EngineCall, req: InferenceRequest, *, failed: bool
                   ) -> list[bytes]:
        object_id = self.response_id
        if failed or self.final is None:
            text = "".join(self.text)
            failed_response = self._response(
                object_id, status="failed", tier=self.tier,
                output=[self._message(object_id, "incomplete", text)],
                usage=response_usage(call.result), error=self.failure)
            return [self._event("response.failed", response=failed_response)]
        final = self.final
        item = final["output"][0]
        part = item["content"][0]
        return [
            self._event("response.output_text.done", item_id=item["id"], output_index=0,
                        content_index=0, text=part["text"], logprobs=[]),
            self._event("response.content_part.done", item_id=item["id"], output_index=0,
                        content_index=0, part=part),
            self._event("response.output_item.done", output_index=0, item=item),
            self._event(f"response.{final['status']}", response=final),
        ]
