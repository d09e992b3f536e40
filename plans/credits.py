"""Token-plan credit state: the ledger, period totals and credit packs of a batch.

``TokenPlanLedger`` is loaded once per batch (under a row lock on the subscriptions when it
records), splits each event's credits into plan / pack / overage in batch order, and writes the
ledger rows, period totals and pack balances back in one go. ``plans.rating`` explains why this
counts every event exactly once. ``CreditReplay`` applies the same rules (``plan_room``,
``past_cap``) to a period of past events as if they had been on a plan (``plans.advisor``).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict, deque
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import TypeVar, cast

import numpy as np
from django.db.models import F
from django.utils import timezone

from plans.choices import CapPolicy
from plans.models import (
    CreditPackPurchase,
    Plan,
    Subscription,
    TokenPlanPeriod,
    TokenPlanUsage,
)
from plans.periods import epoch_us, from_epoch_us, period_bounds

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


_N = TypeVar("_N", int, Decimal)


def plan_room(*, period_cap: _N, period_used: _N, window_cap: _N | None,
              window_used: _N) -> _N:
    """Return the plan credits left for an event: what both caps (the period's and, when the
    plan has one, the rolling window's) leave, never below 0.

    The same rule for the ledger (credits, Decimal) and a replay (micro-credits, int): every
    argument is in the one unit.
    """
    room = period_cap - period_used
    if window_cap is not None:
        room = min(room, window_cap - window_used)
    return room if room > 0 else room - room


def past_cap(plan: Plan, *, in_plan: _N, rest: _N) -> tuple[_N, _N]:
    """Return (plan credits, overage credits) of an event once the room and packs are used.

    ``rest`` is what neither covered. Under ``overage`` it is billed at on-demand prices; under
    ``block`` admission refuses past the cap, and what it let through (at most the last
    request's excess) is covered by the plan and counted, so the next one is refused.
    """
    zero = rest - rest
    if rest <= 0:
        return in_plan, zero
    if plan.cap_policy == CapPolicy.OVERAGE:
        return in_plan, rest
    return in_plan + rest, zero


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
        window = self.windows[sub.id]
        window_used = (window.between(t - timedelta(hours=plan.window_hours), t)
                       if plan.window_credits is not None else ZERO)
        # a token plan always has credits_per_period (constraint token_plan_has_credits)
        in_plan = min(credits, plan_room(
            period_cap=cast(Decimal, plan.credits_per_period), period_used=period.plan_credits,
            window_cap=plan.window_credits, window_used=window_used))
        rest = credits - in_plan
        pack = self.take_packs(sub, rest, t) if rest > 0 else ZERO
        in_plan, overage = past_cap(plan, in_plan=in_plan, rest=rest - pack)
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



MICRO = 1_000_000  # micro-credits in a credit (credits keep 6 places, so these are exact)


class CreditReplay:
    """One token plan's caps replayed over a time-ordered stream of events, writing nothing.

    It books what ``TokenPlanLedger`` books for the same events on a subscription that starts
    at ``anchor`` with an empty ledger and no credit packs (the plan advisor's "had you been on
    this plan"): the same rules (``plan_room``, ``past_cap``, periods from ``period_bounds``,
    a rolling window over (t - window, t]). Only the bookkeeping differs, for speed: events
    come in time order, so the window is a queue that drops what left it; credits are integer
    micro-credits (exact: credits keep 6 places) and times integer microseconds since the Unix
    epoch (``plans.periods.epoch_us``), so a month of a million events replays in a second.
    """

    __slots__ = ("anchor", "blocks", "period_cap", "period_end", "period_start", "period_used",
                 "plan", "queue", "window", "window_cap", "window_used")

    def __init__(self, plan: Plan, *, anchor: datetime):
        self.plan = plan
        self.anchor = anchor
        # a token plan always has credits_per_period (constraint token_plan_has_credits)
        self.period_cap = int(cast(Decimal, plan.credits_per_period) * MICRO)
        self.window_cap = (None if plan.window_credits is None
                           else int(plan.window_credits * MICRO))
        self.window = plan.window_hours * 3_600_000_000
        self.blocks = plan.cap_policy == CapPolicy.BLOCK
        self.period_start = self.period_end = 0  # the first event looks its period up
        self.period_used = 0
        self.queue: deque[tuple[int, int]] = deque()
        self.window_used = 0

    def consume(self, t: int, credits: int) -> tuple[int, int] | None:
        """Return the (plan, overage) micro-credits of ``credits`` at ``t`` (microseconds since
        the epoch, never before the previous event's), or None where a blocking plan has
        nothing left at ``t``: admission would have refused the request, and nothing of it
        is counted."""
        if not self.period_start <= t < self.period_end:
            start, end = period_bounds(self.anchor, from_epoch_us(t))
            self.period_start, self.period_end = epoch_us(start), epoch_us(end)
            self.period_used = 0
        queue = self.queue
        edge = t - self.window
        while queue and queue[0][0] <= edge:
            self.window_used -= queue.popleft()[1]
        room = plan_room(period_cap=self.period_cap, period_used=self.period_used,
                         window_cap=self.window_cap, window_used=self.window_used)
        if not room and self.blocks:
            return None
        if credits <= room:  # inside both caps: all of it in the plan, nothing past a cap
            in_plan, overage = credits, 0
        else:
            in_plan, overage = past_cap(self.plan, in_plan=room, rest=credits - room)
        self.period_used += in_plan
        if in_plan and self.window_cap is not None:
            queue.append((t, in_plan))
            self.window_used += in_plan
        return in_plan, overage

    def consume_many(self, t: np.ndarray, credits: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Book a time-ordered run of events at once: return (plan, overage, refused) per
        event, as ``consume`` one by one would (refused: its None; plan and overage 0 then).

        ``t`` and ``credits`` are int64 arrays (microseconds, micro-credits). Where no cap
        binds, a block of events is checked in one go against both caps (the window's use from
        cumulative sums and a search for each event's window start); an event that crosses a
        cap goes through ``plan_room`` and ``past_cap`` alone; and the run of events that
        find no room after it (until the period ends or enough of the window leaves it) is
        booked at once, as ``consume`` books an event with no room. The state afterwards is
        ``consume``'s, so the two can be mixed.
        """
        n = len(t)
        plan = np.zeros(n, dtype=np.int64)
        overage = np.zeros(n, dtype=np.int64)
        refused = np.zeros(n, dtype=bool)
        if not n:
            return plan, overage, refused
        if int(credits.max()) * n + self.period_used >= 2**62:  # int64 sums could overflow
            for i, (ti, ci) in enumerate(zip(t.tolist(), credits.tolist(), strict=True)):
                split = self.consume(ti, ci)
                if split is None:
                    refused[i] = True
                else:
                    plan[i], overage[i] = split
            return plan, overage, refused
        windowed, window = self.window_cap is not None, self.window
        q_t = np.fromiter((q for q, _ in self.queue), dtype=np.int64, count=len(self.queue))
        q_c = np.fromiter((c for _, c in self.queue), dtype=np.int64, count=len(self.queue))
        block, i = 256, 0
        while i < n:
            ti = int(t[i])
            if not self.period_start <= ti < self.period_end:
                start, end = period_bounds(self.anchor, from_epoch_us(ti))
                self.period_start, self.period_end = epoch_us(start), epoch_us(end)
                self.period_used = 0
            stop = int(np.searchsorted(t, self.period_end, side="left"))  # this period's end
            if windowed:  # what left the window by t[i] never counts again
                keep = int(np.searchsorted(q_t, ti - window, side="right"))
                q_t, q_c = q_t[keep:], q_c[keep:]
            hi = min(stop, i + block)
            tb, cb = t[i:hi], credits[i:hi]
            used = np.cumsum(cb) - cb  # credits of the block before each event, had all fit
            room = self.period_cap - self.period_used - used
            if windowed:
                times = np.concatenate((q_t, tb))
                sums = np.concatenate(([0], np.cumsum(np.concatenate((q_c, cb)))))
                first = np.searchsorted(times, tb - window, side="right")
                inside = sums[len(q_t) + np.arange(hi - i)] - sums[first]
                room = np.minimum(room, cast(int, self.window_cap) - inside)
            room = np.maximum(room, 0)
            fits = (cb <= room) & ((room > 0) | (not self.blocks))
            f = int(np.argmin(fits)) if not fits.all() else hi - i
            if f:  # inside both caps: all of it in the plan
                plan[i:i + f] = cb[:f]
                self.period_used += int(cb[:f].sum())
                if windowed:
                    booked = cb[:f] > 0  # as consume: an event of no credits is not queued
                    q_t = np.concatenate((q_t, tb[:f][booked]))
                    q_c = np.concatenate((q_c, cb[:f][booked]))
            if f == hi - i:
                i, block = hi, min(block * 2, 65_536)
                continue
            k, block = i + f, 256
            tk, ck = int(t[k]), int(credits[k])
            window_used = 0
            if windowed:
                keep = int(np.searchsorted(q_t, tk - window, side="right"))
                q_t, q_c = q_t[keep:], q_c[keep:]
                window_used = int(q_c.sum())
            room_k = plan_room(period_cap=self.period_cap, period_used=self.period_used,
                               window_cap=self.window_cap, window_used=window_used)
            if room_k:  # the event that crosses a cap
                in_plan, over = past_cap(self.plan, in_plan=room_k, rest=ck - room_k)
                plan[k], overage[k] = in_plan, over
                self.period_used += in_plan
                if windowed and in_plan:
                    q_t, q_c = np.append(q_t, tk), np.append(q_c, in_plan)
                i = k + 1
                continue
            # No room: nor for any event until the period ends or, when only the window is
            # full, until enough of it leaves (nothing booked meanwhile adds to it).
            until = stop
            if windowed and self.period_used < self.period_cap:
                need = window_used - cast(int, self.window_cap)  # leaving must exceed this
                j = int(np.searchsorted(np.cumsum(q_c), need, side="right"))
                if j < len(q_t):  # else the window never frees (a cap of 0)
                    until = min(stop, int(np.searchsorted(t, int(q_t[j]) + window,
                                                          side="left")))
            run = slice(k, max(until, k + 1))
            if self.blocks:
                refused[run] = True
            else:  # past_cap with no room: all of it overage
                overage[run] = np.maximum(credits[run], 0)
            i = run.stop
        if windowed:
            keep = int(np.searchsorted(q_t, int(t[-1]) - window, side="right"))
            self.queue = deque(zip(q_t[keep:].tolist(), q_c[keep:].tolist(), strict=True))
            self.window_used = sum(c for _, c in self.queue)
        return plan, overage, refused
