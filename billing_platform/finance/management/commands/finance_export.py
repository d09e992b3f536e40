"""``manage.py finance_export``: export one UTC day (or every due day) to the warehouse
directory, with progress, as the beat task does (``billing_platform.finance.exports``)."""

from __future__ import annotations

from datetime import UTC, date
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from billing_platform.finance import exports


def _day(value: str) -> date:
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise CommandError(f"--day must be a date as YYYY-MM-DD, got {value!r}") from None


class Command(BaseCommand):
    help = ("Export a day's invoices, invoice lines and hourly usage rollups as gzip'd CSV "
            "with a manifest (once per day; --replace writes an exported day again).")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--day", help="the UTC day, YYYY-MM-DD (default: every due day)")
        parser.add_argument("--replace", action="store_true",
                            help="write the day again even if it is exported already")
        parser.add_argument("--dir", default=None,
                            help=f"export directory (default {exports.export_root()})")

    def handle(self, *args: Any, **options: Any) -> None:
        root = Path(options["dir"]) if options["dir"] else exports.export_root()
        if options["day"]:
            days = [_day(options["day"])]
            if days[0] >= timezone.now().astimezone(UTC).date():
                raise CommandError(f"{days[0]} has not ended yet (UTC); export a past day")
        else:
            days = exports.days_due(root=root)
            if not days:
                self.stdout.write("finance_export: nothing due")
        for day in days:
            self.stdout.write(f"finance_export: {day} -> {root / day.isoformat()}")
            result = exports.export_day(day=day, root=root, replace=options["replace"],
                                        progress=self._progress)
            if not result.written:
                self.stdout.write(f"  already exported at {result.manifest['generated_at']}; "
                                  "left as it is (--replace writes it again)")
                continue
            total = sum(f["rows"] for f in result.manifest["files"])
            self.stdout.write(self.style.SUCCESS(f"  done: {total} rows in "
                                                 f"{len(result.manifest['files'])} files"))

    def _progress(self, table: str, rows: int, done: bool) -> None:
        self.stdout.write(f"  {table}: {rows} rows{'' if done else ' ...'}")
        self.stdout.flush()
