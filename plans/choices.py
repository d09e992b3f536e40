"""Enumerations of the plans app, and the default multipliers a new price version starts with."""

from __future__ import annotations

from decimal import Decimal

from django.db import models


class ServiceTier(models.TextChoices):
    DEFAULT = "default", "Default (standard)"
    PRIORITY = "priority", "Priority"
    FLEX = "flex", "Flex"
    BATCH = "batch", "Batch"


class CapacitySource(models.TextChoices):
    ON_DEMAND = "on_demand", "On-demand"
    PROVISIONED = "provisioned", "Provisioned"
    SPILLOVER = "spillover", "Spillover from provisioned"
    PLAN = "plan", "Token plan"
    OVERAGE = "overage", "Token plan overage"


class TokenClass(models.TextChoices):
    INPUT = "input", "Input (uncached)"
    CACHED_INPUT = "cached_input", "Cached input"
    OUTPUT = "output", "Output"
    CACHE_WRITE = "cache_write", "Cache write"


class RatingKind(models.TextChoices):
    """Which rating function prices an event (the keys of ``plans.rating.RATERS``)."""

    ON_DEMAND = "on_demand", "On-demand"
    TOKEN_PLAN = "token_plan", "Subscription token plan"
    PROVISIONED = "provisioned", "Provisioned units"


class PlanKind(models.TextChoices):
    ON_DEMAND = "on_demand", "On-demand"
    TOKEN_PLAN = "token_plan", "Subscription token plan"


class CapPolicy(models.TextChoices):
    BLOCK = "block", "Block at the cap (429 plan_quota_exhausted)"
    OVERAGE = "overage", "Overage at on-demand prices"


class ReservationTerm(models.TextChoices):
    HOURLY = "hourly", "Hourly"
    MONTHLY = "monthly", "Monthly"


class OverflowPolicy(models.TextChoices):
    SPILLOVER = "spillover", "Spill over to on-demand (billed, marked)"
    REJECT = "reject", "Reject (429)"


class MultiplierDimension(models.TextChoices):
    TIER = "tier", "Service tier"
    ZONE = "zone", "Data zone"


class CreditGrantKind(models.TextChoices):
    PROMOTIONAL = "promotional", "Promotional"
    GOODWILL = "goodwill", "Goodwill"  # granted by finance to make up for a fault of ours
    PURCHASED = "purchased", "Purchased"
    CREDIT_NOTE = "credit_note", "Credit note"


class WebhookEvent(models.TextChoices):
    """The event types an organization's webhook endpoints receive."""

    BUDGET_THRESHOLD_REACHED = "budget.threshold_reached", "A budget alert threshold was reached"
    TEST = "webhook.test", "A test event sent from the console"


class WebhookDeliveryStatus(models.TextChoices):
    PENDING = "pending", "Pending"  # not yet answered 2xx; attempts continue (with backoff)
    DELIVERED = "delivered", "Delivered"
    FAILED = "failed", "Failed"  # every attempt failed; the console can send it again
    REFUSED = "refused", "Refused"  # the URL leads to a non-public address: never sent


DEFAULT_TIER_MULTIPLIERS: dict[str, Decimal] = {
    ServiceTier.DEFAULT: Decimal("1.0"),
    ServiceTier.PRIORITY: Decimal("2.0"),
    ServiceTier.FLEX: Decimal("0.5"),
    ServiceTier.BATCH: Decimal("0.5"),
}
DEFAULT_ZONE_MULTIPLIERS: dict[str, Decimal] = {
    "global": Decimal("1.0"),
    "us": Decimal("1.1"),
    "eu": Decimal("1.1"),
}

# cached_input defaults to this fraction of input when a model price leaves it empty.
DEFAULT_CACHED_INPUT_FRACTION = Decimal("0.1")
# A token plan's rolling window, unless the plan says otherwise.
DEFAULT_WINDOW_HOURS = 5
# The coefficient row that applies to every model a plan does not name.
ANY_MODEL = "*"
