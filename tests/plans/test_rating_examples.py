"""Worked examples of on-demand rating, each computed by hand in its docstring.

Prices are per 1M tokens. ``amount = tier x zone x (uncached x p_in + cached x p_cached +
out x p_out) / 1e6``; every line is rounded once to 10 places, the amount is their sum.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from billing_platform.errors import InvalidRequest
from plans import services
from plans.models import PriceVersion
from plans.rating import UnpricedModel, quote, rate_usage_batch
from tests.factories import OrganizationFactory, make_price_book
from tests.plans.helpers import usage

D = Decimal


@pytest.fixture
def book(db):
    """input 0.30, cached_input empty (= 0.1 x 0.30 = 0.03), output 1.20 per 1M."""
    return make_price_book(prices=[{"model": "test-model", "input": "0.30", "output": "1.20"}])


CACHED = {  # prompt 10,000 of which 4,000 cached, 2,000 out
    # 6,000 x 0.30 = 1,800; 4,000 x 0.03 = 120; 2,000 x 1.20 = 2,400; sum 4,320 / 1e6
    "default": D("0.00432"),
    "priority": D("0.00864"),  # x 2.0
    "flex": D("0.00216"),  # x 0.5
    "batch": D("0.00216"),  # x 0.5
}
UNCACHED = {  # prompt 10,000, none cached, 2,000 out
    # 10,000 x 0.30 = 3,000; 2,000 x 1.20 = 2,400; sum 5,400 / 1e6
    "default": D("0.0054"),
    "priority": D("0.0108"),
    "flex": D("0.0027"),
    "batch": D("0.0027"),
}


@pytest.mark.parametrize("tier", ["default", "priority", "flex", "batch"])
def test_cached_and_uncached_prompts_on_every_tier(book, org, tier):
    """Cached tokens are priced at cached_input on every tier, and the tier multiplies all.

    Cached: 6,000 x 0.30 + 4,000 x 0.03 + 2,000 x 1.20 = 1,800 + 120 + 2,400 = 4,320 -> 0.00432
    at x1; priority x2 = 0.00864; flex and batch x0.5 = 0.00216.
    Uncached: 10,000 x 0.30 + 2,000 x 1.20 = 5,400 -> 0.0054; x2 = 0.0108; x0.5 = 0.0027.
    Lines (default tier, cached): input 0.0018, cached_input 0.00012, output 0.0024.
    """
    # when
    cached, uncached = rate_usage_batch([
        usage(org, service_tier=tier, prompt_tokens=10_000, cached_tokens=4_000,
              completion_tokens=2_000),
        usage(org, service_tier=tier, prompt_tokens=10_000, cached_tokens=0,
              completion_tokens=2_000),
    ])
    # then
    assert cached.amount == CACHED[tier]
    assert uncached.amount == UNCACHED[tier]
    mult = {"default": D("1"), "priority": D("2"), "flex": D("0.5"), "batch": D("0.5")}[tier]
    assert cached.breakdown == {"input": D("0.0018") * mult, "cached_input": D("0.00012") * mult,
                                "output": D("0.0024") * mult}
    assert cached.amount == sum(cached.breakdown.values())
    assert cached.currency == "USD"
    assert cached.capacity_source == "on_demand"
    assert cached.price_version_id == PriceVersion.objects.get(price_book=book).pk
    assert cached.amount.as_tuple().exponent == -10  # stored with 10 places


def test_data_zone_multiplier_stacks_with_tier_and_cache(book):
    """An EU org's batch request: 0.5 (batch) x 1.1 (eu) x 4,320 / 1e6 = 0.002376.

    Lines: input 0.55 x 1,800 = 990 -> 0.00099; cached 0.55 x 120 = 66 -> 0.000066;
    output 0.55 x 2,400 = 1,320 -> 0.00132.
    """
    eu = OrganizationFactory(data_zone="eu")
    [rating] = rate_usage_batch([usage(eu, data_zone="eu", service_tier="batch",
                                       prompt_tokens=10_000, cached_tokens=4_000,
                                       completion_tokens=2_000)])
    assert rating.amount == D("0.002376")
    assert rating.breakdown == {"input": D("0.00099"), "cached_input": D("0.000066"),
                                "output": D("0.00132")}


def test_edited_multipliers_are_data(book, org):
    """Staff set priority to 2.5 in a new version from July: 2.5 x 5,400 / 1e6 = 0.0135."""
    july = datetime(2025, 7, 1, tzinfo=UTC)
    services.price_version_create(price_book=book, effective_from=july, allow_backdate=True,
                                  tier_multipliers={"priority": "2.5"})
    before, after = rate_usage_batch([
        usage(org, service_tier="priority", prompt_tokens=10_000, completion_tokens=2_000,
              event_time=july - timedelta(seconds=1)),
        usage(org, service_tier="priority", prompt_tokens=10_000, completion_tokens=2_000,
              event_time=july),
    ])
    assert before.amount == D("0.0108")
    assert after.amount == D("0.0135")


@pytest.mark.parametrize(("prompt", "expected", "lines"), [
    # 127,999 x 0.40 = 51,199.6 -> 0.0511996; 1,000 x 1.20 -> 0.0012
    (127_999, D("0.0523996"), {"input": D("0.0511996"), "output": D("0.0012")}),
    # 128,000 x 0.40 = 51,200 -> 0.0512; not above the threshold: base prices
    (128_000, D("0.0524"), {"input": D("0.0512"), "output": D("0.0012")}),
    # 128,001 x 1.20 = 153,601.2 -> 0.1536012; 1,000 x 3.60 -> 0.0036: band on the WHOLE request
    (128_001, D("0.1572012"), {"input": D("0.1536012"), "output": D("0.0036")}),
])
def test_context_band_boundary(db, prompt, expected, lines):
    """Band above N = 128,000 prompt tokens: base in 0.40 / out 1.20, band in 1.20 / out 3.60.

    N-1 and N pay base prices; N+1 pays the band's prices for every token of the request
    (input and output alike). 1,000 completion tokens each, nothing cached.
    """
    make_price_book(prices=[{
        "model": "test-model", "input": "0.40", "output": "1.20",
        "bands": [{"above_prompt_tokens": 128_000, "input": "1.20", "output": "3.60"}],
    }])
    org = OrganizationFactory()
    [rating] = rate_usage_batch([usage(org, prompt_tokens=prompt, completion_tokens=1_000)])
    assert rating.amount == expected
    assert rating.breakdown == {**lines, "cached_input": D("0")}


def test_price_change_at_midnight_rates_each_side_with_its_version(db):
    """v1 (from Jan 1): in 1.00 / out 2.00; v2 (from Mar 1 00:00:00 UTC): in 0.50 / out 1.00.

    1,000 in + 1,000 out at 23:59:59.999999 on Feb 28: 1,000 + 2,000 = 3,000 -> 0.003 (v1).
    The same at 00:00:00 on Mar 1: 500 + 1,000 = 1,500 -> 0.0015 (v2). Both in one batch, and
    each rating names the version it used. The batch costs the same few queries as one event.
    """
    book = make_price_book(prices=[{"model": "test-model", "input": "1.00", "output": "2.00"}])
    midnight = datetime(2025, 3, 1, tzinfo=UTC)
    v2 = services.price_version_create(
        price_book=book, effective_from=midnight, allow_backdate=True,
        prices=[{"model": "test-model", "input": "0.50", "output": "1.00"}])
    v1 = PriceVersion.objects.get(price_book=book, effective_from__lt=midnight)
    org = OrganizationFactory()
    batch = [usage(org, prompt_tokens=1_000, completion_tokens=1_000,
                   event_time=midnight - timedelta(microseconds=1)),
             usage(org, prompt_tokens=1_000, completion_tokens=1_000, event_time=midnight)]
    with CaptureQueriesContext(connection) as small:
        before, after = rate_usage_batch(batch)
    assert (before.amount, before.price_version_id) == (D("0.003"), v1.pk)
    assert (after.amount, after.price_version_id) == (D("0.0015"), v2.pk)
    # bulk: 2,000 events cost no more queries than 2
    with CaptureQueriesContext(connection) as big:
        rate_usage_batch(batch * 1_000)
    assert len(big.captured_queries) == len(small.captured_queries)


def test_prices_float_would_get_wrong_are_exact(db):
    """Prices 0.1 (input) and 0.2 (output): 1M in + 1M out = 0.1 + 0.2 = 0.3 exactly.

    In binary floating point 0.1 + 0.2 = 0.30000000000000004, and x1.1 (us zone) gives
    0.33000000000000007; in Decimal the us-zone amount is 1.1 x 0.3 = 0.33 exactly. Every value
    that comes back is a Decimal, and the services refuse floats for prices.
    """
    book = make_price_book(prices=[{"model": "test-model", "input": "0.1", "output": "0.2"}])
    org = OrganizationFactory()
    plain, us = rate_usage_batch([
        usage(org, prompt_tokens=1_000_000, completion_tokens=1_000_000),
        usage(org, prompt_tokens=1_000_000, completion_tokens=1_000_000, data_zone="us"),
    ])
    assert plain.amount == D("0.3")
    assert str(plain.amount) == "0.3000000000"
    assert us.amount == D("0.33")
    assert us.breakdown == {"input": D("0.11"), "cached_input": D("0"), "output": D("0.22")}
    assert all(type(v) is Decimal for r in (plain, us) for v in (r.amount, *r.breakdown.values()))
    with pytest.raises(InvalidRequest, match="not a float"):
        services.price_version_create(
            price_book=book, effective_from=datetime(2030, 1, 1, tzinfo=UTC),
            prices=[{"model": "test-model", "input": 0.1, "output": "0.2"}])


def test_a_million_one_token_events_sum_exactly_to_their_rollup(db):
    """1,000,000 one-token events, us zone (x1.1), input 0.1 and output 0.2 per 1M.

    Half are one input token: 1.1 x 0.1 / 1e6 = 0.00000011 each; half one output token:
    1.1 x 0.2 / 1e6 = 0.00000022 each. Sum: 500,000 x 0.00000011 + 500,000 x 0.00000022 =
    0.055 + 0.11 = 0.165. Their hourly rollup (500,000 in, 500,000 out) rated as one:
    1.1 x (500,000 x 0.1 + 500,000 x 0.2) / 1e6 = 1.1 x 150,000 / 1e6 = 0.165. Equal to the
    last digit, per line too. (Summing the same amounts as floats drifts from 0.165.)
    """
    make_price_book(prices=[{"model": "test-model", "input": "0.1", "output": "0.2"}])
    org = OrganizationFactory()
    one_in = usage(org, prompt_tokens=1, data_zone="us")
    one_out = usage(org, completion_tokens=1, data_zone="us")
    n = 500_000
    batch = [one_in, one_out] * 50_000  # 100,000 events per call, as metering streams them
    # when: rated in bulk, ten batches, keeping only the running sums (as a rollup does)
    count, total, inputs, outputs = 0, D("0"), D("0"), D("0")
    for _ in range(2 * n // len(batch)):
        ratings = rate_usage_batch(batch)
        count += len(ratings)
        total += sum(r.amount for r in ratings)
        inputs += sum(r.breakdown["input"] for r in ratings)
        outputs += sum(r.breakdown["output"] for r in ratings)
    [rollup] = rate_usage_batch([usage(org, prompt_tokens=n, completion_tokens=n,
                                       data_zone="us")])
    # then
    assert count == 2 * n
    assert total == rollup.amount == D("0.165")
    assert (inputs, outputs) == (rollup.breakdown["input"], rollup.breakdown["output"])
    assert (inputs, outputs) == (D("0.055"), D("0.11"))
    assert (ratings[0].amount, ratings[1].amount) == (D("0.00000011"), D("0.00000022"))


def test_unpriced_model_and_bad_counts_are_refused(book, org):
    """A model the book does not price is refused (not rated at 0), as are impossible counts."""
    with pytest.raises(UnpricedModel):
        rate_usage_batch([usage(org, model="no-such-model", prompt_tokens=1)])
    with pytest.raises(UnpricedModel):  # before the first version takes effect
        rate_usage_batch([usage(org, prompt_tokens=1, event_time=datetime(2024, 12, 31,
                                                                           tzinfo=UTC))])
    with pytest.raises(InvalidRequest, match="cached"):
        rate_usage_batch([usage(org, prompt_tokens=5, cached_tokens=6)])
    with pytest.raises(InvalidRequest, match="tier"):
        rate_usage_batch([usage(org, prompt_tokens=5, service_tier="platinum")])


def test_cache_write_price_and_default_cached_price(db):
    """Optional cache_write: in 3.00, cache_write 3.75, cached 0.30, out 15.00 per 1M.

    Prompt 10,000 = 2,000 cached + 6,000 cache writes + 2,000 plain input; 1,000 out:
    2,000 x 3.00 = 6,000 -> 0.006; 6,000 x 3.75 = 22,500 -> 0.0225; 2,000 x 0.30 = 600 ->
    0.0006; 1,000 x 15 = 15,000 -> 0.015. Total 0.0441.
    """
    make_price_book(prices=[{"model": "test-model", "input": "3.00", "cached_input": "0.30",
                             "output": "15.00", "cache_write": "3.75"}])
    org = OrganizationFactory()
    [r] = rate_usage_batch([usage(org, prompt_tokens=10_000, cached_tokens=2_000,
                                  cache_write_tokens=6_000, completion_tokens=1_000)])
    assert r.breakdown == {"input": D("0.006"), "cache_write": D("0.0225"),
                           "cached_input": D("0.0006"), "output": D("0.015")}
    assert r.amount == D("0.0441")


def test_quote_prices_hypothetical_counts_without_writing(book, org):
    """quote: 10,000 in (4,000 cached) + 2,000 out at priority = 2 x 0.00432 = 0.00864."""
    r = quote(org_id=org.pk, model="test-model", prompt_tokens=10_000, cached_tokens=4_000,
              completion_tokens=2_000, service_tier="priority",
              at=datetime(2025, 6, 1, tzinfo=UTC))
    assert r.amount == D("0.00864")


def test_backdated_price_versions_are_refused(book):
    """Prices cannot change in the past: events already rated would lose their explanation."""
    with pytest.raises(InvalidRequest, match="past"):
        services.price_version_create(price_book=book,
                                      effective_from=datetime(2025, 2, 1, tzinfo=UTC),
                                      prices=[{"model": "test-model", "input": "9",
                                               "output": "9"}])
