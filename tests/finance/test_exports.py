"""The warehouse export over real data: usage recorded through metering's record path, invoices
closed by the real period close, a day exported by a real Celery worker (beat's task) and by
``manage.py finance_export``. The files are read back with the csv module and compared with
what the database holds, summed from the usage events themselves (not from the rollups the
export reads); a rerun changes nothing, a crash mid-export leaves no day behind, and two runs at
once write a day once.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.db.models import Sum

from billing_platform.finance import exports
from billing_platform.finance.tasks import export_task
from billing_platform.invoicing import services as invoicing
from billing_platform.invoicing.models import Invoice, InvoiceLine
from metering.models import UsageEvent
from tests.conftest import wait_until
from tests.factories import make_billed_org, make_price_book
from tests.invoicing.conftest import record

NOW = datetime.now(tz=UTC)
# the day exported: two days ago, so it has ended (and the lag after it) when the tests run
DAY = NOW.date() - timedelta(days=2)
DAY_START = datetime.combine(DAY, time(0), tzinfo=UTC)
NEXT_DAY = DAY + timedelta(days=1)


def read_csv(path) -> list[dict[str, str]]:
    with gzip.open(path, "rt", encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def traffic(db):
    """Two organizations (USD, EUR) with usage on DAY and either side of it, and last month's
    invoices finalized on DAY; one of them paid the day after."""
    make_price_book(prices=[{"model": "m-small", "input": "1.00", "output": "2.00"}])
    make_price_book(currency="EUR", prices=[
        {"model": "m-small", "input": "0.90", "output": "1.80"}])
    month = DAY_START.replace(day=1)
    before = (month - timedelta(days=1)).replace(day=1)
    usd = make_billed_org(name="Dollar Co", created_at=before, tax_rate="0.2000")
    eur = make_billed_org(name="Euro GmbH", created_at=before, currency="EUR")
    # last month's usage, billed by the close below
    record(usd, "u-old", before + timedelta(days=3), prompt_tokens=1_000_000,
           completion_tokens=250_000)
    record(eur, "e-old", before + timedelta(days=4), prompt_tokens=2_000_000,
           cached_tokens=500_000, completion_tokens=10_000)
    # DAY's usage, in several hours, and one event each side of it (not DAY's)
    record(usd, "u1", DAY_START + timedelta(hours=1, minutes=5), prompt_tokens=120_000,
           cached_tokens=20_000, completion_tokens=3_001)
    record(usd, "u2", DAY_START + timedelta(hours=1, minutes=50), prompt_tokens=7,
           completion_tokens=11)
    record(usd, "u3", DAY_START + timedelta(hours=23, minutes=59, seconds=59),
           service_tier="priority", prompt_tokens=5_000, completion_tokens=900)
    record(eur, "e1", DAY_START + timedelta(hours=12), prompt_tokens=333_333,
           completion_tokens=77_777)
    record(usd, "u-before", DAY_START - timedelta(seconds=1), prompt_tokens=1_000)
    record(eur, "e-after", DAY_START + timedelta(days=1), prompt_tokens=1_000)
    # last month closed on DAY (finalized then), the USD invoice paid by bank transfer next day
    invoicing.period_close_run(now=DAY_START + timedelta(hours=13), enqueue_payments=False)
    usd_invoice = Invoice.objects.get(organization=usd, kind="invoice")
    invoicing.invoice_mark_paid(invoice=usd_invoice, now=DAY_START + timedelta(days=1, hours=9),
                                acting_user=None)
    return {"usd": usd, "eur": eur}


def event_sums(start: datetime, end: datetime) -> dict[tuple[str, str], dict[str, object]]:
    """Sum the usage events themselves per (org, currency): what the rollups must add up to."""
    out = {}
    rows = (UsageEvent.objects.filter(event_time__gte=start, event_time__lt=end)
            .values("organization__public_id", "currency")
            .annotate(amount=Sum("amount"), prompt=Sum("prompt_tokens"),
                      cached=Sum("cached_tokens"), completion=Sum("completion_tokens")))
    for r in rows:
        out[(r["organization__public_id"], r["currency"])] = {
            "amount": r["amount"], "prompt": r["prompt"], "cached": r["cached"],
            "completion": r["completion"]}
    return out


def assert_day_matches_database(path, day: date) -> None:
    """The day's files, read with the csv module, hold exactly what the database says."""
    start = datetime.combine(day, time(0), tzinfo=UTC)
    end = start + timedelta(days=1)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["day"] == day.isoformat()
    assert manifest["covers"] == {"start": start.isoformat(), "end": end.isoformat()}
    files = {f["table"]: f for f in manifest["files"]}
    assert set(files) == {"invoices", "invoice_lines", "usage_rollups_hourly"}
    for entry in files.values():
        assert sha256(path / entry["name"]) == entry["sha256"]
        assert (path / entry["name"]).stat().st_size == entry["bytes"]
        with gzip.open(path / entry["name"], "rt", newline="") as f:
            header = next(csv.reader(f))
        assert header == [c["name"] for c in entry["columns"]]

    # invoices: every one finalized, paid, voided or written off that day, as it stands
    invoices = read_csv(path / "invoices.csv.gz")
    assert len(invoices) == files["invoices"]["rows"]
    touched = {i.public_id: i for i in Invoice.objects.exclude(status="draft") if any(
        t is not None and start <= t < end
        for t in (i.finalized_at, i.paid_at, i.voided_at, i.marked_uncollectible_at,
                  i.written_off_at, i.refunded_at))}
    assert {r["public_id"] for r in invoices} == set(touched)
    for row in invoices:
        inv = touched[row["public_id"]]
        assert (row["number"], row["status"], row["currency"]) == (
            inv.number, inv.status, inv.currency)
        assert row["organization"] == inv.organization.public_id
        for name in ("subtotal", "tax", "credits_applied", "total", "amount_due",
                     "amount_paid", "amount_refunded"):
            assert Decimal(row[name]) == getattr(inv, name), name
        assert datetime.fromisoformat(row["finalized_at"]) == inv.finalized_at
        assert (datetime.fromisoformat(row["paid_at"]) if row["paid_at"] else None
                ) == inv.paid_at

    # lines: those of the invoices finalized that day, each exactly once, amounts exact
    lines = read_csv(path / "invoice_lines.csv.gz")
    assert len(lines) == files["invoice_lines"]["rows"]
    expected = InvoiceLine.objects.filter(invoice__finalized_at__gte=start,
                                          invoice__finalized_at__lt=end)
    assert sorted((r["invoice"], int(r["position"])) for r in lines) == sorted(
        (ln.invoice.public_id, ln.position) for ln in expected)
    by_key = {(ln.invoice.public_id, ln.position): ln for ln in expected}
    for row in lines:
        ln = by_key[(row["invoice"], int(row["position"]))]
        assert Decimal(row["amount"]) == ln.amount
        assert Decimal(row["amount_precise"]) == ln.amount_precise
        assert row["description"] == ln.description
        assert json.loads(row["details"]) == ln.details
    for inv in {ln.invoice for ln in expected}:
        assert sum(Decimal(r["amount"]) for r in lines if r["invoice"] == inv.public_id
                   ) == inv.total

    # hourly rollups: they add up to that day's usage events, per organization and currency
    rollups = read_csv(path / "usage_rollups_hourly.csv.gz")
    assert len(rollups) == files["usage_rollups_hourly"]["rows"]
    assert all(start <= datetime.fromisoformat(r["hour"]) < end for r in rollups)
    got: dict[tuple[str, str], dict[str, object]] = {}
    for r in rollups:
        sums = got.setdefault((r["organization"], r["currency"]), {
            "amount": Decimal(0), "prompt": 0, "cached": 0, "completion": 0})
        sums["amount"] += Decimal(r["amount"])
        sums["prompt"] += int(r["prompt_tokens"])
        sums["cached"] += int(r["cached_tokens"])
        sums["completion"] += int(r["completion_tokens"])
    assert got == event_sums(start, end)


@pytest.mark.django_db(transaction=True)
def test_beat_task_in_a_worker_exports_each_ended_day_once(traffic, celery_worker_process,
                                                           tmp_path):
    root = tmp_path / "warehouse"
    worker = celery_worker_process(queues="billing", env={
        "TOLLGATE_FINANCE_EXPORT_DIR": str(root), "TOLLGATE_FINANCE_EXPORT_LAG_S": "0",
        "TOLLGATE_FINANCE_EXPORT_BACKFILL_DAYS": "3"})

    # when beat's export task runs in the worker
    export_task.delay()

    # then the three days that have ended appear, each whole, with what the database holds
    days = [NOW.date() - timedelta(days=n) for n in (3, 2, 1)]
    wait_until(lambda: all((root / d.isoformat() / "manifest.json").exists() for d in days),
               timeout=90, what=f"the exported days (log: {worker.log_path})")
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
        d.isoformat() for d in days]
    for day in days:
        assert_day_matches_database(root / day.isoformat(), day)
    assert len(read_csv(root / DAY.isoformat() / "invoices.csv.gz")) == 2
    # USD: hour 1 (two events, one rollup), hour 23 (priority); EUR: hour 12
    assert len(read_csv(root / DAY.isoformat() / "usage_rollups_hourly.csv.gz")) == 3
    # the USD invoice was paid the next day: that day's file carries it too, with no lines
    paid = read_csv(root / NEXT_DAY.isoformat() / "invoices.csv.gz")
    assert [(r["organization"], r["status"]) for r in paid] == [
        (traffic["usd"].public_id, "paid")]
    assert read_csv(root / NEXT_DAY.isoformat() / "invoice_lines.csv.gz") == []

    # when the task runs again (a second beat): nothing is written again, nothing added
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns, sha256(p))
              for p in root.glob("*/*") if p.is_file()}
    manifest = (root / DAY.isoformat() / "manifest.json").read_text()
    export_task.delay()
    export_task.delay()

    # (the worker logs each task it finished: wait for all three runs)
    wait_until(lambda: len(_finished_runs(worker.log_path)) == 3, timeout=60,
               what="the reruns")
    # the first run wrote the three days, the reruns none
    assert [line.rsplit(": ", 1)[1] for line in _finished_runs(worker.log_path)] == [
        repr([d.isoformat() for d in days]), "[]", "[]"]
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns, sha256(p))
            for p in root.glob("*/*") if p.is_file()} == before
    assert (root / DAY.isoformat() / "manifest.json").read_text() == manifest
    assert not [p for p in root.iterdir() if p.name.startswith((".tmp-", ".old-"))]


def _finished_runs(log_path) -> list[str]:
    """Return the worker's log lines of finance.export runs that succeeded, in order."""
    return [line for line in log_path.read_text().splitlines()
            if "Task finance.export[" in line and "succeeded" in line]


@pytest.mark.django_db(transaction=True)
def test_command_exports_a_day_with_progress_and_replace_is_byte_identical(traffic, tmp_path):
    root = tmp_path / "warehouse"
    out = io.StringIO()

    # when finance runs the command for DAY
    call_command("finance_export", "--day", DAY.isoformat(), "--dir", str(root), stdout=out)

    # then it says what it wrote, table by table, and the day holds what the database holds
    text = out.getvalue()
    assert f"finance_export: {DAY} -> {root / DAY.isoformat()}" in text
    assert "invoices: 2 rows" in text and "usage_rollups_hourly: 3 rows" in text
    assert "done: " in text
    assert_day_matches_database(root / DAY.isoformat(), DAY)
    first = json.loads((root / DAY.isoformat() / "manifest.json").read_text())

    # when it runs again: the day is left as it is, and it says so
    out = io.StringIO()
    call_command("finance_export", "--day", DAY.isoformat(), "--dir", str(root), stdout=out)
    assert "already exported" in out.getvalue()
    assert json.loads((root / DAY.isoformat() / "manifest.json").read_text()) == first

    # when it is written again with nothing changed: byte-identical files, a new generated_at
    call_command("finance_export", "--day", DAY.isoformat(), "--dir", str(root), "--replace",
                 stdout=io.StringIO())
    again = json.loads((root / DAY.isoformat() / "manifest.json").read_text())
    assert again["files"] == first["files"]
    assert again["generated_at"] > first["generated_at"]

    # when a late event lands for DAY and the day is written again: it carries the event
    record(traffic["eur"], "e-late", DAY_START + timedelta(hours=12, minutes=30),
           prompt_tokens=1_000_000)
    call_command("finance_export", "--day", DAY.isoformat(), "--dir", str(root), "--replace",
                 stdout=io.StringIO())
    late = json.loads((root / DAY.isoformat() / "manifest.json").read_text())
    changed = {f["table"] for f, g in zip(late["files"], first["files"], strict=True)
               if f["sha256"] != g["sha256"]}
    assert changed == {"usage_rollups_hourly"}
    assert_day_matches_database(root / DAY.isoformat(), DAY)
    assert not [p for p in root.iterdir() if p.name.startswith((".tmp-", ".old-"))]


def test_command_refuses_a_malformed_or_unended_day(db, tmp_path):
    for bad in ("2026-13-01", "yesterday", "2026-11-31'; drop table x; --"):
        with pytest.raises(CommandError, match="YYYY-MM-DD"):
            call_command("finance_export", "--day", bad, "--dir", str(tmp_path))
    with pytest.raises(CommandError, match="has not ended"):
        call_command("finance_export", "--day", NOW.date().isoformat(), "--dir", str(tmp_path))
    assert list(tmp_path.iterdir()) == []


class Interrupted(Exception):
    """The export was stopped part way (as a killed process would be)."""


@pytest.mark.django_db(transaction=True)
def test_a_day_is_never_visible_half_written(traffic, tmp_path):
    root = tmp_path / "warehouse"
    seen = []

    def stop_after_first_table(table: str, rows: int, done: bool) -> None:
        # while the export is under way, the day is not there to be read (only a hidden
        # temporary directory is)
        seen.append((table, [p.name for p in root.iterdir()]))
        if done:
            raise Interrupted(table)

    # when an export is stopped after its first file
    with pytest.raises(Interrupted):
        exports.export_day(day=DAY, root=root, progress=stop_after_first_table)

    # then the day was never visible and nothing of it is left, and it is not "exported"
    assert seen and all(DAY.isoformat() not in names for _, names in seen)
    assert any(n.startswith(f".tmp-{DAY}") for _, names in seen for n in names)
    assert not (root / DAY.isoformat()).exists()
    assert exports.read_manifest(DAY, root=root) is None
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]

    # when it runs again, the whole day is written
    result = exports.export_day(day=DAY, root=root)
    assert result.written
    assert_day_matches_database(root / DAY.isoformat(), DAY)


@pytest.mark.django_db(transaction=True)
def test_two_exports_of_one_day_at_once_write_it_once(traffic, tmp_path):
    root = tmp_path / "warehouse"

    def run(_: int) -> bool:
        try:
            return exports.export_day(day=DAY, root=root).written
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=2) as pool:
        written = list(pool.map(run, range(2)))
    assert sorted(written) == [False, True]
    assert [p.name for p in root.iterdir() if not p.name.startswith(".lock")] == [
        DAY.isoformat()]
    assert_day_matches_database(root / DAY.isoformat(), DAY)


def test_days_due_are_the_ended_days_of_the_window_not_yet_exported(settings, tmp_path):
    settings.FINANCE_EXPORT_LAG_S = 3600
    settings.FINANCE_EXPORT_BACKFILL_DAYS = 3
    (tmp_path / "2026-11-29").mkdir()  # a directory without a manifest is not an export
    (tmp_path / "2026-11-28").mkdir()
    (tmp_path / "2026-11-28" / "manifest.json").write_text("{}")
    # 00:30 on Dec 1: Nov 30 ended less than the lag ago, so Nov 29 is the last due
    now = datetime(2026, 12, 1, 0, 30, tzinfo=UTC)
    assert exports.days_due(now=now, root=tmp_path) == [date(2026, 11, 27),
                                                       date(2026, 11, 29)]
    # 01:30: Nov 30 too
    assert exports.days_due(now=now + timedelta(hours=1), root=tmp_path) == [
        date(2026, 11, 29), date(2026, 11, 30)]
