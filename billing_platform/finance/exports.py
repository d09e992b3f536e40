"""Warehouse export: one UTC day of invoices, invoice lines and hourly usage rollups, written
as gzip'd CSV files with a JSON manifest, for a finance team to load into its own warehouse.

Layout: ``<FINANCE_EXPORT_DIR>/<YYYY-MM-DD>/`` holds ``invoices.csv.gz``,
``invoice_lines.csv.gz``, ``usage_rollups_hourly.csv.gz`` and ``manifest.json`` (per file: its
table, columns with their warehouse types, row count, byte size and sha256; the day covered as
a UTC range; when it was generated). Which rows a day holds is said by the owning apps'
selectors (``invoicing.export_rows``, ``metering.export_rows``).

Per day, exactly once:

- A day's directory appears whole or not at all. Everything is written into a hidden
  temporary directory beside it, flushed to disk, and renamed into place in one step; a
  reader (or a loader polling the directory) never sees a half-written day, and a crash leaves
  only a ``.tmp-`` directory, removed by the next run.
- A day that is already exported is left as it is: a rerun (a beat that came twice, a
  command run by hand) neither rewrites nor duplicates it. ``replace=True`` writes it again,
  from the data as it stands then (late usage, newer invoice states), swapping the whole
  directory (between the two renames the day is briefly absent, never half there). Runs of
  one day take turns on a lock file, so two at once export it once.
- The files are deterministic: rows in id order, values in one text form, gzip without a name
  or a time in its header. The same data gives byte-identical files (the same sha256); only
  the manifest's ``generated_at`` says when.
- The three files are read in one REPEATABLE READ, READ ONLY transaction, so they are one
  consistent snapshot (no invoice without its lines because it was finalized mid-export).

Values are written exactly (no spreadsheet formula guard, unlike ``billing_platform.csv_export``,
which is for files people open in a spreadsheet): a warehouse must load what the database
holds. Decimals are fixed point at their stored scale, timestamps ISO 8601 in UTC, an empty
cell is NULL, JSON is compact with sorted keys.
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import gzip
import hashlib
import io
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from billing_platform.invoicing.export_rows import (
    INVOICE_COLUMNS,
    LINE_COLUMNS,
    invoice_line_rows_finalized,
    invoice_rows_touched,
)
from metering.export_rows import ROLLUP_COLUMNS, rollup_rows_between

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
GZIP_LEVEL = 6
ROWS_PER_PROGRESS = 10_000

Rows = Callable[..., Iterator[tuple[object, ...]]]


@dataclass(frozen=True)
class Table:
    """One exported table: its file, its columns (name, type) and the selector of its rows."""

    name: str
    columns: tuple[tuple[str, str], ...]
    rows: Rows

    @property
    def filename(self) -> str:
        return f"{self.name}.csv.gz"


TABLES: tuple[Table, ...] = (
    Table("invoices", INVOICE_COLUMNS, invoice_rows_touched),
    Table("invoice_lines", LINE_COLUMNS, invoice_line_rows_finalized),
    Table("usage_rollups_hourly", ROLLUP_COLUMNS, rollup_rows_between),
)


@dataclass(frozen=True)
class ExportResult:
    """What one export of a day did: ``written`` False when the day was already there."""

    day: date
    path: Path
    written: bool
    manifest: dict[str, Any]


# progress(table, rows so far, done): called every ROWS_PER_PROGRESS rows and once at the end
Progress = Callable[[str, int, bool], None]


def export_root() -> Path:
    """Return the directory the days are exported to (``FINANCE_EXPORT_DIR``)."""
    return Path(settings.FINANCE_EXPORT_DIR)


def day_bounds(day: date) -> tuple[datetime, datetime]:
    """Return the UTC range [start, end) of ``day``."""
    start = datetime.combine(day, time(0), tzinfo=UTC)
    return start, start + timedelta(days=1)


def cell(value: object) -> str:
    """Return one value's text in the export (exact: no rounding, no formula guard)."""
    if value is None:
        return ""
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat()
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Decimal):
        return format(value, "f")  # fixed point at the stored scale: "0.0000000000", no "0E-10"
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(value)


def _write_table(path: Path, table: Table, rows: Iterable[tuple[object, ...]],
                 progress: Progress | None) -> dict[str, Any]:
    """Write one table as gzip'd CSV (header first); return its manifest entry."""
    count = 0
    with open(path, "wb") as raw:
        # no file name and mtime 0 in the gzip header: the same rows give the same bytes
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=GZIP_LEVEL,
                           mtime=0) as gz, io.TextIOWrapper(gz, encoding="utf-8",
                                                            newline="") as text:
            writer = csv.writer(text)
            writer.writerow([name for name, _ in table.columns])
            for row in rows:
                writer.writerow([cell(v) for v in row])
                count += 1
                if progress and count % ROWS_PER_PROGRESS == 0:
                    progress(table.name, count, False)
        raw.flush()
        os.fsync(raw.fileno())
    if progress:
        progress(table.name, count, True)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"name": table.filename, "table": table.name, "rows": count,
            "bytes": path.stat().st_size, "sha256": digest.hexdigest(),
            "compression": "gzip", "format": "csv", "encoding": "utf-8", "header": True,
            "columns": [{"name": n, "type": t} for n, t in table.columns]}


@contextlib.contextmanager
def _snapshot() -> Iterator[None]:
    """Read everything in one consistent snapshot (REPEATABLE READ, READ ONLY)."""
    if connection.in_atomic_block:
        # already inside a transaction (a caller's, or a test's): its snapshot rules apply
        yield
        return
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        yield


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(day: date, *, root: Path | None = None) -> dict[str, Any] | None:
    """Return a day's manifest, or None when the day is not exported."""
    path = (root or export_root()) / day.isoformat() / MANIFEST
    try:
        return dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def _day_lock(root: Path, day: date) -> Iterator[None]:
    """Hold the day's lock file: one export of a day at a time on this directory (a second
    waits, then finds the day exported)."""
    with open(root / f".lock-{day.isoformat()}", "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def export_day(*, day: date, root: Path | None = None, replace: bool = False,
               progress: Progress | None = None) -> ExportResult:
    """Export one UTC day (once: an exported day is left as it is unless ``replace``)."""
    root = root or export_root()
    root.mkdir(parents=True, exist_ok=True)
    final = root / day.isoformat()
    with _day_lock(root, day):
        existing = read_manifest(day, root=root)
        if existing is not None and not replace:
            return ExportResult(day=day, path=final, written=False, manifest=existing)
        # what a crashed run of this day left (no run of it is in progress: we hold its lock)
        for stale in [*root.glob(f".tmp-{day.isoformat()}-*"),
                      *root.glob(f".old-{day.isoformat()}-*")]:
            shutil.rmtree(stale, ignore_errors=True)
        tmp = root / f".tmp-{day.isoformat()}-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            manifest = _write_day(tmp, day, progress)
            _publish(tmp, final, day=day)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already once it was renamed
    return ExportResult(day=day, path=final, written=True, manifest=manifest)


def _write_day(tmp: Path, day: date, progress: Progress | None) -> dict[str, Any]:
    """Write the day's files and manifest into ``tmp``; return the manifest."""
    start, end = day_bounds(day)
    with _snapshot():
        files = [_write_table(tmp / t.filename, t, t.rows(start=start, end=end), progress)
                 for t in TABLES]
    manifest = {"format_version": FORMAT_VERSION, "day": day.isoformat(),
                "covers": {"start": start.isoformat(), "end": end.isoformat()},
                "generated_at": timezone.now().astimezone(UTC).isoformat(),
                "files": files}
    with open(tmp / MANIFEST, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    return manifest


def _publish(tmp: Path, final: Path, *, day: date) -> None:
    """Rename the finished directory into place, whole; a replaced day is swapped out whole
    first, and put back if the new one cannot be put in its place."""
    old = None
    if final.exists():
        old = final.with_name(f".old-{day.isoformat()}-{uuid.uuid4().hex}")
        final.rename(old)
    try:
        tmp.rename(final)
    except OSError:
        if old is not None:
            old.rename(final)
        raise
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def days_due(*, now: datetime | None = None, root: Path | None = None) -> list[date]:
    """Return the days that have ended (plus the settle lag) within the backfill window and
    are not exported yet, oldest first."""
    now = now or timezone.now()
    root = root or export_root()
    lag = timedelta(seconds=settings.FINANCE_EXPORT_LAG_S)
    last = (now.astimezone(UTC) - lag).date() - timedelta(days=1)
    days = [last - timedelta(days=n) for n in range(settings.FINANCE_EXPORT_BACKFILL_DAYS)]
    return sorted(d for d in days if read_manifest(d, root=root) is None)


def export_due(*, now: datetime | None = None) -> list[ExportResult]:
    """Export every due day (see ``days_due``); return what each export did."""
    return [export_day(day=day) for day in days_due(now=now)]
