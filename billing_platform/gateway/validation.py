"""Validate /v1 request bodies into what the gateway needs, with OpenAI's error params."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from billing_platform.gateway.errors import invalid

SERVICE_TIERS = ("auto", "default", "priority", "flex")
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# Fields we never pass through: we set them ourselves or the engine must not see them.
RESERVED = ("cache_salt", "extra_key", "priority", "rid", "stream_options", "service_tier",
            "lora_path", "return_hidden_states", "custom_logit_processor")


@dataclass(frozen=True)
class InferenceRequest:
    kind: str                   # "chat" | "completion"
    model: str
    stream: bool
    include_usage: bool
    service_tier: str           # as asked: auto | default | priority | flex
    prompt_text: str            # for routing (prefix affinity) only
    engine_body: dict[str, Any]


def _text_of(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or "type" not in part:
                raise invalid(f"{where}[{i}] must be an object with a 'type'.", param=where)
            if part["type"] == "text":
                parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise invalid(f"{where} must be a string or an array of content parts.", param=where)


def _common(body: dict[str, Any]) -> tuple[str, bool, bool, str]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("you must provide a model parameter", param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid("'stream' must be a boolean.", param="stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true.",
                          param="stream_options")
        if not isinstance(options, dict):
            raise invalid("'stream_options' must be an object.", param="stream_options")
    include_usage = bool(options and options.get("include_usage"))
    tier = body.get("service_tier") or "auto"
    if tier not in SERVICE_TIERS:
        raise invalid(f"Invalid service_tier {tier!r}; expected one of "
                      f"{', '.join(SERVICE_TIERS)}.", param="service_tier")
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise invalid(f"'{name}' must be a positive integer.", param=name)
    n = body.get("n", 1)
    if n != 1:
        raise invalid("Only n=1 is supported.", param="n")
    temperature = body.get("temperature")
    if temperature is not None and (not isinstance(temperature, int | float)
                                    or not 0 <= temperature <= 2):
        raise invalid("'temperature' must be between 0 and 2.", param="temperature")
    return model, stream, include_usage, tier


def parse_chat(body: Any) -> InferenceRequest:
    """Validate a chat completion body."""
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    model, stream, include_usage, tier = _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty array.", param="messages")
    texts = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(f"{where} must be an object.", param=where)
        if message.get("role") not in ROLES:
            raise invalid(f"{where}.role must be one of {', '.join(ROLES)}.",
                          param=f"{where}.role")
        texts.append(f"{message['role']}: {_text_of(message.get('content'), where + '.content')}")
    return InferenceRequest("chat", model, stream, include_usage, tier, "\n".join(texts),
                            {k: v for k, v in body.items() if k not in RESERVED})


def parse_completion(body: Any) -> InferenceRequest:
    """Validate a legacy completion body (a single prompt string)."""
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    model, stream, include_usage, tier = _common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise invalid("'prompt' must be a non-empty string.", param="prompt")
    engine_body = {k: v for k, v in body.items() if k not in RESERVED}
    engine_body["prompt"] = prompt
    return InferenceRequest("completion", model, stream, include_usage, tier, prompt,
                            engine_body)
