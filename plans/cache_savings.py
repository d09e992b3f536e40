"""What prompt caching saved an organization, in money: its cached prompt tokens priced at the
input price less what they were billed at the cached-input price.

The per-token prices are the rating code's (``plans.pricing.class_units``: the band's price x
tier x zone / 1e6, from the price-book version the rater would pick), so the saving and the bill
come from one formula: ``saving = cached x (unit_input - unit_cached_input)`` per group, summed
exactly and rounded once (``quantize_amount``, 10 places). Only tokens billed per token save
money: on-demand, spillover and token-plan overage. Tokens under a token plan's credits or a
reservation cost no money per token, so caching saves none there (it saves credits or
capacity instead).

The caller passes sums (per day, model, tier and capacity source: the hourly rollups' grouping
by day), not events, so two approximations are stated here rather than hidden: the price
version is the one in force at the start of the group's day (a version that takes effect
mid-day moves that day's saving to the new prices), and where a model has context bands the
band is chosen by the group's mean prompt size (requests of very different sizes in one group
may have been priced in different bands). Without context bands and mid-day price changes
(the common case) the figure is exact.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal, localcontext

from billing_platform.accounts.models import Organization
from plans.choices import CapacitySource
from plans.models import PriceBook
from plans.pricing import EXACT, ZERO, PriceIndex, class_units, quantize_amount
from plans.rating import price_book_of
from plans.selectors import subscription_at

BILLED_PER_TOKEN = frozenset({CapacitySource.ON_DEMAND, CapacitySource.SPILLOVER,
                              CapacitySource.OVERAGE})


@dataclass(frozen=True)
class CachedUsage:
    """Usage sums of one group: its day's start (UTC), model, tier and capacity source."""

    at: datetime
    model: str
    service_tier: str
    capacity_source: str
    currency: str
    requests: int
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class CacheSavings:
    """The money caching saved (``amount`` in ``currency``, 10 places) and the cached tokens
    it covers; ``unpriced_tokens``: cached tokens billed per token that no price was found for
    (another currency, a model the book lacks)."""

    amount: Decimal
    currency: str
    priced_tokens: int
    unpriced_tokens: int


def cache_savings(*, organization: Organization, usage: Sequence[CachedUsage],
                  at: datetime) -> CacheSavings:
    """Return what caching saved ``organization`` on ``usage``, priced as the rater prices it.

    The price book is the one the org's subscription at ``at`` rates with (else the default
    book of its currency). A fixed number of queries, whatever the number of groups.
    """
    books = list(PriceBook.objects.values_list("id", "currency", "is_default"))
    book_id, currency = price_book_of(
        subscription_at(organization=organization, at=at), org_currency=organization.currency,
        default_books={cur: pk for pk, cur, default in books if default},
        book_currency={pk: cur for pk, cur, _ in books})
    billed = [u for u in usage if u.capacity_source in BILLED_PER_TOKEN and u.cached_tokens]
    if book_id is None or not billed:
        return CacheSavings(ZERO, currency, 0, sum(u.cached_tokens for u in billed))
    index = PriceIndex({book_id}, {u.model for u in billed}, min(u.at for u in billed),
                       max(u.at for u in billed))
    total, priced, unpriced = ZERO, 0, 0
    with localcontext(EXACT):
        for u in billed:
            times, pricings = index.series(book_id, u.model)
            i = bisect_right(times, u.at) - 1
            pricing = pricings[i] if i >= 0 else None
            if pricing is None or u.currency != currency:
                unpriced += u.cached_tokens
                continue
            mean_prompt = u.prompt_tokens // max(u.requests, 1)
            unit_in, unit_cached, _, _ = class_units(pricing, mean_prompt, u.service_tier,
                                                     organization.data_zone)
            total += u.cached_tokens * (unit_in - unit_cached)
            priced += u.cached_tokens
    return CacheSavings(quantize_amount(total), currency, priced, unpriced)
