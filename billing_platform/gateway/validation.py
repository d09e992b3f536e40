"""Validate /v1 request bodies into what the gateway needs, with OpenAI's error params.

What reaches an engine is built here, and only from an allow-list: a field the gateway does
not know could change what the engine generates or whose prompt it reads (SGLang's
``session_params`` prepend a stored session, ``input_ids`` replace the messages,
``bootstrap_*`` and ``routed_dp_rank`` pick where it runs, ``return_meta_info`` and
``custom_params`` reach server internals), so it is refused, never passed on.

Two bounds come out of every body, and admission reserves the worst case from them:

- the output bound: ONE number per choice, sent to the engine in the one field it honours on
  that endpoint (SGLang's chat reads ``max_completion_tokens`` before ``max_tokens``, its
  legacy completions only ``max_tokens``); the other field is never forwarded, so the engine
  cannot generate more than was reserved; with ``n`` choices the engine generates up to ``n``
  times that, and ``max_output`` (what admission reserves) is that product;
- the prompt bound: every field the engine renders into the prompt counts (message contents,
  tool calls and other message fields, ``tools``, a completion's ``suffix``), at least one
  byte per token; content the gateway cannot bound (images, audio, files) is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from billing_platform.errors import InvalidRequest
from billing_platform.gateway import pipeline
from metering.events import MAX_USER, is_end_user
from plans.admission import prompt_token_bound

SERVICE_TIERS = ("auto", "default", "priority", "flex")
ROLES = ("system", "developer", "user", "assistant", "tool", "function")

# Passed to the engine as given: OpenAI's sampling fields and SGLang's sampling extensions.
# None of them adds to the prompt or lets the engine generate past the output bound.
_SAMPLING = frozenset({
    "stream", "temperature", "top_p", "frequency_penalty", "presence_penalty", "seed", "stop",
    "logit_bias", "logprobs", "response_format",
    "top_k", "min_p", "min_tokens", "repetition_penalty", "stop_token_ids", "stop_regex",
    "no_stop_trim", "ignore_eos", "skip_special_tokens", "regex", "ebnf",
})
CHAT_FIELDS = _SAMPLING | {"messages", "top_logprobs", "tools", "tool_choice",
                           "parallel_tool_calls", "reasoning_effort", "separate_reasoning",
                           "stream_reasoning", "chat_template_kwargs"}
COMPLETION_FIELDS = _SAMPLING | {"prompt", "echo", "suffix", "json_schema"}
# Read by the gateway itself; the engine gets the gateway's own value (or nothing).
GATEWAY_FIELDS = frozenset({"model", "stream_options", "service_tier", "n", "max_tokens",
                            "max_completion_tokens", "user"})
# OpenAI's informational fields: accepted so clients that send them work, never forwarded.
DROPPED = frozenset({"metadata", "store", "prompt_cache_key", "safety_identifier"})
# OpenAI takes n up to 128; each choice is reserved in full, so a large n only reserves more.
MAX_N = 128
# ``user`` is stored on the usage event (metering.events.is_end_user) and grouped by in
# /api/v1/usage; what the event store refuses is refused here, with OpenAI's param.
# The engine field that carries the output bound, per endpoint (the one SGLang honours).
OUTPUT_FIELD = {"chat": "max_completion_tokens", "completion": "max_tokens"}
# Which of the two fields a client sent is the bound, in the engine's own order.
OUTPUT_ORDER = {"chat": ("max_completion_tokens", "max_tokens"),
                "completion": ("max_tokens", "max_completion_tokens")}
# Chat templates render tools with a fixed preamble (how to call them) and a wrapper around
# each tool and each tool call; these cover it generously.
TOOLS_PREAMBLE_TOKENS = 512
PER_TOOL_TOKENS = 16
# Content parts whose tokens are their text; any other part (image, audio, file) is refused.
TEXT_PARTS = {"text": "text", "refusal": "refusal"}


@dataclass(frozen=True)
class InferenceRequest:
    kind: str                   # "chat" | "completion" | "embedding"
    model: str
    stream: bool
    include_usage: bool
    service_tier: str           # as asked: auto | default | priority | flex
    prompt_text: str            # for routing (prefix affinity) only
    engine_body: dict[str, Any]
    prompt_bound: int = 0       # tokens the engine's prompt can have, at most
    max_output: int = 0         # tokens the engine may generate, all choices together
    n: int = 1                  # choices; each gets max_output // n (sent in OUTPUT_FIELD)
    user: str | None = None     # the client's end user, stored on the usage event


def _json_bytes(value: Any) -> int:
    """Return an upper bound of the bytes a template renders ``value`` into.

    Jinja's ``tojson`` (what chat templates use for tools) writes ASCII-escaped JSON with
    ``<``, ``>``, ``&`` and ``'`` as six-byte escapes; a raw rendering of the strings inside
    is never longer than that.
    """
    text = json.dumps(value, ensure_ascii=True)
    return len(text) + 5 * sum(text.count(c) for c in "<>&'")


def _text_of(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or "type" not in part:
                raise InvalidRequest(f"{where}[{i}] must be an object with a 'type'.", param=where)
            field = TEXT_PARTS.get(part["type"]) if isinstance(part["type"], str) else None
            if field is None:
                raise InvalidRequest(f"{where}[{i}]: content parts of type {part['type']!r} are "
                                     "not supported by this model; send text parts only.",
                                     param=f"{where}[{i}].type", code="unsupported_content")
            text = part.get(field, "")
            if not isinstance(text, str):
                raise InvalidRequest(f"{where}[{i}].{field} must be a string.",
                                     param=f"{where}[{i}].{field}")
            parts.append(text)
        return "".join(parts)
    raise InvalidRequest(f"{where} must be a string or an array of content parts.", param=where)


def _forwarded(body: dict[str, Any], allowed: frozenset[str]) -> dict[str, Any]:
    """Return the fields the engine gets as sent; refuse any field not on the allow-list."""
    out = {}
    for name, value in body.items():
        if name in allowed:
            out[name] = value
        elif name not in GATEWAY_FIELDS and name not in DROPPED:
            raise InvalidRequest(f"Unknown parameter: '{name}'.", param=name,
                                 code="unknown_parameter")
    return out


def _output_bound(body: dict[str, Any], kind: str) -> int:
    """Return the one output bound: the field the engine would read first, else the default."""
    asked = next((body[name] for name in OUTPUT_ORDER[kind] if body.get(name) is not None),
                 None)
    return pipeline.output_bound(asked)


@dataclass(frozen=True)
class _Common:
    model: str
    stream: bool
    include_usage: bool
    tier: str
    n: int
    user: str | None


def _user(body: dict[str, Any]) -> str | None:
    user = body.get("user")
    if user is None:
        return None
    if not is_end_user(user):
        raise InvalidRequest(f"'user' must be a string of at most {MAX_USER} characters, "
                             "without tabs, line breaks, backslashes or NUL.", param="user")
    return user or None


def _common(body: dict[str, Any]) -> _Common:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("you must provide a model parameter", param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean.", param="stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise InvalidRequest("'stream_options' is only allowed when 'stream' is true.",
                                 param="stream_options")
        if not isinstance(options, dict):
            raise InvalidRequest("'stream_options' must be an object.", param="stream_options")
    include_usage = bool(options and options.get("include_usage"))
    tier = body.get("service_tier") or "auto"
    if tier not in SERVICE_TIERS:
        raise InvalidRequest(f"Invalid service_tier {tier!r}; expected one of "
                             f"{', '.join(SERVICE_TIERS)}.", param="service_tier")
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise InvalidRequest(f"'{name}' must be a positive integer.", param=name)
    n = body.get("n")
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise InvalidRequest(f"'n' must be an integer between 1 and {MAX_N}.", param="n")
    temperature = body.get("temperature")
    if temperature is not None and (not isinstance(temperature, int | float)
                                    or not 0 <= temperature <= 2):
        raise InvalidRequest("'temperature' must be between 0 and 2.", param="temperature")
    return _Common(model, stream, include_usage, tier, n, _user(body))


def _choices(engine_body: dict[str, Any], common: _Common) -> None:
    """Forward ``n`` only when it asks for more than one choice (SGLang's default is 1)."""
    if common.n > 1:
        engine_body["n"] = common.n


def parse_chat(body: Any) -> InferenceRequest:
    """Validate a chat completion body."""
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    common = _common(body)
    engine_body = _forwarded(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array.", param="messages")
    texts = []
    extra = 0  # bytes of what the template renders besides the contents
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"{where} must be an object.", param=where)
        if message.get("role") not in ROLES:
            raise InvalidRequest(f"{where}.role must be one of {', '.join(ROLES)}.",
                                 param=f"{where}.role")
        texts.append(f"{message['role']}: {_text_of(message.get('content'), where + '.content')}")
        for name, value in message.items():
            if name not in ("role", "content") and value is not None:
                extra += _json_bytes(value)
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            extra += PER_TOOL_TOKENS * len(calls)
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidRequest("'tools' must be an array.", param="tools")
        if tools:
            extra += TOOLS_PREAMBLE_TOKENS + PER_TOOL_TOKENS * len(tools) + _json_bytes(tools)
    for name in ("tool_choice", "chat_template_kwargs", "response_format"):
        if body.get(name) is not None:
            extra += _json_bytes(body[name])
    per_choice = _output_bound(body, "chat")
    engine_body[OUTPUT_FIELD["chat"]] = per_choice
    _choices(engine_body, common)
    prompt_text = "\n".join(texts)
    return InferenceRequest("chat", common.model, common.stream, common.include_usage,
                            common.tier, prompt_text, engine_body,
                            prompt_bound=prompt_token_bound(prompt_text, len(messages)) + extra,
                            max_output=common.n * per_choice, n=common.n, user=common.user)


def parse_completion(body: Any) -> InferenceRequest:
    """Validate a legacy completion body (a single prompt string)."""
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    common = _common(body)
    engine_body = _forwarded(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise InvalidRequest("'prompt' must be a non-empty string.", param="prompt")
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise InvalidRequest("'suffix' must be a string.", param="suffix")
    extra = len(suffix.encode()) if suffix else 0
    per_choice = _output_bound(body, "completion")
    engine_body["prompt"] = prompt
    engine_body[OUTPUT_FIELD["completion"]] = per_choice
    _choices(engine_body, common)
    return InferenceRequest("completion", common.model, common.stream, common.include_usage,
                            common.tier, prompt, engine_body,
                            prompt_bound=prompt_token_bound(prompt, 1) + extra,
                            max_output=common.n * per_choice, n=common.n, user=common.user)


# OpenAI takes at most 2048 inputs in one embeddings request.
MAX_EMBEDDING_INPUTS = 2048
EMBEDDING_FIELDS = frozenset({"input", "encoding_format", "dimensions"})
ENCODING_FORMATS = ("float", "base64")


def _embedding_input(value: Any) -> tuple[list[str], list[list[int]]]:
    """Return an embeddings body's inputs: its texts, or its token-id arrays (one kind)."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise InvalidRequest("'input' must be a non-empty string, an array of strings, an "
                             "array of token ids or an array of token-id arrays.",
                             param="input")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        value = [value]
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise InvalidRequest(f"'input' has {len(value)} items; at most "
                             f"{MAX_EMBEDDING_INPUTS} may be embedded in one request.",
                             param="input")
    if all(isinstance(item, str) for item in value):
        for i, item in enumerate(value):
            if not item.strip():
                raise InvalidRequest(f"'input[{i}]' is empty; every input must have text.",
                                     param=f"input[{i}]")
        return value, []
    arrays = []
    for i, item in enumerate(value):
        if not isinstance(item, list) or not item or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in item):
            raise InvalidRequest(f"'input[{i}]' must be a string when the first input is, "
                                 "or a non-empty array of non-negative token ids.",
                                 param=f"input[{i}]")
        arrays.append(item)
    return [], arrays


def parse_embeddings(body: Any) -> InferenceRequest:
    """Validate an embeddings body: texts or token-id arrays, ``encoding_format``,
    ``dimensions`` (the engine says whether the model can shorten its vectors) and ``user``.

    The prompt bound is every input's (a text's bytes and its special tokens; an array's
    length); nothing is generated, so nothing is reserved for output. Token ids are checked
    against the model's vocabulary when the request is placed (``pipeline.request_check``).
    """
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    for name in body:
        if name not in EMBEDDING_FIELDS and name not in ("model", "user") and (
                name not in DROPPED):
            raise InvalidRequest(f"Unknown parameter: '{name}'.", param=name,
                                 code="unknown_parameter")
    common = _common(body)
    engine_body = {name: body[name] for name in ("encoding_format", "dimensions")
                   if body.get(name) is not None}
    encoding = body.get("encoding_format", "float")
    if encoding not in ENCODING_FORMATS:
        raise InvalidRequest(f"'encoding_format' must be one of {', '.join(ENCODING_FORMATS)}.",
                             param="encoding_format")
    dims = body.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
        raise InvalidRequest("'dimensions' must be a positive integer.", param="dimensions")
    texts, arrays = _embedding_input(body.get("input"))
    engine_body["input"] = texts if texts else arrays
    bound = (sum(prompt_token_bound(text, 1) for text in texts)
             + sum(len(ids) for ids in arrays))
    return InferenceRequest("embedding", common.model, False, False, common.tier,
                            "\n".join(texts), engine_body, prompt_bound=bound, max_output=0,
                            user=common.user)
