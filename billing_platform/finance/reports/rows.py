"""What every report shares: rows that know their CSV columns, rounding, dates."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import astuple, fields
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any, ClassVar

from billing_platform.accounts.models import Organization
from billing_platform.invoicing.money import ZERO, quantize_money


class Row:
    """A report row: its CSV columns are its fields, in order."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @classmethod
    def csv_columns(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def csv_values(self) -> tuple[Any, ...]:
        """Return the row's cells: instants as ISO 8601 (``Z`` for UTC, as the JSON answer
        writes them), None as an empty cell, the rest as they are."""
        return tuple(_cell(v) for v in astuple(self))


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, datetime):
        text = value.astimezone(UTC).isoformat()
        return text[:-6] + "Z" if text.endswith("+00:00") else text
    return value


def day(at: datetime) -> date:
    return at.astimezone(UTC).date()


def money(value: Decimal | None, currency: str) -> Decimal:
    return quantize_money(value or ZERO, currency)



def org_labels(org_ids: set[int]) -> dict[int, tuple[str, str]]:
    """Return (public id, name) of each organization."""
    return {pk: (public_id, name) for pk, public_id, name in Organization.objects.filter(
        pk__in=org_ids).values_list("pk", "public_id", "name")}


def csv_rows(rows: list[Any], row_type: type[Row]) -> Iterator[tuple[Any, ...]]:
    """Yield ``row_type``'s columns, then each row's values (the table, as it is shown)."""
    yield row_type.csv_columns()
    for row in rows:
        yield row.csv_values()
