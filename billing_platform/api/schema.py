"""What the management API's OpenAPI schema says beyond what drf-spectacular infers per view.

Two house rules hold for every ``/api/v1`` operation, so they are written down here once (a
drf-spectacular post-processing hook, in settings' ``SPECTACULAR_SETTINGS``) instead of in each
view's ``extend_schema``:

- A list answers OpenAI's envelope, ``{"object": "list", "data": [...]}`` (some add
  ``has_more``, ``last_id`` or a summary beside ``data``), never a bare array. Views declare
  ``Serializer(many=True)``; the hook turns each such array into its ``<Item>List`` envelope,
  so a generated client reads ``data``.
- Errors answer DRF's shape (``{"detail", "code", "param"}``, or a map of fields to messages
  for a validation error) with the statuses ``ERRORS`` names. Each operation documents those
  that can happen to it, so a generated client knows them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ERROR = "Error"
ERROR_SCHEMAS = {
    ERROR: {
        "description": "DRF's error shape: a ``detail`` (with a stable ``code``, and the "
                       "``param`` at fault when there is one), or, for a body that fails "
                       "validation, each field's messages.",
        "anyOf": [{"$ref": "#/components/schemas/ErrorDetail"},
                  {"$ref": "#/components/schemas/FieldErrors"}],
    },
    "ErrorDetail": {
        "type": "object",
        "properties": {"detail": {"type": "string"}, "code": {"type": "string"},
                       "param": {"type": "string"}},
        "required": ["detail"],
    },
    "FieldErrors": {
        "type": "object",
        "description": "field name (or ``non_field_errors``) -> its messages; nested for a "
                       "nested field",
        "additionalProperties": {},
    },
}
WRITES = frozenset({"post", "put", "patch", "delete"})
# status -> (what it means, does it apply to this (method, operation)?)
ERRORS: dict[str, tuple[str, Callable[[str, dict[str, Any]], bool]]] = {
    "400": ("The request is invalid (a parameter, the body or a business rule).",
            lambda method, op: True),
    "401": ("No credentials, or an API key that is wrong, revoked or expired.",
            lambda method, op: True),
    "403": ("The caller's role or key scope does not allow this.", lambda method, op: True),
    "404": ("No such object in the caller's organizations.", lambda method, op: True),
    "409": ("The request conflicts with the object's current state.",
            lambda method, op: method in WRITES),
    "415": ("The body's Content-Type is not one this operation reads.",
            lambda method, op: "requestBody" in op),
}


def _envelope(items: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "object": {"type": "string", "enum": ["list"]},
            "data": {"type": "array", "items": items},
            "has_more": {"type": "boolean"},
            "last_id": {"type": "string", "nullable": True},
        },
        "required": ["object", "data"],
    }


def _list_envelope(schema: dict[str, Any], components: dict[str, Any]) -> dict[str, Any]:
    """Return the envelope for a bare-array response ``schema`` (a named component if the
    items are one)."""
    items = schema["items"]
    ref = items.get("$ref", "")
    if not ref.startswith("#/components/schemas/"):
        return _envelope(items)
    name = ref.rsplit("/", 1)[1] + "List"
    components.setdefault(name, _envelope(items))
    return {"$ref": f"#/components/schemas/{name}"}


def document_house_rules(result: dict[str, Any], generator: Any, **kwargs: Any
                         ) -> dict[str, Any]:
    """drf-spectacular post-processing hook: list envelopes and error responses."""
    components = result.setdefault("components", {}).setdefault("schemas", {})
    components.update(ERROR_SCHEMAS)
    error_ref = {"$ref": f"#/components/schemas/{ERROR}"}
    for operations in result.get("paths", {}).values():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            for status, response in responses.items():
                content = response.get("content", {}).get("application/json", {})
                if status.startswith("2") and content.get("schema", {}).get("type") == "array":
                    content["schema"] = _list_envelope(content["schema"], components)
            for status, (description, applies) in ERRORS.items():
                if status not in responses and applies(method, operation):
                    responses[status] = {"description": description,
                                         "content": {"application/json": {"schema": error_ref}}}
    return result
