"""Token-plan credit state: the ledger, period totals and credit packs of a batch.

``TokenPlanLedger`` is loaded once per batch (under a row lock on the subscriptions when it
records), splits each event's credits into plan / pack / overage in batch order, and writes the
ledger rows, period totals and pack balances back in one go. ``plans.rating`` explains why this
counts every event exactly once.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import cast

from django.db.models import F
from django.utils import timezone

from plans.choices import CapPolicy
from plans.models import CreditPackPurchase, Subscription, TokenPlanPeriod, TokenPlanUsage
from plans.periods import period_bounds

ZERO = Decimal("0")


class _Window:
    """Credits by event time for one subscription: sum over (lo, hi] in O(log n)."""

    __slots__ = ("cums", "times")

    def __init__(self) -> None:
        self.times: list[datetime] = []
        self.cums: list[Decimal] = [ZERO]  # cums[i] = credits of the first i entries

    def add(self, t: datetime, credits: Decimal) -> None:
        i = bisect_right(self.times, t)
        self.times.insert(i, t)
        if i == len(self.times) - 1:
            self.cums.append(self.cums[-1] + credits)
            return
        self.cums.insert(i + 1, self.cums[i] + credits)
        for k in range(i + 2, len(self.cums)):
            self.cums[k] += credits

    def between(self, lo: datetime, hi: datetime) -> Decimal:
        return self.cums[bisect_right(self.times, hi)] - self.cums[bisect_right(self.times, lo)]


@dataclass(frozen=True, slots=True)
class CreditSplit:
    """Where one event's credits came from: the plan, credit packs, or past every cap."""

    plan: Decimal
    pack: Decimal
    overage: Decimal

    @property
    def total(self) -> Decimal:
        return self.plan + self.pack + self.overage


class TokenPlanLedger:
    """Token-plan counters for a batch's subscriptions, loaded once, written back once.

    ``events`` are (request_id, event_time, subscription). With ``record`` the subscriptions
    are locked (``SELECT ... FOR UPDATE`` in id order) before anything is read, events already
    in the ledger return their stored split, and ``flush`` writes the new state; without it
    (quotes) nothing is locked or written.
    """

    def __init__(self, events: list[tuple[str, datetime, Subscription]], *, record: bool):
        self.record = record
        subs = {sub.id: sub for _, _, sub in events}
        ids = sorted(subs)
        if record:
            # Serialize with every other batch touching these subscriptions.
            list(Subscription.objects.select_for_update().filter(id__in=ids).order_by("id")
                 .values_list("id", flat=True))
        times = [t for _, t, _ in events]
        min_t, max_t = min(times), max(times)
        longest = max(timedelta(hours=s.plan.window_hours) for s in subs.values())
        self.stored: dict[tuple[int, str], CreditSplit] = {}
        if record:
            for sub_id, rid, plan, pack, over in TokenPlanUsage.objects.filter(
                    subscription_id__in=ids,
                    request_id__in={rid for rid, _, _ in events}).values_list(
                    "subscription_id", "request_id", "plan_credits", "pack_credits",
                    "overage_credits"):
                self.stored[(sub_id, rid)] = CreditSplit(plan, pack, over)
        self.windows: dict[int, _Window] = defaultdict(_Window)
        for sub_id, t, credits in (TokenPlanUsage.objects
                                   .filter(subscription_id__in=ids, event_time__gt=min_t - longest,
                                           event_time__lte=max_t)
                                   .order_by("event_time").values_list(
                                       "subscription_id", "event_time", "plan_credits")):
            self.windows[sub_id].add(t, credits)
        starts = {period_bounds(sub.billing_anchor, t)[0] for _, t, sub in events}
        self.periods: dict[tuple[int, datetime], TokenPlanPeriod] = {
            (p.subscription_id, p.period_start): p
            for p in TokenPlanPeriod.objects.filter(subscription_id__in=ids,
                                                    period_start__in=starts)}
        self.packs: dict[int, list[CreditPackPurchase]] = defaultdict(list)
        for purchase in (CreditPackPurchase.objects
                         .filter(subscription_id__in=ids, credits_used__lt=F("credits"))
                         .order_by(F("expires_at").asc(nulls_last=True), "purchased_at", "id")):
            self.packs[purchase.subscription_id].append(purchase)
        self.new_usage: list[TokenPlanUsage] = []
        self.dirty_periods: set[tuple[int, datetime]] = set()
        self.dirty_packs: dict[int, CreditPackPurchase] = {}

    def period(self, sub: Subscription, t: datetime) -> TokenPlanPeriod:
        start, end = period_bounds(sub.billing_anchor, t)
        row = self.periods.get((sub.id, start))
        if row is None:
            row = TokenPlanPeriod(subscription_id=sub.id, period_start=start, period_end=end,
                                  plan_credits=ZERO, pack_credits=ZERO, overage_credits=ZERO)
            self.periods[(sub.id, start)] = row
        return row

    def take_packs(self, sub: Subscription, need: Decimal, t: datetime) -> Decimal:
        taken = ZERO
        for purchase in self.packs.get(sub.id, ()):
            if need <= 0:
                break
            if purchase.purchased_at > t or (purchase.expires_at and purchase.expires_at <= t):
                continue
            part = min(purchase.credits_left, need)
            if part > 0:
                purchase.credits_used += part
                self.dirty_packs[purchase.id] = purchase
                taken += part
                need -= part
        return taken

    def consume(self, sub: Subscription, request_id: str, t: datetime, credits: Decimal
                ) -> CreditSplit:
        """Split ``credits`` into plan / pack / overage and book it (once per request id).

        Plan credits are what is left of both caps (period, rolling window); then credit
        packs, oldest expiry first; the rest is overage (``overage`` policy) or, under
        ``block``, counted against the plan (admission refuses the next request).
        """
        stored = self.stored.get((sub.id, request_id))
        if stored is not None:
            return stored
        plan = sub.plan
        period = self.period(sub, t)
        # a token plan always has credits_per_period (constraint token_plan_has_credits)
        room = cast(Decimal, plan.credits_per_period) - period.plan_credits
        window = self.windows[sub.id]
        if plan.window_credits is not None:
            used = window.between(t - timedelta(hours=plan.window_hours), t)
            room = min(room, plan.window_credits - used)
        room = max(room, ZERO)
        in_plan = min(credits, room)
        rest = credits - in_plan
        pack = self.take_packs(sub, rest, t) if rest > 0 else ZERO
        rest -= pack
        overage = ZERO
        if rest > 0:
            if plan.cap_policy == CapPolicy.OVERAGE:
                overage = rest
            else:
                # Block: admission refuses past the cap; what it let through (at most the last
                # request's excess) is covered by the plan and counted, so the next one is
                # refused.
                in_plan += rest
        split = CreditSplit(in_plan, pack, overage)
        window.add(t, in_plan)
        period.plan_credits += in_plan
        period.pack_credits += pack
        period.overage_credits += overage
        self.dirty_periods.add((sub.id, period.period_start))
        self.stored[(sub.id, request_id)] = split
        if self.record:
            self.new_usage.append(TokenPlanUsage(
                subscription_id=sub.id, request_id=request_id, event_time=t,
                period_start=period.period_start, plan_credits=in_plan, pack_credits=pack,
                overage_credits=overage))
        return split

    def flush(self) -> None:
        """Write the new ledger rows, period totals and pack balances (when recording)."""
        if not self.record:
            return
        now = timezone.now()
        if self.new_usage:
            TokenPlanUsage.objects.bulk_create(self.new_usage, batch_size=5000)
        if self.dirty_periods:
            rows = [self.periods[key] for key in sorted(self.dirty_periods)]
            for row in rows:
                row.updated_at = now
            TokenPlanPeriod.objects.bulk_create(
                rows, update_conflicts=True, unique_fields=["subscription", "period_start"],
                update_fields=["plan_credits", "pack_credits", "overage_credits", "updated_at"])
        if self.dirty_packs:
            CreditPackPurchase.objects.bulk_update(list(self.dirty_packs.values()),
                                                   ["credits_used"])

