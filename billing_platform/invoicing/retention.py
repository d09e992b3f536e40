"""Which months of usage events billing still reads, so metering's retention keeps them.

Metering retires a month's events (archives and drops its partition, ``metering.retention``)
only when it is older than the retention horizon and invoicing says it is done with it;
invoicing owns that answer, and calls metering (the arrow points this way). A month stays
while, for an organization with usage in it:

- an invoice overlapping it is a draft (period close is computing it: drafts live only inside
  its transaction);
- a billing period overlapping it reaches past the horizon: events for that period may still
  arrive, and a late one makes period close sum the whole period again;
- the organization (unless closed: nothing is invoiced for it any more) is not invoiced up to
  ``INVOICING_LATE_LOOKBACK_DAYS`` past the month's end: period close sums recent periods
  again for late usage (``builder._late``), and a period whose bounds are not on the hour is
  summed partly from its events;
- one of its periods overlapping the month received late usage since the lookback before its
  next period: the next close sums that period again too.

Invoices themselves never change once final, so a month found done stays done. Void,
uncollectible, open and paid invoices are final: their lines are fixed and their usage billed.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, date, datetime, timedelta

from django.conf import settings

from billing_platform.accounts.choices import OrgStatus
from billing_platform.accounts.models import Organization
from billing_platform.invoicing.choices import InvoiceKind, InvoiceStatus
from billing_platform.invoicing.models import Invoice
from billing_platform.invoicing.selectors import periods_open
from metering.selectors import usage_late_hours


def _month_bounds(month: date) -> tuple[datetime, datetime]:
    upper = date(month.year + month.month // 12, month.month % 12 + 1, 1)
    return (datetime(month.year, month.month, 1, tzinfo=UTC),
            datetime(upper.year, upper.month, 1, tzinfo=UTC))


def _span(start: datetime, end: datetime) -> str:
    return f"{start:%Y-%m-%d %H:%M} to {end:%Y-%m-%d %H:%M}"


def usage_months_held(orgs_by_month: Mapping[date, set[int]], horizon: datetime
                      ) -> dict[date, str]:
    """Return the months (first days, each with the organizations that have usage in it)
    whose events billing may still read, each with why; the module says when."""
    lookback = timedelta(days=settings.INVOICING_LATE_LOOKBACK_DAYS)
    org_ids = set().union(*orgs_by_month.values()) if orgs_by_month else set()
    closed = set(Organization.objects.filter(id__in=org_ids, status=OrgStatus.CLOSED)
                 .values_list("id", flat=True)) if org_ids else set()
    invoiced_to = {t.org_id: t.period_start for t in periods_open(org_ids=org_ids)
                   if t.org_id not in closed} if org_ids else {}
    late = usage_late_hours(since={org: start - lookback for org, start in invoiced_to.items()})
    held: dict[date, str] = {}
    for month in sorted(orgs_by_month):
        start, end = _month_bounds(month)
        overlapping = Invoice.objects.filter(period_start__lt=end, period_end__gt=start)
        draft = overlapping.filter(status=InvoiceStatus.DRAFT).order_by("id").first()
        if draft is not None:
            held[month] = (f"invoice {draft.public_id} of organization {draft.organization_id} "
                           f"({_span(draft.period_start, draft.period_end)}) is a draft: "
                           "period close is computing it")
            continue
        orgs = orgs_by_month[month]
        periods: dict[int, list[tuple[datetime, datetime]]] = {}
        for org, ps, pe in (overlapping.filter(kind=InvoiceKind.INVOICE, organization_id__in=orgs)
                            .values_list("organization_id", "period_start", "period_end")):
            periods.setdefault(org, []).append((ps, pe))
        held_why = _held_by_org(sorted(orgs), periods, closed=closed, invoiced_to=invoiced_to,
                                late=late, month_end=end, horizon=horizon, lookback=lookback)
        if held_why:
            held[month] = held_why
    return held


def _held_by_org(orgs: list[int], periods: Mapping[int, list[tuple[datetime, datetime]]], *,
                 closed: set[int], invoiced_to: Mapping[int, datetime],
                 late: Mapping[int, list[datetime]], month_end: datetime, horizon: datetime,
                 lookback: timedelta) -> str:
    """Return why the first of ``orgs`` that holds the month does, or "" when none does."""
    for org in orgs:
        own = periods.get(org, [])
        past = [(ps, pe) for ps, pe in own if pe > horizon]
        if past:
            return (f"organization {org}'s billing period {_span(*past[0])} reaches past the "
                    f"retention horizon {horizon:%Y-%m-%d}: events can still arrive for it")
        if org in closed:
            continue
        upto = invoiced_to[org]
        if upto < month_end + lookback:
            return (f"organization {org} is invoiced up to {upto:%Y-%m-%d}; period close "
                    f"sums periods up to {lookback.days} days before its next one again for "
                    "late usage, partly from their events")
        lo = min((ps for ps, _ in own), default=month_end)
        hi = max((pe for _, pe in own), default=month_end)
        hours = [h for h in late.get(org, ()) if lo <= h < hi]
        if hours:
            return (f"organization {org} received late usage for {hours[0]:%Y-%m-%d %H}:00 "
                    "recently; the next period close sums that period again")
    return ""

