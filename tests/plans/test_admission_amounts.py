"""Admission's amounts in micro-units: the integer paths (whole units of 1e-10 per token) give
exactly what the Decimal rating gives, for every band, tier and zone, and prices too fine for
them still take the Decimal path."""

from __future__ import annotations

import random
from decimal import ROUND_CEILING, Decimal

from plans import admission
from plans.pricing import ModelPricing, PriceSet, TokenCounts, exact_lines, rounded_lines


def _pricing(rng: random.Random, *, places: int) -> ModelPricing:
    def price() -> Decimal:
        return Decimal(rng.randrange(1, 10**6)).scaleb(-places)

    def prices() -> PriceSet:
        return PriceSet(price(), price(), price(), price())

    return ModelPricing(version_id=1, currency="USD", model="m", base=prices(),
                        bands=((1000, prices()), (5000, prices())),
                        tier={"priority": Decimal("2"), "flex": Decimal("0.5")},
                        zone={"eu": Decimal("1.1")})


def _rated_micro(pricing: ModelPricing, tier: str, zone: str, p: int, c: int, o: int) -> int:
    counts = TokenCounts(prompt_tokens=p, cached_tokens=c, completion_tokens=o,
                         cache_write_tokens=0, service_tier=tier, data_zone=zone)
    _lines, amount = rounded_lines(exact_lines(pricing, counts))
    return admission.to_micro(amount)


def _worst_micro(pricing: ModelPricing, tier: str, zone: str, p: int, o: int) -> int:
    sets = [pricing.base, *[s for above, s in pricing.bands if p > above]]
    p_in = max(max(s.input, s.cached_input, s.cache_write) for s in sets)
    p_out = max(s.output for s in sets)
    return int(((p * p_in + o * p_out) * pricing.multiplier(tier, zone))
               .to_integral_value(rounding=ROUND_CEILING))


def test_admission_amounts_equal_the_rated_amounts_to_the_micro_unit():
    rng = random.Random(22)
    # 4 places: whole units of 1e-10 (integer path); 9 places: finer (Decimal path)
    for places in (4, 9):
        for _ in range(20):
            pricing = _pricing(rng, places=places)
            for _ in range(50):
                tier = rng.choice(["default", "priority", "flex"])
                zone = rng.choice(["global", "eu"])
                p, o = rng.randrange(0, 9000), rng.randrange(0, 4000)
                c = rng.randrange(0, p + 1)
                # twice: the second answer comes from the cached units
                for _again in range(2):
                    assert admission.actual_micro(
                        pricing, tier=tier, zone=zone, prompt_tokens=p, cached_tokens=c,
                        completion_tokens=o) == _rated_micro(pricing, tier, zone, p, c, o)
                    assert admission.worst_case_micro(
                        pricing, tier=tier, zone=zone, prompt_tokens=p,
                        max_output=o) == _worst_micro(pricing, tier, zone, p, o)


def test_a_new_pricing_object_is_not_answered_with_an_older_ones_units():
    # given two pricings alive one after the other (the second may reuse the first's id)
    cheap = PriceSet(Decimal("0.10"), Decimal("0.01"), Decimal("0.20"), Decimal("0.10"))
    dear = PriceSet(Decimal("10"), Decimal("1"), Decimal("20"), Decimal("10"))
    for first, second in ((cheap, dear), (dear, cheap)):
        a = ModelPricing(version_id=1, currency="USD", model="m", base=first, bands=(),
                         tier={}, zone={})
        got_a = admission.actual_micro(a, tier="default", zone="global", prompt_tokens=1000,
                                       cached_tokens=0, completion_tokens=1000)
        del a
        b = ModelPricing(version_id=1, currency="USD", model="m", base=second, bands=(),
                         tier={}, zone={})
        # then each is charged at its own prices
        got_b = admission.actual_micro(b, tier="default", zone="global", prompt_tokens=1000,
                                       cached_tokens=0, completion_tokens=1000)
        assert got_a == (first.input + first.output) * 1000
        assert got_b == (second.input + second.output) * 1000
