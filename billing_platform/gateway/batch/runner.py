"""Run a batch's lines through the fleet in the troughs.

One run is a time slice of one Celery task: it asks the engine adapter how much spare room the
model's engines have (``engine_adapter.selectors.spare_slots``, scraped live), leases that many
lines, sends them at the lowest SGLang priority, records the outcomes, and asks again. With no
spare room it sends nothing and waits; interactive traffic always has the engines first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime

from asgiref.sync import sync_to_async
from django.conf import settings

from billing_platform.accounts.selectors import KeyPrincipal
from billing_platform.gateway.batch import services as batch_services
from billing_platform.gateway.batch.services import ENDPOINTS, MAX_ATTEMPTS, LineOutcome
from billing_platform.gateway.errors import GatewayError
from billing_platform.gateway.models import Batch, BatchLine, BatchStatus, LineState
from billing_platform.gateway.services import (
    PATHS,
    allowed_regions_for,
    openai_usage,
    usage_event,
)
from engine_adapter.registry import Fleet
from engine_adapter.selectors import spare_slots
from engine_adapter.types import EngineBadRequest, EngineError, NoCapacity

log = logging.getLogger(__name__)

# SGLang runs larger priority values first; batch sits below flex (-10), the lowest of all.
BATCH_PRIORITY = -20
IDLE_WAIT_S = 0.2


async def _run_line(line: BatchLine, *, fleet: Fleet, batch: Batch, principal: KeyPrincipal,
                    regions: set[str] | None) -> LineOutcome:
    req = ENDPOINTS[batch.endpoint](line.body)
    started = datetime.now(tz=UTC)
    call = fleet.client.call(
        model=req.model, path=PATHS[req.kind], body=req.engine_body,
        namespace=principal.org_public_id, prompt_text=req.prompt_text,
        allowed_regions=regions, priority=BATCH_PRIORITY, request_id=line.request_id)
    try:
        async with call:
            pass
    except NoCapacity:
        return LineOutcome(line.id, retry=True)
    except EngineBadRequest as exc:
        error = {"message": str(exc), "type": "invalid_request_error", "param": None,
                 "code": exc.code}
        return LineOutcome(line.id, state=LineState.FAILED, status_code=400,
                           response={"error": error}, error={"code": exc.code,
                                                             "message": str(exc)})
    except EngineError as exc:
        if line.attempts < MAX_ATTEMPTS:
            return LineOutcome(line.id, retry=True)
        return LineOutcome(line.id, state=LineState.FAILED, status_code=exc.status,
                           response={"error": {"message": str(exc), "type": "server_error",
                                               "param": None, "code": exc.code}},
                           error={"code": exc.code, "message": str(exc)})
    result = call.result
    if result is None or result.status != "ok":
        if line.attempts < MAX_ATTEMPTS:
            return LineOutcome(line.id, retry=True)
        message = (result.error if result else None) or "the engine failed"
        return LineOutcome(line.id, state=LineState.FAILED, status_code=502,
                           error={"code": "engine_error", "message": message})
    body = call.body or {}
    kind = "chatcmpl" if req.kind == "chat" else "cmpl"
    body.update(id=f"{kind}-{line.request_id}", service_tier="batch",
                usage=openai_usage(result))
    body.pop("metadata", None)
    event = usage_event(principal=principal, request_id=line.request_id, model=req.model,
                        tier="batch", engine=call.tried[-1], result=result,
                        status=result.status, started=started)
    event["batch_id"] = batch.public_id
    return LineOutcome(line.id, status_code=200, response=body, usage=event)


async def _run(batch_id: int, *, slice_s: float) -> str:
    """Run lines until the slice ends or nothing is left; return why it stopped."""
    batch = await Batch.objects.filter(pk=batch_id).afirst()
    if batch is None or batch.status != BatchStatus.IN_PROGRESS:
        return "inactive"
    principal = KeyPrincipal.from_json(batch.principal)
    try:
        regions = await allowed_regions_for(principal, batch.model)
    except GatewayError:
        regions = set()  # the model left the caller's zone: nothing runs; expiry ends it
    # A fleet view of this slice's own: its HTTP pool belongs to this event loop.
    fleet = Fleet(salt_secret=settings.SECRET_KEY)
    await sync_to_async(fleet.refresh)()
    try:
        return await _slice(batch, fleet=fleet, principal=principal, regions=regions,
                            deadline=time.monotonic() + slice_s)
    finally:
        await fleet.client.aclose()


async def _slice(batch: Batch, *, fleet: Fleet, principal: KeyPrincipal,
                 regions: set[str] | None, deadline: float) -> str:
    batch_id = batch.pk
    heartbeat = sync_to_async(batch_services.batch_heartbeat)
    probe = sync_to_async(spare_slots)
    claim = sync_to_async(batch_services.batch_lines_claim)
    record = sync_to_async(batch_services.batch_lines_record)
    while time.monotonic() < deadline:
        if await heartbeat(batch_id=batch_id) != BatchStatus.IN_PROGRESS:
            return "stopped"
        slots = await probe(model=batch.model, regions=regions, live=True,
                            fraction=settings.BATCH_MAX_RUNNING_FRACTION)
        if slots <= 0:
            await asyncio.sleep(IDLE_WAIT_S)
            continue
        token, lines = await claim(batch_id=batch_id, limit=min(slots, settings.BATCH_CHUNK))
        if not lines:
            return "drained"
        await fleet.arefresh_if_stale()
        outcomes = await asyncio.gather(*(
            _run_line(line, fleet=fleet, batch=batch, principal=principal, regions=regions)
            for line in lines))
        await record(batch_id=batch_id, token=token, outcomes=list(outcomes))
    return "slice"


def batch_run(*, batch_id: int, slice_s: float | None = None) -> str:
    """Run one slice of a batch; finalize it when done. Return why the slice ended."""
    why = asyncio.run(_run(batch_id, slice_s=slice_s or settings.BATCH_SLICE_S))
    if why in ("drained", "stopped"):
        batch_services.batch_finalize_if_done(batch_id=batch_id)
    return why
