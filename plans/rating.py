"""Rating: turn usage events into exact amounts under what each customer bought.

This module is the contract metering codes against: ``UsageFacts`` in, ``Rating`` out, through
``rate_usage_batch`` (stateful for token plans, called inside the ingest transaction) and
``quote`` (pure: reads prices and plan state, writes nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal


@dataclass(frozen=True, slots=True)
class UsageFacts:
    """One usage event as metering sees it. Token counts are the engine's."""

    request_id: str
    org_id: int
    project_id: int | None
    api_key_id: int | None
    model: str
    region: str  # engine region the request ran in, e.g. "us-east"
    data_zone: str  # "global" | "us" | "eu" (the org's zone)
    service_tier: str  # "default" | "priority" | "flex" | "batch"
    capacity_source: str  # "on_demand" | "provisioned" | "spillover" | "plan"
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    event_time: datetime  # aware UTC
    cache_write_tokens: int = 0  # part of the uncached prompt written to a priced cache


@dataclass(frozen=True, slots=True)
class Rating:
    """The rated outcome of one event. ``amount`` is the sum of ``breakdown``'s lines."""

    amount: Decimal  # quantized to 10 places, in `currency`
    currency: str
    price_version_id: int | None  # the price-book version in force at event_time
    breakdown: dict[str, Decimal]  # token class -> amount
    credits_consumed: Decimal  # token-plan credits, 0 otherwise
    normalized_tokens: int  # provisioned burndown tokens, 0 otherwise
    capacity_source: str  # final source: e.g. "plan" -> "overage" when past the cap
    rating_kind: str = "on_demand"  # which rater priced it: on_demand | token_plan | provisioned
    subscription_id: int | None = None
    reservation_id: int | None = None
    pack_credits: Decimal = Decimal("0")  # the part of credits_consumed taken from credit packs
    overage_credits: Decimal = Decimal("0")  # credits past the cap, billed at on-demand prices


def rate_usage_batch(facts: Sequence[UsageFacts]) -> list[Rating]:
    """Rate a batch of events in order (bulk: one price-book lookup per (currency, model))."""
    raise NotImplementedError("plans.rating.rate_usage_batch is being built (issue 5)")


def quote(
    *,
    org_id: int,
    model: str,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
    service_tier: str = "default",
    data_zone: str | None = None,
    capacity_source: str = "on_demand",
    at: datetime | None = None,
) -> Rating:
    """Return what these hypothetical token counts would cost ``org_id`` now; write nothing."""
    raise NotImplementedError("plans.rating.quote is being built (issue 5)")
