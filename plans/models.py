"""What customers can buy and what they bought.

Prices are data: a ``PriceBook`` per currency (and, for negotiated deals, extra books a plan can
point at) holds ``PriceVersion`` rows, each a complete copy of the book from its
``effective_from`` on. An event is rated with the version in force at its event time, and that
version's id is stored on the event, so an old invoice can always be explained.

Units: unit prices are per 1M tokens in the book's currency with 10 decimal places; amounts keep
10 places; multipliers and credit coefficients keep 6; credits keep 6. Times are aware UTC;
periods are [start, end).

Token-plan state (``TokenPlanUsage`` ledger and ``TokenPlanPeriod`` totals) is written by
``plans.rating.rate_usage_batch`` in the caller's transaction; see that module for why it is
counted exactly once.

Length: Django finds an app's models in one module, and these models reference each other
(books, versions, plans, subscriptions, reservations, budgets, grants); each class is
declarations and docstrings, with no behaviour beyond properties.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.db.models import F, Q
from django.utils import timezone

from billing_platform.accounts.choices import DataZone
from billing_platform.accounts.models import Organization, User, public_id
from billing_platform.model_fields import decimal_field_maker
from plans.choices import (
    ANY_MODEL,
    DEFAULT_CACHED_INPUT_FRACTION,
    DEFAULT_WINDOW_HOURS,
    CapPolicy,
    CreditGrantKind,
    MultiplierDimension,
    OverflowPolicy,
    PlanKind,
    ReservationTerm,
    TokenClass,
    WebhookDeliveryStatus,
    WebhookEvent,
)

_price_field = decimal_field_maker(max_digits=24, decimal_places=10)
_money_field = decimal_field_maker(max_digits=30, decimal_places=10)
_factor_field = decimal_field_maker(max_digits=14, decimal_places=6)
_credits_field = decimal_field_maker(max_digits=30, decimal_places=6)


ZERO = Decimal("0")


# --- price books ---------------------------------------------------------------------------

class PriceBook(models.Model):
    """A list of per-model token prices in one currency, versioned by ``PriceVersion``.

    The default book of a currency prices every on-demand customer billed in it; a plan may
    name another book (negotiated prices).
    """

    code = models.SlugField(max_length=60, unique=True)
    name = models.CharField(max_length=200)
    currency = models.CharField(max_length=3)
    is_default = models.BooleanField(
        default=False, help_text="The book on-demand customers in this currency are rated with."
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["currency"], condition=Q(is_default=True),
                name="one_default_price_book_per_currency",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.currency})"


class PriceVersion(models.Model):
    """The whole book as of ``effective_from``: model prices and tier/zone multipliers.

    The version in force at time t is the one with the latest ``effective_from`` <= t. A model
    absent from that version is not priced (delisted) at t.
    """

    price_book = models.ForeignKey(PriceBook, on_delete=models.PROTECT, related_name="versions")
    effective_from = models.DateTimeField()
    note = models.CharField(max_length=500, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["price_book", "effective_from"]
        constraints = [
            models.UniqueConstraint(
                fields=["price_book", "effective_from"], name="one_version_per_instant"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.price_book.code} @ {self.effective_from:%Y-%m-%d %H:%M}Z"


class ModelPrice(models.Model):
    """One model's prices in a version. Per 1M tokens, in the book's currency.

    ``cached_input`` empty means 0.1 x ``input``; ``cache_write`` empty means cache writes are
    priced as input.
    """

    version = models.ForeignKey(PriceVersion, on_delete=models.CASCADE, related_name="prices")
    model = models.CharField(max_length=200)
    input = _price_field()
    cached_input = _price_field(null=True, blank=True)
    output = _price_field()
    cache_write = _price_field(null=True, blank=True)

    class Meta:
        ordering = ["version", "model"]
        constraints = [
            models.UniqueConstraint(fields=["version", "model"], name="one_price_per_model"),
            models.CheckConstraint(
                condition=Q(input__gte=0) & Q(output__gte=0)
                & (Q(cached_input__isnull=True) | Q(cached_input__gte=0))
                & (Q(cache_write__isnull=True) | Q(cache_write__gte=0)),
                name="model_price_non_negative",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.model}: in {self.input} / out {self.output} per 1M"

    @property
    def effective_cached_input(self) -> Decimal:
        if self.cached_input is not None:
            return self.cached_input
        return self.input * DEFAULT_CACHED_INPUT_FRACTION


class ContextBand(models.Model):
    """A second price set used when the prompt exceeds ``above_prompt_tokens``.

    Priced on the whole request, as Gemini and Qwen do: a prompt of N+1 tokens pays the band's
    prices for every token, N tokens pays the base prices. Empty ``cached_input`` is 0.1 x the
    band's input.
    """

    model_price = models.ForeignKey(ModelPrice, on_delete=models.CASCADE, related_name="bands")
    above_prompt_tokens = models.PositiveBigIntegerField()
    input = _price_field()
    cached_input = _price_field(null=True, blank=True)
    output = _price_field()
    cache_write = _price_field(null=True, blank=True)

    class Meta:
        ordering = ["model_price", "above_prompt_tokens"]
        constraints = [
            models.UniqueConstraint(
                fields=["model_price", "above_prompt_tokens"], name="one_band_per_threshold"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.model_price.model} > {self.above_prompt_tokens} tokens"


class PriceMultiplier(models.Model):
    """A factor applied to every token class: per service tier or per data zone.

    A tier or zone without a row in the version is priced at 1.
    """

    version = models.ForeignKey(PriceVersion, on_delete=models.CASCADE, related_name="multipliers")
    dimension = models.CharField(max_length=8, choices=MultiplierDimension.choices)
    key = models.CharField(max_length=32)
    factor = _factor_field()

    class Meta:
        ordering = ["version", "dimension", "key"]
        constraints = [
            models.UniqueConstraint(
                fields=["version", "dimension", "key"], name="one_multiplier_per_key"
            ),
            models.CheckConstraint(condition=Q(factor__gte=0), name="multiplier_non_negative"),
        ]

    def __str__(self) -> str:
        return f"{self.dimension}:{self.key} x{self.factor}"


# --- plans and subscriptions ---------------------------------------------------------------

class Plan(models.Model):
    """A product a customer subscribes to.

    ``on_demand``: the price book, nothing else. ``token_plan``: ``monthly_fee`` buys
    ``credits_per_period`` credits per period (anchored at the subscription's billing anchor),
    at most ``window_credits`` of them in any rolling ``window_hours``; credits per token come
    from ``CreditCoefficient``; past a cap the plan blocks or bills overage at the book's
    on-demand prices (``cap_policy``); bought credit packs are used before either.
    """

    code = models.SlugField(max_length=60, unique=True)
    name = models.CharField(max_length=200)
    kind = models.CharField(max_length=16, choices=PlanKind.choices)
    currency = models.CharField(max_length=3, default="USD")
    price_book = models.ForeignKey(
        PriceBook, null=True, blank=True, on_delete=models.PROTECT, related_name="plans",
        help_text="Empty: the currency's default book.",
    )
    description = models.TextField(blank=True)
    monthly_fee = _money_field(default=ZERO)
    credits_per_period = _credits_field(null=True, blank=True)
    window_credits = _credits_field(
        null=True, blank=True, help_text="Cap in any rolling window; empty: no window cap."
    )
    window_hours = models.PositiveSmallIntegerField(default=DEFAULT_WINDOW_HOURS)
    cap_policy = models.CharField(
        max_length=8, choices=CapPolicy.choices, default=CapPolicy.BLOCK
    )
    is_public = models.BooleanField(default=True)
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=~Q(kind=PlanKind.TOKEN_PLAN)
                | (Q(credits_per_period__isnull=False) & Q(credits_per_period__gte=0)),
                name="token_plan_has_credits",
            ),
            models.CheckConstraint(condition=Q(monthly_fee__gte=0), name="plan_fee_non_negative"),
            models.CheckConstraint(condition=Q(window_hours__gte=1), name="plan_window_positive"),
        ]

    def __str__(self) -> str:
        return self.name


class CreditCoefficient(models.Model):
    """Credits one token of ``token_class`` of ``model`` costs under a token plan.

    ``model="*"`` applies to models the plan does not name. A model with no row (and no ``*``)
    is not covered by the plan and is rated on-demand.
    """

    plan = models.ForeignKey(Plan, on_delete=models.CASCADE, related_name="coefficients")
    model = models.CharField(max_length=200, default=ANY_MODEL)
    token_class = models.CharField(max_length=16, choices=TokenClass.choices)
    coefficient = _factor_field()

    class Meta:
        ordering = ["plan", "model", "token_class"]
        constraints = [
            models.UniqueConstraint(
                fields=["plan", "model", "token_class"], name="one_coefficient_per_class"
            ),
            models.CheckConstraint(condition=Q(coefficient__gte=0),
                                   name="coefficient_non_negative"),
        ]

    def __str__(self) -> str:
        return f"{self.model} {self.token_class}: {self.coefficient} credits/token"


class CreditPack(models.Model):
    """Extra credits a token-plan subscriber can buy; used after the plan's own credits."""

    plan = models.ForeignKey(Plan, on_delete=models.CASCADE, related_name="credit_packs")
    code = models.SlugField(max_length=60)
    name = models.CharField(max_length=200)
    credits = _credits_field()
    price = _money_field()
    validity_days = models.PositiveIntegerField(
        null=True, blank=True, help_text="Empty: valid while the subscription lasts."
    )
    is_active = models.BooleanField(default=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["plan", "code"], name="one_pack_code_per_plan"),
            models.CheckConstraint(condition=Q(credits__gt=0) & Q(price__gte=0),
                                   name="pack_positive"),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.credits} credits)"


class Subscription(models.Model):
    """An organization on a plan for [starts_at, ends_at). At most one covers any instant."""

    public_id = models.CharField(max_length=40, unique=True, editable=False)
    organization = models.ForeignKey(
        Organization, on_delete=models.CASCADE, related_name="subscriptions"
    )
    plan = models.ForeignKey(Plan, on_delete=models.PROTECT, related_name="subscriptions")
    starts_at = models.DateTimeField()
    ends_at = models.DateTimeField(null=True, blank=True)
    billing_anchor = models.DateTimeField(
        help_text="Periods run month to month from this instant (day clamped to month end)."
    )
    data_zone = models.CharField(max_length=16, choices=DataZone.choices, default=DataZone.GLOBAL)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["organization", "starts_at"])]
        constraints = [
            models.CheckConstraint(
                condition=Q(ends_at__isnull=True) | Q(ends_at__gt=F("starts_at")),
                name="subscription_ends_after_start",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.organization} on {self.plan}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self.public_id:
            self.public_id = public_id("sub")
        super().save(*args, **kwargs)

    def covers(self, at: datetime) -> bool:
        return self.starts_at <= at and (self.ends_at is None or at < self.ends_at)


class CreditPackPurchase(models.Model):
    """Credits bought for one subscription; consumed oldest-expiry first after plan credits."""

    public_id = models.CharField(max_length=40, unique=True, editable=False)
    subscription = models.ForeignKey(
        Subscription, on_delete=models.CASCADE, related_name="pack_purchases"
    )
    pack = models.ForeignKey(CreditPack, null=True, blank=True, on_delete=models.SET_NULL)
    credits = _credits_field()
    credits_used = _credits_field(default=ZERO)
    price = _money_field()
    currency = models.CharField(max_length=3)
    purchased_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=Q(credits_used__gte=0) & Q(credits_used__lte=F("credits")),
                name="pack_used_within_credits",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.credits_used}/{self.credits} credits ({self.subscription})"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self.public_id:
            self.public_id = public_id("cpk")
        super().save(*args, **kwargs)

    @property
    def credits_left(self) -> Decimal:
        return self.credits - self.credits_used


class TokenPlanUsage(models.Model):
    """Ledger: the credits one usage event consumed, written once per (subscription, request).

    ``plan_credits`` count against the window and period caps; ``pack_credits`` came from
    credit packs; ``overage_credits`` were past every cap and billed at on-demand prices.
    """

    subscription = models.ForeignKey(
        Subscription, on_delete=models.CASCADE, related_name="usage_ledger"
    )
    request_id = models.CharField(max_length=200)
    event_time = models.DateTimeField()
    period_start = models.DateTimeField()
    plan_credits = _credits_field(default=ZERO)
    pack_credits = _credits_field(default=ZERO)
    overage_credits = _credits_field(default=ZERO)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["subscription", "event_time"])]
        constraints = [
            # Request ids are unique per organization (metering's idempotency key), and a
            # subscription belongs to one organization.
            models.UniqueConstraint(fields=["subscription", "request_id"],
                                    name="one_ledger_row_per_request"),
        ]

    def __str__(self) -> str:
        return f"{self.request_id}: {self.plan_credits} plan credits"


class TokenPlanPeriod(models.Model):
    """Running totals of a subscription's period (sums of its ledger rows in the period)."""

    subscription = models.ForeignKey(
        Subscription, on_delete=models.CASCADE, related_name="periods"
    )
    period_start = models.DateTimeField()
    period_end = models.DateTimeField()
    plan_credits = _credits_field(default=ZERO)
    pack_credits = _credits_field(default=ZERO)
    overage_credits = _credits_field(default=ZERO)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["subscription", "period_start"], name="one_row_per_plan_period"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.subscription} {self.period_start:%Y-%m-%d}: {self.plan_credits}"


# --- provisioned units -----------------------------------------------------------------------

class ProvisionedOffering(models.Model):
    """Provisioned throughput for sale: units of a model, each ``tokens_per_minute_per_unit``.

    Normalized tokens = uncached input + cached x ``cache_burndown`` + output x
    ``output_burndown``. Unit prices are per unit per hour or per month.
    """

    code = models.SlugField(max_length=60, unique=True)
    name = models.CharField(max_length=200)
    model = models.CharField(max_length=200)
    region = models.CharField(max_length=40, help_text="Engine region, e.g. us-east.")
    currency = models.CharField(max_length=3, default="USD")
    tokens_per_minute_per_unit = models.PositiveBigIntegerField()
    cache_burndown = _factor_field(default=ZERO)
    output_burndown = _factor_field(default=Decimal("1"))
    hourly_unit_price = _money_field()
    monthly_unit_price = _money_field()
    min_units = models.PositiveIntegerField(default=1)
    is_active = models.BooleanField(default=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=Q(cache_burndown__gte=0) & Q(output_burndown__gte=0)
                & Q(hourly_unit_price__gte=0) & Q(monthly_unit_price__gte=0),
                name="offering_non_negative",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.model} in {self.region})"


class Reservation(models.Model):
    """Units of provisioned throughput an organization holds for [starts_at, ends_at).

    The offering's terms are copied at purchase (a later price or burndown change does not
    touch a running reservation). Fee = units x unit_price x term_count.
    """

    public_id = models.CharField(max_length=40, unique=True, editable=False)
    organization = models.ForeignKey(
        Organization, on_delete=models.CASCADE, related_name="reservations"
    )
    offering = models.ForeignKey(
        ProvisionedOffering, on_delete=models.PROTECT, related_name="reservations"
    )
    model = models.CharField(max_length=200)
    region = models.CharField(max_length=40)
    units = models.PositiveIntegerField()
    term = models.CharField(max_length=8, choices=ReservationTerm.choices)
    term_count = models.PositiveIntegerField(default=1)
    unit_price = _money_field()
    currency = models.CharField(max_length=3)
    tokens_per_minute_per_unit = models.PositiveBigIntegerField()
    cache_burndown = _factor_field()
    output_burndown = _factor_field()
    overflow_policy = models.CharField(
        max_length=10, choices=OverflowPolicy.choices, default=OverflowPolicy.SPILLOVER
    )
    starts_at = models.DateTimeField()
    ends_at = models.DateTimeField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["organization", "model", "starts_at"])]
        constraints = [
            models.CheckConstraint(condition=Q(units__gte=1), name="reservation_has_units"),
            models.CheckConstraint(condition=Q(ends_at__gt=F("starts_at")),
                                   name="reservation_ends_after_start"),
        ]

    def __str__(self) -> str:
        return f"{self.units} x {self.model} in {self.region} ({self.organization})"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self.public_id:
            self.public_id = public_id("rsv")
        super().save(*args, **kwargs)

    @property
    def tokens_per_minute(self) -> int:
        return self.units * self.tokens_per_minute_per_unit

    @property
    def fee(self) -> Decimal:
        return self.units * self.unit_price * self.term_count

    def covers(self, at: datetime) -> bool:
        return self.starts_at <= at < self.ends_at


# --- credit grants ---------------------------------------------------------------------------

class CreditGrant(models.Model):
    """Money credited to an organization (promotional, purchased, credit note), with expiry.

    Invoicing applies grants oldest-expiry first (never-expiring last) via
    ``plans.services.credit_grants_apply``; ``remaining`` is what is left.
    """

    public_id = models.CharField(max_length=40, unique=True, editable=False)
    organization = models.ForeignKey(
        Organization, on_delete=models.CASCADE, related_name="credit_grants"
    )
    kind = models.CharField(max_length=16, choices=CreditGrantKind.choices)
    currency = models.CharField(max_length=3)
    amount = _money_field()
    remaining = _money_field()
    granted_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(null=True, blank=True)
    note = models.CharField(max_length=500, blank=True)
    created_by = models.ForeignKey(User, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")

    class Meta:
        indexes = [models.Index(fields=["organization", "currency", "expires_at"])]
        constraints = [
            models.CheckConstraint(
                condition=Q(amount__gt=0) & Q(remaining__gte=0) & Q(remaining__lte=F("amount")),
                name="grant_remaining_within_amount",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.remaining}/{self.amount} {self.currency}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self.public_id:
            self.public_id = public_id("cg")
        super().save(*args, **kwargs)


class CreditGrantApplication(models.Model):
    """One use of a grant against something (e.g. ``invoice:42``); unique per grant and ref."""

    grant = models.ForeignKey(CreditGrant, on_delete=models.PROTECT, related_name="applications")
    reference = models.CharField(max_length=200)
    amount = _money_field()
    applied_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["grant", "reference"], name="one_application_per_ref"),
            models.CheckConstraint(condition=Q(amount__gt=0), name="application_positive"),
        ]

    def __str__(self) -> str:
        return f"{self.amount} from {self.grant.public_id} for {self.reference}"


# --- quotas: rate limits, budgets, alerts ---------------------------------------------------

class QuotaLimit(models.Model):
    """Rate limits (and a region narrowing) for one organization, project or API key.

    Exactly one row per scope: the org row (project and key null), a project row (key null) or a
    key row. ``rpm``/``tpm`` null means "no limit at this scope" for projects and keys, and "the
    usage tier's default" for the org. ``allowed_regions`` empty means "no narrowing"; otherwise
    requests may only run in these regions (intersected with the org's data zone).
    """

    organization = models.ForeignKey(Organization, on_delete=models.CASCADE,
                                     related_name="quota_limits")
    project = models.ForeignKey("accounts.Project", null=True, blank=True,
                                on_delete=models.CASCADE, related_name="quota_limits")
    api_key = models.ForeignKey("accounts.ApiKey", null=True, blank=True,
                                on_delete=models.CASCADE, related_name="quota_limits")
    usage_tier = models.CharField(max_length=16, blank=True,
                                  help_text="Org row only: the default limits' tier.")
    rpm = models.PositiveBigIntegerField(null=True, blank=True,
                                         help_text="Requests per minute.")
    tpm = models.PositiveBigIntegerField(null=True, blank=True,
                                         help_text="Tokens per minute (prompt + max output).")
    allowed_regions = ArrayField(models.CharField(max_length=40), default=list, blank=True)
    set_by_role = models.CharField(
        max_length=16, blank=True,
        help_text="Role of whoever set this row last ('staff' for staff and the system; blank "
                  "before this was recorded). A row an owner, admin or staff set (or a blank "
                  "one) is changed or removed only by someone who may write the org.")
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["organization"],
                                    condition=Q(project__isnull=True, api_key__isnull=True),
                                    name="one_org_quota_limit"),
            models.UniqueConstraint(fields=["project"], condition=Q(api_key__isnull=True),
                                    name="one_project_quota_limit"),
            models.UniqueConstraint(fields=["api_key"], name="one_key_quota_limit"),
        ]

    def __str__(self) -> str:
        return f"limits {self.scope} rpm={self.rpm} tpm={self.tpm}"

    @property
    def scope(self) -> str:
        return self.scope_of(project_id=self.project_id, api_key_id=self.api_key_id)

    @staticmethod
    def scope_of(*, project_id: int | None, api_key_id: int | None) -> str:
        return "key" if api_key_id else "project" if project_id else "organization"


class Budget(models.Model):
    """A monthly spend budget of an organization (project null) or one project.

    ``amount`` is in the organization's currency per calendar month (UTC). A hard budget is
    never exceeded: admission reserves each request's worst-case cost. A soft one only alerts.
    ``suspended_at`` is set while a hard budget is exhausted (its keys get 429).
    """

    public_id = models.CharField(max_length=40, unique=True, editable=False)
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE,
                                     related_name="budgets")
    project = models.ForeignKey("accounts.Project", null=True, blank=True,
                                on_delete=models.CASCADE, related_name="budgets")
    amount = _money_field()
    currency = models.CharField(max_length=3)
    hard = models.BooleanField(default=True)
    thresholds = ArrayField(models.PositiveSmallIntegerField(), default=list,
                            help_text="Alert thresholds in percent, e.g. [50, 80, 100].")
    alert_emails = ArrayField(models.EmailField(), default=list, blank=True)
    webhook_url = models.URLField(blank=True)
    webhook_secret = models.CharField(max_length=80, blank=True, editable=False)
    suspended_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["organization"], condition=Q(project__isnull=True),
                                    name="one_org_budget"),
            models.UniqueConstraint(fields=["project"], name="one_project_budget"),
            models.CheckConstraint(condition=Q(amount__gt=0), name="budget_amount_positive"),
        ]

    def __str__(self) -> str:
        return f"budget {self.amount} {self.currency} ({'hard' if self.hard else 'soft'})"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self.public_id:
            self.public_id = public_id("bud")
        super().save(*args, **kwargs)


class EndUserBudget(models.Model):
    """A hard monthly spend limit on the requests of one of an organization's end users (the
    ``user`` a request names, as resellers name their own customers), or, with ``end_user``
    null, on each end user that has no limit of its own.

    ``amount`` is in the organization's currency per calendar month (UTC), spent across all
    its projects and keys; admission reserves each named request's worst case against it, so
    it is never exceeded. Requests that name no end user are not limited by it.
    """

    public_id = models.CharField(max_length=40, unique=True, editable=False)
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE,
                                     related_name="end_user_budgets")
    # NULL, not "": the default for every end user without a row of its own
    end_user = models.CharField(max_length=256, null=True, blank=True)  # noqa: DJ001
    amount = _money_field()
    currency = models.CharField(max_length=3)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["organization", "end_user"],
                                    name="one_budget_per_end_user"),
            models.UniqueConstraint(fields=["organization"], condition=Q(end_user__isnull=True),
                                    name="one_default_end_user_budget"),
            models.CheckConstraint(condition=Q(amount__gt=0),
                                   name="end_user_budget_amount_positive"),
        ]

    def __str__(self) -> str:
        return f"end-user budget {self.amount} {self.currency} ({self.end_user or 'each'})"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self.public_id:
            self.public_id = public_id("eub")
        super().save(*args, **kwargs)


class BudgetAlert(models.Model):
    """One threshold crossed in one period: sent at most once (the unique constraint).

    The row is also the webhook's delivery record (``plans.webhooks``): ``webhook_status`` is
    the last attempt's answer, ``webhook_delivered_at`` is set by the attempt that got a 2xx,
    and no attempt is made after it.
    """

    budget = models.ForeignKey(Budget, on_delete=models.CASCADE, related_name="alerts")
    period_start = models.DateTimeField()
    threshold = models.PositiveSmallIntegerField()
    spend = _money_field()
    email_sent_at = models.DateTimeField(null=True, blank=True)
    webhook_status = models.CharField(max_length=40, blank=True)
    webhook_attempts = models.PositiveSmallIntegerField(default=0)
    webhook_delivered_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["budget", "period_start", "threshold"],
                                    name="one_alert_per_threshold_period"),
        ]

    def __str__(self) -> str:
        return f"{self.threshold}% of {self.budget_id} at {self.period_start:%Y-%m}"


class WebhookEndpoint(models.Model):
    """An organization's webhook endpoint: each of its events (``WebhookEvent``) is posted to
    it, signed with ``secret`` (``plans.webhooks`` documents the scheme). The secret is shown
    once, when the endpoint is made; the platform keeps it, as it must to sign. A disabled
    endpoint keeps its delivery log and receives nothing."""

    public_id = models.CharField(max_length=40, unique=True, editable=False)
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE,
                                     related_name="webhook_endpoints")
    url = models.URLField(max_length=2000)
    description = models.CharField(max_length=200, blank=True)
    secret = models.CharField(max_length=80, editable=False)
    created_at = models.DateTimeField(default=timezone.now)
    disabled_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"webhook endpoint {self.url}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self.public_id:
            self.public_id = public_id("we")
        super().save(*args, **kwargs)


class WebhookDelivery(models.Model):
    """One event for one endpoint: posted until it is answered 2xx, at most once after that
    (the unique constraint, and the row locked for each attempt). ``payload`` is the exact body
    sent on every attempt; ``event_id`` goes in ``Tollgate-Webhook-Id`` for receivers to
    deduplicate on."""

    public_id = models.CharField(max_length=40, unique=True, editable=False)
    endpoint = models.ForeignKey(WebhookEndpoint, on_delete=models.CASCADE,
                                 related_name="deliveries")
    event_type = models.CharField(max_length=64, choices=WebhookEvent.choices)
    event_id = models.CharField(max_length=64)
    payload = models.TextField()
    status = models.CharField(max_length=16, choices=WebhookDeliveryStatus.choices,
                              default=WebhookDeliveryStatus.PENDING)
    attempts = models.PositiveSmallIntegerField(default=0)
    last_status = models.CharField(max_length=40, blank=True)
    delivered_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["endpoint", "event_id"],
                                    name="one_delivery_per_endpoint_event"),
        ]
        indexes = [models.Index(fields=["endpoint", "-created_at"],
                                name="webhook_delivery_log")]

    def __str__(self) -> str:
        return f"{self.event_type} {self.event_id} -> {self.endpoint_id}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self.public_id:
            self.public_id = public_id("wd")
        super().save(*args, **kwargs)


class WebhookAttempt(models.Model):
    """One POST of a delivery: when, what the endpoint answered, how long it took."""

    delivery = models.ForeignKey(WebhookDelivery, on_delete=models.CASCADE,
                                 related_name="attempt_log")
    at = models.DateTimeField(default=timezone.now)
    status = models.CharField(max_length=40)
    duration_ms = models.PositiveIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.status} at {self.at:%Y-%m-%d %H:%M:%S}"
