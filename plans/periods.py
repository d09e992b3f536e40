"""Calendar arithmetic for billing periods anchored at an instant (month to month)."""

from __future__ import annotations

import calendar
from datetime import UTC, datetime, timedelta


def add_months(anchor: datetime, months: int) -> datetime:
    """Return ``anchor`` moved by ``months`` calendar months, the day clamped to the month's end.

    Always computed from the anchor, never chained, so Jan 31 -> Feb 28 -> Mar 31.
    """
    years, month0 = divmod(anchor.month - 1 + months, 12)
    year = anchor.year + years
    month = month0 + 1
    day = min(anchor.day, calendar.monthrange(year, month)[1])
    return anchor.replace(year=year, month=month, day=day)


def period_bounds(anchor: datetime, at: datetime) -> tuple[datetime, datetime]:
    """Return the [start, end) month-long period anchored at ``anchor`` that contains ``at``."""
    n = (at.year - anchor.year) * 12 + (at.month - anchor.month)
    start = add_months(anchor, n)
    if start > at:
        n -= 1
        start = add_months(anchor, n)
    return start, add_months(anchor, n + 1)


def month_bounds(at: datetime) -> tuple[datetime, datetime]:
    """Return the calendar month [start, end) of ``at`` in UTC."""
    at = at.astimezone(UTC)
    start = datetime(at.year, at.month, 1, tzinfo=UTC)
    end = datetime(at.year + (at.month == 12), at.month % 12 + 1, 1, tzinfo=UTC)
    return start, end


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


def epoch_us(at: datetime) -> int:
    """Return an aware instant as integer microseconds since the Unix epoch (exact)."""
    return (at - _EPOCH) // _MICROSECOND


def from_epoch_us(us: int) -> datetime:
    """Return microseconds since the Unix epoch as an aware UTC instant."""
    return _EPOCH + timedelta(microseconds=us)
