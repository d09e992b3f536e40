"""What admission enforces, as values: the rules of one (key, model), Redis key names, micro-units.

Why a module of its own: everything else in admission reads these types, and none of it needs
IO to do so. A ``QuotaPolicy`` is built from PostgreSQL once (``loading``) and then cached and
shared by every request of that key and model (``runtime``); the scripts (``scripts``) and the
arguments built for them (``decision``) name Redis keys only through the functions here.

Redis keys (all of one organization share the hash tag ``{o<org id>}``, so one operation only
touches one slot):

- ``tg:q:{o1}:rl:<scope>``   HASH, one per scope ("o1", "p3", "k9"): the request window and
  the token bucket. Requests: ``<second>`` -> admissions in that second, ``n`` their sum,
  ``lo`` the oldest second counted. A second counts while any of it lies in the last 60 s
  (61 buckets), so never more than ``rpm`` admissions fall in any 60 s, and a refused client
  may wait up to one second longer than an exact log would make it (a log costs a ZSET write
  per request and scope, the buckets one hash write). Tokens: ``t`` (tokens left), ``ts``
  (ms): a bucket that refills ``tpm`` per minute. Admission takes prompt estimate + max
  output; settlement gives back the difference to the actual tokens.
- ``tg:q:{o1}:bud:<budget id>:<YYYYMM>``  HASH ``spent``, ``reserved`` in integer micro-units
  of the org's currency (1e-6), always rounded UP, so Redis never under-counts spend.
  ``spent`` is seeded from PostgreSQL (hourly rollups) when the key is missing.
- ``tg:q:{o1}:eub:<budget id>:<end user digest>:<YYYYMM>``  HASH like a budget's: one end
  user's spend under a per-end-user budget (``EndUserBudget``), seeded from that end user's
  rated events this month when missing. The digest (blake2b) keeps the client's ``user``
  text out of key names and reservation members.
- ``tg:q:{o1}:res``  ZSET of reservations scored by expiry (ms); a member is
  ``"<request id> <key> <micro> ..."``: what the request holds, per budget or window key.
  Settlement removes it and gives back what it names; one left by a crashed gateway is
  released by the first admission it would otherwise refuse (or the beat sweep) once
  ``TOLLGATE_RESERVATION_TTL_S`` has passed, so nothing leaks and no worker is needed.
- ``tg:q:{o1}:win:<subscription id>``  HASH: a blocking token plan's rolling window (5 hours
  by default) in micro-credits: ``m<minute since epoch>`` -> credits settled in that minute,
  ``reserved`` -> credits held by requests in flight (released like budget reservations).
  Minutes that left the window are trimmed at each admission; the oldest minute still in it
  counts whole, so the window is never under-counted. Seeded from the ledger
  (``TokenPlanUsage``, per minute) when the key is missing.
- ``tg:q:{o1}:prov:<reservation id>``  HASH token bucket of provisioned normalized tokens
  (units x tokens/min per unit); a request that fits is ``provisioned``, else ``spillover``
  (or rejected when the reservation's overflow policy is ``reject``).
- ``tg:q:{o1}:inflight``  ZSET of the organization's /v1 requests in flight, scored by when
  their slot lapses (ms); see ``plans.concurrency``.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from decimal import ROUND_CEILING, Decimal
from functools import cached_property
from typing import TYPE_CHECKING

from django.conf import settings

from billing_platform.errors import DomainError

if TYPE_CHECKING:
    from plans.pricing import ModelPricing

RESERVATION_TTL_MS = int(settings.QUOTA_RESERVATION_TTL_S * 1000)
MICRO = Decimal("1000000")

# Default organization limits by usage tier (requests and tokens per minute), like OpenAI's
# tiers. A self-hosted fleet starts orgs at tier-3 so development is not throttled.
USAGE_TIERS: dict[str, tuple[int, int]] = {
    "free": (3, 40_000),
    "tier-1": (500, 200_000),
    "tier-2": (5_000, 2_000_000),
    "tier-3": (5_000, 4_000_000),
    "tier-4": (10_000, 10_000_000),
    "tier-5": (30_000, 150_000_000),
}
DEFAULT_USAGE_TIER = "tier-3"


# --- key names -----------------------------------------------------------------------------

def _tag(org_id: int) -> str:
    return f"tg:q:{{o{org_id}}}"


def reservations_key(org_id: int) -> str:
    return f"{_tag(org_id)}:res"


def _budget_key(org_id: int, budget_id: int, month: str) -> str:
    return f"{_tag(org_id)}:bud:{budget_id}:{month}"


def budget_key(org_id: int, budget_id: int, at: datetime) -> str:
    return _budget_key(org_id, budget_id, f"{at:%Y%m}")


def rule_key(org_id: int, rule: BudgetRule, month: str) -> str:
    """Return the Redis key of a budget rule; ``month`` is ``YYYYMM`` (UTC)."""
    if rule.scope == "plan":
        return f"{_tag(org_id)}:plan:{rule.budget_id}:{rule.period_tag}"
    if rule.scope == "end_user":
        return f"{_tag(org_id)}:eub:{rule.budget_id}:{rule.period_tag}:{month}"
    return _budget_key(org_id, rule.budget_id, month)


def end_user_digest(end_user: str) -> str:
    """Return the fixed-length name of an end user in Redis keys."""
    return hashlib.blake2b(end_user.encode(), digest_size=12).hexdigest()


def rate_key(org_id: int, scope: str) -> str:
    """Return the key holding one scope's request window and token bucket."""
    return f"{_tag(org_id)}:rl:{scope}"


def window_key(org_id: int, subscription_id: int) -> str:
    return f"{_tag(org_id)}:win:{subscription_id}"


def prov_key(org_id: int, reservation_id: int) -> str:
    return f"{_tag(org_id)}:prov:{reservation_id}"


def inflight_key(org_id: int) -> str:
    """Return the key of the organization's requests in flight (``plans.concurrency``)."""
    return f"{_tag(org_id)}:inflight"


def inflight_full_key(org_id: int) -> str:
    """Return the key that says a request of the organization was just refused at its limit of
    requests in flight (``plans.concurrency``: pools give their unused slots back)."""
    return f"{_tag(org_id)}:inflight:full"


_month: tuple[float, float, str] = (0.0, 0.0, "")


def month_tag(at: float | None = None) -> str:
    """Return ``YYYYMM`` (UTC) of ``at`` (a timestamp; now by default), cached per month."""
    global _month
    at = time.time() if at is None else at
    start, end, tag = _month
    if start <= at < end:
        return tag
    d = datetime.fromtimestamp(at, tz=UTC)
    first = datetime(d.year, d.month, 1, tzinfo=UTC)
    nxt = datetime(d.year + (d.month == 12), d.month % 12 + 1, 1, tzinfo=UTC)
    _month = (first.timestamp(), nxt.timestamp(), f"{d:%Y%m}")
    return _month[2]


# --- micro-units ---------------------------------------------------------------------------

def to_micro(amount: Decimal) -> int:
    """Return ``amount`` in integer micro-units of its currency, rounded up."""
    return int((amount * MICRO).to_integral_value(rounding=ROUND_CEILING))


def from_micro(micro: int | str | bytes) -> Decimal:
    """Return an amount from integer micro-units (as Redis answers them: bytes, text or int)."""
    return Decimal(int(micro)) / MICRO


# --- the policy the gateway applies ---------------------------------------------------------

@dataclass(frozen=True)
class BudgetRule:
    budget_id: int
    scope: str  # "organization" | "project" | "plan" | "end_user"
    limit: Decimal
    hard: bool
    spent_seed: Decimal  # this month's rated spend in PostgreSQL when the policy was read
    suspended: bool
    # A token plan's period credits ride the same machinery: scope "plan", amounts in credits
    # (coefficients per token class: input, cached_input, output), key named by the period.
    coefficients: tuple[Decimal, Decimal, Decimal] | None = None
    period_tag: str = ""  # a plan's period; an end user's digest
    end_user: str = ""  # an end-user rule's end user, as the client named it


def end_user_rule(*, budget_id: int, limit: Decimal, end_user: str) -> BudgetRule:
    """Return the hard rule of one end user's budget (seed not yet known: 0)."""
    return BudgetRule(budget_id=budget_id, scope="end_user", limit=limit, hard=True,
                      spent_seed=Decimal(0), suspended=False,
                      period_tag=end_user_digest(end_user), end_user=end_user)


@dataclass(frozen=True)
class EndUserLimits:
    """An organization's per-end-user budgets: (budget id, monthly amount) of each end user
    that has its own, and the default for each that has not (None: no default)."""

    default: tuple[int, Decimal] | None = None
    named: Mapping[str, tuple[int, Decimal]] = field(default_factory=dict)

    def of(self, end_user: str) -> tuple[int, Decimal] | None:
        return self.named.get(end_user, self.default)


@dataclass(frozen=True)
class WindowRule:
    """A blocking token plan's rolling window: at most ``limit`` credits in any ``hours``."""

    subscription_id: int
    hours: int
    limit: Decimal  # credits
    coefficients: tuple[Decimal, Decimal, Decimal]
    # plan credits per minute (minutes since the epoch) still in the window when the policy
    # was read; used only when Redis has no window for the subscription
    seed: tuple[tuple[int, int], ...] = ()

    @property
    def window_ms(self) -> int:
        return self.hours * 3_600_000


@dataclass(frozen=True)
class ProvisionedRule:
    reservation_id: int
    region: str
    tokens_per_minute: int
    cache_burndown: Decimal
    output_burndown: Decimal
    reject_overflow: bool


@dataclass(frozen=True)
class QuotaPolicy:
    """Everything admission needs about one (key, model), read from PostgreSQL and cached."""

    org_id: int
    project_id: int
    key_id: int
    rpm: tuple[tuple[str, int], ...]  # (scope, limit), scope like "o1" / "p3" / "k9"
    tpm: tuple[tuple[str, int], ...]
    budgets: tuple[BudgetRule, ...]
    pricing: ModelPricing | None  # None: the model has no price
    allowed_regions: frozenset[str] | None  # key/project narrowing; None: no narrowing
    provisioned: ProvisionedRule | None = None
    plan_exhausted: str = ""  # non-empty: a blocking token plan is out of credits (why)
    currency: str = "USD"
    window: WindowRule | None = None
    end_users: EndUserLimits | None = None  # None: the organization limits no end user

    def end_user_limit(self, end_user: str | None) -> BudgetRule | None:
        """Return the rule (seed not yet known: 0) that limits requests naming ``end_user``,
        or None when none does."""
        found = self.end_users.of(end_user) if self.end_users and end_user else None
        if found is None or not end_user:
            return None
        return end_user_rule(budget_id=found[0], limit=found[1], end_user=end_user)

    def with_rule(self, rule: BudgetRule) -> QuotaPolicy:
        """Return this policy with one more budget rule (one request's end user's)."""
        return replace(self, budgets=(*self.budgets, rule))

    @cached_property
    def rate_scopes(self) -> tuple[tuple[str, int, int], ...]:
        """Return (rate key, rpm or -1, tpm or -1) per scope, RPM scopes first."""
        rpm, tpm = dict(self.rpm), dict(self.tpm)
        scopes = list(rpm) + [s for s in tpm if s not in rpm]
        return tuple((rate_key(self.org_id, s), rpm.get(s, -1), tpm.get(s, -1))
                     for s in scopes)

    @cached_property
    def tpm_scopes(self) -> tuple[tuple[str, int], ...]:
        """Return (rate key, tpm) of each scope with a TPM limit (what settlement refunds)."""
        return tuple((k, tpm) for k, _rpm, tpm in self.rate_scopes if tpm >= 0)

    @cached_property
    def static_admit(self) -> tuple[list[str], list[int]]:
        """Return the KEYS and ARGV of the rate limits, which every admission repeats."""
        keys = [reservations_key(self.org_id)] + [k for k, _r, _t in self.rate_scopes]
        argv: list[int] = []
        for _k, rpm, tpm in self.rate_scopes:
            argv += [rpm, tpm]
        return keys, argv

    @cached_property
    def budget_static(self) -> tuple[tuple[int, int, int], ...]:
        """Return (limit, seed, hard) per budget rule, in micro-units."""
        return tuple((to_micro(b.limit), to_micro(b.spent_seed), int(b.hard))
                     for b in self.budgets)

    def budget_keys(self, month: str) -> list[str]:
        cached = self.__dict__.get("_budget_keys")
        if cached is None or cached[0] != month:
            cached = (month, [rule_key(self.org_id, b, month) for b in self.budgets])
            self.__dict__["_budget_keys"] = cached
        return cached[1]


class QuotaExceeded(DomainError):
    """A 429: ``code`` is OpenAI's, ``headers`` carry retry-after and the rate-limit state."""

    status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, code: str, headers: dict[str, str] | None = None,
                 reason: str = ""):
        super().__init__(message, code=code)
        self.headers = headers or {}
        # finer than OpenAI's code: which limit said no (plans.refusals counts by it)
        self.reason = reason or code
