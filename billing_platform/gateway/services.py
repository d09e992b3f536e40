"""Serve one /v1 inference request: place, admit and forward it through the request pipeline
(``pipeline.py``, shared with the batch runner), relay the answer in OpenAI's shape, and meter
the engine's usage durably before the response ends.

Errors are domain errors (``billing_platform.errors``); ``gateway/errors.py`` answers them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
from django.conf import settings
from django.db import DatabaseError
from redis.exceptions import RedisError

from billing_platform.accounts.selectors import KeyPrincipal
from billing_platform.errors import RateLimited
from billing_platform.gateway import capacity, pipeline
from billing_platform.gateway.db_connections import in_thread
from billing_platform.gateway.ttft_signal import note as ttft_note
from billing_platform.gateway.validation import InferenceRequest
from engine_adapter.client import EngineCall
from engine_adapter.registry import get_fleet
from engine_adapter.types import CallResult, EngineError, EngineInfo, NoCapacity
from plans import admission as quota
from plans import selectors as plan_selectors

# Priority is downgraded when every engine queues this many batches' worth of requests.
SATURATION_QUEUE_FACTOR = settings.GATEWAY_SATURATION_QUEUE_FACTOR
# Seconds a client waits before retrying a request no engine in its regions could take.
NO_CAPACITY_RETRY_S = "5"
log = logging.getLogger(__name__)


@dataclass
class Served:
    """What the view needs to answer: a JSON body or an SSE stream, plus headers.

    ``close`` (a stream's) ends the engine call and meters it, once, whether the stream ran to
    its end, was cut short or never started: the route awaits it when the request ends, since
    a client that goes before the first chunk is sent leaves the stream's generator unstarted
    (so its own ``finally`` never runs) and the engine slot and in-flight count would leak.
    """

    headers: dict[str, str]
    body: dict[str, Any] | None = None
    stream: AsyncIterator[bytes] | None = None
    close: Callable[[], Awaitable[None]] | None = None


# What a generating model answers (the Batch API runs its chat, completion and Responses
# lines), and what an embedding model does.
MODEL_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                   "/v1/batches")
EMBEDDING_ENDPOINTS = ("/v1/embeddings", "/v1/batches")


@dataclass(frozen=True)
class OfferedModel:
    """A model a key may call: its id, when its organization's price book first priced it,
    and the endpoints that serve it."""

    id: str
    created: datetime
    endpoints: tuple[str, ...] = MODEL_ENDPOINTS


_FIRST_PRICED: dict[frozenset[tuple[int, str]], tuple[float, dict[str, datetime]]] = {}
FIRST_PRICED_TTL_S = 300.0  # a price book's history changes only when a version is added


async def _first_priced(pairs: list[tuple[int, str]]) -> dict[str, datetime]:
    """``plans.selectors.models_first_priced``, kept a few minutes per process (SDKs list
    models at start-up; this keeps /v1/models off PostgreSQL)."""
    key, now = frozenset(pairs), time.monotonic()
    hit = _FIRST_PRICED.get(key)
    if hit is not None and hit[0] > now:
        return hit[1]
    value = await in_thread(plan_selectors.models_first_priced)(version_models=pairs)
    if len(_FIRST_PRICED) >= 1024:
        _FIRST_PRICED.clear()
    _FIRST_PRICED[key] = (now + FIRST_PRICED_TTL_S, value)
    return value


async def models_for(principal: KeyPrincipal) -> list[OfferedModel]:
    """Return the models this key may use in its organization's data zone, as
    ``placement_resolve`` would serve them: a model with no price in force for the
    organization is not offered (a request for it would be refused)."""
    fleet = get_fleet()
    await fleet.arefresh_if_stale()
    zone = fleet.regions_in_zone(principal.data_zone)
    names = sorted(m for m in fleet.router.models()
                   if principal.may_use_model(m)
                   and (zone is None or fleet.router.regions_of(m) & zone))
    priced = []
    for model in names:  # the cached policies: no query per model
        policy = await quota.apolicy(org_id=principal.org_id, project_id=principal.project_id,
                                     key_id=principal.key_id, model=model)
        if policy.pricing is not None:
            priced.append((policy.pricing.version_id, model))
    first = await _first_priced(priced)
    never = datetime.fromtimestamp(0, UTC)  # (a priced model always has a first price)
    return [OfferedModel(model, first.get(model, never),
                         EMBEDDING_ENDPOINTS if fleet.router.traits(model).embedding
                         else MODEL_ENDPOINTS) for _, model in priced]


async def rate_headers_now(principal: KeyPrincipal) -> dict[str, str]:
    """Return the key's ``x-ratelimit-*`` headers without consuming anything ({} if unknown)."""
    try:
        return await quota.apeek_headers(org_id=principal.org_id,
                                         project_id=principal.project_id,
                                         key_id=principal.key_id)
    except (RedisError, DatabaseError) as exc:
        # Informational headers: an answer that is otherwise complete still goes out.
        log.warning("rate-limit headers skipped: %r", exc)
        return {}


def openai_usage(result: CallResult) -> dict[str, Any]:
    """Return OpenAI's usage object from the engine's counts: the prompt once, the choices'
    completions summed (reasoning included, and its share as the engine counted it)."""
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": result.reasoning_tokens},
    }


def _object_id(kind: str, request_id: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request_id}"


def embeddings_body(call: EngineCall, *, model: str) -> dict[str, Any]:
    """Return an engine's embeddings answer in OpenAI's shape: the vectors as the engine
    encoded them (floats or base64), the model as the caller named it (SGLang names its
    path), and the usage from the engine's count."""
    result = call.result
    prompt = result.prompt_tokens if result else 0
    return {"object": "list", "data": (call.body or {}).get("data", []), "model": model,
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt}}


def openai_body(call: EngineCall, *, kind: str, request_id: str, tier: str,
                model: str) -> dict[str, Any]:
    """Return a finished non-streaming engine answer in OpenAI's shape (our id, tier, usage)."""
    if kind == "embedding":
        return embeddings_body(call, model=model)
    body = call.body or {}
    body.update(id=_object_id(kind, request_id), service_tier=tier,
                usage=openai_usage(call.result))
    body.pop("metadata", None)
    return body


class Surface:
    """How one API surface words an engine's answer; ``serve`` and its relay do the rest
    (admission, metering, settlement), the same for every surface.

    This one is OpenAI's (chat and legacy completions); ``gateway/anthropic.py`` words the
    same answers as Anthropic's Messages API. A surface may keep state for one request (the
    stop reason its last frames name), so ``serve`` gets a fresh one per request.
    """

    def object_id(self, req: InferenceRequest, request_id: str) -> str:
        return _object_id(req.kind, request_id)

    def body(self, call: EngineCall, req: InferenceRequest, request_id: str, tier: str
             ) -> dict[str, Any]:
        """A finished (non-streaming) answer."""
        return openai_body(call, kind=req.kind, request_id=request_id, tier=tier,
                           model=req.model)

    async def frames(self, call: EngineCall, req: InferenceRequest, tier: str,
                     object_id: str) -> AsyncIterator[bytes]:
        """The stream's frames as the engine's chunks come (``EngineError`` may interrupt)."""
        async for chunk in call.chunks():
            chunk["id"] = object_id
            chunk["service_tier"] = tier
            if not chunk.get("choices"):
                if req.include_usage and chunk.get("usage"):
                    chunk["usage"] = openai_usage(call.result)
                    yield _sse(chunk)
                continue
            if req.include_usage:
                chunk["usage"] = None
            else:
                chunk.pop("usage", None)
            yield _sse(chunk)

    def error_frame(self, exc: EngineError, seconds: float) -> bytes:
        """The frame that tells the client the engine failed mid-stream."""
        return _sse({"error": {"message": f"{exc} (after {seconds:.1f}s of streaming)",
                               "type": "server_error", "param": None, "code": exc.code}})

    def end_frames(self, call: EngineCall, req: InferenceRequest, *, failed: bool
                   ) -> list[bytes]:
        """What follows the last chunk once the request is metered."""
        return [_sse("[DONE]")]

    async def persist(self) -> None:
        """Keep the finished answer where the surface lets it be read back (the Responses
        API's stored responses); nothing for the others."""


def usage_event(*, principal: KeyPrincipal, request_id: str, model: str, tier: str,
                engine: EngineInfo | None, result: CallResult | None, started: datetime,
                capacity: str = "on_demand", user: str | None = None) -> dict[str, Any]:
    """Build the usage event of one request from the ENGINE's counts.

    ``result`` None means the engine failed before any output: an unbilled ``engine_error``.
    Its cost-to-serve is attributed afterwards from the engine's GPU time (``metering.costs``).
    """
    return {
        "request_id": request_id,
        "org_id": principal.org_id,
        "project_id": principal.project_id,
        "api_key_id": principal.key_id,
        "model": model,
        "region": engine.region if engine else "",
        "data_zone": principal.data_zone,
        "engine": engine.engine_id if engine else "",
        "service_tier": tier,
        "capacity_source": capacity,
        "prompt_tokens": result.prompt_tokens if result else 0,
        "cached_tokens": result.cached_tokens if result else 0,
        "completion_tokens": result.completion_tokens if result else 0,
        "reasoning_tokens": result.reasoning_tokens if result else 0,
        "queue_ms": round(result.queue_ms) if result else None,
        "ttft_ms": round(result.ttft_ms) if result and result.ttft_ms is not None else None,
        "total_ms": round(result.total_ms) if result else None,
        "status": result.status if result else "engine_error",
        "event_time": started.isoformat(),
        "end_user": user,
    }


async def _append(event: dict[str, Any]) -> None:
    from metering.services import ausage_event_append

    # Shielded: a client that disconnects must not cancel the durable append.
    await asyncio.shield(ausage_event_append(event))


@dataclass
class _Accounting:
    """What metering and settlement need to know about one admitted request."""

    principal: KeyPrincipal
    request_id: str
    model: str
    tier: str
    started: datetime
    capacity: str
    ticket: quota.Ticket | None
    user: str | None = None
    began: float = 0.0  # monotonic: when the gateway took the request up, and sent it on
    sent: float = 0.0
    _closing: asyncio.Future[None] | None = None

    def finish(self, call: EngineCall) -> asyncio.Future[None]:
        """Close the engine call and meter it, once: every caller gets the same task, so a
        disconnect while it runs (the engine connection drained, the event appended) cannot
        cut it short, and a second caller waits for the first one's."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self.close(call))
        return self._closing

    def _event(self, engine: EngineInfo | None, result: CallResult | None) -> dict[str, Any]:
        return usage_event(principal=self.principal, request_id=self.request_id,
                           model=self.model, tier=self.tier, engine=engine, result=result,
                           started=self.started, capacity=self.capacity, user=self.user)

    async def failed_before_output(self, engine: EngineInfo | None) -> None:
        """Record an unbilled engine_error event and release the admission."""
        await self._record(engine, None)

    async def close(self, call: EngineCall) -> None:
        """End the engine call, record its usage durably, settle the admission."""
        try:
            await call.__aexit__(None, None, None)
        except BaseException:
            await pipeline.request_settle(self.ticket, call.result)
            raise
        await self._record(call.tried[-1], call.result)

    async def _record(self, engine: EngineInfo | None, result: CallResult | None) -> None:
        """Append the usage event and settle the admission, side by side.

        Two independent round trips (the usage stream, the quota counters), so neither waits
        for the other; both always run, and an append that failed still raises afterwards.
        An interactive request's TTFT, from the gateway taking it up (its placement, admission
        and routing waited on a busy host too) to its first token, also goes to the batch
        guard's signal (no round trip).
        """
        if result is not None and result.ttft_ms is not None and result.status == "ok" and (
                self.tier != "batch"):
            ttft_note(self.model, result.ttft_ms + max(0.0, self.sent - self.began) * 1000)
        outcomes = await asyncio.gather(_append(self._event(engine, result)),
                                        pipeline.request_settle(self.ticket, result),
                                        return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome


async def serve(*, principal: KeyPrincipal, req: InferenceRequest, request_id: str,
                surface: Surface | None = None) -> Served:
    """Run one inference request; raise a domain error for answers that are errors.
    ``surface`` words the answer (OpenAI's when None)."""
    surface = surface or Surface()
    began, started = time.monotonic(), datetime.now(tz=UTC)
    placement = await pipeline.placement_resolve(principal=principal, model=req.model,
                                                 kind=req.kind)
    pipeline.request_check(req, get_fleet().router)
    tier = _serving_tier(req, placement.regions)
    ticket = await pipeline.request_admit(
        pipeline.admission_policy(placement.policy, tier=tier, regions=placement.regions),
        principal=principal, req=req, tier=tier, request_id=request_id)
    rate_headers = ticket.headers if ticket is not None else {}
    accounting = _Accounting(principal=principal, request_id=request_id, model=req.model,
                             tier=tier, started=started, ticket=ticket,
                             capacity=ticket.capacity if ticket is not None else "on_demand",
                             user=req.user, began=began)
    call = pipeline.engine_call(get_fleet().client, principal=principal, req=req,
                                regions=pipeline.engine_regions(placement, ticket), tier=tier,
                                request_id=request_id, ticket=ticket)
    try:
        # inside the try: a request cancelled here still gives its admission back
        reserved = await capacity.areserved()
        await get_fleet().aroute_lookup(namespace=principal.org_public_id,
                                        prompt_text=req.prompt_text)
        if call.priority < capacity.PROVISIONED_PRIORITY:  # no await from here to routing
            call.allowed_regions = capacity.on_demand_regions(
                get_fleet(), model=req.model, regions=call.allowed_regions, reserved=reserved)
        accounting.sent = time.monotonic()
        await call.__aenter__()
    except NoCapacity as exc:
        # Offered here, but no engine of it is up in the allowed regions: retry, never
        # served elsewhere.
        await pipeline.request_settle(ticket, None)
        raise pipeline.engine_failure(exc, req=req, headers={
            "retry-after": NO_CAPACITY_RETRY_S, **rate_headers}) from exc
    except EngineError as exc:
        await accounting.failed_before_output(call.tried[-1] if call.tried else None)
        raise pipeline.engine_failure(exc, req=req, headers=dict(rate_headers)) from exc
    except BaseException:  # RateLimited (no on-demand share left) too: never ran, not billed
        await pipeline.request_settle(ticket, None)
        raise
    engine = call.tried[-1]
    headers = {"x-request-id": request_id, "x-tollgate-region": engine.region,
               "openai-model": req.model, **rate_headers}
    object_id = surface.object_id(req, request_id[4:])
    if req.stream:
        async def close() -> None:
            await asyncio.shield(accounting.finish(call))

        return Served(headers=headers, close=close,
                      stream=_relay(call, req=req, tier=tier, object_id=object_id,
                                    accounting=accounting, surface=surface))
    await accounting.close(call)
    return Served(headers=headers, body=surface.body(call, req, request_id[4:], tier))


async def count_prompt_tokens(*, principal: KeyPrincipal, req: InferenceRequest) -> int:
    """Return how many tokens ``req``'s prompt is, as an engine of its model counts it (its
    tokenizer and chat template, SGLang's ``/v1/tokenize``).

    Placed as a request is (the key's models, its data zone and residency: the prompt goes to
    an engine, so only where the request itself could run), never admitted or metered: like
    Anthropic's ``count_tokens``, counting is free, and it is bounded by the organization's
    in-flight slots and the body limit as every /v1 call is.
    """
    placement = await pipeline.placement_resolve(principal=principal, model=req.model,
                                                 kind=req.kind)
    call = get_fleet().client.call(
        model=req.model, path=pipeline.TOKENIZE_PATH,
        body={"messages": req.engine_body["messages"]}, namespace=principal.org_public_id,
        prompt_text=req.prompt_text, allowed_regions=placement.regions)
    try:
        async with call:
            count = (call.body or {}).get("count")
    except NoCapacity as exc:
        raise pipeline.engine_failure(exc, req=req,
                                      headers={"retry-after": NO_CAPACITY_RETRY_S}) from exc
    except EngineError as exc:
        raise pipeline.engine_failure(exc, req=req) from exc
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise pipeline.engine_failure(EngineError(
            f"the engine answered no token count: {str(call.body)[:200]}"), req=req)
    return count


def pool_state(model: str, allowed: set[str] | None) -> tuple[bool, bool]:
    """Return (spare, saturated) for ``model``'s healthy engines in ``allowed``.

    From each engine's last scraped load. Spare: some engine queues nothing and runs fewer
    than its maximum. Saturated: every engine's queue is at least SATURATION_QUEUE_FACTOR
    times its batch (a priority request would wait behind that much work anyway).
    """
    router = get_fleet().router
    try:
        engines = router.candidates(model, allowed)
    except EngineError:
        return True, False  # no engine: the call itself answers 503
    spare, saturated = False, True
    for e in engines:
        load = router.scraped_load(e.engine_id)
        if load is None:
            return True, False
        if load.spare_room() > 0:
            spare = True
        if not load.saturated(queue_factor=SATURATION_QUEUE_FACTOR):
            saturated = False
    return spare, saturated


def _serving_tier(req: InferenceRequest, allowed: set[str] | None) -> str:
    tier = "default" if req.service_tier == "auto" else req.service_tier
    if tier not in ("priority", "flex"):
        return tier
    spare, saturated = pool_state(req.model, allowed)
    if tier == "flex" and not spare:
        raise RateLimited("Flex processing has no spare capacity right now; retry later or "
                          "use service_tier 'default'.", code="resource_unavailable",
                          headers={"retry-after": "5"})
    if tier == "priority" and saturated:
        return "default"  # downgraded: billed and reported as default
    return tier


def _sse(obj: dict[str, Any] | str) -> bytes:
    """One server-sent event; a frame per token, so orjson (a tenth of json.dumps' time)."""
    if isinstance(obj, str):
        return f"data: {obj}\n\n".encode()
    return b"data: " + orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS) + b"\n\n"


async def _relay(call: EngineCall, *, req: InferenceRequest, tier: str, object_id: str,
                 accounting: _Accounting, surface: Surface) -> AsyncIterator[bytes]:
    """Relay engine chunks in the surface's shape; meter before its last frames; meter on
    disconnect too.

    Frames of chunks that arrived in one read from the engine go out as one write: a frame is
    held only while the engine's next chunk is already here (``EngineCall.chunk_ready``, no
    wait), so no token waits, and a stream costs fewer sends (and its client fewer reads).
    """
    error_frame = None
    held: list[bytes] = []
    t0 = time.monotonic()
    try:
        try:
            async for frame in surface.frames(call, req, tier, object_id):
                held.append(frame)
                if not call.chunk_ready:
                    yield held[0] if len(held) == 1 else b"".join(held)
                    held.clear()
        except EngineError as exc:
            error_frame = surface.error_frame(exc, time.monotonic() - t0)
        if held:
            yield b"".join(held)
            held.clear()
        await asyncio.shield(accounting.finish(call))
        if error_frame is not None:
            yield error_frame
        for frame in surface.end_frames(call, req, failed=error_frame is not None):
            yield frame
    finally:
        # Client disconnect (generator closed or task cancelled): record what was delivered,
        # or finish recording it if the disconnect came while that ran.
        closing = accounting.finish(call)
        if not closing.done():
            await asyncio.shield(closing)
