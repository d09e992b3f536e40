"""CSV for spreadsheets: the one writer every CSV export goes through (invoices, usage).

A cell that starts with ``=``, ``+``, ``-``, ``@``, a tab or a carriage return is a formula to
Excel, LibreOffice and Google Sheets (CSV injection): a model name, project name or line
description a customer chose could run ``=HYPERLINK(...)`` or worse in finance's spreadsheet.
As OWASP recommends, such a text cell is prefixed with a single quote, which spreadsheets show
as text; the csv module quotes and doubles embedded quotes. Numbers our code computed
(``Decimal``, ``int``) are never formulas and stay as they are, so a negative amount still sums.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable
from typing import Any, Protocol

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


class _Writable(Protocol):
    def write(self, s: str, /) -> Any: ...


def csv_cell(value: Any) -> Any:
    """Return a cell that no spreadsheet reads as a formula (text only; numbers unchanged)."""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value


class SafeCsvWriter:
    """``csv.writer`` whose every text cell goes through ``csv_cell``."""

    def __init__(self, stream: _Writable) -> None:
        self._writer = csv.writer(stream)

    def writerow(self, row: Iterable[Any]) -> Any:
        """Write one row, its text cells made safe."""
        return self._writer.writerow([csv_cell(v) for v in row])

    def writerows(self, rows: Iterable[Iterable[Any]]) -> None:
        """Write rows, each as ``writerow`` does."""
        for row in rows:
            self.writerow(row)


def csv_writer(stream: _Writable) -> SafeCsvWriter:
    """Return the CSV writer for exports people open in a spreadsheet."""
    return SafeCsvWriter(stream)
