"""Provisioned units: burndown inside the reservation, spillover rated on-demand and marked.

Offering: llama-70b in us-east, 10,000 normalized tokens/min per unit, cached burndown 0,
output burndown 4; 1,500.00 per unit-month, 2.50 per unit-hour. On-demand prices per 1M:
input 0.88, cached 0.088 (default), output 0.88.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from plans import services
from plans.rating import normalized_tokens, rate_usage_batch
from plans.selectors import reservation_fee_for_period
from tests.factories import make_price_book
from tests.plans.helpers import usage

D = Decimal
START = datetime(2025, 3, 1, tzinfo=UTC)
NOW = datetime(2025, 3, 10, 12, 0, tzinfo=UTC)


@pytest.fixture
def reservation(db, org):
    make_price_book(prices=[{"model": "llama-70b", "input": "0.88", "output": "0.88"}])
    offering = services.provisioned_offering_create(
        code="l70-use", name="Llama 70B unit", model="llama-70b", region="us-east",
        tokens_per_minute_per_unit=10_000, cache_burndown="0", output_burndown="4",
        hourly_unit_price="2.50", monthly_unit_price="1500.00")
    return services.reservation_create(organization=org, offering=offering, units=2,
                                       term="monthly", term_count=3, starts_at=START)


def test_inside_the_reservation_no_per_token_charge_and_burndown_recorded(reservation, org):
    """1,000 in (400 cached) + 200 out: normalized = 600 + 400 x 0 + 200 x 4 = 1,400; amount 0."""
    [r] = rate_usage_batch([usage(org, model="llama-70b", capacity_source="provisioned",
                                  prompt_tokens=1_000, cached_tokens=400,
                                  completion_tokens=200, event_time=NOW)])
    assert (r.amount, r.normalized_tokens) == (D("0"), 1_400)
    assert (r.capacity_source, r.reservation_id) == ("provisioned", reservation.pk)
    assert r.rating_kind == "provisioned"
    assert reservation.tokens_per_minute == 20_000


def test_spillover_is_rated_on_demand_and_marked(reservation, org):
    """The same request spilled over: 600 x 0.88 + 400 x 0.088 + 200 x 0.88 = 528 + 35.2 + 176
    = 739.2 -> 0.0007392, source "spillover", tied to the reservation it overflowed.
    """
    [r] = rate_usage_batch([usage(org, model="llama-70b", capacity_source="spillover",
                                  prompt_tokens=1_000, cached_tokens=400,
                                  completion_tokens=200, event_time=NOW)])
    assert r.amount == D("0.0007392")
    assert r.breakdown == {"input": D("0.000528"), "cached_input": D("0.0000352"),
                           "output": D("0.000176")}
    assert (r.capacity_source, r.reservation_id, r.normalized_tokens) == ("spillover",
                                                                          reservation.pk, 0)


def test_provisioned_without_a_matching_reservation_is_never_free(reservation, org):
    """Marked provisioned but in eu-west (reserved: us-east), or after the term ended: the
    tokens are priced on-demand (0.0007392) rather than given away.
    """
    wrong_region, after_term = rate_usage_batch([
        usage(org, model="llama-70b", capacity_source="provisioned", region="eu-west",
              prompt_tokens=1_000, cached_tokens=400, completion_tokens=200, event_time=NOW),
        usage(org, model="llama-70b", capacity_source="provisioned", prompt_tokens=1_000,
              cached_tokens=400, completion_tokens=200, event_time=reservation.ends_at),
    ])
    assert (wrong_region.amount, wrong_region.capacity_source) == (D("0.0007392"), "on_demand")
    assert (after_term.amount, after_term.reservation_id) == (D("0.0007392"), None)


def test_reservation_fee_and_term(reservation):
    """2 units x 1,500.00 x 3 months = 9,000.00; Mar 1 -> Jun 1; 3,000.00 billed per month."""
    assert reservation.ends_at == datetime(2025, 6, 1, tzinfo=UTC)
    assert reservation.fee == D("9000.00")
    april = reservation_fee_for_period(reservation=reservation,
                                       period_start=datetime(2025, 4, 1, tzinfo=UTC),
                                       period_end=datetime(2025, 5, 1, tzinfo=UTC))
    assert april == D("3000.00")


def test_hourly_term_and_normalized_tokens_round_up(db, org):
    """Hourly: 1 unit x 2.50 x 5 h = 12.50. Burndown 1.5 on 3 out tokens = 4.5 -> 5 (ceiling)."""
    offering = services.provisioned_offering_create(
        code="tiny", name="tiny", model="tiny", region="us-east",
        tokens_per_minute_per_unit=100, output_burndown="1.5", hourly_unit_price="2.50",
        monthly_unit_price="1000")
    r = services.reservation_create(organization=org, offering=offering, units=1,
                                    term="hourly", term_count=5, starts_at=START)
    assert r.ends_at - r.starts_at == timedelta(hours=5)
    assert r.fee == D("12.50")
    assert normalized_tokens(prompt_tokens=0, cached_tokens=0, completion_tokens=3,
                             cache_burndown=D("0"), output_burndown=D("1.5")) == 5
