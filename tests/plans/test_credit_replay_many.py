"""``CreditReplay.consume_many`` (the plan advisor's vectorized replay) books exactly what
``consume`` books one event at a time: the same plan, overage and refusals per event, and the
same state afterwards, for both cap policies, with caps that bind often, across period
boundaries, at equal timestamps, and mixed with ``consume`` calls."""

from __future__ import annotations

import random
from datetime import UTC, datetime
from decimal import Decimal

import numpy as np
import pytest

from plans.choices import CapPolicy
from plans.credits import CreditReplay
from plans.models import Plan
from plans.periods import epoch_us

ANCHOR = datetime(2026, 1, 15, tzinfo=UTC)
HOUR = 3_600_000_000


def _plan(policy: str, period: int, window: int | None, hours: int) -> Plan:
    # an unsaved plan: the replay reads its caps and policy only
    return Plan(code="p", name="P", kind="token_plan", cap_policy=policy,
                credits_per_period=Decimal(period), window_credits=(
                    None if window is None else Decimal(window)), window_hours=hours)


def _stream(rng: random.Random, n: int) -> tuple[list[int], list[int]]:
    t, times, credits = epoch_us(ANCHOR) - 3 * HOUR, [], []
    for _ in range(n):
        # ties, a window's length exactly (an event leaves as the next arrives), and gaps
        t += rng.choice((0, 0, 1, HOUR, 5 * HOUR, rng.randrange(1, HOUR),
                         rng.randrange(1, 40 * HOUR)))
        times.append(t)
        credits.append(rng.choice((0, rng.randrange(1, 50), rng.randrange(1, 400))) * 10**6)
    return times, credits


@pytest.mark.parametrize("seed", range(40))
def test_consume_many_books_what_consume_books(seed: int) -> None:
    rng = random.Random(seed)
    policy = rng.choice((CapPolicy.BLOCK, CapPolicy.OVERAGE))
    plan = _plan(policy, period=rng.choice((500, 3_000, 20_000)),
                 window=rng.choice((None, 100, 400, 1_500)), hours=rng.choice((1, 5)))
    times, credits = _stream(rng, rng.choice((50, 400, 3_000)))
    one = CreditReplay(plan, anchor=ANCHOR)
    want = [one.consume(t, c) for t, c in zip(times, credits, strict=True)]

    many = CreditReplay(plan, anchor=ANCHOR)
    got: list[tuple[int, int] | None] = []
    i = 0
    while i < len(times):  # chunks of random sizes, some events through consume itself
        if rng.random() < 0.2:
            got.append(many.consume(times[i], credits[i]))
            i += 1
            continue
        j = min(len(times), i + rng.randrange(1, 700))
        plan_c, over_c, refused = many.consume_many(
            np.array(times[i:j], dtype=np.int64), np.array(credits[i:j], dtype=np.int64))
        got += [None if r else (int(p), int(o))
                for p, o, r in zip(plan_c, over_c, refused, strict=True)]
        i = j
    assert got == want
    assert sum(1 for g in want if g is None) == sum(1 for g in got if g is None)
    assert (many.period_start, many.period_end, many.period_used) == (
        one.period_start, one.period_end, one.period_used)
    edge = times[-1] - plan.window_hours * HOUR  # what can still count for a later event
    assert [q for q in many.queue if q[0] > edge] == [q for q in one.queue if q[0] > edge]


def test_the_bench_shape_refuses_after_the_cap_and_keeps_counting() -> None:
    """A blocking plan whose period cap runs out mid-stream: every later event is refused."""
    plan = _plan(CapPolicy.BLOCK, period=1_000, window=None, hours=5)
    t = np.arange(2_000, dtype=np.int64) * 1_000_000 + epoch_us(ANCHOR)
    credits = np.full(2_000, 3 * 10**6, dtype=np.int64)
    p, o, r = CreditReplay(plan, anchor=ANCHOR).consume_many(t, credits)
    # 333 events fit (999 credits), the 334th crosses (a blocking plan covers it), then none
    assert int(p.sum()) == 1_002 * 10**6 and not o.any()
    assert int(r.sum()) == 2_000 - 334 and not r[:334].any() and r[334:].all()
