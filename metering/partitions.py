"""Monthly partitions of ``usage_event``: created ahead by a beat task and on demand.

PostgreSQL rejects a row for which no partition exists, so every writer calls
``ensure_for(times)`` before its transaction: months already known to this process cost a set
lookup; a new month (a late or early event, or the first event of a month) costs one short
transaction that takes an advisory lock, so concurrent writers create each partition once. There
is deliberately no DEFAULT partition: rows parked there would block creating their month later.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, date, datetime

from django.db import connection, transaction

PARENT = "usage_event"
LOCK_KEY = 0x7467_7573  # "tgus": one advisory lock for partition DDL
_known: set[tuple[str, date]] = set()


def month_of(moment: datetime) -> date:
    """Return the first day of the UTC month that contains ``moment``."""
    moment = moment.astimezone(UTC)
    return date(moment.year, moment.month, 1)


def add_months(month: date, n: int) -> date:
    """Return the first day of the month ``n`` months after ``month``."""
    index = month.year * 12 + month.month - 1 + n
    return date(index // 12, index % 12 + 1, 1)


def partition_name(month: date) -> str:
    """Return the table name of the partition holding ``month``."""
    return f"{PARENT}_y{month.year:04d}m{month.month:02d}"


def _months_named(names: Iterable[str]) -> set[date]:
    months = set()
    for name in names:
        suffix = name.removeprefix(f"{PARENT}_y")
        if len(suffix) == 7 and suffix[4] == "m" and suffix[:4].isdigit() \
                and suffix[5:].isdigit():
            months.add(date(int(suffix[:4]), int(suffix[5:]), 1))
    return months


def existing() -> set[date]:
    """Return the months that have a partition in the database."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = %s::regclass", [PARENT],
        )
        return _months_named(row[0] for row in cur.fetchall())


def detached() -> set[date]:
    """Return the months whose table exists but is no partition any more (detached by
    ``metering.retention``, not dropped yet)."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT c.relname FROM pg_class c "
            "WHERE c.relnamespace = current_schema()::regnamespace AND c.relkind = 'r' "
            "AND NOT c.relispartition AND c.relname LIKE %s", [f"{PARENT}\\_y%"],
        )
        return _months_named(row[0] for row in cur.fetchall())


def ensure(months: Iterable[date]) -> list[str]:
    """Create the partitions of ``months`` that do not exist yet; return the names created."""
    db = connection.settings_dict["NAME"]
    wanted = {m for m in months if (db, m) not in _known}
    if not wanted:
        return []
    # Inside an outer transaction the DDL may still roll back: remember nothing then.
    durable = not connection.in_atomic_block
    created = []
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(%s)", [LOCK_KEY])
        have = existing()
        for month in sorted(wanted - have):
            upper = add_months(month, 1)
            cur.execute(
                f"CREATE TABLE {partition_name(month)} PARTITION OF {PARENT} "
                f"FOR VALUES FROM ('{month.isoformat()} 00:00:00+00') "
                f"TO ('{upper.isoformat()} 00:00:00+00')"
            )
            created.append(partition_name(month))
    if durable:
        _known.update((db, m) for m in wanted)
    return created


def ensure_for(times: Iterable[datetime]) -> list[str]:
    """Create the partitions needed for events at ``times``."""
    return ensure({month_of(t) for t in times})


def ensure_ahead(*, months_ahead: int = 2, now: datetime | None = None) -> list[str]:
    """Create this month's partition and the next ``months_ahead`` ones."""
    current = month_of(now or datetime.now(UTC))
    return ensure(add_months(current, n) for n in range(months_ahead + 1))


def forget_month(month: date) -> None:
    """Drop this process's memory of one month's partition (it was detached)."""
    _known.difference_update({k for k in _known if k[1] == month})


def forget() -> None:
    """Drop this process's memory of which partitions exist (after a database switch)."""
    _known.clear()
