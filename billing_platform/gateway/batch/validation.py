"""Validate a batch: ``validating`` -> ``in_progress`` with its lines loaded, or ``failed``.

A worker reads the uploaded input file once (``batch_validate``): every line must be a JSON
object with a unique ``custom_id``, ``POST`` to the batch's endpoint, a body that the endpoint's
own validation accepts (the /v1 parser, so a line is refused for what /v1 would refuse) and
does not stream, and one model for the whole batch that the caller may run (the request
pipeline's placement). A file with any bad line fails the batch with line-level ``errors``
(1-based, as OpenAI reports them) and loads nothing; otherwise each line gets its own random
platform request id, the idempotency key of its usage event.

Split from ``services.py`` (the rest of the life of a batch) so that each stays a size a
reader holds; ``services.batch_validate`` remains the name callers use.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.utils import timezone

from billing_platform.accounts.selectors import KeyPrincipal
from billing_platform.errors import InvalidRequest, NotFound
from billing_platform.gateway.batch import files
from billing_platform.gateway.models import Batch, BatchLine, BatchStatus
from billing_platform.gateway.pipeline import placement_resolve
from billing_platform.gateway.responses import (
    ResponsesBody,
    ResponsesSurface,
    inference_request,
    parse_responses,
)
from billing_platform.gateway.services import Surface
from billing_platform.gateway.validation import (
    InferenceRequest,
    parse_chat,
    parse_completion,
    parse_embeddings,
)
from billing_platform.json_input import json_loads
from metering.events import new_request_id

MAX_REPORTED_ERRORS = 1000


@dataclass(frozen=True)
class LineRequest:
    """One line's request as its endpoint's /v1 validation reads it; a /v1/responses line
    also keeps its Responses body, so its answer is worded (and stored) as /v1 does."""

    req: InferenceRequest
    responses: ResponsesBody | None = None

    def surface(self, *, principal: KeyPrincipal, request_id: str) -> Surface:
        """Return the surface that words this line's answer (OpenAI's chat, completion and
        embeddings shapes, or a Response)."""
        if self.responses is None:
            return Surface()
        return ResponsesSurface(self.responses, principal=principal, request_id=request_id,
                                previous_pk=None)


def _responses_line(body: Any) -> LineRequest:
    """A /v1/responses line: a whole conversation in itself (a stored one is not continued,
    since lines run in any order and a line's own answer may not exist yet)."""
    parsed = parse_responses(body)
    if parsed.previous_response_id is not None:
        raise InvalidRequest("'previous_response_id' is not supported in a batch line; "
                             "send the conversation's earlier turns in 'input'.",
                             param="previous_response_id", code="unsupported_parameter")
    return LineRequest(inference_request(parsed, []), parsed)


@dataclass(frozen=True)
class Endpoint:
    """A batch endpoint: the kind of request its lines are (``pipeline.PATHS``) and how a
    line's body is validated."""

    kind: str
    parse: Callable[[Any], LineRequest]


def _plain(parse: Callable[[Any], InferenceRequest]) -> Callable[[Any], LineRequest]:
    return lambda body: LineRequest(parse(body))


ENDPOINTS = {"/v1/chat/completions": Endpoint("chat", _plain(parse_chat)),
             "/v1/completions": Endpoint("completion", _plain(parse_completion)),
             "/v1/embeddings": Endpoint("embedding", _plain(parse_embeddings)),
             "/v1/responses": Endpoint("chat", _responses_line)}


@dataclass
class _Parsed:
    line_no: int
    custom_id: str
    body: dict[str, Any]
    model: str


def _line_error(code: str, message: str, line: int, param: str | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def _parse_input(batch: Batch, raw_lines: Iterator[bytes]) -> tuple[list[_Parsed], list[dict]]:
    """Parse and check every line; return the lines and the line-level errors (1-based)."""
    parse = ENDPOINTS[batch.endpoint].parse
    parsed: list[_Parsed] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    models: set[str] = set()
    for number, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        try:
            doc = json_loads(raw)
        except ValueError:
            errors.append(_line_error("invalid_json_line", "This line is not parseable as "
                                      "valid JSON.", number))
            continue
        if not isinstance(doc, dict):
            errors.append(_line_error("invalid_json_line", "Each line must be a JSON object.",
                                      number))
            continue
        custom_id = doc.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            errors.append(_line_error("missing_required_parameter", "Missing required "
                                      "parameter: 'custom_id'.", number, "custom_id"))
            continue
        if len(custom_id) > 512:
            errors.append(_line_error("invalid_value", "'custom_id' is longer than 512 "
                                      "characters.", number, "custom_id"))
            continue
        if custom_id in seen:
            errors.append(_line_error("duplicate_custom_id", f"The custom_id {custom_id!r} "
                                      "is used by another request in this file.", number,
                                      "custom_id"))
            continue
        seen.add(custom_id)
        if doc.get("method", "POST") != "POST":
            errors.append(_line_error("invalid_value", "'method' must be 'POST'.", number,
                                      "method"))
            continue
        if doc.get("url") != batch.endpoint:
            errors.append(_line_error("invalid_url", f"The url {doc.get('url')!r} does not "
                                      f"match the batch endpoint {batch.endpoint}.", number,
                                      "url"))
            continue
        body = doc.get("body")
        try:
            req = parse(body).req
        except InvalidRequest as exc:
            errors.append(_line_error("invalid_request", exc.message, number,
                                      f"body.{exc.param}" if exc.param else "body"))
            continue
        if req.stream:
            errors.append(_line_error("invalid_value", "Batch requests cannot stream.", number,
                                      "body.stream"))
            continue
        models.add(req.model)
        if len(models) > 1:
            errors.append(_line_error("mismatched_model", "Every request in a batch must use "
                                      f"the same model; found {sorted(models)}.", number,
                                      "body.model"))
            models = {parsed[0].model} if parsed else set()
            continue
        parsed.append(_Parsed(number, custom_id, body, req.model))
    return parsed, errors


def _model_error(principal: KeyPrincipal, model: str, endpoint: str) -> str | None:
    """Return why the caller may not run ``model`` on ``endpoint`` (existence, key, data
    zone, residency narrowing, price, an embedding model or not), or None: the placement rule
    of /v1, so a batch /v1 would refuse fails here rather than wait, never run, until it
    expires."""
    try:
        asyncio.run(placement_resolve(principal=principal, model=model,
                                      kind=ENDPOINTS[endpoint].kind))
    except NotFound as exc:
        return exc.message
    return None


def batch_validate(*, batch_id: int) -> Batch | None:
    """Validate a ``validating`` batch's file; load its lines (in_progress) or fail it."""
    batch = Batch.objects.select_related("input_file").filter(pk=batch_id).first()
    if batch is None or batch.status != BatchStatus.VALIDATING:
        return batch
    errors: list[dict[str, Any]] = []
    parsed: list[_Parsed] = []
    path = files.file_path(batch.input_file) if batch.input_file else None
    if path is None or not path.exists():
        errors.append(_line_error("file_not_found", "The input file was deleted.", 0))
    else:
        with open(path, "rb") as handle:
            parsed, errors = _parse_input(batch, iter(handle))
        if not parsed and not errors:
            errors.append(_line_error("empty_file", "The input file has no requests.", 0))
    model = parsed[0].model if parsed else ""
    if not errors:
        why = _model_error(KeyPrincipal.from_json(batch.principal), model, batch.endpoint)
        if why:
            errors.append(_line_error("model_not_found", why, parsed[0].line_no, "body.model"))
    now = timezone.now()
    with transaction.atomic():
        locked = Batch.objects.select_for_update().get(pk=batch.pk)
        if locked.status != BatchStatus.VALIDATING:
            return locked
        if errors:
            Batch.objects.filter(pk=batch.pk).update(
                status=BatchStatus.FAILED, failed_at=now,
                errors=errors[:MAX_REPORTED_ERRORS], total=0)
        else:
            BatchLine.objects.bulk_create(
                [BatchLine(batch_id=batch.pk, line_no=p.line_no, custom_id=p.custom_id,
                           body=p.body, request_id=new_request_id())
                 for p in parsed], batch_size=2000)
            Batch.objects.filter(pk=batch.pk).update(
                status=BatchStatus.IN_PROGRESS, in_progress_at=now, model=model,
                total=len(parsed), heartbeat_at=now)
    batch.refresh_from_db()
    return batch
