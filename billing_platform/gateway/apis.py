"""The OpenAI-compatible /v1 endpoints, as async Django views.

They are served by the lean ASGI route in ``gateway/asgi.py`` (no Django middleware, no thread
per request), keeping Django's URL map, request objects and one auth path; the gateway's own
work (auth cache hit, validation, admission, relay, metering) stays on the event loop.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial, wraps
from typing import Any

from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from billing_platform.accounts.choices import Scope
from billing_platform.accounts.selectors import KeyPrincipal, aapi_key_authenticate
from billing_platform.errors import (
    DomainError,
    Forbidden,
    InvalidRequest,
    Unauthenticated,
)
from billing_platform.gateway import pipeline, response_store, services
from billing_platform.gateway.anthropic import (
    MessagesSurface,
    anthropic_error,
    parse_count_tokens,
    parse_messages,
)
from billing_platform.gateway.bodies import GatewayRequest
from billing_platform.gateway.db_connections import in_thread, unavailable
from billing_platform.gateway.errors import MethodNotAllowed, openai_error
from billing_platform.gateway.responses import (
    ResponsesSurface,
    inference_request,
    parse_responses,
)
from billing_platform.gateway.validation import (
    InferenceRequest,
    parse_chat,
    parse_completion,
    parse_embeddings,
)
from billing_platform.json_input import json_loads
from metering.events import new_request_id
from plans import concurrency, refusals

View = Callable[..., Awaitable[HttpResponse]]


def openai_endpoint(scope: str = Scope.INFERENCE, methods: tuple[str, ...] = ("POST",),
                    error: Callable[[DomainError, str], HttpResponse] = openai_error,
                    key_header: str | None = None):
    """Authenticate the bearer key, check scope and method, take an in-flight slot, then read
    the body (``gateway/bodies.py``); answer any domain error the view or a service raises in
    OpenAI's shape (the one place /v1 maps them), or ``error``'s (Anthropic's, on
    /v1/messages, which also takes the key from ``key_header``: ``x-api-key``)."""

    def decorator(view: View) -> View:
        @csrf_exempt
        @wraps(view)
        async def wrapper(request: GatewayRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            request_id = new_request_id()
            principal = None
            try:
                if request.method not in methods:
                    raise MethodNotAllowed(f"Method {request.method} not allowed.")
                principal = await _authenticate(request, key_header)
                if not principal.has_scope(scope):
                    raise Forbidden(f"This API key lacks the '{scope}' scope.",
                                    code="insufficient_scope")
                # one of the org's in-flight slots, held until the response is sent or the
                # client goes (gateway/asgi.py runs the release; a stream holds it to its end)
                slot = await concurrency.aacquire(
                    org_id=principal.org_id, request_id=request_id,
                    limit=concurrency.limit_of(principal.max_concurrent_requests))
                request.on_close(partial(concurrency.arelease, slot))
                # only now, with the caller known, is its body read (under its route's limit)
                await request.aread_body()
                response = await view(request, principal, request_id, *args, **kwargs)
            except DomainError as exc:
                response = error(exc, request_id)
                if exc.status == 429 and principal is not None:  # the console's 429s by reason
                    await refusals.arecord(org_id=principal.org_id,
                                           reason=getattr(exc, "reason", "") or exc.code)
            if principal is not None and "x-ratelimit-limit-requests" not in response:
                # Not admitted (model lists, errors, refusals before admission): report the
                # key's state as it is, like OpenAI does on every response.
                for name, value in (await services.rate_headers_now(principal)).items():
                    response.setdefault(name, value)
            return response

        return wrapper

    return decorator


async def _authenticate(request: HttpRequest, key_header: str | None = None) -> KeyPrincipal:
    # META, not request.headers: that builds a mapping of every header on first use, a
    # cost on every /v1 request for the one or two read here
    header = request.META.get("HTTP_AUTHORIZATION", "")
    secret = header[7:].strip() if header.startswith("Bearer ") else ""
    if key_header is not None:
        secret = request.META.get(
            "HTTP_" + key_header.upper().replace("-", "_"), "").strip() or secret
    if not secret:
        raise Unauthenticated("You didn't provide an API key. Provide it in the "
                              "Authorization header as 'Bearer YOUR_KEY'"
                              + (f" or in the {key_header} header." if key_header else "."),
                              code="missing_api_key")
    # failures are counted per client address, and throttled (429) past a limit
    principal = await aapi_key_authenticate(secret,
                                            client_address=request.META.get("REMOTE_ADDR"))
    if principal is None:
        raise Unauthenticated("Incorrect, revoked or expired API key provided.",
                              code="invalid_api_key")
    return principal


def _json_body(request: HttpRequest) -> Any:
    try:
        return json_loads(request.body)
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequest("We could not parse the JSON body of your request. Send valid "
                             "JSON with Content-Type: application/json.") from None


async def _respond(request: GatewayRequest, served: services.Served) -> HttpResponse:
    if served.close is not None:  # run when the request ends, even if the stream never starts
        request.on_close(served.close)
    if served.stream is not None:
        response = StreamingHttpResponse(served.stream, content_type="text/event-stream")
        response["Cache-Control"] = "no-cache"
        response["X-Accel-Buffering"] = "no"
    else:
        response = JsonResponse(served.body)
    for name, value in served.headers.items():
        response[name] = value
    return response


def _inference(parse: Callable[[Any], InferenceRequest], doc: str) -> View:
    """Return the /v1 endpoint that validates its body with ``parse`` and serves it through
    the request pipeline, answering in OpenAI's shape."""

    @openai_endpoint()
    async def endpoint(request: GatewayRequest, principal: KeyPrincipal,
                       request_id: str) -> HttpResponse:
        req = parse(_json_body(request))
        return await _respond(request, await services.serve(principal=principal, req=req,
                                                            request_id=request_id))

    endpoint.__doc__ = doc
    return endpoint


chat_completions = _inference(parse_chat, "OpenAI's chat completions.")
completions = _inference(parse_completion, "OpenAI's legacy completions (a string prompt).")
embeddings = _inference(parse_embeddings, "OpenAI's embeddings, served by the fleet's "
                        "embedding pools (``--is-embedding``).")


@openai_endpoint(error=anthropic_error, key_header="x-api-key")
async def messages(request: GatewayRequest, principal: KeyPrincipal,
                   request_id: str) -> HttpResponse:
    """Anthropic's Messages API (``gateway/anthropic.py``)."""
    body = _json_body(request)
    req = parse_messages(body)
    surface = MessagesSurface(stops=body.get("stop_sequences") or [])
    return await _respond(request, await services.serve(principal=principal, req=req,
                                                        request_id=request_id,
                                                        surface=surface))


@openai_endpoint(error=anthropic_error, key_header="x-api-key")
async def messages_count_tokens(request: GatewayRequest, principal: KeyPrincipal,
                                request_id: str) -> HttpResponse:
    """Anthropic's ``count_tokens``: the prompt a Messages body would send, counted by an
    engine of its model; free (no usage event), as Anthropic's is."""
    req = parse_count_tokens(_json_body(request))
    count = await services.count_prompt_tokens(principal=principal, req=req)
    response = JsonResponse({"input_tokens": count})
    response["request-id"] = response["x-request-id"] = request_id
    return response


@openai_endpoint()
async def responses(request: GatewayRequest, principal: KeyPrincipal,
                    request_id: str) -> HttpResponse:
    """OpenAI's Responses API (``gateway/responses.py``): the conversation a
    ``previous_response_id`` continues is rebuilt from the organization's stored responses."""
    parsed = parse_responses(_json_body(request))
    history: list[dict[str, str]] = []
    previous_pk: int | None = None
    if parsed.previous_response_id is not None:
        try:
            chain = await in_thread(response_store.stored_response_chain)(
                org_id=principal.org_id, public_id=parsed.previous_response_id)
        except DatabaseError as exc:
            raise unavailable(exc) from exc
        history, previous_pk = chain.messages, chain.head_pk
    req = inference_request(parsed, history)
    surface = ResponsesSurface(parsed, principal=principal, request_id=request_id,
                               previous_pk=previous_pk)
    served = await services.serve(principal=principal, req=req, request_id=request_id,
                                  surface=surface)
    if served.body is not None:  # a stream stores its answer as it ends
        await surface.persist()
    return await _respond(request, served)


@openai_endpoint(methods=("GET", "DELETE"))
async def response_detail(request: HttpRequest, principal: KeyPrincipal, request_id: str,
                          response_id: str) -> HttpResponse:
    """``GET`` (the Response as it was answered) or ``DELETE`` one of the organization's
    stored responses; another organization's id is not found, like one that never was."""
    try:
        if request.method == "DELETE":
            await in_thread(response_store.stored_response_delete)(
                org_id=principal.org_id, public_id=response_id)
            body = {"id": response_id, "object": "response", "deleted": True}
        else:
            stored = await in_thread(response_store.stored_response_get)(
                org_id=principal.org_id, public_id=response_id)
            body = stored.body
    except DatabaseError as exc:
        raise unavailable(exc) from exc
    response = JsonResponse(body)
    response["x-request-id"] = request_id
    return response


@openai_endpoint(methods=("GET",))
async def response_input_items(request: HttpRequest, principal: KeyPrincipal,
                               request_id: str, response_id: str) -> HttpResponse:
    """The input items of one of the organization's stored responses, as OpenAI pages them
    (``limit`` 1-100, default 20; ``order`` desc by default; ``after`` an item id)."""
    limit_text, order = request.GET.get("limit", "20"), request.GET.get("order", "desc")
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
        raise InvalidRequest("Invalid 'limit': expected an integer from 1 to 100.",
                             param="limit")
    if order not in ("asc", "desc"):
        raise InvalidRequest("Invalid 'order': expected 'asc' or 'desc'.", param="order")
    try:
        stored = await in_thread(response_store.stored_response_get)(
            org_id=principal.org_id, public_id=response_id)
    except DatabaseError as exc:
        raise unavailable(exc) from exc
    items = response_store.input_item_objects(stored)
    if order == "desc":
        items.reverse()
    after = request.GET.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise InvalidRequest(f"Invalid 'after': no input item '{after}' in this "
                                 "response.", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:int(limit_text)]
    response = JsonResponse({"object": "list", "data": page,
                             "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None,
                             "has_more": len(items) > len(page)})
    response["x-request-id"] = request_id
    return response


def _model_object(model: services.OfferedModel) -> dict[str, Any]:
    return {"id": model.id, "object": "model", "created": int(model.created.timestamp()),
            "owned_by": "tollgate", "endpoints": list(model.endpoints)}


@openai_endpoint(methods=("GET",))
async def models(request: HttpRequest, principal: KeyPrincipal,
                 request_id: str) -> HttpResponse:
    offered = await services.models_for(principal)
    response = JsonResponse({"object": "list", "data": [_model_object(m) for m in offered]})
    response["x-request-id"] = request_id
    return response


@openai_endpoint(methods=("GET",))
async def model_detail(request: HttpRequest, principal: KeyPrincipal, request_id: str,
                       model_id: str) -> HttpResponse:
    offered = {m.id: m for m in await services.models_for(principal)}
    if model_id not in offered:
        raise pipeline.model_not_found(model_id)
    response = JsonResponse(_model_object(offered[model_id]))
    response["x-request-id"] = request_id
    return response
