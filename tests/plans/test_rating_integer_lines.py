"""On-demand lines computed in integers equal the Decimal route, digit for digit.

``plans.rating`` rates an event in whole numbers of 1e-10 when its per-token amounts allow it
(the ingest consumer's hot path); the amounts stored on events and summed into rollups must
be exactly what ``rounded_lines(exact_lines(...))`` gives, value and written form alike, and
prices too fine for that must still take the Decimal route.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime
from decimal import Decimal
from types import SimpleNamespace
from typing import Any

import pytest

from plans import rating
from plans.pricing import ModelPricing, PriceSet, exact_lines, rounded_lines
from plans.rating import UsageFacts

D = Decimal
TIERS = {"default": D(1), "priority": D("2.0"), "flex": D("0.5"), "batch": D("0.5")}
ZONES = {"global": D(1), "us": D("1.1"), "eu": D("1.1")}


def _pricing(base: PriceSet, band: PriceSet) -> ModelPricing:
    return ModelPricing(version_id=1, currency="USD", model="m", base=base,
                        bands=((128_000, band),), tier=TIERS, zone=ZONES)


def _facts(rng: random.Random) -> UsageFacts:
    prompt = rng.choice([0, 1, 17, 999, 127_999, 128_000, 128_001, 400_000,
                         rng.randrange(0, 2**40)])
    cached = rng.randrange(0, prompt + 1)
    write = rng.choice([0, 0, rng.randrange(0, prompt - cached + 1)])
    return UsageFacts(
        request_id="r", org_id=1, project_id=1, api_key_id=None, model="m", region="us-east",
        data_zone=rng.choice(list(ZONES)), service_tier=rng.choice(list(TIERS)),
        capacity_source="on_demand", prompt_tokens=prompt, cached_tokens=cached,
        completion_tokens=rng.choice([0, 1, rng.randrange(0, 2**33)]),
        event_time=datetime(2026, 1, 1, tzinfo=UTC), cache_write_tokens=write)


@pytest.mark.parametrize(("base", "band", "integer"), [
    # per-token amounts are whole 1e-10s: the integer route
    (PriceSet(D("0.15"), D("0.015"), D("0.60"), D("0.1875")),
     PriceSet(D("0.30"), D("0.03"), D("1.20"), D("0.375")), True),
    (PriceSet(D("3"), D("0.3"), D("15"), D("3.75")),
     PriceSet(D("6"), D("0.6"), D("22.5"), D("7.5")), True),
    (PriceSet(D(0), D(0), D(0), D(0)), PriceSet(D(0), D(0), D(0), D(0)), True),
    # finer than 1e-10 per token: lines round, the Decimal route
    (PriceSet(D("0.1234567"), D("0.01234567"), D("0.7654321"), D("0.1")),
     PriceSet(D("0.15"), D("0.015"), D("0.000001"), D("0.1875")), False),
])
def test_integer_lines_equal_the_decimal_route(base: PriceSet, band: PriceSet,
                                               integer: bool) -> None:
    # given prices, with a context band, and many events of every tier and zone
    pricing = _pricing(base, band)
    rng = random.Random(22)
    batch: Any = SimpleNamespace(units={})
    for _ in range(2_000):
        f = _facts(rng)
        # when rated on demand
        lines, amount = rating._on_demand_lines(batch, pricing, f)
        # then lines and amount are the Decimal route's, written the same way
        want_lines, want_amount = rounded_lines(exact_lines(pricing, f))
        assert [(k, str(v)) for k, v in lines.items()] == \
            [(k, str(v)) for k, v in want_lines.items()]
        assert str(amount) == str(want_amount)
        assert amount == sum(lines.values())
    # (tier x zone may make a price set too fine, e.g. 0.015 x 0.5 x 1.1 per 1M)
    assert any(u is not None for u in batch.units.values()) == integer


def test_fine_prices_take_the_decimal_route() -> None:
    # given a price whose per-token amount is not a whole number of 1e-10
    fine = PriceSet(D("0.1234567"), D("0.01"), D("0.5"), D("0.1"))
    pricing = _pricing(fine, fine)
    batch: Any = SimpleNamespace(units={})
    f = UsageFacts(request_id="r", org_id=1, project_id=1, api_key_id=None, model="m",
                   region="us-east", data_zone="global", service_tier="default",
                   capacity_source="on_demand", prompt_tokens=3, cached_tokens=0,
                   completion_tokens=0, event_time=datetime(2026, 1, 1, tzinfo=UTC))
    # when rated
    lines, amount = rating._on_demand_lines(batch, pricing, f)
    # then the line is rounded once, half-even: 3 x 0.1234567e-6 = 3.703701e-7 -> 10 places
    assert lines["input"] == D("0.0000003704")
    assert amount == D("0.0000003704")
    assert list(batch.units.values()) == [None]
