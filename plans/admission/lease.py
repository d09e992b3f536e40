"""Quota leases: a busy policy's admissions decided in the gateway process, from a share of its
limits taken in one script call.

Why a module of its own: one script operation per admission and one per settlement cost Redis
~29 us of Lua per request and the gateway process ~20 us (``bench/admission.py``), and one Redis
thread serves every gateway process. A key that sends many requests a second far from its
limits does not need Redis to tell each one apart: this module takes a share of what each limit
has left (a lease: ``n`` requests, ``n`` times the request's token estimate from every TPM
bucket, ``n`` times its worst-case cost from every hard budget) in ONE admission of the same
script, and admits and settles requests from it in the process until it runs out or its second
ends; then ONE giveback returns what was not used and adds the spend of what was.

What it keeps exact:

- **Never over a limit.** Whatever a lease holds is counted or reserved in Redis while it
  lives, so every process's admissions together never pass a limit; a lease may take at most
  1/8 of what each limit has left and at least 8 requests' worth (``LEASE_SHARE``,
  ``LEASE_MIN`` in the Lua), so no lease is taken within 64 requests of a limit's end (nor
  on any limit under 64): there, requests are decided by Redis alone, as before.
- **Requests are counted in their own second.** A lease lives at most until the end of the
  Redis second its requests count in: the one it was granted in, or in that second's last
  50 ms the next one (a request then leaves the window a little later, never earlier).
  Unused requests leave the bucket at the giveback; unused tokens go back to the buckets;
  unused reservations are released.
- **One process agrees with itself exactly.** A lease that cannot cover a request is given back
  before that request goes to Redis alone (the batcher keeps their order), so a process refuses
  only what Redis would refuse; what another process's live lease holds may make a request wait
  (a 429, ``retry-after: 1``) up to a second early, only when a limit is used up within the
  second that lease was taken in. ``TOLLGATE_QUOTA_LEASE_MAX=0`` turns leases off.
- **Requests in flight keep their reservations.** A lease given back with requests still in
  flight keeps their worst cases reserved under a new member of the reservation set (same
  expiry); as they settle, their spend is added and their reservations released within
  ``FLUSH_S`` (one giveback for all that settled meanwhile; at once after the last). A
  process that dies holding a lease loses it as it would a request: the reservation expires
  (``TOLLGATE_RESERVATION_TTL_S``) and the beat sweep raises spend to PostgreSQL's, as when a
  giveback fails (Redis down; its unused requests then count until they leave the window); the
  web process gives its leases back when it shuts down (``aclose``, the ASGI lifespan).

Only policies without a token plan's window or provisioned capacity lease (those count every
request against shared per-minute state), and only one without an end user's budget (a rule of
its own per request). A policy leases once it is busy (``plans.demand``: at least 4 of its
admissions within 0.1 s), for a second's worth at that rate (at most ``LEASE_MAX``), and while
it stays busy it takes the next lease before this one ends or runs out (``AHEAD_S``), so its
requests do not wait for Redis at each second's end. Its
reload (``runtime``, every ``QUOTA_POLICY_TTL_S``) takes over its lease and demand when none
of its terms changed (``carry``), and gives the lease back at once when one did.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from decimal import Decimal
from typing import Any

from django.conf import settings

from plans.admission.decision import Ticket, admit_frame, budget_amounts, rate_headers
from plans.admission.policy import QuotaPolicy, month_tag
from plans.admission.wire import Frame, Op, bulk, ints
from plans.demand import BUSY, WINDOW_S, Demand

LEASE_MAX = settings.QUOTA_LEASE_MAX  # TOLLGATE_QUOTA_LEASE_MAX; 0: no leases
LEASE_MIN = 8  # the script's LEASE_MIN: no lease is smaller (a smaller LEASE_MAX: none at all)
# A lease's local deadline is this much before the end of its Redis second: the answer reaches
# the process after the script ran, and a busy loop runs timers late.
DEADLINE_MARGIN_S = 0.01
# A busy policy takes its next lease ahead (at most AHEAD_MAX of them) when its lease will run
# out before its deadline at the rate of its demand, or within AHEAD_S of the deadline: the
# script counts a lease taken in a second's last 50 ms in the next second (the deadline is
# DEADLINE_MARGIN_S before the second's end; AHEAD_S leaves 10 ms for the clocks to differ), so
# that one carries on when this one ends. No request waits for Redis while the policy is busy.
AHEAD_MAX = 2
AHEAD_S = 0.03
# How soon a closed lease gives back what its settled requests freed while others are in flight
# (their spend reaches Redis; their reservations are released).
FLUSH_S = 0.1

Send = Callable[[Op], None]  # queue a script operation nobody waits for
Submit = Callable[[Op], "asyncio.Future[Any]"]  # queue one; the future of its answer
# Leases not yet wholly given back (what ``aclose`` returns at shutdown).
_live: weakref.WeakSet[Lease] = weakref.WeakSet()


def _giveback_frame(p: QuotaPolicy, month: str) -> Frame:
    """Return the policy's giveback frame for budget keys of ``month`` (cached on it)."""
    hit: tuple[str, Frame] | None = p.__dict__.get("_giveback_frame")
    if hit is not None and hit[0] == month:
        return hit[1]
    rate_keys, rate_argv = p.static_admit
    frame = Frame("r", [*rate_keys, *p.budget_keys(month)],
                  [len(p.rate_scopes), len(p.budgets), *rate_argv], 5 + 2 * len(p.budgets))
    p.__dict__["_giveback_frame"] = (month, frame)
    return frame


class Lease:
    """A share of one policy's limits held by this process: what is left of it to hand out,
    and what its settled requests spent."""

    __slots__ = ("__weakref__", "admitted_ms", "deadline", "flush", "gen", "handed", "headers",
                 "held", "inflight", "left", "level", "member", "month", "open", "policy",
                 "rate", "requests", "spent", "timer", "tokens", "tokens_out", "uid")

    def __init__(self, policy: QuotaPolicy, month: str, uid: str, raw: Sequence[Any],
                 estimate: int, worst: Sequence[int], deadline: float) -> None:
        n = int(raw[12])
        self.policy, self.month, self.uid, self.deadline = policy, month, uid, deadline
        member = raw[10]
        self.member: str = member.decode() if isinstance(member, bytes) else member
        self.admitted_ms = int(raw[11])
        self.rate = [int(v) for v in raw[4:10]]  # the first request's limits, remaining, resets
        self.headers = rate_headers(self.rate)  # each request's: its own remaining
        self.level = self.rate[4] + estimate  # the tokens left before the lease took its own
        self.requests = n  # not yet handed out
        self.tokens: int | None = estimate * n if policy.tpm_scopes else None
        # per budget: what Redis holds under ``member``, and what of it is free (not handed
        # out, or given back by a settled request); None: not a hard budget, nothing held
        self.held: list[int | None] = [w * n if b.hard else None
                                       for b, w in zip(policy.budgets, worst, strict=True)]
        self.left: list[int | None] = list(self.held)
        self.spent = [0] * len(policy.budgets)  # settled, not yet added in Redis
        self.handed = self.tokens_out = self.inflight = self.gen = 0
        self.open = True
        self.timer: asyncio.TimerHandle | None = None  # the end of its second
        self.flush: asyncio.TimerHandle | None = None  # a closed lease's next giveback
        _live.add(self)

    def take(self, request_id: str, tier: str, zone: str, estimate: int,
             worst: Sequence[int]) -> Ticket | None:
        """Return the ticket of a request admitted from this lease, or None when the lease is
        closed or cannot cover it."""
        if not self.open or self.requests <= 0 or (
                self.tokens is not None and estimate > self.tokens):
            return None
        left = self.left
        for i, w in enumerate(worst):
            v = left[i]
            if v is not None and w > v:
                return None
        for i, w in enumerate(worst):
            v = left[i]
            if v is not None:
                left[i] = v - w
        self.requests -= 1
        if self.tokens is not None:
            self.tokens -= estimate
        self.tokens_out += estimate
        self.inflight += 1
        j = self.handed
        self.handed = j + 1
        lim_req, rem_req, reset_req, lim_tok, _rem_tok, reset_tok = self.rate
        rem_req, rem_tok = max(rem_req - j, 0), max(self.level - self.tokens_out, 0)
        headers = self.headers.copy()
        if lim_req >= 0:
            headers["x-ratelimit-remaining-requests"] = str(rem_req)
        if lim_tok >= 0:
            headers["x-ratelimit-remaining-tokens"] = str(rem_tok)
        return Ticket(self.policy, request_id, tier, zone, estimate, 0, "on_demand",
                      (lim_req, rem_req, reset_req, lim_tok, rem_tok, reset_tok), self.month,
                      "", self.admitted_ms, _headers=headers, lease=self, held=tuple(worst))

    def settle(self, ticket: Ticket, *, prompt_tokens: int, cached_tokens: int,
               completion_tokens: int, send: Send) -> None:
        """Settle a ticket this lease admitted, in the process. A closed lease gives back
        what its settled requests freed within ``FLUSH_S`` (at once after its last)."""
        unused = ticket.estimate_tokens - prompt_tokens - completion_tokens
        if self.tokens is not None:
            self.tokens += unused
        self.tokens_out -= unused
        actual = budget_amounts(self.policy, tier=ticket.tier, zone=ticket.zone,
                                prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                                completion_tokens=completion_tokens)
        left, spent = self.left, self.spent
        for i, w in enumerate(ticket.held):
            v = left[i]
            if v is not None:
                left[i] = v + w
            spent[i] += actual[i]
        self.inflight -= 1
        if self.open:
            return
        if self.inflight == 0:
            self._return(send)
        elif self.flush is None:
            self.flush = asyncio.get_running_loop().call_later(FLUSH_S, self._return, send)

    def close(self, send: Send) -> None:
        """Hand out nothing more, and give back what is not held by requests in flight."""
        if not self.open:
            return
        self.open = False
        if self.timer is not None:
            self.timer.cancel()
        self._return(send)

    def _return(self, send: Send) -> None:
        """Send the giveback of everything the requests in flight do not hold: requests and
        tokens not handed out (or refunded), free reservations, and the spend of settled
        requests; what those in flight hold stays reserved under a new member."""
        if self.flush is not None:
            self.flush.cancel()
            self.flush = None
        keep = [0 if h is None else h - (v or 0) for h, v in zip(self.held, self.left,
                                                                  strict=True)]
        kept = ""
        if self.inflight and any(keep):
            self.gen += 1
            kept = " ".join([f"{self.uid}.{self.gen}", *(
                f"{k} {v}" for k, v in zip(self.policy.budget_keys(self.month), keep,
                                           strict=True) if v)])
        dyn: list[int] = [self.admitted_ms, self.requests, self.tokens or 0]
        for spent, k in zip(self.spent, keep, strict=True):
            dyn += [spent, k]
        send(_giveback_frame(self.policy, self.month).op(
            bulk(self.member) + bulk(kept) + ints(dyn)))
        self.member, self.requests, self.spent = kept, 0, [0] * len(self.spent)
        self.held = [None if h is None else k for h, k in zip(self.held, keep, strict=True)]
        self.left = [None if h is None else 0 for h in self.held]
        if self.tokens is not None:
            self.tokens = 0
        if self.inflight == 0:
            _live.discard(self)


class _Slot:
    """A policy's lease, those taken ahead of it, and the demand that decides whether it
    leases (kept on the policy)."""

    __slots__ = ("acquiring", "ahead", "demand", "lease", "quiet_until", "retired")

    def __init__(self) -> None:
        self.retired = False  # its policy's terms changed: a lease answered now goes back
        self.lease: Lease | None = None
        self.ahead: list[Lease] = []  # taken before ``lease`` ended or ran out, in order
        self.acquiring: asyncio.Future[Any] | None = None  # a lease admission's answer
        self.quiet_until = 0.0
        self.demand = Demand()

    def close(self, send: Send) -> None:
        """Give back every lease, and any the lease admission in flight brings."""
        self.retired = True
        for held in (self.lease, *self.ahead):
            if held is not None:
                held.close(send)
        self.lease, self.ahead = None, []

    def short(self, now: float) -> float:
        """Return how many seconds of its demand the policy's next lease should cover when it
        should take it now, while it still holds one (else 0): a second when the last lease
        it holds ends within ``AHEAD_S`` (the next counts in the next second), what is left of
        this one when its lease runs out before its deadline at the rate its demand says (and
        none was taken ahead yet)."""
        lease = self.lease
        if lease is None or self.acquiring is not None or len(self.ahead) >= AHEAD_MAX:
            return 0.0
        last = self.ahead[-1] if self.ahead else lease
        if now >= last.deadline - AHEAD_S:
            return 1.0
        left = lease.deadline - now
        if not self.ahead and lease.requests * WINDOW_S < self.demand.level * left:
            return left + DEADLINE_MARGIN_S
        return 0.0

    def take(self, now: float, request_id: str, tier: str, zone: str, estimate: int,
             worst: Sequence[int], send: Send) -> Ticket | None:
        """Return the ticket of a request admitted from the lease, or from the one taken ahead
        once the lease ended or cannot cover the request (each such lease is given back first,
        before the request goes anywhere else); None when neither covers it."""
        while (lease := self.lease) is not None:
            if now >= lease.deadline or lease.month != month_tag():
                lease.close(send)
            ticket = lease.take(request_id, tier, zone, estimate, worst)
            if ticket is not None:
                return ticket
            lease.close(send)
            self.lease = self.ahead.pop(0) if self.ahead else None
        return None


_NO_SEED = Decimal(0)


def _terms(p: QuotaPolicy) -> QuotaPolicy:
    """Return what of ``p`` a lease depends on: all of it but its budgets' spend seeds (read
    afresh from PostgreSQL at each reload, and used by Redis only to start a month's spend)."""
    return replace(p, budgets=tuple(replace(b, spent_seed=_NO_SEED) for b in p.budgets))


def carry(old: QuotaPolicy, new: QuotaPolicy, send: Send) -> None:
    """Let ``new``, the reload of ``old``, take over its lease and demand when nothing a lease
    depends on changed (its limits, budgets, prices): otherwise, each reload (every
    ``QUOTA_POLICY_TTL_S``) made a busy key count its demand again and take a new lease, its
    next requests decided in Redis meanwhile while the old lease held its share unused. When
    something changed, the old lease is given back now and the new terms start afresh."""
    slot: _Slot | None = old.__dict__.get("_lease_slot")
    if slot is None or "_lease_slot" in new.__dict__:
        return
    if _terms(old) == _terms(new):
        new.__dict__["_lease_slot"] = slot
    else:
        slot.close(send)


def leasable(p: QuotaPolicy) -> bool:
    """Return whether requests of ``p`` may be admitted from a lease (cached on it): not with
    a token plan's window, provisioned capacity, a suspended budget or an exhausted plan,
    which every request must meet in Redis (or be refused by)."""
    hit: bool | None = p.__dict__.get("_leasable")
    if hit is None:
        hit = p.__dict__["_leasable"] = (
            LEASE_MAX >= LEASE_MIN and p.window is None and p.provisioned is None
            and not p.plan_exhausted and not any(b.suspended for b in p.budgets))
    return hit


def take(policy: QuotaPolicy, request_id: str, tier: str, zone: str, estimate: int,
         worst: list[int], submit: Submit, send: Send) -> Ticket | None:
    """Return the ticket of a request admitted from the policy's lease, or None (no lease, or
    none covers the request: then they are given back first). Counts the policy's demand, and
    takes the next lease ahead while the policy stays busy (``_Slot.short``)."""
    slot: _Slot | None = policy.__dict__.get("_lease_slot")
    if slot is None:
        slot = policy.__dict__["_lease_slot"] = _Slot()
    now = time.monotonic()
    slot.demand.add(now)
    if slot.lease is None:
        return None
    ticket = slot.take(now, request_id, tier, zone, estimate, worst, send)
    seconds = slot.short(now)
    if seconds:
        _lease(policy, slot, estimate, worst, submit, send, seconds=seconds)
    return ticket


def _lease(policy: QuotaPolicy, slot: _Slot, estimate: int, worst: list[int],
           submit: Submit, send: Send, *, seconds: float = 1.0
           ) -> asyncio.Future[Any] | None:
    """Ask Redis for a lease for a busy policy, sized for ``seconds`` of its demand (at least
    ``LEASE_MIN``, at most ``LEASE_MAX``); return the answer's future (also
    ``slot.acquiring``), or None when it is not busy, keeps quiet after a refusal, or was
    reloaded with other terms."""
    demand = slot.demand.level
    if demand < BUSY or time.monotonic() < slot.quiet_until or slot.retired:
        return None
    month, uid = month_tag(), f"lease_{uuid.uuid4().hex}"
    want = min(LEASE_MAX, max(LEASE_MIN, math.ceil(demand * seconds / WINDOW_S)))
    future = submit(admit_frame(policy, month, "l").op(bulk(uid) + ints([estimate, want,
                                                                         *worst])))
    # The lease is recorded by the answer's callback, first of all that wait for it, whether
    # or not the request that asked for it is still there to take from it.
    future.add_done_callback(functools.partial(
        _granted, policy, slot, month, uid, estimate, worst, send))
    slot.acquiring = future
    return future


async def acquire(policy: QuotaPolicy, request_id: str, tier: str, zone: str, estimate: int,
                  worst: list[int], submit: Submit, send: Send) -> Ticket | None:
    """Take a lease for a busy policy (or wait for the one being taken) and admit the request
    from it; return None when the policy is not busy or no lease covers the request: then it
    goes to Redis alone."""
    slot: _Slot = policy.__dict__["_lease_slot"]
    for _attempt in range(3):
        answer = slot.acquiring or _lease(policy, slot, estimate, worst, submit, send)
        if answer is None:
            return None
        await asyncio.shield(answer)
        ticket = slot.take(time.monotonic(), request_id, tier, zone, estimate, worst, send)
        if ticket is not None:
            return ticket
    return None


def _granted(policy: QuotaPolicy, slot: _Slot, month: str, uid: str, estimate: int,
             worst: list[int], send: Send, future: asyncio.Future[Any]) -> None:
    """Record the lease a lease admission answered: the policy's lease, or the one taken ahead
    while its lease still hands out. Refused, the policy goes to Redis request by request
    until the refusal's retry time (what its lease holds is still handed out)."""
    slot.acquiring = None
    if future.cancelled() or future.exception() is not None:
        return
    raw = future.result()
    now = time.monotonic()
    if raw[0] != 1:
        slot.quiet_until = now + max(int(raw[2]), 1) / 1000
        return
    admitted_ms = int(raw[11])
    lease = Lease(policy, month, uid, raw, estimate, worst,
                  now + (1000 - admitted_ms % 1000) / 1000 - DEADLINE_MARGIN_S)
    lease.timer = asyncio.get_running_loop().call_later(lease.deadline - now, lease.close, send)
    if slot.retired:
        lease.close(send)
    elif slot.lease is not None and slot.lease.open:
        slot.ahead.append(lease)
    else:
        slot.lease = lease


async def aclose(submit: Submit) -> int:
    """Give back every lease this process holds (at shutdown), waiting for Redis; return how
    many were given back."""
    ops: list[Op] = []
    for lease in list(_live):
        if lease.open:
            lease.close(ops.append)
        else:  # what its settled requests freed goes back now
            lease._return(ops.append)
    await asyncio.gather(*(submit(op) for op in ops))
    return len(ops)
