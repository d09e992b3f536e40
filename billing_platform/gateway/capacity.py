"""Provisioned capacity is real: each pool's reserved share is held back from on-demand traffic.

A reservation (``plans.models.Reservation``: N units of a model in a region, each unit T
normalized tokens per minute) used to be only a billing and rate bucket: its requests shared
the engines with on-demand traffic, so a pool saturated by others slowed a customer who paid
for guaranteed throughput. Two things make the promise hold (as Azure's PTU and Vertex's GSU
promise it):

- scheduling: a request admitted ``provisioned`` is sent at ``ENGINE_PRIORITY["provisioned"]``,
  above every other tier (``pipeline.engine_priority``), so it starts before anything queued;
- hold-back (here): SGLang does not preempt a running request for a queued one, so priority
  alone still makes a reserved request wait for a running slot to free. The pool's running
  slots (``max_running`` of its healthy engines, from their /get_server_info) less the
  reservations' share is all that on-demand traffic (on-demand, spillover, every tier below
  ``provisioned``) may hold in flight; past it an on-demand request is refused with a 429
  ``pool_at_capacity`` and a retry-after, never given a reserved slot. A region with room is
  still used: the request runs only where its share is not used up.

How many slots a reservation holds: a running request generates ``d`` tokens per second (the
reciprocal of its engine's measured mean time per output token; the health probe records it),
and a reservation's normalized tokens count output at its ``output_burndown`` R, so one slot
serves at least ``60 x R x d`` normalized tokens per minute (prompt tokens are prefilled far
faster than they count, so output is the slowest a slot can be used). A reservation of
``tpm`` normalized tokens per minute thus holds ``ceil(tpm / (60 x R x d))`` slots, at least
one, and all of the pool's at most. An engine that has not measured ``d`` yet is reckoned at
``TOLLGATE_PROVISIONED_SLOT_DECODE_TOKENS_PER_S``.

With no reservation on a pool nothing changes: on-demand requests queue at the engines as
before. The check and the routing of a request are one step of the event loop (no await
between ``on_demand_regions`` and the router's choice), so one process never lets two requests
through for one slot. Other gateway processes' requests count through the router's shared
loads (``engine_adapter.load_share``), all of them as on-demand, as does anything queued at
the engines: a pool with many processes holds back more rather than less.

Batch lines (``batch`` tier, the runner's own admission) are not refused here: they only fill
slots the engines report free, below every interactive request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from decimal import Decimal

from django.conf import settings
from django.db import DatabaseError

from billing_platform.errors import RateLimited
from billing_platform.gateway.db_connections import in_thread
from billing_platform.gateway.pipeline import ENGINE_PRIORITY
from engine_adapter.registry import Fleet
from engine_adapter.types import EngineError
from plans import selectors as plan_selectors

DEFAULT_MAX_RUNNING = 64  # an engine whose running cap is not known yet (as spare_room's)
RETRY_AFTER_S = "1"  # an on-demand slot frees when any request of the pool ends
PROVISIONED_PRIORITY = ENGINE_PRIORITY["provisioned"]
log = logging.getLogger(__name__)

# model -> region -> (normalized tokens per minute, output burndown) of each reservation
Shares = dict[str, dict[str, tuple[tuple[int, Decimal], ...]]]
_shares: tuple[float, Shares] = (0.0, {})
_loading: asyncio.Future[Shares] | None = None


async def areserved() -> Shares:
    """Return the reservations in force per model and region, read at most every
    ``TOLLGATE_PROVISIONED_SHARES_TTL_S`` (one read at a time; callers share it).

    PostgreSQL down: the last good read goes on being used (none: nothing is held back, as
    before reservations were enforced here), and the read is retried after a TTL; a request
    is not failed for want of this figure."""
    global _shares, _loading
    expires, shares = _shares
    if time.monotonic() < expires:
        return shares
    if _loading is None or _loading.done() or _loading.get_loop() is not (
            asyncio.get_running_loop()):
        _loading = asyncio.ensure_future(_load(shares))
    return await asyncio.shield(_loading)


async def _load(last: Shares) -> Shares:
    global _shares
    try:
        rows = await in_thread(plan_selectors.reserved_shares)()
    except DatabaseError as exc:
        log.warning("reserved capacity: reading the reservations failed (%r); holding back "
                    "what was last read", exc)
        _shares = (time.monotonic() + settings.PROVISIONED_SHARES_TTL_S, last)
        return last
    shares: Shares = {}
    for row in rows:
        shares.setdefault(row.model, {})[row.region] = row.reservations
    _shares = (time.monotonic() + settings.PROVISIONED_SHARES_TTL_S, shares)
    return shares


def held_slots(reservations: tuple[tuple[int, Decimal], ...], *, slots: int,
               decode_tokens_per_s: float) -> int:
    """Return how many of a pool's ``slots`` its reservations hold (see the module doc)."""
    held = 0
    for tpm, burndown in reservations:
        per_slot = 60 * decode_tokens_per_s * float(burndown)
        if per_slot <= 0:  # output that burns nothing down: the reservation may use it all
            return slots
        held += max(1, math.ceil(tpm / per_slot))
    return min(slots, held)


@dataclass(frozen=True)
class PoolShare:
    """One pool (a model in a region) with reservations: its running slots, those held for
    reservations, and the on-demand requests in flight on it."""

    region: str
    slots: int
    held: int
    on_demand: int

    @property
    def room(self) -> int:
        """Return how many more on-demand requests the pool takes now."""
        return self.slots - self.held - self.on_demand


def pool_shares(fleet: Fleet, model: str, reserved: Shares) -> list[PoolShare]:
    """Return the share of every pool of ``model`` that has reservations in force."""
    router, client = fleet.router, fleet.client
    out = []
    for region, reservations in sorted(reserved.get(model, {}).items()):
        try:
            engines = router.candidates(model, {region})
        except EngineError:
            continue  # nothing runs there now: the engine call answers for it
        slots = on_demand = 0
        decode = float("inf")
        for e in engines:
            load = router.scraped_load(e.engine_id)
            slots += (load.max_running if load and load.max_running else DEFAULT_MAX_RUNNING)
            decode = min(decode, (load.decode_tokens_per_s if load else None)
                         or settings.PROVISIONED_SLOT_DECODE_TOKENS_PER_S)
            # this process's below the reserved priority; the other processes' and the
            # engine's queue whatever they are (``router.load`` counts all three)
            on_demand += (client.inflight_below(e.engine_id, PROVISIONED_PRIORITY)
                          + router.load(e.engine_id) - router.inflight(e.engine_id))
        out.append(PoolShare(region=region, slots=slots, on_demand=on_demand,
                             held=held_slots(reservations, slots=slots,
                                             decode_tokens_per_s=decode)))
    return out


def on_demand_regions(fleet: Fleet, *, model: str, regions: set[str] | None,
                      reserved: Shares) -> set[str] | None:
    """Return where an on-demand request for ``model`` may run within ``regions`` (None: any),
    leaving out pools whose on-demand share is in use; raise ``RateLimited``
    (``pool_at_capacity``) when that leaves none. Call it right before the engine call is
    routed, with no await in between."""
    if model not in reserved or not settings.PROVISIONED_HOLD_BACK:
        return regions
    full = {s.region for s in pool_shares(fleet, model, reserved) if s.room <= 0}
    if not full or (regions is not None and not regions & full):
        return regions
    served = fleet.router.regions_of(model) if regions is None else regions
    left = served - full
    if left:
        return left
    raise RateLimited(
        f"The model '{model}' has no on-demand capacity left: what remains is reserved for "
        "provisioned throughput. Retry shortly, or reserve provisioned units.",
        code="pool_at_capacity", headers={"retry-after": RETRY_AFTER_S})
