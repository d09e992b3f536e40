"""Serve one /v1 inference request: resolve the model in the caller's zone, forward it through
the engine adapter, relay the answer in OpenAI's shape, and meter the engine's usage durably
before the response ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.db import DatabaseError
from redis.exceptions import RedisError

from billing_platform.accounts.selectors import KeyPrincipal
from billing_platform.gateway.errors import GatewayError
from billing_platform.gateway.validation import InferenceRequest
from engine_adapter.client import EngineCall
from engine_adapter.registry import get_fleet
from engine_adapter.types import CallResult, EngineError, EngineInfo, NoCapacity
from plans import admission as quota

# SGLang with --enable-priority-scheduling runs larger priority values first.
ENGINE_PRIORITY = {"priority": 10, "default": 0, "flex": -10}
# Priority is downgraded when every engine queues this many batches' worth of requests.
SATURATION_QUEUE_FACTOR = settings.GATEWAY_SATURATION_QUEUE_FACTOR
# Seconds a client waits before retrying a request no engine in its regions could take.
NO_CAPACITY_RETRY_S = "5"
log = logging.getLogger(__name__)
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


@dataclass
class Served:
    """What the view needs to answer: a JSON body or an SSE stream, plus headers."""

    headers: dict[str, str]
    body: dict[str, Any] | None = None
    stream: AsyncIterator[bytes] | None = None


def model_not_found(model: str) -> GatewayError:
    """Return the one answer for a model this caller cannot use, whatever the reason.

    A model that does not exist, one the key may not use and one that is offered only in
    other data zones or regions get the same words: the answer says nothing about where else
    a model runs.
    """
    return GatewayError(404, f"The model '{model}' does not exist or you do not have access "
                             "to it.", code="model_not_found", param="model")


async def allowed_regions_for(principal: KeyPrincipal, model: str) -> set[str] | None:
    """Return the regions this caller's request for ``model`` may run in, or raise 404."""
    return (await model_access(principal, model))[0]


async def model_access(principal: KeyPrincipal, model: str
                       ) -> tuple[set[str] | None, quota.QuotaPolicy]:
    """Return the regions of the caller's zone and its quota policy for ``model``, or raise.

    404 for a model that does not exist, that the key may not use, that is offered only in
    other zones (all three in the same words), or that has no price in force. A model offered
    in the caller's zone whose engines are all down is not refused here: the engine call
    answers a retryable 503, and nothing runs outside the zone.

    Nothing is served that cannot be billed: rating needs a price for every event (on demand,
    token plan and provisioned alike), so an unpriced model's events would be dead-lettered
    and its worst case would reserve nothing. A price of zero is a price. The policy is the
    cached one (``quota.apolicy``): this adds no query to a request.
    """
    fleet = get_fleet()
    await fleet.arefresh_if_stale()
    served = fleet.router.regions_of(model)
    if not served or not principal.may_use_model(model):
        raise model_not_found(model)
    zone = fleet.regions_in_zone(principal.data_zone)
    if zone is not None and not served & zone:
        raise model_not_found(model)
    policy = await quota.apolicy(org_id=principal.org_id, project_id=principal.project_id,
                                 key_id=principal.key_id, model=model)
    if policy.pricing is None:
        raise GatewayError(404, f"The model '{model}' has no price in force for your "
                                "organization, so it cannot be served.",
                           code="model_not_found", param="model")
    return zone, policy


async def models_for(principal: KeyPrincipal) -> list[str]:
    """Return the models this key may use in its organization's data zone."""
    fleet = get_fleet()
    await fleet.arefresh_if_stale()
    zone = fleet.regions_in_zone(principal.data_zone)
    return sorted(m for m in fleet.router.models()
                  if principal.may_use_model(m)
                  and (zone is None or fleet.router.regions_of(m) & zone))


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
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def _object_id(kind: str, request_id: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request_id}"


def openai_body(call: EngineCall, *, kind: str, request_id: str, tier: str) -> dict[str, Any]:
    """Return a finished non-streaming engine answer in OpenAI's shape (our id, tier, usage)."""
    body = call.body or {}
    body.update(id=_object_id(kind, request_id), service_tier=tier,
                usage=openai_usage(call.result))
    body.pop("metadata", None)
    return body


def usage_event(*, principal: KeyPrincipal, request_id: str, model: str, tier: str,
                engine: EngineInfo | None, result: CallResult | None, started: datetime,
                capacity: str = "on_demand") -> dict[str, Any]:
    """Build the usage event of one request from the ENGINE's counts.

    ``result`` None means the engine failed before any output: an unbilled ``engine_error``.
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
        "queue_ms": round(result.queue_ms) if result else None,
        "ttft_ms": round(result.ttft_ms) if result and result.ttft_ms is not None else None,
        "total_ms": round(result.total_ms) if result else None,
        "status": result.status if result else "engine_error",
        "cost_to_serve": str(result.cost_to_serve) if result else "0",
        "event_time": started.isoformat(),
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

    def _event(self, engine: EngineInfo | None, result: CallResult | None) -> dict[str, Any]:
        return usage_event(principal=self.principal, request_id=self.request_id,
                           model=self.model, tier=self.tier, engine=engine, result=result,
                           started=self.started, capacity=self.capacity)

    async def failed_before_output(self, engine: EngineInfo | None) -> None:
        """Record an unbilled engine_error event and release the admission."""
        await self._record(engine, None)

    async def close(self, call: EngineCall) -> None:
        """End the engine call, record its usage durably, settle the admission."""
        try:
            await call.__aexit__(None, None, None)
        except BaseException:
            await _settle(self.ticket, call.result)
            raise
        await self._record(call.tried[-1], call.result)

    async def _record(self, engine: EngineInfo | None, result: CallResult | None) -> None:
        """Append the usage event and settle the admission, side by side.

        Two independent round trips (the usage stream, the quota counters), so neither waits
        for the other; both always run, and an append that failed still raises afterwards.
        """
        outcomes = await asyncio.gather(_append(self._event(engine, result)),
                                        _settle(self.ticket, result), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome


async def serve(*, principal: KeyPrincipal, req: InferenceRequest,
                request_id: str) -> Served:
    """Run one inference request; raise GatewayError for answers that are errors."""
    started = datetime.now(tz=UTC)
    allowed, policy = await model_access(principal, req.model)
    allowed = _narrow(allowed, policy, req.model)
    tier = _serving_tier(req, allowed)
    ticket = await _admit(principal, req, policy, tier=tier, request_id=request_id,
                          allowed=allowed)
    if ticket is not None and ticket.capacity == "provisioned" and policy.provisioned:
        allowed = {policy.provisioned.region}
    rate_headers = ticket.headers if ticket is not None else {}
    accounting = _Accounting(principal=principal, request_id=request_id, model=req.model,
                             tier=tier, started=started, ticket=ticket,
                             capacity=ticket.capacity if ticket is not None else "on_demand")
    fleet = get_fleet()
    call = fleet.client.call(
        model=req.model, path=PATHS[req.kind], body=req.engine_body,
        namespace=principal.org_public_id, prompt_text=req.prompt_text,
        allowed_regions=allowed, priority=ENGINE_PRIORITY[tier], request_id=request_id,
    )
    try:
        await call.__aenter__()
    except NoCapacity as exc:
        # Offered here, but no engine of it is up in the allowed regions: retry, never
        # served elsewhere.
        await _settle(ticket, None)
        raise _with_headers(GatewayError.from_engine(exc),
                            {"retry-after": NO_CAPACITY_RETRY_S, **rate_headers}) from exc
    except EngineError as exc:
        await accounting.failed_before_output(call.tried[-1] if call.tried else None)
        raise _with_headers(GatewayError.from_engine(exc), rate_headers) from exc
    except BaseException:
        await _settle(ticket, None)
        raise
    engine = call.tried[-1]
    headers = {"x-request-id": request_id, "x-tollgate-region": engine.region,
               "openai-model": req.model, **rate_headers}
    object_id = _object_id(req.kind, request_id[4:])
    if req.stream:
        return Served(headers=headers, stream=_relay(call, req=req, tier=tier,
                                                     object_id=object_id,
                                                     accounting=accounting))
    await accounting.close(call)
    return Served(headers=headers, body=openai_body(call, kind=req.kind,
                                                    request_id=request_id[4:], tier=tier))


def _with_headers(exc: GatewayError, headers: dict[str, str]) -> GatewayError:
    exc.headers.update(headers)
    return exc


def _narrow(allowed: set[str] | None, policy: quota.QuotaPolicy, model: str
            ) -> set[str] | None:
    """Intersect the zone's regions with the key's/project's narrowing (404 if none serve)."""
    if policy.allowed_regions is None:
        return allowed
    narrowed = set(policy.allowed_regions) if allowed is None else (
        allowed & policy.allowed_regions)
    if not get_fleet().router.regions_of(model) & narrowed:
        raise model_not_found(model)
    return narrowed


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
        raise GatewayError(429, "Flex processing has no spare capacity right now; retry "
                                "later or use service_tier 'default'.",
                           code="resource_unavailable", headers={"retry-after": "5"})
    if tier == "priority" and saturated:
        return "default"  # downgraded: billed and reported as default
    return tier


async def _admit(principal: KeyPrincipal, req: InferenceRequest, policy: quota.QuotaPolicy,
                 *, tier: str, request_id: str, allowed: set[str] | None
                 ) -> quota.Ticket | None:
    if policy.provisioned is not None and allowed is not None and (
            policy.provisioned.region not in allowed):
        policy = replace(policy, provisioned=None)
    try:
        return await quota.aadmit(
            policy, request_id=request_id, tier=tier, zone=principal.data_zone,
            prompt_tokens=req.prompt_bound, max_output=req.max_output)
    except quota.QuotaExceeded as exc:
        raise GatewayError(429, exc.message, code=exc.code, headers=exc.headers) from exc
    except RedisError as exc:
        if any(b.hard for b in policy.budgets):
            raise GatewayError(503, "Quota enforcement is unavailable, and this organization "
                                    "has a hard budget; retry shortly.",
                               code="quota_unavailable", headers={"retry-after": "1"}) from exc
        log.warning("admission skipped for %s: Redis unavailable (%r)", request_id, exc)
        return None


async def _settle(ticket: quota.Ticket | None, result: CallResult | None) -> None:
    if ticket is None or ticket.settled:
        return
    try:
        await asyncio.shield(quota.asettle(
            ticket, prompt_tokens=result.prompt_tokens if result else 0,
            cached_tokens=result.cached_tokens if result else 0,
            completion_tokens=result.completion_tokens if result else 0))
    except RedisError as exc:
        # The reservation expires on its own; the sweep raises spend to PostgreSQL's.
        log.warning("settlement of %s failed: %r", ticket.request_id, exc)


def _sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def _relay(call: EngineCall, *, req: InferenceRequest, tier: str, object_id: str,
                 accounting: _Accounting) -> AsyncIterator[bytes]:
    """Relay engine chunks in OpenAI's shape; meter before [DONE]; meter on disconnect too."""
    closing: asyncio.Future[None] | None = None

    def meter() -> asyncio.Future[None]:
        # One task, awaited shielded: a disconnect while it runs (the engine connection is
        # being drained, the event appended) cannot cut it short; the finally waits for it.
        nonlocal closing
        if closing is None:
            closing = asyncio.ensure_future(accounting.close(call))
        return closing

    error_frame = None
    t0 = time.monotonic()
    try:
        try:
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
        except EngineError as exc:
            error_frame = _sse({"error": {"message": f"{exc} (after "
                                          f"{time.monotonic() - t0:.1f}s of streaming)",
                                          "type": "server_error", "param": None,
                                          "code": exc.code}})
        await asyncio.shield(meter())
        if error_frame is not None:
            yield error_frame
        yield _sse("[DONE]")
    finally:
        # Client disconnect (generator closed or task cancelled): record what was delivered,
        # or finish recording it if the disconnect came while that ran.
        if closing is None or not closing.done():
            await asyncio.shield(meter())
