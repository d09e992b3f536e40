"""A period's usage read from whole months (the monthly summary), whole hours and cut hours.

``metering.selectors.usage_sums_for_periods`` reads a period's whole UTC calendar months off
``usage_rollup_monthly``, the whole hours outside them off the hourly rollups and the hours
its bounds cut off the events. Each event must count once, in the one period holding it.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db import DatabaseError, transaction

from billing_platform.invoicing import services
from billing_platform.invoicing.choices import LineKind
from billing_platform.invoicing.models import Invoice, InvoiceLine
from metering.models import UsageRollupHourly
from metering.selectors import usage_sums_for_periods
from tests.factories import make_billed_org
from tests.invoicing.conftest import DEC, NOV, OCT, record

SEP30 = datetime(2026, 9, 30, tzinfo=UTC)


def _tokens(org, periods):
    """Return the prompt tokens of each period of ``org``, in the order given."""
    got: dict[tuple[datetime, datetime], int] = {}
    for u in usage_sums_for_periods(periods=[(org.id, ps, pe) for ps, pe in periods]):
        key = (u.period_start, u.period_end)
        got[key] = got.get(key, 0) + u.prompt_tokens
    return [got.get(p, 0) for p in periods]


def test_a_period_of_whole_months_and_partial_hours_counts_each_event_once(catalog):
    # given events (powers of ten, so each sum names its events) around a period that runs
    # from Sep 30 22:30 to Nov 1 01:30: a cut hour, a whole hour, the whole of October (the
    # monthly summary), a whole hour after it and a cut hour at its end
    org = make_billed_org(name="Months", created_at=datetime(2026, 9, 1, tzinfo=UTC))
    usage = {
        SEP30 + timedelta(hours=22, minutes=10): 1,          # before the period
        SEP30 + timedelta(hours=22, minutes=40): 10,         # the cut first hour
        SEP30 + timedelta(hours=23, minutes=15): 100,        # a whole hour of September
        OCT: 1_000,                                          # October, its first instant
        OCT + timedelta(days=14, hours=7): 10_000,           # October
        NOV - timedelta(microseconds=1): 100_000,            # October, its last instant
        NOV + timedelta(minutes=20): 1_000_000,              # a whole hour of November
        NOV + timedelta(hours=1, minutes=10): 10_000_000,    # the cut last hour
        NOV + timedelta(hours=1, minutes=40): 100_000_000,   # after the period
    }
    for i, (when, tokens) in enumerate(usage.items()):
        record(org, f"months-{i}", when, prompt_tokens=tokens)
    start, end = SEP30 + timedelta(hours=22, minutes=30), NOV + timedelta(hours=1, minutes=30)

    # when its usage is read, with adjacent periods and the calendar month alone
    got = _tokens(org, [(SEP30, start), (start, end), (end, DEC), (OCT, NOV)])

    # then every event is in exactly the periods that hold its time
    assert got == [1, 11_111_110, 100_000_000, 111_000]


def test_a_month_whose_rollups_were_deleted_is_no_usage(catalog):
    # given October's usage recorded, then its hourly rollups deleted (the monthly summary
    # keeps the key with no rollups under it)
    org = make_billed_org(name="Deleted", created_at=datetime(2026, 9, 1, tzinfo=UTC))
    record(org, "deleted-1", OCT + timedelta(days=3), prompt_tokens=1_000)
    assert _tokens(org, [(OCT, NOV)]) == [1_000]
    UsageRollupHourly.objects.filter(organization=org).delete()

    # then the month has no usage, not a row of zeros
    assert usage_sums_for_periods(periods=[(org.id, OCT, NOV)]) == []


def test_lines_added_in_bulk_to_a_finalized_invoice_are_refused(catalog):
    # given a finalized invoice (period close) and a draft of another organization
    org = make_billed_org(name="Final", created_at=datetime(2026, 9, 1, tzinfo=UTC))
    record(org, "final-1", OCT + timedelta(days=3), prompt_tokens=1_000)
    services.period_close_run(now=NOV + timedelta(hours=1), enqueue_payments=False)
    invoice = Invoice.objects.get(organization=org, period_start=OCT)
    other = make_billed_org(name="Draft")
    draft = Invoice.objects.create(organization=other, currency="USD", period_start=OCT,
                                   period_end=NOV, kind="invoice")

    def line(inv, pos):
        return InvoiceLine(invoice=inv, position=pos, kind=LineKind.ADJUSTMENT,
                           description="added", amount_precise=0, amount=0)

    # when lines for the draft and one for the finalized invoice go in one statement
    with pytest.raises(DatabaseError, match="finalized"), transaction.atomic():
        InvoiceLine.objects.bulk_create([line(draft, 1), line(draft, 2), line(invoice, 99)])

    # then none of them is added; lines for drafts alone still go in
    assert not InvoiceLine.objects.filter(invoice=draft).exists()
    assert not invoice.lines.filter(position=99).exists()
    InvoiceLine.objects.bulk_create([line(draft, 1), line(draft, 2)])
    assert draft.lines.count() == 2
    draft.delete()  # a hand-made draft, not billed: the invariant reads the org's draft
