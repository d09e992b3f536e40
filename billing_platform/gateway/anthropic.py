"""Anthropic's Messages API on the same pipeline: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``.

Coding tools and Anthropic's SDKs speak this API to any base URL. A Messages body is
translated into the chat body the engines serve (``parse_chat`` then validates it and computes
the prompt and output bounds admission reserves, so nothing here is a second set of rules),
``services.serve`` runs it (admission, routing, metering from the engine's counts, rating),
and ``MessagesSurface`` words the answer as Anthropic does:

- a message ``{"id": "msg_...", "type": "message", "role": "assistant", "content": [{"type":
  "text", ...}], "stop_reason", "stop_sequence", "usage"}``; ``usage.input_tokens`` is the
  uncached prompt tokens, ``cache_read_input_tokens`` the engine's cached ones (Anthropic
  counts them apart), ``output_tokens`` the completion;
- a stream of Anthropic's events (``message_start``, ``content_block_start``, ``ping``,
  ``content_block_delta`` with ``text_delta``, ``content_block_stop``, ``message_delta`` with
  the stop reason and the usage, ``message_stop``), the usage in ``message_delta`` once the
  engine has counted it (the SDK's final message carries it; ``message_start`` says 0);
- errors as ``{"type": "error", "error": {"type", "message"}}`` with Anthropic's types;
- ``count_tokens`` (``model``, ``messages``, ``system``): ``{"input_tokens": N}``, the prompt
  the same body would send, counted by an engine of the model (SGLang's ``/v1/tokenize``,
  through the chat template), so it is what a create call reports as ``input_tokens`` plus
  ``cache_read_input_tokens``; free, as Anthropic's is (no usage event).

Accepted: ``model``, ``max_tokens`` (required, as Anthropic requires it), ``messages`` (user
and assistant turns, text content), ``system`` (a string or text blocks), ``stop_sequences``,
``temperature``, ``top_p``, ``top_k``, ``stream``, ``metadata`` (its ``user_id`` is the end
user stored on the usage event, as ``user`` is on chat), ``service_tier``. Refused with
a clear message: content blocks other than text (images, documents, tool use and results),
``tools``/``tool_choice``, ``thinking`` and any unknown field.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from django.http import JsonResponse

from billing_platform.errors import DomainError, InvalidRequest
from billing_platform.gateway.services import Surface
from billing_platform.gateway.validation import InferenceRequest, parse_chat
from engine_adapter.client import EngineCall
from engine_adapter.types import EngineError

ROLES = ("user", "assistant")
SERVICE_TIERS = {"auto": "auto", "standard_only": "default"}
FIELDS = frozenset({"model", "max_tokens", "messages", "system", "stop_sequences",
                    "temperature", "top_p", "top_k", "stream", "metadata", "service_tier"})
COUNT_FIELDS = frozenset({"model", "messages", "system"})
UNSUPPORTED = {"tools": "tools", "tool_choice": "tools", "thinking": "extended thinking",
               "mcp_servers": "MCP servers", "container": "containers"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "abort": "end_turn"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               408: "timeout_error", 409: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               502: "api_error", 503: "overloaded_error", 504: "timeout_error"}


def _text(content: Any, where: str) -> str:
    """Return a turn's text: a string, or text blocks (anything else is refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}: Input should be a valid list or string.")
    parts = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise InvalidRequest(f"{where}.{i}: content blocks of type {kind!r} are not "
                                 "supported here; send text blocks.")
        text = block.get("text")
        if not isinstance(text, str):
            raise InvalidRequest(f"{where}.{i}.text: Input should be a valid string.")
        parts.append(text)
    return "".join(parts)


def _fields(body: Any, allowed: frozenset[str], where: str) -> dict[str, Any]:
    """Return ``body`` if it is an object naming only ``allowed`` fields (raise otherwise)."""
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    for name in body:
        if name in UNSUPPORTED:
            raise InvalidRequest(f"{name}: {UNSUPPORTED[name]} are not supported on "
                                 f"{where} yet; use /v1/chat/completions.")
        if name not in allowed:
            raise InvalidRequest(f"{name}: Extra inputs are not permitted")
    return body


def _chat_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """Return the chat messages of a Messages body's ``system`` and ``messages``."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages: Field required (a non-empty list of turns).")
    chat: list[dict[str, str]] = []
    system = body.get("system")
    if system is not None:
        chat.append({"role": "system", "content": _text(system, "system")})
    for i, turn in enumerate(messages):
        if not isinstance(turn, dict) or turn.get("role") not in ROLES:
            raise InvalidRequest(f"messages.{i}.role: Input should be 'user' or 'assistant'.")
        chat.append({"role": turn["role"],
                     "content": _text(turn.get("content"), f"messages.{i}.content")})
    return chat


def chat_body(body: Any) -> dict[str, Any]:
    """Return the chat completions body a Messages body asks for (raise on what it cannot)."""
    body = _fields(body, FIELDS, "/v1/messages")
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise InvalidRequest("max_tokens: Field required (a positive integer)."
                             if max_tokens is None else
                             "max_tokens: Input should be a positive integer.")
    chat = _chat_messages(body)
    tier = body.get("service_tier", "auto")
    if tier not in SERVICE_TIERS:
        raise InvalidRequest("service_tier: Input should be 'auto' or 'standard_only'.")
    temperature = body.get("temperature")
    if temperature is not None and (not isinstance(temperature, int | float)
                                    or isinstance(temperature, bool)
                                    or not 0 <= temperature <= 1):
        raise InvalidRequest("temperature: Input should be between 0 and 1.")
    out: dict[str, Any] = {"model": body.get("model"), "messages": chat,
                           "max_tokens": max_tokens, "service_tier": SERVICE_TIERS[tier]}
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
            raise InvalidRequest("stop_sequences: Input should be a list of non-empty strings.")
        out["stop"] = stops
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            out[name] = body[name]
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict) or set(metadata) - {"user_id"}:
            raise InvalidRequest("metadata: only user_id is accepted.")
        if metadata.get("user_id") is not None:
            out["user"] = metadata["user_id"]  # the end user, stored on the usage event
    if body.get("stream") is not None:
        out["stream"] = body["stream"]
        if body["stream"] is True:  # the engine's counts come in its last chunk
            out["stream_options"] = {"include_usage": True}
    return out


def parse_messages(body: Any) -> InferenceRequest:
    """Validate a Messages body into the gateway's request (bounds from ``parse_chat``)."""
    return parse_chat(chat_body(body))


def parse_count_tokens(body: Any) -> InferenceRequest:
    """Validate a ``count_tokens`` body (``model``, ``messages``, ``system``) into the request
    whose prompt the engine counts: the same chat messages ``/v1/messages`` would send, so the
    count is the ``input_tokens`` plus ``cache_read_input_tokens`` a create call reports."""
    body = _fields(body, COUNT_FIELDS, "/v1/messages/count_tokens")
    return parse_chat({"model": body.get("model"), "messages": _chat_messages(body),
                       "max_tokens": 1})


def _usage(call: EngineCall) -> dict[str, int]:
    r = call.result
    if r is None:  # (never once metered: the engine's counts come before the last frames)
        return {"input_tokens": 0, "output_tokens": 0}
    return {"input_tokens": r.prompt_tokens - r.cached_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": r.cached_tokens,
            "output_tokens": r.completion_tokens}


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return (f"event: {kind}\ndata: "
            f"{json.dumps({'type': kind, **data}, separators=(',', ':'))}\n\n").encode()


def _stop(choice: dict[str, Any], stops: list[str]) -> tuple[str, str | None]:
    """Return (stop_reason, stop_sequence) from the engine's finish reason."""
    reason = choice.get("finish_reason")
    if isinstance(reason, dict):  # SGLang's native form {"type": ..., "matched": ...}
        reason = reason.get("type")
    matched = choice.get("matched_stop")
    if isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return STOP_REASONS.get(str(reason), "end_turn"), None


class MessagesSurface(Surface):
    """Anthropic's wording of one request's answer (see the module); one per request."""

    def __init__(self, stops: list[str] | None = None):
        self.stops = stops or []
        self.stop_reason, self.stop_sequence = "end_turn", None

    def object_id(self, req: InferenceRequest, request_id: str) -> str:
        return f"msg_{request_id}"

    def body(self, call: EngineCall, req: InferenceRequest, request_id: str, tier: str
             ) -> dict[str, Any]:
        choice = ((call.body or {}).get("choices") or [{}])[0]
        text = (choice.get("message") or {}).get("content") or ""
        reason, sequence = _stop(choice, self.stops)
        return {"id": self.object_id(req, request_id), "type": "message",
                "role": "assistant", "model": req.model,
                "content": [{"type": "text", "text": text}] if text else [],
                "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(call)}

    async def frames(self, call: EngineCall, req: InferenceRequest, tier: str,
                     object_id: str) -> AsyncIterator[bytes]:
        yield _event("message_start", {"message": {
            "id": object_id, "type": "message", "role": "assistant", "model": req.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0}}})
        yield _event("content_block_start", {"index": 0,
                                             "content_block": {"type": "text", "text": ""}})
        yield _event("ping", {})
        async for chunk in call.chunks():
            for choice in chunk.get("choices") or ():
                text = (choice.get("delta") or {}).get("content")
                if text:
                    yield _event("content_block_delta", {
                        "index": 0, "delta": {"type": "text_delta", "text": text}})
                if choice.get("finish_reason") is not None:
                    self.stop_reason, self.stop_sequence = _stop(choice, self.stops)

    def error_frame(self, exc: EngineError, seconds: float) -> bytes:
        return _event("error", {"error": {
            "type": "api_error", "message": f"{exc} (after {seconds:.1f}s of streaming)"}})

    def end_frames(self, call: EngineCall, req: InferenceRequest, *, failed: bool
                   ) -> list[bytes]:
        if failed:
            return []
        return [_event("content_block_stop", {"index": 0}),
                _event("message_delta", {"delta": {"stop_reason": self.stop_reason,
                                                   "stop_sequence": self.stop_sequence},
                                         "usage": _usage(call)}),
                _event("message_stop", {})]


def anthropic_error(exc: DomainError, request_id: str | None = None) -> JsonResponse:
    """Return Anthropic's answer to a domain error: ``{"type": "error", "error": {...}}``."""
    response = JsonResponse({"type": "error", "error": {
        "type": ERROR_TYPES.get(exc.status, "api_error"), "message": exc.message}},
        status=exc.status)
    for name, value in exc.headers.items():
        response[name] = value
    if request_id:
        response["request-id"] = request_id
        response["x-request-id"] = request_id
    return response
