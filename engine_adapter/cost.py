"""Cost-to-serve: an engine's GPU time over one interval, split exactly between the requests it
served and idle capacity.

For an engine with G GPUs and an interval ``[a, b)`` the engine's GPU time is ``(b - a) x G``.
The part of the interval during which at least one of its requests was active (the union of
their spans) is busy; its GPU time is shared among the requests active in the interval in
proportion to their work there::

    work = uncached prompt tokens / prefill throughput + decode tokens / decode throughput

with both throughputs the engine's own measurements (``measured_rates``: SGLang's prefill
forward time per uncached prompt token, its time per output token), so a prefill token weighs
what it costs that engine next to a decode token. A request's work is spread evenly over its
span (the usage event does not say when its prefill ended), so a request spanning intervals
gets its share of each. The rest of the interval is idle capacity.

Exactness: GPU time is counted in integer GPU-microseconds and split by largest remainder, so
``attributed + idle == (b - a) x G`` to the microsecond, always. The interval's cost is that
time at ``gpu_hourly_cost / 3600`` per GPU-second, to 10 places, split over the same parts by
largest remainder in units of 1e-10, so the shares' costs plus the idle cost are the
interval's cost exactly. Ties go to the earlier part (requests ordered by their key), so the
same inputs always give the same split.

No Django and no IO: ``metering.costs`` reads the events and the engines' counters, calls
:func:`split_interval` and stores what it returns.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal

from engine_adapter.types import EngineCounters

US = 1_000_000  # microseconds per second
PLACES = Decimal("0.0000000001")  # costs keep 10 decimal places, as amounts on events do
_US_PER_HOUR = Decimal(3600 * US)
_PICO = Decimal(10**12)  # work is weighed in picoseconds of engine time


@dataclass(frozen=True)
class Throughput:
    """An engine's measured rates: uncached prompt tokens and decode tokens per second."""

    prefill_tokens_per_s: Decimal
    decode_tokens_per_s: Decimal


@dataclass(frozen=True)
class Work:
    """One request's span on the engine (microseconds since the epoch) and its tokens."""

    key: int
    start_us: int
    end_us: int
    uncached_tokens: int
    decode_tokens: int


@dataclass(frozen=True)
class IntervalSplit:
    """One engine-interval, split: ``attributed_us + idle_us == capacity_us`` and
    ``sum(share_costs) + idle_cost == capacity_cost``, exactly."""

    capacity_us: int
    attributed_us: int
    idle_us: int
    shares: dict[int, int]  # work key -> GPU-microseconds
    capacity_cost: Decimal
    idle_cost: Decimal
    share_costs: dict[int, Decimal]


def largest_remainder(total: int, weights: Sequence[int]) -> list[int]:
    """Split ``total`` into non-negative integers proportional to ``weights``, summing to it.

    Each part gets ``floor(total x w / sum)``; the units left over go one each to the parts
    with the largest remainders, ties to the earlier part. All-zero weights split 0 only.
    """
    whole = sum(weights)
    if whole <= 0:
        if total:
            raise ValueError("cannot split a non-zero total by zero weights")
        return [0] * len(weights)
    parts: list[int] = []
    remainders: list[tuple[int, int]] = []
    for i, weight in enumerate(weights):
        part, remainder = divmod(total * weight, whole)
        parts.append(part)
        remainders.append((-remainder, i))
    for _, i in sorted(remainders)[: total - sum(parts)]:
        parts[i] += 1
    return parts


def measured_rates(pairs: Iterable[tuple[EngineCounters, EngineCounters]]
                   ) -> tuple[Decimal | None, Decimal | None]:
    """Return the (prefill, decode) tokens per second an engine measured over scrape pairs
    (first, last) of its process lives; None for a rate nothing was measured for.

    Prefill: uncached prompt tokens per second of prefill forward. Decode: the reciprocal of
    the mean time per output token. Deltas are summed over the pairs before dividing.
    """
    uncached = timed = 0
    prefill_s = tpot_s = Decimal(0)
    for first, last in pairs:
        uncached += last.uncached_prompt_tokens - first.uncached_prompt_tokens
        prefill_s += last.prefill_seconds - first.prefill_seconds
        timed += last.tpot_requests - first.tpot_requests
        tpot_s += last.tpot_seconds - first.tpot_seconds
    prefill = Decimal(uncached) / prefill_s if uncached > 0 and prefill_s > 0 else None
    decode = Decimal(timed) / tpot_s if timed > 0 and tpot_s > 0 else None
    return prefill, decode


def work_in(work: Work, a: int, b: int, throughput: Throughput) -> int:
    """Return the work of one request that falls in ``[a, b)``, in picoseconds of engine time."""
    start, end = work.start_us, work.end_us
    if end > start:
        fraction = Decimal(max(0, min(end, b) - max(start, a))) / (end - start)
    else:  # an instant: all of it where it happened
        fraction = Decimal(1 if a <= start < b else 0)
    if not fraction:
        return 0
    seconds = (Decimal(max(0, work.uncached_tokens)) / throughput.prefill_tokens_per_s
               + Decimal(max(0, work.decode_tokens)) / throughput.decode_tokens_per_s)
    return int(seconds * fraction * _PICO)


def _union_us(spans: list[tuple[int, int]]) -> int:
    busy, reach = 0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            busy += end - start
            reach = end
        elif end > reach:
            busy += end - reach
            reach = end
    return busy


def split_interval(*, start_us: int, end_us: int, gpus: int, gpu_hourly_cost: Decimal,
                   works: Sequence[Work], throughput: Throughput) -> IntervalSplit:
    """Split one engine-interval's GPU time and its cost; see the module docstring."""
    if end_us <= start_us or gpus < 1:
        raise ValueError("an interval has a positive length and at least one GPU")
    capacity_us = (end_us - start_us) * gpus
    weighed = sorted((w.key, weight, w) for w in works
                     if (weight := work_in(w, start_us, end_us, throughput)) > 0)
    busy_us = _union_us([(max(w.start_us, start_us), min(w.end_us, end_us))
                         for _, _, w in weighed if w.end_us > w.start_us])
    attributed_us = busy_us * gpus
    parts = largest_remainder(attributed_us, [weight for _, weight, _ in weighed])
    shares = {key: part for (key, _, _), part in zip(weighed, parts, strict=True)}
    idle_us = capacity_us - attributed_us
    capacity_cost = (Decimal(capacity_us) * gpu_hourly_cost / _US_PER_HOUR).quantize(
        PLACES, rounding=ROUND_HALF_EVEN)
    units = largest_remainder(int(capacity_cost / PLACES), [*shares.values(), idle_us])
    share_costs = {key: units[i] * PLACES for i, key in enumerate(shares)}
    return IntervalSplit(capacity_us=capacity_us, attributed_us=attributed_us, idle_us=idle_us,
                         shares=shares, capacity_cost=capacity_cost,
                         idle_cost=units[-1] * PLACES, share_costs=share_costs)
