"""The policy of one (key, model), read from PostgreSQL: limits, budgets, plan credits, capacity.

Why a module of its own: this is the only part of admission that reads the database. The
runtime calls it off the request path (in a thread, about every ``POLICY_TTL_S`` per key and
model) and caches what it returns; the scripts never see PostgreSQL. It used to live in
``plans.quotas``, which made quotas and admission import each other; now quotas (budgets)
uses admission's key names and scripts, and admission imports nothing of quotas.
"""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, NamedTuple

from django.conf import settings
from django.db.models import Min, Q, Sum
from django.db.models.functions import TruncMinute
from django.utils import timezone

from billing_platform.accounts.models import Organization
from billing_platform.compiled_sql import CompiledQuery, rows_of
from metering.selectors import end_user_spend, rated_spend_query
from plans.admission.policy import (
    DEFAULT_USAGE_TIER,
    USAGE_TIERS,
    BudgetRule,
    EndUserLimits,
    ProvisionedRule,
    QuotaPolicy,
    WindowRule,
    to_micro,
)
from plans.choices import ANY_MODEL, CapPolicy, OverflowPolicy, PlanKind
from plans.models import (
    Budget,
    CreditCoefficient,
    EndUserBudget,
    Plan,
    PriceBook,
    QuotaLimit,
    Subscription,
)
from plans.periods import month_bounds, period_bounds
from plans.pricing import ModelPricing, PriceIndex
from plans.selectors import (
    TokenPlanStatus,
    active_reservations,
    credit_packs_in_force,
    subscriptions_at,
    token_plan_period,
    token_plan_status_of,
    token_plan_window_usage,
)

# A gateway process reloads each (key, model) policy about every QUOTA_POLICY_TTL_S, so a
# quiet tenant's request nearly always comes with a reload: the reads below are the ORM's
# queries compiled once and sent as one statement string (``CompiledQuery``, ``rows_of``).
# An organization with a subscription reads it with its plan in a second round trip (model
# instances built from the row: joined into the first, the plan's columns cost every reload
# ~0.1 ms more of PostgreSQL's planning, subscription or not); a token plan's credits (period
# totals, window, packs, coefficients) are a third.
_ORG, _PROJECT, _KEY, _MODEL = -9_000_001, -9_000_002, -9_000_003, "<model>"
_SUB, _PLAN = -9_000_004, -9_000_005
_AT, _START, _END = (datetime(1901, 1, 1, 0, 0, s, tzinfo=UTC) for s in (1, 2, 3))
_SUB_FIELDS = tuple(f.attname for f in Subscription._meta.concrete_fields)
_PLAN_FIELDS = tuple(f.attname for f in Plan._meta.concrete_fields)


class _LimitRow(NamedTuple):
    project_id: int | None
    api_key_id: int | None
    usage_tier: str
    rpm: int | None
    tpm: int | None
    allowed_regions: list[str]


_LIMITS = CompiledQuery(lambda org, project, key: QuotaLimit.objects.filter(
    Q(organization_id=org, project__isnull=True, api_key__isnull=True)
    | Q(project_id=project, api_key__isnull=True) | Q(api_key_id=key)
).values_list(*_LimitRow._fields), org=_ORG, project=_PROJECT, key=_KEY)
_CURRENCY = CompiledQuery(lambda org: Organization.objects.filter(pk=org).values_list(
    "currency"), org=_ORG)
_BUDGETS = CompiledQuery(lambda org, project: Budget.objects.filter(
    Q(organization_id=org, project__isnull=True) | Q(project_id=project)
).order_by("project_id").values_list("id", "project_id", "amount", "hard", "suspended_at"),
    org=_ORG, project=_PROJECT)
_SPEND = CompiledQuery(lambda org, project, start, end: rated_spend_query(
    organization_id=org, project_id=project, start=start, end=end),
    org=_ORG, project=_PROJECT, start=_START, end=_END)
_SUBSCRIPTION = CompiledQuery(lambda org, at: subscriptions_at(
    organization_id=org, at=at).order_by("pk").values_list("pk")[:1], org=_ORG, at=_AT)
_RESERVATION = CompiledQuery(lambda org, at, model: active_reservations(
    organization_id=org, at=at).filter(model=model).order_by("pk").values_list(
    "id", "region", "units", "tokens_per_minute_per_unit", "cache_burndown", "output_burndown",
    "overflow_policy")[:1], org=_ORG, at=_AT, model=_MODEL)
_END_USERS = CompiledQuery(lambda org: EndUserBudget.objects.filter(
    organization_id=org).values_list("id", "end_user", "amount"), org=_ORG)
_SUBSCRIPTION_ROW = CompiledQuery(lambda sub: Subscription.objects.filter(pk=sub).values_list(
    *_SUB_FIELDS, *(f"plan__{f}" for f in _PLAN_FIELDS)), sub=_SUB)
# a token plan's: `start` is its period's start, `since` its rolling window's
_PERIOD = CompiledQuery(lambda sub, start: token_plan_period(
    subscription_id=sub, period_start=start).values_list(
    "plan_credits", "pack_credits", "overage_credits")[:1], sub=_SUB, start=_START)
_WINDOW = CompiledQuery(lambda sub, since, at: token_plan_window_usage(
    subscription_id=sub, since=since, at=at).order_by().values("subscription_id").annotate(
    used=Sum("plan_credits"), oldest=Min("event_time")).values_list("used", "oldest"),
    sub=_SUB, since=_START, at=_AT)
_WINDOW_MINUTES = CompiledQuery(lambda sub, since, at: token_plan_window_usage(
    subscription_id=sub, since=since, at=at).annotate(
    minute=TruncMinute("event_time", tzinfo=UTC)).values("minute").annotate(
    credits=Sum("plan_credits")).values_list("minute", "credits"),
    sub=_SUB, since=_START, at=_AT)
_PACKS = CompiledQuery(lambda sub, at: credit_packs_in_force(
    subscription_id=sub, at=at).values_list("credits", "credits_used"), sub=_SUB, at=_AT)
_COEFFICIENTS = CompiledQuery(lambda plan: CreditCoefficient.objects.filter(
    plan_id=plan).values_list("model", "token_class", "coefficient"), plan=_PLAN)


def limits_of(*, organization_id: int, project_id: int, key_id: int
              ) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...],
                         frozenset[str] | None]:
    """Return the (rpm, tpm) limits per scope and the region narrowing for one key."""
    return _limits(organization_id, project_id, key_id, _LIMITS.rows(
        org=organization_id, project=project_id, key=key_id))


def _limits(organization_id: int, project_id: int, key_id: int, limit_rows: list[tuple[Any, ...]]
            ) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...],
                       frozenset[str] | None]:
    rows = {QuotaLimit.scope_of(project_id=row.project_id, api_key_id=row.api_key_id): row
            for row in map(_LimitRow._make, limit_rows)}
    org = rows.get("organization")
    tier_rpm, tier_tpm = USAGE_TIERS[(org.usage_tier if org and org.usage_tier
                                      else DEFAULT_USAGE_TIER)]
    rpm = [(f"o{organization_id}", org.rpm if org and org.rpm is not None else tier_rpm)]
    tpm = [(f"o{organization_id}", org.tpm if org and org.tpm is not None else tier_tpm)]
    regions: frozenset[str] | None = None
    for scope, tag in (("project", f"p{project_id}"), ("key", f"k{key_id}")):
        row = rows.get(scope)
        if row is None:
            continue
        if row.rpm is not None:
            rpm.append((tag, row.rpm))
        if row.tpm is not None:
            tpm.append((tag, row.tpm))
        if row.allowed_regions:
            mine = frozenset(row.allowed_regions)
            regions = mine if regions is None else regions & mine
    if org and org.allowed_regions:
        mine = frozenset(org.allowed_regions)
        regions = mine if regions is None else regions & mine
    return tuple(rpm), tuple(tpm), regions


# A price book's pricing of a model is what every key's policy reads alike (six of the twelve
# queries of a policy, about half its CPU): it is read once per QUOTA_POLICY_TTL_S for all the
# keys of this process, not once per key and model. A policy cached for up to the TTL may so
# hold pricing read up to a TTL before it: a price version in force from now reaches admission
# within two TTLs (4 s by default) instead of one. Admission prices only the worst case it
# reserves against hard budgets and plan credits; what is charged is rated at ingest from the
# ledger's own read. Loads run in executor threads; a race reads twice and keeps the later.
# (plan book or None, currency, model) -> (when read, monotonic; the pricing in effect then)
_pricing_reads: dict[tuple[int | None, str, str], tuple[float, ModelPricing | None]] = {}
_PRICING_READS_MAX = 10_000


def _pricing_for(org_currency: str, sub: Subscription | None, model: str, at: datetime
                 ) -> ModelPricing | None:
    book_id = sub.plan.price_book_id if sub is not None and sub.plan.price_book_id else None
    currency = sub.plan.currency if sub is not None else org_currency
    key, now = (book_id, currency, model), time.monotonic()
    hit = _pricing_reads.get(key)
    if hit is not None and now - hit[0] < settings.QUOTA_POLICY_TTL_S:
        return hit[1]
    pricing = _book_pricing(book_id, currency, model, at)
    if len(_pricing_reads) >= _PRICING_READS_MAX:
        _pricing_reads.clear()
    _pricing_reads[key] = (now, pricing)
    return pricing


def forget_pricing_reads() -> None:
    """Drop the pricing reads kept for the TTL (a test's database is not the last test's)."""
    _pricing_reads.clear()


def _book_pricing(book_id: int | None, currency: str, model: str, at: datetime
                  ) -> ModelPricing | None:
    if book_id is None:
        book_id = (PriceBook.objects.filter(is_default=True, currency=currency)
                   .values_list("id", flat=True).first())
    if book_id is None:
        return None
    times, pricings = PriceIndex({book_id}, {model}, at, at).series(book_id, model)
    candidates = [p for t, p in zip(times, pricings, strict=True) if t <= at]
    return candidates[-1] if candidates else None


def _plan_exhausted(status: TokenPlanStatus | None) -> str:
    if status is None or status.cap_policy != CapPolicy.BLOCK or status.credits_left > 0:
        return ""
    if status.window_credits is not None and status.window_used >= status.window_credits:
        return f"the {status.window_hours}-hour window's credits are used up"
    return "this period's credits are used up"


def _coefficients(rows: list[tuple[Any, ...]], model: str
                  ) -> tuple[Decimal, Decimal, Decimal] | None:
    """Return the plan's credit coefficients of ``model`` (its own, else the plan's any-model
    row) as (input, cached input, output), or None where the model is not on the plan."""
    coefs: dict[str, dict[str, Decimal]] = {}
    for m, cls, c in rows:
        coefs.setdefault(m, {})[cls] = c
    mine = coefs.get(model) or coefs.get(ANY_MODEL)
    if mine is None:
        return None
    zero = Decimal("0")
    return mine.get("input", zero), mine.get("cached_input", zero), mine.get("output", zero)


class _TokenPlan(NamedTuple):
    """A token plan's reads at one instant, for the three rules that depend on them."""

    status: TokenPlanStatus
    period: tuple[Decimal, Decimal] | None  # the period row's (plan credits, pack credits)
    # where the plan blocks at its cap, the model's coefficients (None otherwise, or where the
    # model is not on the plan: rated on demand, nothing to block)
    mine: tuple[Decimal, Decimal, Decimal] | None
    minutes: list[tuple[Any, ...]]  # (minute, plan credits) in the window, where it blocks


def _token_plan(sub: Subscription, model: str, at: datetime) -> _TokenPlan | None:
    """Read a token plan's credits now in one round trip (None for any other plan)."""
    plan = sub.plan
    if plan.kind != PlanKind.TOKEN_PLAN:
        return None
    start, end = period_bounds(sub.billing_anchor, at)
    blocks = plan.cap_policy == CapPolicy.BLOCK
    queries = [_PERIOD, _WINDOW, _PACKS] + ([_COEFFICIENTS, _WINDOW_MINUTES] if blocks else [])
    period, window, packs, *blocking = rows_of(
        *queries, sub=sub.pk, plan=plan.pk, start=start, at=at,
        since=at - timedelta(hours=plan.window_hours))
    used, oldest = window[0] if window else (None, None)
    status = token_plan_status_of(
        plan, start=start, end=end, period=(period[0][0], period[0][2]) if period else None,
        window_used=used, window_oldest=oldest,
        pack_credits_left=sum((credits - spent for credits, spent in packs), Decimal("0")))
    return _TokenPlan(
        status=status, period=(period[0][0], period[0][1]) if period else None,
        mine=_coefficients(blocking[0], model) if blocking else None,
        minutes=blocking[1] if blocking else [])


def _plan_rule(sub: Subscription | None, plan: _TokenPlan | None) -> BudgetRule | None:
    """Return a blocking token plan's period credits as an admission rule (None otherwise)."""
    if sub is None or plan is None or plan.mine is None or not sub.plan.credits_per_period:
        return None
    zero = Decimal("0")
    plan_used, pack_used = plan.period or (zero, zero)
    return BudgetRule(
        budget_id=sub.id, scope="plan", hard=True, suspended=False,
        limit=sub.plan.credits_per_period + plan.status.pack_credits_left + pack_used,
        spent_seed=plan_used + pack_used, period_tag=f"{plan.status.period_start:%Y%m%d%H}",
        coefficients=plan.mine)


def _window_rule(sub: Subscription | None, plan: _TokenPlan | None) -> WindowRule | None:
    """Return a blocking token plan's rolling window as an admission rule (None otherwise).

    The limit adds the credit packs left, as the period rule does: past the window's room the
    ledger draws on packs before blocking. The seed is the ledger's plan credits per minute
    still in the window, used by Redis only when it holds no window for the subscription.
    """
    if sub is None or plan is None or plan.mine is None or sub.plan.window_credits is None:
        return None
    # truncated in UTC: a plain cursor reads the minute naive, the ORM aware
    seed = tuple(sorted(
        (int((m if m.tzinfo else m.replace(tzinfo=UTC)).timestamp()) // 60, to_micro(credits))
        for m, credits in plan.minutes))
    return WindowRule(
        subscription_id=sub.id, hours=sub.plan.window_hours,
        limit=sub.plan.window_credits + plan.status.pack_credits_left, coefficients=plan.mine,
        seed=seed)


def _provisioned(rows: list[tuple[Any, ...]]) -> ProvisionedRule | None:
    if not rows:
        return None
    pk, region, units, per_unit, cache_burndown, output_burndown, overflow = rows[0]
    return ProvisionedRule(
        reservation_id=pk, region=region, tokens_per_minute=units * per_unit,
        cache_burndown=cache_burndown, output_burndown=output_burndown,
        reject_overflow=overflow == OverflowPolicy.REJECT)


def quota_policy_load(*, organization_id: int, project_id: int, key_id: int, model: str
                      ) -> QuotaPolicy:
    """Return what admission enforces for one key and model, read from PostgreSQL."""
    now = timezone.now()
    start, end = month_bounds(now)
    currency, limit_rows, budget_rows, spend, sub_rows, reservation, end_users = rows_of(
        _CURRENCY, _LIMITS, _BUDGETS, _SPEND, _SUBSCRIPTION, _RESERVATION, _END_USERS,
        org=organization_id, project=project_id, key=key_id, model=model, at=now, start=start,
        end=end)
    if not currency:
        raise Organization.DoesNotExist(f"no organization {organization_id}")
    rpm, tpm, regions = _limits(organization_id, project_id, key_id, limit_rows)
    org_spend, project_spend = spend[0] if spend else (None, None)
    budgets = [BudgetRule(
        budget_id=pk, scope="project" if budget_project else "organization", limit=amount,
        hard=hard, spent_seed=(project_spend if budget_project else org_spend) or Decimal("0"),
        suspended=suspended_at is not None)
        for pk, budget_project, amount, hard, suspended_at in budget_rows]
    # org budget first, then the project's (the order of the spend-limit codes' precedence)
    budgets.sort(key=lambda b: b.scope != "organization")
    # read once: four rules depend on it. Most organizations have none
    sub = _subscription(sub_rows[0][0]) if sub_rows else None
    # a token plan's credits now (None for any other plan): read once for the three rules
    token_plan = _token_plan(sub, model, now) if sub is not None else None
    status = token_plan.status if token_plan is not None else None
    plan_rule = _plan_rule(sub, token_plan)
    if plan_rule is not None:
        budgets.append(plan_rule)
    return QuotaPolicy(
        org_id=organization_id, project_id=project_id, key_id=key_id, rpm=rpm, tpm=tpm,
        budgets=tuple(budgets), pricing=_pricing_for(currency[0][0], sub, model, now),
        allowed_regions=regions, provisioned=_provisioned(reservation),
        plan_exhausted=_plan_exhausted(status), currency=currency[0][0],
        window=_window_rule(sub, token_plan), end_users=_end_user_limits(end_users))


def _subscription(pk: int) -> Subscription | None:
    """Return a subscription with its plan, as the ORM would load them (``select_related``;
    every column read, none deferred); None when it was deleted since it was found."""
    rows = _SUBSCRIPTION_ROW.rows(sub=pk)
    if not rows:
        return None
    row = rows[0]
    sub = Subscription.from_db("default", _SUB_FIELDS, row[:len(_SUB_FIELDS)])
    sub.plan = Plan.from_db("default", _PLAN_FIELDS, row[len(_SUB_FIELDS):])
    return sub


def _end_user_limits(rows: list[tuple[Any, ...]]) -> EndUserLimits | None:
    if not rows:
        return None
    named = {user: (pk, amount) for pk, user, amount in rows if user is not None}
    default = next(((pk, amount) for pk, user, amount in rows if user is None), None)
    return EndUserLimits(default=default, named=named)


def end_user_seed(*, organization_id: int, rule: BudgetRule) -> BudgetRule:
    """Return ``rule`` (an end user's) seeded with that end user's rated spend this month:
    read only when Redis holds no spend for it yet (the first request of the month, or after
    Redis lost it)."""
    start, end = month_bounds(timezone.now())
    return replace(rule, spent_seed=end_user_spend(organization_id=organization_id,
                                                   end_user=rule.end_user, start=start,
                                                   end=end))
