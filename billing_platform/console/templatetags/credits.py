"""``{{ value|credits }}``: a token plan's credits as a person reads them (``1,234.5``).

Credits keep 6 decimal places (``plans.models``); trailing zeros say nothing, so they go, and
thousands are grouped. Credits are not money: ``money`` and ``usage_money`` are for amounts.
"""

from __future__ import annotations

from decimal import Decimal

from django import template

register = template.Library()


@register.filter
def credits(value: Decimal | None) -> str:
    """Return ``value`` without trailing zeros, thousands grouped ("" for None)."""
    if value is None:
        return ""
    text = f"{value:,f}"
    return text.rstrip("0").rstrip(".") if "." in text else text
