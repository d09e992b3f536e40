"""Console dashboard (issue 19 item 1): this month's spend against the budget with a forecast
to the month's end, tokens by model per day, the cache hit rate and what caching saved,
requests by tier and outcome, the top projects and keys, and the upcoming invoice's total.

Every usage figure comes from ``metering.selectors.usage_summary``, the selector behind
``GET /api/v1/usage``, over the same range (this calendar month, UTC, through the current
hour), so the charts, the tables and the API agree to the token and the last decimal place.
The chart data rides in ``json_script`` blocks that ``console/dashboard_charts.js`` draws
(no inline script: the Content-Security-Policy forbids it); amounts travel as decimal strings.

Rejected requests (429) are not here: admission refuses them before any usage event exists,
and the gateway counts them only in Prometheus (``tollgate_gateway_requests_total`` by status
and error code, platform-wide, not per organization). What the rollups store per organization
is the outcome of the requests that ran: ok, engine error, client aborted.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any, cast

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone

from billing_platform.accounts.models import ApiKey
from billing_platform.accounts.selectors import OrgAccess
from billing_platform.console.views import org_page
from billing_platform.db import replica_report
from metering.selectors import UsageBucket, UsageFilter, usage_summary
from plans import refusals
from plans.cache_savings import CachedUsage, cache_savings
from plans.periods import month_bounds
from plans.pricing import quantize_amount
from plans.quotas import budgets_of

TOP = 5  # projects and keys listed
ZERO = Decimal("0")
DAY = timedelta(days=1)


@dataclass(frozen=True)
class Forecast:
    """Spend so far in the month, its daily run-rate, and the month's end at that rate."""

    spent: Decimal
    per_day: Decimal
    at_end: Decimal


def month_range(now: datetime) -> tuple[datetime, datetime, datetime]:
    """Return the calendar month of ``now`` (start, end) and the end of the current hour:
    the range the dashboard sums, as ``GET /api/v1/usage``'s defaults are."""
    start, end = month_bounds(now)
    return start, end, min(now.replace(minute=0, second=0, microsecond=0)
                           + timedelta(hours=1), end)


def forecast(*, spent: Decimal, start: datetime, end: datetime, now: datetime) -> Forecast:
    """Return the linear forecast: spend so far / days elapsed, run on to the period's end."""
    elapsed = Decimal(int((now - start).total_seconds() * 1_000_000))  # microseconds
    whole = Decimal(int((end - start).total_seconds() * 1_000_000))
    if elapsed <= 0:
        return Forecast(spent, ZERO, spent)
    return Forecast(spent, quantize_amount(spent * 86_400_000_000 / elapsed),
                    quantize_amount(spent * whole / elapsed))


def budget_reached(*, spent: Decimal, budget: Decimal, start: datetime, end: datetime,
                   now: datetime) -> date | None:
    """Return the day the forecast line crosses ``budget`` before the period ends, else None
    (already past it: today)."""
    if spent >= budget:
        return now.date()
    elapsed = int((now - start).total_seconds() * 1_000_000)
    if spent <= 0 or elapsed <= 0:
        return None
    at = start + timedelta(microseconds=int(budget * elapsed / spent))
    return at.date() if at < end else None


def _days(start: datetime, end: datetime) -> list[date]:
    first, count = start.date(), (end - start) // DAY
    return [first + timedelta(days=i) for i in range(count)]


def _spend_chart(days: list[date], spend: dict[date, Decimal], *, start: datetime,
                 end: datetime, now: datetime, budget: Decimal | None) -> dict[str, Any]:
    """Cumulative spend by day through today, then the forecast from today's point on."""
    today = now.date()
    actual: list[str | None] = []
    ahead: list[str | None] = []
    running = ZERO
    total = sum(spend.values(), ZERO)
    fc = forecast(spent=total, start=start, end=end, now=now)
    elapsed = Decimal(int((now - start).total_seconds() * 1_000_000))
    for day in days:
        if day <= today:
            running += spend.get(day, ZERO)
            actual.append(str(running))
        else:
            actual.append(None)
        if day < today or elapsed <= 0:
            ahead.append(None)
        elif day == today:
            ahead.append(str(total))
        else:
            day_end = datetime(day.year, day.month, day.day, tzinfo=UTC) + DAY
            until = Decimal(int((day_end - start).total_seconds() * 1_000_000))
            ahead.append(str(quantize_amount(total * until / elapsed)))
    datasets: list[dict[str, Any]] = [
        {"label": "Spend so far", "data": actual},
        {"label": "Forecast", "data": ahead, "dashed": True},
    ]
    if budget is not None:
        datasets.append({"label": "Budget", "data": [str(budget)] * len(days), "flat": True})
    return {"type": "line", "labels": [d.isoformat() for d in days], "datasets": datasets,
            "forecast_at_end": str(fc.at_end)}


def _tokens_chart(days: list[date], rows: list[UsageBucket]) -> dict[str, Any]:
    """Tokens (prompt + completion, as the API's ``total_tokens``) per day, a stack per model."""
    per: dict[str, dict[date, int]] = defaultdict(lambda: defaultdict(int))
    for r in rows:
        per[cast(str, r.group["model"])][cast(date, r.group["day"])] += r.total_tokens
    return {"type": "bar", "stacked": True, "labels": [d.isoformat() for d in days],
            "datasets": [{"label": model, "data": [per[model].get(d, 0) for d in days]}
                         for model in sorted(per)]}


def _outcomes(rows: list[UsageBucket]) -> list[dict[str, Any]]:
    tiers: dict[str, dict[str, int]] = {}
    for r in rows:
        t = tiers.setdefault(cast(str, r.group["service_tier"]),
                             {"requests": 0, "errors": 0, "aborted": 0})
        t["requests"] += r.requests
        t["errors"] += r.error_requests
        t["aborted"] += r.aborted_requests
    return [{"tier": tier, **t, "ok": t["requests"] - t["errors"] - t["aborted"]}
            for tier, t in sorted(tiers.items())]


def _top(rows: list[UsageBucket], currency: str, names: dict[str | None, str]
         ) -> list[dict[str, Any]]:
    ranked = sorted((r for r in rows if r.currency == currency),
                    key=lambda r: (-r.amount, -r.total_tokens, str(r.group)))[:TOP]
    return [{"id": r.group[next(iter(r.group))], "name": names.get(
        cast("str | None", r.group[next(iter(r.group))]), ""), "bucket": r} for r in ranked]


def dashboard_context(access: OrgAccess, now: datetime) -> dict[str, Any]:
    """Return what the dashboard shows for ``access``'s organization at ``now``."""
    org = access.organization
    start, end, through = month_range(now)
    usage_filter = UsageFilter(org_id=org.pk, start=start, end=through)
    rows = usage_summary(usage_filter=usage_filter,
                         group_by=("day", "model", "service_tier", "capacity_source"))
    currencies = sorted({r.currency for r in rows})
    currency = org.currency if not currencies or org.currency in currencies else currencies[0]
    mine = [r for r in rows if r.currency == currency]
    spend: dict[date, Decimal] = defaultdict(lambda: ZERO)
    for r in mine:
        spend[cast(date, r.group["day"])] += r.amount
    spent = sum(spend.values(), ZERO)
    budget = next((b for b in budgets_of(organization=org) if b.project_id is None), None)
    on_chart = budget.amount if budget is not None and budget.currency == currency else None
    days = _days(start, end)
    prompt = sum(r.prompt_tokens for r in rows)
    cached = sum(r.cached_tokens for r in rows)
    savings = cache_savings(organization=org, at=now, usage=[
        CachedUsage(at=datetime.combine(cast(date, r.group["day"]), datetime.min.time(), UTC),
                    model=cast(str, r.group["model"]),
                    service_tier=cast(str, r.group["service_tier"]),
                    capacity_source=cast(str, r.group["capacity_source"]),
                    currency=r.currency, requests=r.requests, prompt_tokens=r.prompt_tokens,
                    cached_tokens=r.cached_tokens) for r in rows])
    projects = usage_summary(usage_filter=usage_filter, group_by=("project",))
    keys = usage_summary(usage_filter=usage_filter, group_by=("key",))
    key_names: dict[str | None, str] = dict(ApiKey.objects.filter(
        organization=org, public_id__in=[k.group["key"] for k in keys if k.group["key"]])
        .values_list("public_id", "name"))
    key_names[None] = "(no key: batch or external usage)"
    upcoming = None
    if access.can("billing.read"):
        from billing_platform.invoicing.selectors import upcoming_invoice

        upcoming = upcoming_invoice(organization=org, now=now)
    outcomes = _outcomes(rows)
    refused = [(refusals.reason_label(reason), n) for reason, n in
               refusals.refusals_by_reason(org_id=org.pk, start=start, end=through)]
    return {
        "projects": org.projects.order_by("created_at"),
        "active_keys": ApiKey.objects.filter(organization=org, revoked_at__isnull=True).count(),
        "members": org.memberships.count(),
        "start": start, "end": end, "through": through, "currency": currency,
        "other_currencies": [c for c in currencies if c != currency],
        "spent": spent, "budget": budget,
        "budget_percent": (spent * 100 / budget.amount).quantize(Decimal("0.1"))
        if budget is not None and budget.currency == currency else None,
        "forecast": forecast(spent=spent, start=start, end=end, now=now),
        "budget_reached": budget_reached(spent=spent, budget=on_chart, start=start, end=end,
                                         now=now) if on_chart is not None else None,
        "spend_chart": _spend_chart(days, spend, start=start, end=end, now=now,
                                    budget=on_chart),
        "tokens_chart": _tokens_chart([d for d in days if d <= now.date()], rows),
        "requests_chart": {"type": "bar", "stacked": True,
                           "labels": [o["tier"] for o in outcomes],
                           "datasets": [{"label": label, "data": [o[k] for o in outcomes]}
                                        for label, k in (("OK", "ok"), ("Engine error", "errors"),
                                                         ("Client aborted", "aborted"))]},
        "outcomes": outcomes,
        "refused": refused,
        "refused_chart": {"type": "bar", "labels": [label for label, _n in refused],
                          "datasets": [{"label": "Refused (429)",
                                        "data": [n for _label, n in refused]}]},
        "requests": sum(r.requests for r in rows),
        "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_rate": f"{Decimal(cached * 100) / prompt:.1f}%" if prompt else "-",
        "savings": savings,
        "top_projects": _top(projects, currency, dict(
            org.projects.values_list("public_id", "name"))),
        "top_keys": _top(keys, currency, key_names),
        "upcoming": upcoming,
    }


@org_page()
@replica_report  # may lag the primary by DATABASE_REPLICA_MAX_LAG_S (billing_platform/db.py)
def dashboard(request: HttpRequest, access: OrgAccess) -> HttpResponse:
    return render(request, "console/dashboard.html", dashboard_context(access, timezone.now()))
