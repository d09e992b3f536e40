"""/v1/files and /v1/batches: OpenAI's Files and Batch API (keys need the ``batch`` scope).

Thin async views over the batch services; database work runs in a thread so the event loop
keeps relaying interactive streams while a 200 MB upload is stored: ``in_thread``, whose
connections are checked as a Django request's are (so they recover from a PostgreSQL restart).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse

from billing_platform.accounts.choices import Scope
from billing_platform.accounts.selectors import KeyPrincipal
from billing_platform.errors import InvalidRequest
from billing_platform.gateway.apis import openai_endpoint
from billing_platform.gateway.batch import files
from billing_platform.gateway.batch import services as batch_services
from billing_platform.gateway.bodies import GatewayRequest, file_response
from billing_platform.gateway.db_connections import in_thread
from billing_platform.gateway.models import Batch, StoredFile
from billing_platform.json_input import json_loads

MAX_LIMIT = 100


def _json(body: dict[str, Any], request_id: str, status: int = 200) -> JsonResponse:
    response = JsonResponse(body, status=status)
    response["x-request-id"] = request_id
    return response


def _limit(request: HttpRequest, default: int) -> int:
    raw = request.GET.get("limit", str(default))
    try:
        limit = int(raw)
    except ValueError:
        raise InvalidRequest("'limit' must be an integer.", param="limit") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidRequest(f"'limit' must be between 1 and {MAX_LIMIT}.", param="limit")
    return limit


def _page(rows: list, limit: int, render) -> dict[str, Any]:
    data = [render(row) for row in rows[:limit]]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}


# -- files ------------------------------------------------------------------------------------

def _upload(request: HttpRequest, principal: KeyPrincipal) -> StoredFile:
    try:
        upload = request.FILES.get("file")
        purpose = request.POST.get("purpose", "")
    except Exception as exc:  # a malformed multipart body
        raise InvalidRequest(f"Could not parse the multipart body: {exc}") from None
    if upload is None:
        raise InvalidRequest("Send the file as multipart form field 'file'.", param="file")
    if not purpose:
        raise InvalidRequest("'purpose' is required.", param="purpose")
    return files.file_create(org_id=principal.org_id, org_public_id=principal.org_public_id,
                             project_id=principal.project_id, purpose=purpose,
                             filename=upload.name or "upload.jsonl", source=upload)


def _list_files(request: HttpRequest, principal: KeyPrincipal) -> dict[str, Any]:
    limit = _limit(request, 100)
    rows = files.files_for_org(org_id=principal.org_id, purpose=request.GET.get("purpose"))
    if request.GET.get("order") == "asc":
        rows = rows.order_by("id")
    after = request.GET.get("after")
    if after:
        anchor = files.file_get(org_id=principal.org_id, file_id=after)
        rows = rows.filter(id__gt=anchor.id) if request.GET.get("order") == "asc" else \
            rows.filter(id__lt=anchor.id)
    return _page(list(rows[:limit + 1]), limit, files.file_object)


@openai_endpoint(scope=Scope.BATCH, methods=("GET", "POST"))
async def files_root(request: HttpRequest, principal: KeyPrincipal,
                     request_id: str) -> HttpResponse:
    if request.method == "POST":
        file = await in_thread(_upload)(request, principal)
        return _json(files.file_object(file), request_id)
    return _json(await in_thread(_list_files)(request, principal), request_id)


@openai_endpoint(scope=Scope.BATCH, methods=("GET", "DELETE"))
async def file_detail(request: HttpRequest, principal: KeyPrincipal, request_id: str,
                      file_id: str) -> HttpResponse:
    file = await in_thread(files.file_get)(org_id=principal.org_id, file_id=file_id)
    if request.method == "DELETE":
        await in_thread(files.file_delete)(file=file)
        return _json({"id": file_id, "object": "file", "deleted": True}, request_id)
    return _json(files.file_object(file), request_id)


@openai_endpoint(scope=Scope.BATCH, methods=("GET",))
async def file_content(request: GatewayRequest, principal: KeyPrincipal, request_id: str,
                       file_id: str) -> HttpResponse:
    file = await in_thread(files.file_get)(org_id=principal.org_id, file_id=file_id)
    response = await file_response(request, partial(files.file_open, file),
                                   content_type="application/jsonl")
    response["x-request-id"] = request_id
    return response


# -- batches ----------------------------------------------------------------------------------

def _body(request: HttpRequest) -> dict[str, Any]:
    try:
        body = json_loads(request.body or b"{}")
    except ValueError:
        raise InvalidRequest("We could not parse the JSON body of your request.") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    return body


def _create_batch(request: HttpRequest, principal: KeyPrincipal) -> dict[str, Any]:
    body = _body(request)
    batch = batch_services.batch_create(
        principal=principal, input_file_id=body.get("input_file_id"),
        endpoint=body.get("endpoint"), completion_window=body.get("completion_window"),
        metadata=body.get("metadata"))
    return batch_services.batch_object(
        batch_services.batch_get(org_id=principal.org_id, batch_id=batch.public_id))


def _list_batches(request: HttpRequest, principal: KeyPrincipal) -> dict[str, Any]:
    limit = _limit(request, 20)
    rows = batch_services.batches_for_org(org_id=principal.org_id)
    after = request.GET.get("after")
    if after:
        anchor = batch_services.batch_get(org_id=principal.org_id, batch_id=after)
        rows = rows.filter(id__lt=anchor.id)
    return _page(list(rows[:limit + 1]), limit, batch_services.batch_object)


@openai_endpoint(scope=Scope.BATCH, methods=("GET", "POST"))
async def batches_root(request: HttpRequest, principal: KeyPrincipal,
                       request_id: str) -> HttpResponse:
    if request.method == "POST":
        return _json(await in_thread(_create_batch)(request, principal), request_id)
    return _json(await in_thread(_list_batches)(request, principal), request_id)


def _get_batch(principal: KeyPrincipal, batch_id: str) -> dict[str, Any]:
    return batch_services.batch_object(
        batch_services.batch_get(org_id=principal.org_id, batch_id=batch_id))


def _cancel_batch(principal: KeyPrincipal, batch_id: str) -> dict[str, Any]:
    batch: Batch = batch_services.batch_get(org_id=principal.org_id, batch_id=batch_id)
    return batch_services.batch_object(batch_services.batch_cancel(batch=batch))


@openai_endpoint(scope=Scope.BATCH, methods=("GET",))
async def batch_detail(request: HttpRequest, principal: KeyPrincipal, request_id: str,
                       batch_id: str) -> HttpResponse:
    return _json(await in_thread(_get_batch)(principal, batch_id), request_id)


@openai_endpoint(scope=Scope.BATCH, methods=("POST",))
async def batch_cancel(request: HttpRequest, principal: KeyPrincipal, request_id: str,
                       batch_id: str) -> HttpResponse:
    return _json(await in_thread(_cancel_batch)(principal, batch_id), request_id)
