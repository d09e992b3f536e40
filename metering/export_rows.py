"""Reads of metering for the warehouse export (``billing_platform.finance.exports``): the
hourly usage rollups of one UTC day as plain rows, in a fixed column order, each column with
the type a warehouse loads it as.

A day holds the rollups of its 24 hours as they stand when read. Events that arrive late for
an hour already exported change that hour's rollup; the next invoice bills them as late usage,
and exporting the day again (``manage.py finance_export --replace``) carries them. Rows come in
id order, so the same data always gives the same file. Cost-to-serve is included: the export is
for the platform's own finance team, never for a customer.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime

from metering.models import UsageRollupHourly

# (column, warehouse type): the order of the columns in the file
ROLLUP_COLUMNS: tuple[tuple[str, str], ...] = (
    ("hour", "timestamp"), ("organization", "string"), ("project", "string"),
    ("api_key", "string"), ("model", "string"), ("region", "string"),
    ("service_tier", "string"), ("capacity_source", "string"), ("currency", "string"),
    ("requests", "integer"), ("error_requests", "integer"), ("aborted_requests", "integer"),
    ("prompt_tokens", "integer"), ("cached_tokens", "integer"),
    ("completion_tokens", "integer"), ("normalized_tokens", "integer"),
    ("amount", "decimal(28,10)"), ("input_amount", "decimal(28,10)"),
    ("cached_input_amount", "decimal(28,10)"), ("output_amount", "decimal(28,10)"),
    ("credits_consumed", "decimal(28,10)"), ("cost_to_serve", "decimal(28,10)"),
)
_ROLLUP_FIELDS = (
    "hour", "organization__public_id", "project__public_id", "api_key__public_id", "model",
    "region", "service_tier", "capacity_source", "currency", "requests", "error_requests",
    "aborted_requests", "prompt_tokens", "cached_tokens", "completion_tokens",
    "normalized_tokens", "amount", "input_amount", "cached_input_amount", "output_amount",
    "credits_consumed", "cost_to_serve",
)

CHUNK = 5000  # rows fetched per round trip (a server-side cursor)


def rollup_rows_between(*, start: datetime, end: datetime) -> Iterator[tuple[object, ...]]:
    """Yield every organization's hourly rollups with ``hour`` in [start, end), in id order,
    one tuple per ``ROLLUP_COLUMNS``."""
    rows = (UsageRollupHourly.objects.filter(hour__gte=start, hour__lt=end).order_by("id")
            .values_list(*_ROLLUP_FIELDS))
    yield from rows.iterator(chunk_size=CHUNK)
