"""Money rounding: the one place an exact amount becomes a payable one.

Amounts are exact ``Decimal`` until an invoice line is built; then each line is rounded once,
half-up (what finance teams and tax authorities expect of a printed invoice), to its currency's
minor unit. Stripe wants integer minor units; ``to_minor_units`` gives them.
"""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Context, Decimal

# ISO 4217 minor units where they are not 2 (the currencies Stripe treats as zero-decimal,
# and the three-decimal dinars).
_MINOR_UNITS: dict[str, int] = {
    "BIF": 0, "CLP": 0, "DJF": 0, "GNF": 0, "JPY": 0, "KMF": 0, "KRW": 0, "MGA": 0, "PYG": 0,
    "RWF": 0, "UGX": 0, "VND": 0, "VUV": 0, "XAF": 0, "XOF": 0, "XPF": 0,
    "BHD": 3, "JOD": 3, "KWD": 3, "OMR": 3, "TND": 3,
}
EXACT = Context(prec=100, rounding=ROUND_HALF_UP)
ZERO = Decimal("0")


def minor_units(currency: str) -> int:
    """Return how many decimal places the currency's minor unit has."""
    return _MINOR_UNITS.get(currency.upper(), 2)


def quantize_money(value: Decimal, currency: str) -> Decimal:
    """Round an exact amount once, half-up, to the currency's minor unit."""
    if not isinstance(value, Decimal):
        raise TypeError(f"money must be Decimal, not {type(value).__name__}")
    return value.quantize(Decimal(1).scaleb(-minor_units(currency)), context=EXACT)


def to_minor_units(value: Decimal, currency: str) -> int:
    """Return a rounded amount as an integer count of minor units (what Stripe takes)."""
    rounded = quantize_money(value, currency)
    if rounded != value:
        raise ValueError(f"{value} {currency} is not rounded to the minor unit")
    return int(rounded.scaleb(minor_units(currency)))


def from_minor_units(minor: int, currency: str) -> Decimal:
    """Return an integer count of minor units (what Stripe reports) as an amount."""
    return Decimal(minor).scaleb(-minor_units(currency))
