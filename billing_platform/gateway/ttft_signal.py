"""Interactive time to first token per model, as the gateways measure it, shared through Redis.

The batch runner's guard (``gateway/batch/guard.py``) lets batch lines fill the engines' slots
only while interactive requests get their first token as fast as they do without batch. It
cannot see that from the engines (a slot count says nothing about a CPU or a GPU being shared)
nor from its own lines (they run at the lowest priority): the gateways see it, on every /v1
request, so they publish it and the runner reads it.

Each gateway process adds every interactive request's TTFT (the engine client's: from sending
the request to its first token) to a tally per model and ``SLOT_S`` of wall-clock time, and a
background task adds the tallies to Redis every ``TOLLGATE_TTFT_SIGNAL_FLUSH_S`` while there
are any: one pipeline of HINCRBYs per flush, never a round trip on the request path. A slot is
one hash ``tg:ttft:{<model>}:<slot number>`` of ``n`` (requests), ``us`` (their TTFTs
summed, microseconds) and ``ln`` (their logarithms summed, for the geometric mean: a typical
request's TTFT, which a few slow ones do not swing as they swing the mean), living
``KEY_TTL_S``; the hash tag keeps a model's slots in one Redis
Cluster slot, so a reader's pipeline is one round trip there too.

Redis failing costs the signal, never a request: a flush that fails is dropped (logged once per
outage). A reader that cannot read raises, and the guard then holds batch at its floor.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

import redis.exceptions
from django.conf import settings

from billing_platform.redis_conn import get_aredis

SLOT_S = 0.2  # the signal's resolution: one Redis hash per model per slot
KEY_TTL_S = 30.0  # a slot is read for a few seconds at most (the guard's lookback)
log = logging.getLogger(__name__)

# (model, slot) -> [requests, TTFT sum in us, sum of ln(TTFT in ms) in millionths]
_pending: dict[tuple[str, int], list[int]] = {}
_flusher: asyncio.Task[None] | None = None
_failing = False


def slot_key(model: str, slot: int) -> str:
    """Return the Redis key of ``model``'s tally for slot number ``slot``."""
    return f"tg:ttft:{{{model}}}:{slot}"


def note(model: str, ttft_ms: float, *, now: float | None = None) -> None:
    """Count one interactive request's TTFT; it reaches Redis within a flush interval."""
    slot = int((time.time() if now is None else now) / SLOT_S)
    tally = _pending.get((model, slot))
    if tally is None:
        tally = _pending[(model, slot)] = [0, 0, 0]
    tally[0] += 1
    tally[1] += round(ttft_ms * 1000)
    tally[2] += round(math.log(max(ttft_ms, 0.001)) * 1_000_000)
    global _flusher
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return  # noted outside an event loop (a script): the next flush takes it
    if _flusher is None or _flusher.done() or _flusher.get_loop() is not loop:
        _flusher = loop.create_task(_flush_while_busy())


async def _flush_while_busy() -> None:
    while _pending:
        await asyncio.sleep(settings.TTFT_SIGNAL_FLUSH_S)
        await aflush()


async def aflush() -> None:
    """Add the tallies noted so far to Redis (dropped if it fails: they are a hint)."""
    global _failing
    if not _pending:
        return
    tallies = list(_pending.items())
    _pending.clear()
    ttl_ms = int(KEY_TTL_S * 1000)
    try:
        async with get_aredis().pipeline(transaction=False) as pipe:
            for (model, slot), (n, us, ln) in tallies:
                key = slot_key(model, slot)
                pipe.hincrby(key, "n", n)
                pipe.hincrby(key, "us", us)
                pipe.hincrby(key, "ln", ln)
                pipe.pexpire(key, ttl_ms)
            await pipe.execute()
    except (redis.exceptions.RedisError, OSError) as exc:
        if not _failing:
            log.warning("TTFT signal: Redis failed (%r); the batch guard holds batch at its "
                        "floor until it answers", exc)
            _failing = True
        return
    if _failing:
        log.warning("TTFT signal: Redis answers again")
        _failing = False


@dataclass(frozen=True)
class Slot:
    """One slot of the signal: when it began (wall-clock seconds), its requests, and their
    TTFTs' sum (ms) and sum of natural logarithms (of ms)."""

    start: float
    requests: int
    sum_ms: float = 0.0
    sum_ln: float = 0.0


async def aslots(model: str, *, seconds: float, now: float | None = None) -> list[Slot]:
    """Return ``model``'s slots of the last ``seconds``, oldest first, the current one last
    (still filling). Raise Redis's error when it cannot be read."""
    now = time.time() if now is None else now
    last = int(now / SLOT_S)
    numbers = range(last - max(1, round(seconds / SLOT_S)) + 1, last + 1)
    async with get_aredis().pipeline(transaction=False) as pipe:
        for number in numbers:
            pipe.hmget(slot_key(model, number), ["n", "us", "ln"])
        replies = await pipe.execute()
    return [Slot(start=number * SLOT_S, requests=int(n or 0), sum_ms=int(us or 0) / 1000,
                 sum_ln=int(ln or 0) / 1_000_000)
            for number, (n, us, ln) in zip(numbers, replies, strict=True)]
