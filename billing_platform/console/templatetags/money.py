"""Money in templates, in two readings.

``{{ amount|money:currency }}``: an amount shown in its currency's minor unit, with the code
(the one quantizer, ``invoicing.money.quantize_money``; stored amounts keep 4 places). For
invoices, credits and anything billed: it keeps cents.

``{{ amount|usage_money:currency }}``: a rated usage amount shown with the precision it needs
(issue 19 item 8): thirty small requests cost ``$0.0031``, which cents would show as
``$0.00`` and read as "not billed". One place decides how many places that is
(``usage_places``).
"""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

from django import template

from billing_platform.invoicing.money import minor_units, quantize_money

register = template.Library()

# what a reader recognises before the number; other currencies get their code after it
SYMBOLS = {"USD": "$", "EUR": "€", "GBP": "£"}
USAGE_MIN_PLACES = 4  # below one unit of the currency: at least 4 places (0.1250)
USAGE_MAX_PLACES = 10  # what an event's amount keeps
USAGE_SIGNIFICANT = 2  # tiny amounts: this many significant digits (0.0000012)


@register.filter
def money(amount: Decimal | None, currency: str) -> str:
    """Return ``amount`` rounded to ``currency``'s minor unit, followed by the code."""
    if amount is None:
        return ""
    return f"{quantize_money(amount, currency)} {currency}"


def usage_places(amount: Decimal, currency: str) -> int:
    """Return how many decimal places a usage amount is shown with.

    From one unit of the currency up: its minor unit (``$12.35``). Below it: at least
    ``USAGE_MIN_PLACES``, and more where that would leave fewer than ``USAGE_SIGNIFICANT``
    significant digits (``$0.0031``, ``$0.000012``), up to the 10 places amounts keep. Zero is
    shown in the minor unit (``$0.00``).
    """
    cents = minor_units(currency)
    size = abs(amount)
    if size == 0 or size >= 1:
        return cents
    # adjusted(): the exponent of the first significant digit (0.0031 -> -3)
    wanted = -size.adjusted() + USAGE_SIGNIFICANT - 1
    return min(max(USAGE_MIN_PLACES, cents, wanted), USAGE_MAX_PLACES)


@register.filter
def usage_money(amount: Decimal | None, currency: str) -> str:
    """Return a usage amount with the places it needs, with its currency's symbol or code."""
    if amount is None:
        return ""
    places = usage_places(amount, currency)
    shown = amount.quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP)
    sign = "-" if shown < 0 else ""
    digits = f"{abs(shown):,f}"
    symbol = SYMBOLS.get(currency)
    return f"{sign}{symbol}{digits}" if symbol else f"{sign}{digits} {currency}"
