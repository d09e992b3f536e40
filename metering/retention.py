"""Usage retention: old months of ``usage_event`` archived and dropped, and the idempotency
index (``usage_event_id``) bounded by the same horizon, so neither grows with all of history.

Settings (``metering.conf``; each a Django setting ``METERING_*`` or the environment):

- ``TOLLGATE_USAGE_RETENTION_MONTHS`` (default 0: keep every month, refuse nothing, the
  behaviour before retention existed). With N > 0 the *horizon* is the start of the UTC month
  N months before the current one: on 2026-12-02 with N = 3, 2026-09-01.
- ``TOLLGATE_USAGE_ARCHIVE_DIR`` (default ``.tollgate/usage-archive``): where retired months
  are archived. There is deliberately no "drop without archive" mode: usage is a financial
  record, and a provider that wants no archive deletes the files itself, knowingly.

What the horizon does (``retire``, run daily by beat; safe to run twice, or at once):

1. Events dated before it are refused wherever they enter: the usage API answers each with
   ``beyond_retention`` naming the horizon; the record path behind the stream consumer, spool
   replay and the PostgreSQL fallback dead-letters them with the same words (never a silent
   drop, never a consumer crash). Why: their idempotency keys are no longer kept (step 2), so
   the platform could not tell a late event from one it recorded already, and could bill it
   twice.
2. ``usage_event_id`` rows dated before it are deleted, ``ID_BATCH`` at a time (index
   ``usage_event_id_time``): the index stays about N + 1 months large.
3. A month's partition that ends at or before the horizon is retired once billing no longer
   reads its events; the caller says which months it still needs and why (``held``:
   invoicing's ``usage_months_held``: a draft being computed, a period not invoiced yet, one
   still rescanned for late usage). A held month is logged with its reason and tried again on
   the next run, so in practice a month goes a couple of months after the horizon passes it.
   Retiring is DETACH, archive, read the archive back and compare its row count with the
   table's, DROP. The archive is ``<dir>/usage_event_y2025m03.csv.gz`` (``COPY ... TO STDOUT``
   as CSV with a header row, gzip) and ``usage_event_y2025m03.json`` (table, month range,
   columns, rows, bytes, sha256 of the ``.csv.gz``), each written to a temporary name,
   fsync'd and renamed, the manifest last: a manifest means a complete archive. A run cut off
   part way finds the detached table (``partitions.detached``) next time and finishes it;
   there is no way back to a partition once it was detached.

What disappears with a retired month is its single events. Every sum stays: the hourly and
monthly rollups (usage API and console charts, budgets, finance reports), invoices and their
billed-usage ledger. Reads of single events find nothing for that month: the usage API and
explorer grouped by ``user``, per-request margins, the plan advisor over it, looking an event
up by its request id (``selectors.usage_event_get``; its key is gone with step 2 already).
Cost-to-serve shares of retired events (``usage_cost_share``) are kept.

Locks: a run holds the session advisory lock ``RETIRE_LOCK`` (a second run at the same time
returns at once, doing nothing); DETACH and DROP take the partition DDL lock
(``partitions.LOCK_KEY``) with a short ``lock_timeout``, so a busy table postpones a month to
the next run instead of queueing ingest behind DDL.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from pathlib import Path
from typing import IO

from django.db import OperationalError, connection, transaction

from billing_platform.errors import InvalidRequest
from metering import conf, partitions
from metering.events import I_TIME, Row

log = logging.getLogger(__name__)

RETIRE_LOCK = 0x7467_7572  # "tgur": one retention run at a time
ID_BATCH = 10_000
DDL_LOCK_TIMEOUT = "5s"
_CHUNK = 1 << 20

# month start -> organizations with usage in it  =>  month start -> why it must stay
HeldFn = Callable[[Mapping[date, set[int]], datetime], Mapping[date, str]]


class UsageBeyondRetention(InvalidRequest):
    """An event dated before the usage retention horizon: it is not recorded."""

    code = "beyond_retention"


def horizon(now: datetime | None = None) -> datetime | None:
    """Return the retention horizon (events before it are refused), or None: keep forever."""
    months = conf.usage_retention_months()
    if not months:
        return None
    first = partitions.add_months(partitions.month_of(now or datetime.now(UTC)), -months)
    return datetime(first.year, first.month, 1, tzinfo=UTC)


def beyond_message(limit: datetime) -> str:
    """Return why an event dated before ``limit`` (the horizon) is refused."""
    return (f"event_time is before {limit.isoformat()}, the usage retention horizon "
            f"({conf.usage_retention_months()} months, TOLLGATE_USAGE_RETENTION_MONTHS): the "
            "idempotency keys of older events are no longer kept, so the platform cannot tell "
            "whether this event was recorded already, and it could be billed twice. It was "
            "not recorded.")


def refuse_beyond_horizon(event_time: datetime, *, now: datetime | None = None) -> None:
    """Raise ``UsageBeyondRetention`` when ``event_time`` is before the horizon."""
    limit = horizon(now)
    if limit is not None and event_time < limit:
        raise UsageBeyondRetention(beyond_message(limit), param="event_time")


def split_beyond_horizon(rows: Sequence[Row]) -> tuple[list[Row], list[Row], datetime | None]:
    """Return (rows to record, rows dated before the horizon, the horizon).

    ``rows`` carry ``event_time`` as UTC ISO strings (``recording``'s form), which compare
    chronologically on their first 19 characters (to the second; the horizon is on one).
    """
    limit = horizon()
    if limit is None:
        return list(rows), [], None
    cut = limit.isoformat()[:19]
    keep: list[Row] = []
    beyond: list[Row] = []
    for r in rows:
        (beyond if r[I_TIME][:19] < cut else keep).append(r)
    return keep, beyond, limit


@dataclass
class RetireReport:
    """What one retention run did."""

    horizon: datetime | None = None
    retired: list[str] = field(default_factory=list)  # partitions archived and dropped
    archives: list[str] = field(default_factory=list)  # their .csv.gz paths
    held: dict[str, str] = field(default_factory=dict)  # partition -> why it stays
    ids_deleted: int = 0
    busy: bool = False  # another run held the lock: this one did nothing


def _month_range(month: date) -> tuple[datetime, datetime]:
    upper = partitions.add_months(month, 1)
    return (datetime(month.year, month.month, 1, tzinfo=UTC),
            datetime(upper.year, upper.month, 1, tzinfo=UTC))


def _orgs_by_month(months: Iterable[date]) -> dict[date, set[int]]:
    """Return the organizations with usage in each month (from the monthly rollups)."""
    wanted = {_month_range(m)[0]: m for m in months}
    out: dict[date, set[int]] = {m: set() for m in wanted.values()}
    if not wanted:
        return out
    with connection.cursor() as cur:
        cur.execute("SELECT DISTINCT month, organization_id FROM usage_rollup_monthly "
                    "WHERE rollups > 0 AND month = ANY(%s::timestamptz[])", [list(wanted)])
        for month, org in cur.fetchall():
            out[partitions.month_of(month)].add(org)
    return out


def _ddl(sql: str) -> bool:
    """Run partition DDL under the DDL lock; return False when the table was too busy."""
    try:
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute(f"SET LOCAL lock_timeout = '{DDL_LOCK_TIMEOUT}'")
            cur.execute("SELECT pg_advisory_xact_lock(%s)", [partitions.LOCK_KEY])
            cur.execute(sql)
    except OperationalError as exc:
        if getattr(exc.__cause__, "sqlstate", None) != "55P03":  # lock_not_available
            raise
        return False
    return True


def read_archive(path: Path) -> tuple[list[str], int, str, int]:
    """Return an archive's columns, rows, sha256 (of the file) and size, reading it through."""
    sha256 = hashlib.sha256()
    with path.open("rb") as raw:
        while chunk := raw.read(_CHUNK):
            sha256.update(chunk)
    with gzip.open(path, "rt", newline="", encoding="utf-8") as text:
        reader = csv.reader(text)
        columns = next(reader, [])
        rows = sum(1 for _ in reader)
    return columns, rows, sha256.hexdigest(), path.stat().st_size


def _write_atomically(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _table_rows(name: str) -> int:
    with connection.cursor() as cur:
        cur.execute(f"SELECT count(*) FROM {name}")  # noqa: S608 (our own table name)
        return int(cur.fetchone()[0])


def _archive(month: date, directory: Path) -> Path:
    """Archive a detached month's table (kept if a complete archive of it exists); return the
    .csv.gz path. Raise ``RuntimeError`` when the archive does not read back complete."""
    name = partitions.partition_name(month)
    directory.mkdir(parents=True, exist_ok=True)
    data, manifest = directory / f"{name}.csv.gz", directory / f"{name}.json"
    rows = _table_rows(name)
    if manifest.exists() and data.exists():
        kept = json.loads(manifest.read_text())
        columns, found, sha256, _ = read_archive(data)
        if kept.get("rows") == rows == found and kept.get("sha256") == sha256:
            return data

    def dump(out: IO[bytes]) -> None:
        connection.ensure_connection()
        with gzip.GzipFile(fileobj=out, mode="wb", mtime=0) as gz, \
                connection.connection.cursor() as cur, \
                cur.copy(f"COPY {name} TO STDOUT WITH (FORMAT csv, HEADER)") as copy:
            for chunk in copy:
                gz.write(chunk)

    _write_atomically(data, dump)
    columns, found, sha256, size = read_archive(data)
    if found != rows:
        raise RuntimeError(f"archive {data} holds {found} rows, table {name} {rows}")
    start, end = _month_range(month)
    body = {"table": name, "period_start": start.isoformat(), "period_end": end.isoformat(),
            "columns": columns, "rows": rows, "bytes": size, "sha256": sha256,
            "file": data.name, "format": "csv+gzip, header row",
            "archived_at": datetime.now(UTC).isoformat()}
    _write_atomically(manifest, lambda out: out.write(json.dumps(body, indent=1).encode()))
    return data


def _finish(month: date, directory: Path, report: RetireReport) -> None:
    """Archive and drop one detached month."""
    name = partitions.partition_name(month)
    data = _archive(month, directory)
    if not _ddl(f"DROP TABLE {name}"):
        report.held[name] = "detached and archived; its table was busy, dropped next run"
        log.warning("usage retention: %s archived to %s; DROP postponed (table busy)", name,
                    data)
        return
    report.retired.append(name)
    report.archives.append(str(data))
    log.info("usage retention: %s archived to %s and dropped", name, data)


def _prune_ids(limit: datetime) -> int:
    deleted = 0
    while True:
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute("DELETE FROM usage_event_id WHERE ctid = ANY(ARRAY("
                        "SELECT ctid FROM usage_event_id WHERE event_time < %s LIMIT %s))",
                        [limit, ID_BATCH])
            n: int = cur.rowcount
        deleted += n
        if n < ID_BATCH:
            return deleted


def retire(*, held: HeldFn, now: datetime | None = None) -> RetireReport:
    """Apply the retention horizon once: see the module. Return what was done."""
    report = RetireReport(horizon=horizon(now))
    limit = report.horizon
    if limit is None:
        return report
    with connection.cursor() as cur:
        cur.execute("SELECT pg_try_advisory_lock(%s)", [RETIRE_LOCK])
        if not cur.fetchone()[0]:
            log.info("usage retention: another run holds the lock; nothing done")
            report.busy = True
            return report
    try:
        directory = conf.usage_archive_dir()
        for month in sorted(m for m in partitions.detached() if _month_range(m)[1] <= limit):
            _finish(month, directory, report)  # cut off after DETACH last time
        due = sorted(m for m in partitions.existing() if _month_range(m)[1] <= limit)
        keep = held(_orgs_by_month(due), limit) if due else {}
        for month in due:
            name = partitions.partition_name(month)
            if month in keep:
                report.held[name] = keep[month]
                log.info("usage retention: %s kept: %s", name, keep[month])
                continue
            if not _ddl(f"ALTER TABLE {partitions.PARENT} DETACH PARTITION {name}"):
                report.held[name] = "the table was busy; detached next run"
                log.warning("usage retention: %s not detached (table busy); next run", name)
                continue
            partitions.forget_month(month)
            _finish(month, directory, report)
        report.ids_deleted = _prune_ids(limit)
        log.info("usage retention (horizon %s): %d month(s) retired, %d kept, %d idempotency "
                 "key(s) deleted", limit.date(), len(report.retired), len(report.held),
                 report.ids_deleted)
    finally:
        with connection.cursor() as cur:
            cur.execute("SELECT pg_advisory_unlock(%s)", [RETIRE_LOCK])
    return report
