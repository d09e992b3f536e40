"""``{{ amount|money:currency }}``: an amount shown in its currency's minor unit, with the code
(the one quantizer, ``invoicing.money.quantize_money``; stored amounts keep 4 places)."""

from __future__ import annotations

from decimal import Decimal

from django import template

from billing_platform.invoicing.money import quantize_money

register = template.Library()


@register.filter
def money(amount: Decimal | None, currency: str) -> str:
    """Return ``amount`` rounded to ``currency``'s minor unit, followed by the code."""
    if amount is None:
        return ""
    return f"{quantize_money(amount, currency)} {currency}"
