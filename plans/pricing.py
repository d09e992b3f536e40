"""Prices as numbers: the price sets of a model, exact per-class amounts, rounding once.

``PriceIndex`` loads the versions of the price books a batch needs with a fixed number of
queries and answers "which prices were in force for this model at t" by bisection.
All arithmetic runs in a 100-digit decimal context, so nothing is rounded before the one
explicit ``quantize_amount`` (half-even, 10 places).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import ROUND_CEILING, ROUND_HALF_EVEN, Context, Decimal, localcontext
from typing import TYPE_CHECKING

import numpy as np

from plans.choices import DEFAULT_CACHED_INPUT_FRACTION, MultiplierDimension, TokenClass
from plans.models import ContextBand, ModelPrice, PriceBook, PriceMultiplier, PriceVersion

if TYPE_CHECKING:
    from plans.rating import UsageFacts

AMOUNT_QUANTUM = Decimal("1E-10")
ZERO = Decimal("0")
ONE = Decimal("1")
_MILLION = Decimal(1_000_000)
# Wide enough that no product of tokens (< 2^63), prices and factors is ever rounded before the
# one explicit quantize; InvalidOperation and friends stay trapped (the default).
EXACT = Context(prec=100, rounding=ROUND_HALF_EVEN)


@dataclass(frozen=True, slots=True)
class TokenCounts:
    """What pricing needs of a request: its token counts, tier and zone.

    A usage event (``plans.rating.UsageFacts``) carries the same fields; admission builds one
    of these to price a request it settles before the event is rated.
    """

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cache_write_tokens: int
    service_tier: str
    data_zone: str


def quantize_amount(value: Decimal) -> Decimal:
    """Round an exact amount once, half-even, to the 10 places events keep."""
    return value.quantize(AMOUNT_QUANTUM, rounding=ROUND_HALF_EVEN, context=EXACT)


def normalized_tokens(*, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
                      cache_burndown: Decimal, output_burndown: Decimal) -> int:
    """Return provisioned burndown tokens: uncached + cached x cache_bd + out x output_bd.

    Rounded up to a whole token: a reservation is never credited with capacity it did not use.
    """
    with localcontext(EXACT):
        exact = ((prompt_tokens - cached_tokens) + cached_tokens * cache_burndown
                 + completion_tokens * output_burndown)
    return int(exact.to_integral_value(rounding=ROUND_CEILING))


def normalizer(*, cache_burndown: Decimal, output_burndown: Decimal
               ) -> Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    """Return ``normalized_tokens`` for these burndowns as a function of (prompt, cached,
    completion) token arrays (int64, one event each), for callers that normalize many events.

    Burndowns of at most 6 places (all the models store) are computed in integer millionths,
    which is exact, so the ceiling is the same; other values go through ``normalized_tokens``
    one event at a time.
    """
    cb, ob = (cache_burndown * _MILLION).normalize(), (output_burndown * _MILLION).normalize()
    if cb != cb.to_integral_value() or ob != ob.to_integral_value():
        def each(prompt: np.ndarray, cached: np.ndarray, completion: np.ndarray) -> np.ndarray:
            return np.array([normalized_tokens(
                prompt_tokens=p, cached_tokens=c, completion_tokens=o,
                cache_burndown=cache_burndown, output_burndown=output_burndown)
                for p, c, o in zip(prompt.tolist(), cached.tolist(), completion.tolist(),
                                   strict=True)], dtype=np.int64)
        return each
    cbi, obi = int(cb), int(ob)

    def norm(prompt: np.ndarray, cached: np.ndarray, completion: np.ndarray) -> np.ndarray:
        exact = (prompt - cached) * 1_000_000 + cached * cbi + completion * obi
        return np.asarray(-(-exact // 1_000_000), dtype=np.int64)
    return norm


@dataclass(frozen=True, slots=True)
class PriceSet:
    """Per-1M-token prices of one model in one band."""

    input: Decimal
    cached_input: Decimal
    output: Decimal
    cache_write: Decimal

    @classmethod
    def of(cls, row: ModelPrice | ContextBand) -> PriceSet:
        cached = (row.cached_input if row.cached_input is not None
                  else row.input * DEFAULT_CACHED_INPUT_FRACTION)
        write = row.cache_write if row.cache_write is not None else row.input
        return cls(row.input, cached, row.output, write)


@dataclass(frozen=True, slots=True)
class ModelPricing:
    """A model's prices in one price version, with that version's multipliers."""

    version_id: int
    currency: str
    model: str
    base: PriceSet
    bands: tuple[tuple[int, PriceSet], ...]  # ascending thresholds
    tier: Mapping[str, Decimal]
    zone: Mapping[str, Decimal]

    def prices_for(self, prompt_tokens: int) -> PriceSet:
        """Return the band's prices when the prompt exceeds its threshold, else the base."""
        chosen = self.base
        for above, prices in self.bands:
            if prompt_tokens > above:
                chosen = prices
            else:
                break
        return chosen

    def multiplier(self, tier: str, zone: str) -> Decimal:
        return self.tier.get(tier, ONE) * self.zone.get(zone, ONE)


def class_units(pricing: ModelPricing, prompt_tokens: int, service_tier: str, data_zone: str
                ) -> tuple[Decimal, Decimal, Decimal, Decimal]:
    """Return what one token of each class costs in a request of this prompt size, tier and
    zone: (input, cached input, output, cache write), the band's price x tier x zone / 1e6,
    exact. ``exact_lines`` multiplies them by the token counts."""
    prices = pricing.prices_for(prompt_tokens)
    with localcontext(EXACT):
        mult = pricing.multiplier(service_tier, data_zone)
        return ((prices.input * mult).scaleb(-6), (prices.cached_input * mult).scaleb(-6),
                (prices.output * mult).scaleb(-6), (prices.cache_write * mult).scaleb(-6))


def exact_lines(pricing: ModelPricing, f: TokenCounts | UsageFacts) -> dict[str, Decimal]:
    """Return the on-demand amount of each token class, exact (not yet rounded)."""
    u_in, u_cached, u_out, u_write = class_units(pricing, f.prompt_tokens, f.service_tier,
                                                 f.data_zone)
    with localcontext(EXACT):
        uncached = f.prompt_tokens - f.cached_tokens
        lines = {
            TokenClass.INPUT.value: (uncached - f.cache_write_tokens) * u_in,
            TokenClass.CACHED_INPUT.value: f.cached_tokens * u_cached,
            TokenClass.OUTPUT.value: f.completion_tokens * u_out,
        }
        if f.cache_write_tokens:
            lines[TokenClass.CACHE_WRITE.value] = f.cache_write_tokens * u_write
    return lines


def units_in_last_places(units: Sequence[Decimal]) -> tuple[int, ...] | None:
    """Return per-token amounts (``class_units``) as whole numbers of 1e-10, else None.

    When each is a whole number of the amounts' last place (prices of at most 4 places times
    the usual multipliers are), a line of n tokens is n x unit exactly, so rounding it once to
    10 places (``rounded_lines``) changes nothing: an event's lines are n x unit in units of
    1e-10, and sums of them over any number of events are exact integers. None means some
    line of some event may round: rate those events one by one (``rounded_lines``).
    """
    out = []
    for unit in units:
        scaled = unit.scaleb(10, context=EXACT)
        if scaled != scaled.to_integral_value():
            return None
        out.append(int(scaled))
    return tuple(out)


def lines_in_last_places(units: tuple[int, ...], f: TokenCounts | UsageFacts
                         ) -> tuple[dict[str, Decimal], Decimal]:
    """Return ``rounded_lines(exact_lines(...))`` of an event whose per-token amounts are
    ``units`` (``units_in_last_places``, not None): each line an integer product scaled by
    1e-10, the same value and exponent as the Decimal route without its contexts."""
    u_in, u_cached, u_out, u_write = units
    write = f.cache_write_tokens
    n_in = (f.prompt_tokens - f.cached_tokens - write) * u_in
    n_cached = f.cached_tokens * u_cached
    n_out = f.completion_tokens * u_out
    # n x 1e-10 parsed from "<n>E-10": the digits and exponent of Decimal(n).scaleb(-10)
    # (exact for any integer) in two thirds of its time; this runs for nearly every event
    lines = {_INPUT: _D(f"{n_in}E-10"), _CACHED_INPUT: _D(f"{n_cached}E-10"),
             _OUTPUT: _D(f"{n_out}E-10")}
    total = n_in + n_cached + n_out
    if write:
        lines[_CACHE_WRITE] = _D(f"{write * u_write}E-10")
        total += write * u_write
    return lines, _D(f"{total}E-10")


_INPUT, _CACHED_INPUT, _OUTPUT, _CACHE_WRITE = (
    str(TokenClass.INPUT.value), str(TokenClass.CACHED_INPUT.value),
    str(TokenClass.OUTPUT.value), str(TokenClass.CACHE_WRITE.value))


_D = Decimal


def rounded_lines(lines: Mapping[str, Decimal], fraction: Decimal | None = None
                  ) -> tuple[dict[str, Decimal], Decimal]:
    """Round each line once (after scaling by ``fraction``); return the lines and their sum."""
    ctx = EXACT  # half-even, 100 digits: the scaling and the sum are exact
    out: dict[str, Decimal] = {}
    total = ZERO
    for cls, value in lines.items():
        if fraction is not None:
            value = ctx.multiply(value, fraction)
        rounded = value.quantize(AMOUNT_QUANTUM, context=ctx)
        out[cls] = rounded
        total = ctx.add(total, rounded)
    return out, total


class PriceIndex:
    """Price versions of the books a batch needs, loaded once; looked up per (book, model)."""

    def __init__(self, book_ids: set[int], models: set[str], min_t: datetime, max_t: datetime):
        self.currency = dict(PriceBook.objects.filter(id__in=book_ids)
                             .values_list("id", "currency"))
        versions = list(PriceVersion.objects.filter(price_book_id__in=book_ids,
                                                    effective_from__lte=max_t)
                        .order_by("price_book_id", "effective_from")
                        .values_list("id", "price_book_id", "effective_from"))
        by_book: dict[int, list[tuple[int, datetime]]] = defaultdict(list)
        for vid, book_id, eff in versions:
            by_book[book_id].append((vid, eff))
        relevant: dict[int, list[tuple[int, datetime]]] = {}
        for book_id, rows in by_book.items():
            first = max(bisect_right([eff for _, eff in rows], min_t) - 1, 0)
            relevant[book_id] = rows[first:]
        version_ids = [vid for rows in relevant.values() for vid, _ in rows]
        mults: dict[int, dict[str, dict[str, Decimal]]] = defaultdict(
            lambda: {MultiplierDimension.TIER: {}, MultiplierDimension.ZONE: {}})
        for vid, dim, key, factor in PriceMultiplier.objects.filter(
                version_id__in=version_ids).values_list("version_id", "dimension", "key",
                                                        "factor"):
            mults[vid][dim][key] = factor
        prices = (ModelPrice.objects.filter(version_id__in=version_ids, model__in=models)
                  .select_related("version").prefetch_related("bands"))
        by_version_model: dict[tuple[int, str], ModelPricing] = {}
        for row in prices:
            book_id = row.version.price_book_id
            m = mults[row.version_id]
            by_version_model[(row.version_id, row.model)] = ModelPricing(
                version_id=row.version_id, currency=self.currency[book_id], model=row.model,
                base=PriceSet.of(row),
                bands=tuple((b.above_prompt_tokens, PriceSet.of(b))
                            for b in sorted(row.bands.all(), key=lambda b: b.above_prompt_tokens)),
                tier=m[MultiplierDimension.TIER], zone=m[MultiplierDimension.ZONE],
            )
        # (book, model) -> (effective_from list, pricing-or-None list), for bisect per event.
        self._series: dict[tuple[int, str], tuple[list[datetime], list[ModelPricing | None]]] = {}
        for book_id, rows in relevant.items():
            times = [eff for _, eff in rows]
            for model in models:
                self._series[(book_id, model)] = (
                    times, [by_version_model.get((vid, model)) for vid, _ in rows])

    def series(self, book_id: int | None, model: str
               ) -> tuple[list[datetime], list[ModelPricing | None]]:
        """Return (effective_from list, pricing-or-None list) of a model in a book."""
        return self._series.get((book_id, model), ([], [])) if book_id else ([], [])

