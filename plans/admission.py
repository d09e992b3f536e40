"""Admission: ONE atomic Redis step per request that checks and reserves every quota together.

Why one Lua script: a check followed by a separate write lets two gateway processes both pass
the check (budgets exceeded under concurrency, rate limits multiplied by the replica count).
The script runs atomically inside Redis, so every gateway process shares one exact view.

Redis keys (all of one organization share the hash tag ``{o<org id>}``, so one script only
touches one slot):

- ``tg:q:{o1}:rpm:<scope>``   ZSET, a sliding-window log of admitted request ids scored by ms.
  Bounded by the limit itself; exactly ``rpm`` admissions in any 60 s window.
- ``tg:q:{o1}:tpm:<scope>``   HASH ``t`` (tokens left), ``ts`` (ms): a token bucket that
  refills ``tpm`` per minute. Admission takes prompt estimate + max output; settlement gives
  back the difference to the actual tokens.
- ``tg:q:{o1}:bud:<budget id>:<YYYYMM>``  HASH ``spent``, ``reserved`` in integer micro-units
  of the org's currency (1e-6), always rounded UP, so Redis never under-counts spend.
  ``spent`` is seeded from PostgreSQL (hourly rollups) when the key is missing.
- ``tg:q:{o1}:res``  ZSET request id -> reservation expiry (ms); ``tg:q:{o1}:resv`` HASH
  request id -> "<budget key> <micro> ..." (what the request reserved, per budget).
  Every admission (and the beat sweep) first releases reservations past their expiry, so a
  crashed gateway's reservations vanish after ``TOLLGATE_RESERVATION_TTL_S`` without a
  worker; settlement removes them earlier.
- ``tg:q:{o1}:win:<subscription id>``  HASH: a blocking token plan's rolling window (5 hours
  by default) in micro-credits: ``m<minute since epoch>`` -> credits settled in that minute,
  ``reserved`` -> credits held by requests in flight (released like budget reservations).
  Minutes that left the window are trimmed at each admission; the oldest minute still in it
  counts whole, so the window is never under-counted. Seeded from the ledger
  (``TokenPlanUsage``, per minute) when the key is missing.
- ``tg:q:{o1}:prov:<reservation id>``  HASH token bucket of provisioned normalized tokens
  (units x tokens/min per unit); a request that fits is ``provisioned``, else ``spillover``
  (or rejected when the reservation's overflow policy is ``reject``).

Time is Redis's own clock (``TIME``), so gateway hosts with skewed clocks agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import ROUND_CEILING, Decimal
from typing import Any

from django.conf import settings

from billing_platform.errors import DomainError

RESERVATION_TTL_MS = int(settings.QUOTA_RESERVATION_TTL_S * 1000)
MICRO = Decimal("1000000")

# Shared by the scripts: Redis time in ms, and the release of reservations whose requests
# never settled (crashed gateways). KEYS[1] is the reservation index, KEYS[2] their amounts.
REDIS_NOW_LUA = r"""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""
RELEASE_EXPIRED_LUA = r"""
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
for _, id in ipairs(expired) do
  local v = redis.call('HGET', KEYS[2], id)
  if v then
    for key, amt in string.gmatch(v, '(%S+) (%S+)') do
      if amt ~= '0' and redis.call('EXISTS', key) == 1 then
        redis.call('HINCRBY', key, 'reserved', 0 - tonumber(amt))
      end
    end
    redis.call('HDEL', KEYS[2], id)
  end
  redis.call('ZREM', KEYS[1], id)
end
"""

ADMIT_LUA = REDIS_NOW_LUA + r"""
local rid, ttl, est = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local n_rpm, n_tpm, n_bud, n_prov = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]),
  tonumber(ARGV[7])
local n_win = tonumber(ARGV[8])
local ki, ai = 3, 9
local LONG = 40 * 86400000

-- 1. release reservations of requests that never settled (crashed gateways)
""" + RELEASE_EXPIRED_LUA + r"""

-- 2. check everything; write nothing yet
local reject, retry = false, 0
local lim_req, rem_req, reset_req = -1, -1, 0
local lim_tok, rem_tok, reset_tok = -1, -1, 0
local rpm = {}
for i = 1, n_rpm do
  local key, limit = KEYS[ki], tonumber(ARGV[ai]); ki = ki + 1; ai = ai + 1
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - 60000)
  local count = redis.call('ZCARD', key)
  local oldest = now
  if count > 0 then oldest = tonumber(redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')[2]) end
  local reset = oldest + 60000 - now
  if count >= limit and not reject then reject = 'requests'; retry = reset end
  local rem = math.max(limit - count - 1, 0)
  if rem_req < 0 or rem < rem_req then lim_req, rem_req, reset_req = limit, rem, reset end
  rpm[i] = key
end
local tpm = {}
for i = 1, n_tpm do
  local key, cap = KEYS[ki], tonumber(ARGV[ai]); ki = ki + 1; ai = ai + 1
  local h = redis.call('HMGET', key, 't', 'ts')
  local level = cap
  if h[1] then level = math.min(cap, tonumber(h[1]) + (now - tonumber(h[2])) * cap / 60000) end
  if est > cap then
    if not reject then reject = 'too_large'; retry = 0 end
  elseif est > level and not reject then
    reject = 'tokens'; retry = math.ceil((est - level) * 60000 / cap)
  end
  local rem = math.max(math.floor(level - est), 0)
  if rem_tok < 0 or rem < rem_tok then
    lim_tok, rem_tok = cap, rem
    reset_tok = math.ceil((cap - math.max(level - est, 0)) * 60000 / cap)
  end
  tpm[i] = {key, level}
end
local bud = {}
for i = 1, n_bud do
  local key = KEYS[ki]; ki = ki + 1
  local limit, worst, seed, hard = tonumber(ARGV[ai]), tonumber(ARGV[ai + 1]),
    tonumber(ARGV[ai + 2]), tonumber(ARGV[ai + 3])
  ai = ai + 4
  if redis.call('HSETNX', key, 'spent', seed) == 1 then
    redis.call('HSETNX', key, 'reserved', 0)
    redis.call('PEXPIRE', key, LONG)
  end
  local b = redis.call('HMGET', key, 'spent', 'reserved')
  local spent, reserved = tonumber(b[1]), tonumber(b[2] or '0')
  if hard == 1 and spent + reserved + worst > limit and not reject then
    reject = 'budget:' .. i
    if spent + worst > limit then retry = -1 else retry = 1000 end
  end
  if hard == 1 then bud[i] = {key, worst} else bud[i] = {key, 0} end
end
local win = nil
if n_win == 1 then
  local key = KEYS[ki]; ki = ki + 1
  local limit, worst, wms, seed = tonumber(ARGV[ai]), tonumber(ARGV[ai + 1]),
    tonumber(ARGV[ai + 2]), ARGV[ai + 3]
  ai = ai + 4
  if redis.call('EXISTS', key) == 0 then
    redis.call('HSET', key, 'reserved', 0)
    for m, v in string.gmatch(seed, '(%S+) (%S+)') do
      redis.call('HINCRBY', key, 'm' .. m, tonumber(v))
    end
    redis.call('PEXPIRE', key, wms + 3600000)
  end
  local from = now - wms
  local h = redis.call('HGETALL', key)
  local used, reserved, oldest = 0, 0, nil
  for j = 1, #h, 2 do
    local f, v = h[j], tonumber(h[j + 1])
    if f == 'reserved' then
      reserved = v
    else
      local m = tonumber(string.sub(f, 2))
      if (m + 1) * 60000 <= from then
        redis.call('HDEL', key, f)
      else
        used = used + v
        if v > 0 and (oldest == nil or m < oldest) then oldest = m end
      end
    end
  end
  if used + reserved + worst > limit and not reject then
    reject = 'window'
    retry = 1000
    if oldest and used + worst > limit then
      retry = math.max((oldest + 1) * 60000 + wms - now, 1000)
    end
  end
  win = {key, worst, wms}
end
local capacity = 'on_demand'
local prov = nil
if n_prov == 1 then
  local key = KEYS[ki]
  local cap, need, rej = tonumber(ARGV[ai]), tonumber(ARGV[ai + 1]), tonumber(ARGV[ai + 2])
  local h = redis.call('HMGET', key, 't', 'ts')
  local level = cap
  if h[1] then level = math.min(cap, tonumber(h[1]) + (now - tonumber(h[2])) * cap / 60000) end
  if need <= level then
    capacity = 'provisioned'; prov = {key, level - need}
  elseif rej == 1 then
    if not reject then reject = 'provisioned'; retry = math.ceil((need - level) * 60000 / cap) end
  else
    capacity = 'spillover'
  end
end

local headers = {lim_req, rem_req, reset_req, lim_tok, rem_tok, reset_tok}
if reject then
  if rem_req >= 0 and reject ~= 'requests' then headers[2] = rem_req + 1 end
  return {0, reject, retry, capacity, unpack(headers)}
end

-- 3. all passed: take everything
for _, key in ipairs(rpm) do
  redis.call('ZADD', key, now, rid); redis.call('PEXPIRE', key, 61000)
end
for i, v in ipairs(tpm) do
  redis.call('HSET', v[1], 't', v[2] - est, 'ts', now); redis.call('PEXPIRE', v[1], 120000)
end
if n_bud > 0 or win then
  local parts = {}
  for i, v in ipairs(bud) do
    if v[2] > 0 then redis.call('HINCRBY', v[1], 'reserved', v[2]) end
    parts[#parts + 1] = v[1] .. ' ' .. v[2]
  end
  if win then
    redis.call('HINCRBY', win[1], 'reserved', win[2])
    redis.call('PEXPIRE', win[1], win[3] + 3600000)
    parts[#parts + 1] = win[1] .. ' ' .. win[2]
  end
  redis.call('HSET', KEYS[2], rid, table.concat(parts, ' '))
  redis.call('ZADD', KEYS[1], now + ttl, rid)
  redis.call('PEXPIRE', KEYS[1], LONG); redis.call('PEXPIRE', KEYS[2], LONG)
end
if prov then
  redis.call('HSET', prov[1], 't', prov[2], 'ts', now); redis.call('PEXPIRE', prov[1], 120000)
end
return {1, '', 0, capacity, unpack(headers)}
"""

SETTLE_LUA = REDIS_NOW_LUA + r"""
local rid = ARGV[1]
local n_bud, n_tpm, n_prov = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local n_win = tonumber(ARGV[5])
local v = redis.call('HGET', KEYS[2], rid)
if v then
  for key, amt in string.gmatch(v, '(%S+) (%S+)') do
    if amt ~= '0' and redis.call('EXISTS', key) == 1 then
      redis.call('HINCRBY', key, 'reserved', 0 - tonumber(amt))
    end
  end
  redis.call('HDEL', KEYS[2], rid)
  redis.call('ZREM', KEYS[1], rid)
end
local ki, ai = 3, 6
for i = 1, n_bud do
  local key = KEYS[ki]; ki = ki + 1
  local actual = tonumber(ARGV[ai]); ai = ai + 1
  if actual > 0 then
    redis.call('HINCRBY', key, 'spent', actual); redis.call('PEXPIRE', key, 40 * 86400000)
  end
end
for i = 1, n_win do
  local key = KEYS[ki]; ki = ki + 1
  local actual, wms = tonumber(ARGV[ai]), tonumber(ARGV[ai + 1]); ai = ai + 2
  -- A missing key is seeded from the ledger at the next admission (this request included
  -- once it is ingested); writing here would make a key that skips the seed.
  if actual > 0 and redis.call('EXISTS', key) == 1 then
    redis.call('HINCRBY', key, 'm' .. math.floor(now / 60000), actual)
    redis.call('PEXPIRE', key, wms + 3600000)
  end
end
for i = 1, n_tpm + n_prov do
  local key = KEYS[ki]; ki = ki + 1
  local cap, refund = tonumber(ARGV[ai]), tonumber(ARGV[ai + 1]); ai = ai + 2
  local h = redis.call('HMGET', key, 't', 'ts')
  if h[1] and refund ~= 0 then
    local level = math.min(cap, tonumber(h[1]) + (now - tonumber(h[2])) * cap / 60000)
    redis.call('HSET', key, 't', math.min(cap, level + refund), 'ts', now)
  end
end
return v and 1 or 0
"""

# Release expired reservations of one org without admitting anything (the beat sweep).
PURGE_LUA = REDIS_NOW_LUA + RELEASE_EXPIRED_LUA + r"""
return #expired
"""

# Report the rate-limit state of a key without taking anything (every /v1 answer that did not
# go through admission: model lists, errors, refusals before admission). Read-only: the
# sliding window is counted from ``now - 60 s`` instead of being trimmed.
PEEK_LUA = REDIS_NOW_LUA + r"""
local n_rpm, n_tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local ki, ai = 1, 3
local lim_req, rem_req, reset_req = -1, -1, 0
local lim_tok, rem_tok, reset_tok = -1, -1, 0
for i = 1, n_rpm do
  local key, limit = KEYS[ki], tonumber(ARGV[ai]); ki = ki + 1; ai = ai + 1
  local live = redis.call('ZRANGEBYSCORE', key, '(' .. (now - 60000), '+inf', 'WITHSCORES',
    'LIMIT', 0, 1)
  local count = redis.call('ZCOUNT', key, '(' .. (now - 60000), '+inf')
  local reset = 0
  if live[2] then reset = tonumber(live[2]) + 60000 - now end
  local rem = math.max(limit - count, 0)
  if rem_req < 0 or rem < rem_req then lim_req, rem_req, reset_req = limit, rem, reset end
end
for i = 1, n_tpm do
  local key, cap = KEYS[ki], tonumber(ARGV[ai]); ki = ki + 1; ai = ai + 1
  local h = redis.call('HMGET', key, 't', 'ts')
  local level = cap
  if h[1] then level = math.min(cap, tonumber(h[1]) + (now - tonumber(h[2])) * cap / 60000) end
  local rem = math.max(math.floor(level), 0)
  if rem_tok < 0 or rem < rem_tok then
    lim_tok, rem_tok = cap, rem
    reset_tok = math.ceil((cap - math.max(level, 0)) * 60000 / cap)
  end
end
return {lim_req, rem_req, reset_req, lim_tok, rem_tok, reset_tok}
"""


# --- key names -----------------------------------------------------------------------------

def _tag(org_id: int) -> str:
    return f"tg:q:{{o{org_id}}}"


def reservations_keys(org_id: int) -> tuple[str, str]:
    return f"{_tag(org_id)}:res", f"{_tag(org_id)}:resv"


def budget_key(org_id: int, budget_id: int, at: datetime) -> str:
    return f"{_tag(org_id)}:bud:{budget_id}:{at:%Y%m}"


def rule_key(org_id: int, rule: BudgetRule, at: datetime) -> str:
    if rule.scope == "plan":
        return f"{_tag(org_id)}:plan:{rule.budget_id}:{rule.period_tag}"
    return budget_key(org_id, rule.budget_id, at)


def rpm_key(org_id: int, scope: str) -> str:
    return f"{_tag(org_id)}:rpm:{scope}"


def tpm_key(org_id: int, scope: str) -> str:
    return f"{_tag(org_id)}:tpm:{scope}"


def window_key(org_id: int, subscription_id: int) -> str:
    return f"{_tag(org_id)}:win:{subscription_id}"


def prov_key(org_id: int, reservation_id: int) -> str:
    return f"{_tag(org_id)}:prov:{reservation_id}"


def to_micro(amount: Decimal) -> int:
    """Return ``amount`` in integer micro-units of its currency, rounded up."""
    return int((amount * MICRO).to_integral_value(rounding=ROUND_CEILING))


def from_micro(micro: int | str) -> Decimal:
    return Decimal(int(micro)) / MICRO


# --- the policy the gateway applies ---------------------------------------------------------

@dataclass(frozen=True)
class BudgetRule:
    budget_id: int
    scope: str  # "organization" | "project"
    limit: Decimal
    hard: bool
    spent_seed: Decimal  # this month's rated spend in PostgreSQL when the policy was read
    suspended: bool
    # A token plan's period credits ride the same machinery: scope "plan", amounts in credits
    # (coefficients per token class: input, cached_input, output), key named by the period.
    coefficients: tuple[Decimal, Decimal, Decimal] | None = None
    period_tag: str = ""


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
    pricing: Any  # plans.pricing.ModelPricing | None (None: the model has no price)
    allowed_regions: frozenset[str] | None  # key/project narrowing; None: no narrowing
    provisioned: ProvisionedRule | None = None
    plan_exhausted: str = ""  # non-empty: a blocking token plan is out of credits (why)
    currency: str = "USD"
    window: WindowRule | None = None


class QuotaExceeded(DomainError):
    """A 429: ``code`` is OpenAI's, ``headers`` carry retry-after and the rate-limit state."""

    status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, code: str, headers: dict[str, str] | None = None):
        super().__init__(message, code=code)
        self.headers = headers or {}


# --- estimates ------------------------------------------------------------------------------

def prompt_token_bound(prompt_text: str, messages: int) -> int:
    """Return an upper bound of the prompt's tokens: a token is at least one UTF-8 byte.

    The chat template adds a few tokens per message (ChatML: ``<|im_start|>role\\n ...
    <|im_end|>\\n``) and the assistant prefix; 8 per message and 8 more cover it.
    """
    return len(prompt_text.encode()) + 8 * max(messages, 1) + 8


def worst_case_micro(pricing: Any, *, tier: str, zone: str, prompt_tokens: int,
                     max_output: int) -> int:
    """Return the worst-case cost of a request in micro-units (highest band, no cache hit)."""
    if pricing is None:
        return 0
    sets = [pricing.base, *[p for _, p in pricing.bands]]
    p_in = max(max(s.input, s.cached_input, s.cache_write) for s in sets)
    p_out = max(s.output for s in sets)
    mult = pricing.multiplier(tier, zone)
    # micro-units of (tokens x price per 1M / 1M) == tokens x price per 1M
    return int(((prompt_tokens * p_in + max_output * p_out) * mult)
               .to_integral_value(rounding=ROUND_CEILING))


def actual_micro(pricing: Any, *, tier: str, zone: str, prompt_tokens: int,
                 cached_tokens: int, completion_tokens: int) -> int:
    """Return what rating will charge for these counts, in micro-units rounded up."""
    if pricing is None or prompt_tokens + completion_tokens == 0:
        return 0
    from plans.pricing import exact_lines, rounded_lines

    facts = _Counts(prompt_tokens, cached_tokens, completion_tokens, 0, tier, zone)
    _lines, amount = rounded_lines(exact_lines(pricing, facts))
    return to_micro(amount)


def credits_micro(coefficients: tuple[Decimal, Decimal, Decimal], *, prompt_tokens: int,
                  cached_tokens: int, completion_tokens: int) -> int:
    """Return token-plan credits (micro-credits, rounded up) of these counts."""
    c_in, c_cached, c_out = coefficients
    exact = ((prompt_tokens - cached_tokens) * c_in + cached_tokens * c_cached
             + completion_tokens * c_out) * MICRO
    return int(exact.to_integral_value(rounding=ROUND_CEILING))


@dataclass
class _Counts:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cache_write_tokens: int
    service_tier: str
    data_zone: str


# --- the decision ---------------------------------------------------------------------------

@dataclass
class Decision:
    admitted: bool
    reason: str
    retry_after_ms: int
    capacity: str
    headers: dict[str, str]
    keys: list[str] = field(default_factory=list)
    argv: list[Any] = field(default_factory=list)


def _duration(ms: int) -> str:
    """OpenAI's reset format: ``1s``, ``6m0s``, ``20ms``."""
    if ms < 1000:
        return f"{max(ms, 0)}ms"
    seconds = math.ceil(ms / 1000)
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"


def rate_headers(raw: list[Any]) -> dict[str, str]:
    lim_req, rem_req, reset_req, lim_tok, rem_tok, reset_tok = (int(x) for x in raw)
    headers = {}
    if lim_req >= 0:
        headers.update({"x-ratelimit-limit-requests": str(lim_req),
                        "x-ratelimit-remaining-requests": str(rem_req),
                        "x-ratelimit-reset-requests": _duration(reset_req)})
    if lim_tok >= 0:
        headers.update({"x-ratelimit-limit-tokens": str(lim_tok),
                        "x-ratelimit-remaining-tokens": str(rem_tok),
                        "x-ratelimit-reset-tokens": _duration(reset_tok)})
    return headers


@dataclass
class Ticket:
    """An admitted request: what it holds, and how to settle it."""

    policy: QuotaPolicy
    request_id: str
    tier: str
    zone: str
    estimate_tokens: int
    estimate_norm: int
    capacity: str
    headers: dict[str, str]
    budget_keys: list[str]
    settled: bool = False
    window_key: str = ""

    def settle_args(self, *, prompt_tokens: int, cached_tokens: int,
                    completion_tokens: int) -> tuple[list[str], list[Any]]:
        p = self.policy
        cost = actual_micro(p.pricing, tier=self.tier, zone=self.zone,
                            prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                            completion_tokens=completion_tokens)
        keys = [*reservations_keys(p.org_id), *self.budget_keys]
        argv: list[Any] = [self.request_id, len(self.budget_keys), len(p.tpm),
                           int(self.capacity == "provisioned"), int(bool(self.window_key))]
        for rule in p.budgets:
            argv.append(cost if rule.coefficients is None else credits_micro(
                rule.coefficients, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                completion_tokens=completion_tokens))
        if self.window_key and p.window is not None:
            keys.append(self.window_key)
            argv += [credits_micro(p.window.coefficients, prompt_tokens=prompt_tokens,
                                   cached_tokens=cached_tokens,
                                   completion_tokens=completion_tokens), p.window.window_ms]
        used = prompt_tokens + completion_tokens
        for scope, cap in p.tpm:
            keys.append(tpm_key(p.org_id, scope))
            argv += [cap, self.estimate_tokens - used]
        if self.capacity == "provisioned" and p.provisioned is not None:
            from plans.pricing import normalized_tokens

            norm = normalized_tokens(prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                                     completion_tokens=completion_tokens,
                                     cache_burndown=p.provisioned.cache_burndown,
                                     output_burndown=p.provisioned.output_burndown)
            keys.append(prov_key(p.org_id, p.provisioned.reservation_id))
            argv += [p.provisioned.tokens_per_minute, self.estimate_norm - norm]
        return keys, argv


SPEND_CODES = {"organization": "organization_spend_limit_exceeded",
               "project": "project_spend_limit_exceeded"}


def build_admit(policy: QuotaPolicy, *, request_id: str, tier: str, zone: str,
                prompt_tokens: int, max_output: int, now: datetime | None = None
                ) -> tuple[list[str], list[Any], list[str], int, int]:
    """Return (KEYS, ARGV, budget keys, worst micro, normalized estimate) of one admission.

    The window key, when the policy has one, follows the budget keys in KEYS.
    """
    now = now or datetime.now(tz=UTC)
    p = policy
    est = prompt_tokens + max_output
    worst = worst_case_micro(p.pricing, tier=tier, zone=zone, prompt_tokens=prompt_tokens,
                             max_output=max_output)
    keys = list(reservations_keys(p.org_id))
    argv: list[Any] = [request_id, RESERVATION_TTL_MS, est, len(p.rpm), len(p.tpm),
                       len(p.budgets), int(p.provisioned is not None), int(p.window is not None)]
    keys += [rpm_key(p.org_id, s) for s, _ in p.rpm]
    argv += [limit for _, limit in p.rpm]
    keys += [tpm_key(p.org_id, s) for s, _ in p.tpm]
    argv += [limit for _, limit in p.tpm]
    bkeys = [rule_key(p.org_id, b, now) for b in p.budgets]
    keys += bkeys
    for b in p.budgets:
        rule_worst = worst if b.coefficients is None else credits_micro(
            b.coefficients, prompt_tokens=prompt_tokens, cached_tokens=0,
            completion_tokens=max_output)
        argv += [to_micro(b.limit), rule_worst, to_micro(b.spent_seed), int(b.hard)]
    if p.window is not None:
        w = p.window
        keys.append(window_key(p.org_id, w.subscription_id))
        argv += [to_micro(w.limit), credits_micro(w.coefficients, prompt_tokens=prompt_tokens,
                                                  cached_tokens=0, completion_tokens=max_output),
                 w.window_ms, " ".join(f"{m} {v}" for m, v in w.seed)]
    norm = 0
    if p.provisioned is not None:
        r = p.provisioned
        norm = math.ceil(prompt_tokens + max_output * r.output_burndown)
        keys.append(prov_key(p.org_id, r.reservation_id))
        argv += [r.tokens_per_minute, norm, int(r.reject_overflow)]
    return keys, argv, bkeys, worst, norm


def explain(policy: QuotaPolicy, reason: str, raw_headers: list[Any], retry_ms: int,
            *, estimate: int, now: datetime | None = None) -> QuotaExceeded:
    """Turn the script's rejection into OpenAI's 429 (message, code, headers)."""
    headers = rate_headers(raw_headers)
    if retry_ms < 0:  # spend limit reached by settled spend: nothing changes before next month
        now = now or datetime.now(tz=UTC)
        nxt = (datetime(now.year + (now.month == 12), now.month % 12 + 1, 1, tzinfo=UTC))
        retry_ms = int((nxt - now).total_seconds() * 1000)
    headers["retry-after"] = str(max(1, math.ceil(retry_ms / 1000)))
    headers["retry-after-ms"] = str(max(retry_ms, 0))
    if reason == "requests":
        msg = (f"Rate limit reached for requests per minute (RPM): Limit "
               f"{headers.get('x-ratelimit-limit-requests')}. Please try again in "
               f"{_duration(retry_ms)}.")
        return QuotaExceeded(msg, code="rate_limit_exceeded", headers=headers)
    if reason in ("tokens", "too_large"):
        limit = headers.get("x-ratelimit-limit-tokens")
        if reason == "too_large":
            headers.pop("retry-after", None)
            headers.pop("retry-after-ms", None)
            msg = (f"Request too large for tokens per minute (TPM): Limit {limit}, Requested "
                   f"{estimate}. Reduce the prompt or max_tokens.")
        else:
            msg = (f"Rate limit reached for tokens per minute (TPM): Limit {limit}, Requested "
                   f"{estimate}. Please try again in {_duration(retry_ms)}.")
        return QuotaExceeded(msg, code="rate_limit_exceeded", headers=headers)
    if reason.startswith("budget:"):
        rule = policy.budgets[int(reason.split(":")[1]) - 1]
        if rule.scope == "plan":
            return QuotaExceeded(
                f"Your token plan's credits for this period are used up (limit "
                f"{rule.limit.normalize():f} credits, this request may need more than is left)."
                f" Buy a credit pack or wait for the next period.",
                code="plan_quota_exhausted", headers=headers)
        return spend_limit_error(rule, headers)
    if reason == "window" and policy.window is not None:
        return QuotaExceeded(
            f"Your token plan's credits for the rolling {policy.window.hours}-hour window are "
            f"used up (limit {policy.window.limit.normalize():f} credits, this request may need "
            f"more than is left). Please try again in {_duration(retry_ms)}.",
            code="plan_quota_exhausted", headers=headers)
    if reason == "provisioned":
        headers["x-tollgate-capacity"] = "provisioned"
        return QuotaExceeded("Your provisioned capacity is fully used and its overflow policy "
                             "rejects excess requests.", code="rate_limit_exceeded",
                             headers=headers)
    return QuotaExceeded("Quota exceeded.", code="rate_limit_exceeded", headers=headers)


def spend_limit_error(rule: BudgetRule, headers: dict[str, str]) -> QuotaExceeded:
    who = "organization" if rule.scope == "organization" else "project"
    return QuotaExceeded(
        f"You exceeded your {who}'s monthly spend limit ({rule.limit.normalize():f}). "
        f"Raise the budget in the console or wait for the next month.",
        code=SPEND_CODES[rule.scope], headers=headers)


def admit_sync(client: Any, script: Any, keys: list[str], argv: list[Any]) -> list[Any]:
    return script(keys=keys, args=argv, client=client)


# --- the runtime the gateway calls ----------------------------------------------------------

POLICY_TTL_S = settings.QUOTA_POLICY_TTL_S
_policies: dict[tuple[int, str], tuple[float, QuotaPolicy]] = {}


async def apolicy(*, org_id: int, project_id: int, key_id: int, model: str) -> QuotaPolicy:
    """Return the (key, model) policy, re-read from PostgreSQL at most every POLICY_TTL_S."""
    import time

    from asgiref.sync import sync_to_async

    from plans.quotas import quota_policy_load

    hit = _policies.get((key_id, model))
    now = time.monotonic()
    if hit is not None and now - hit[0] < POLICY_TTL_S:
        return hit[1]
    policy = await sync_to_async(quota_policy_load, thread_sensitive=False)(
        organization_id=org_id, project_id=project_id, key_id=key_id, model=model)
    if len(_policies) > 50_000:  # keys x models seen by this process; stale ones reload anyway
        _policies.clear()
    _policies[(key_id, model)] = (now, policy)
    return policy


class _Batcher:
    """Send the admissions and settlements of one event-loop tick as ONE pipeline.

    Each script still runs atomically on its own; batching only shares the round trip and
    the syscalls, which is what bounds decisions per second from one process. A request waits
    at most one loop iteration longer than it would alone.
    """

    def __init__(self, client: Any) -> None:
        self.client = client
        self.pending: list[tuple[int, list[str], list[Any], Any]] = []
        self.scheduled = False
        self.flushing: set[Any] = set()
        self.shas: tuple[str, str] | None = None

    async def call(self, which: int, keys: list[str], argv: list[Any]) -> Any:
        import asyncio

        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.pending.append((which, keys, argv, future))
        if not self.scheduled:
            # The flush task's first step runs at the next loop iteration, after every other
            # call() made in this one has joined the batch.
            self.scheduled = True
            task = loop.create_task(self._flush())
            self.flushing.add(task)  # the loop holds tasks weakly
            task.add_done_callback(self.flushing.discard)
        return await future

    async def _load(self) -> tuple[str, str]:
        self.shas = (await self.client.script_load(ADMIT_LUA),
                     await self.client.script_load(SETTLE_LUA))
        return self.shas

    async def _run(self, batch: list[tuple[int, list[str], list[Any], Any]]) -> list[Any]:
        from redis.exceptions import ResponseError

        shas = self.shas or await self._load()
        if len(batch) == 1:  # alone (the usual case at low load): no pipeline to build
            which, keys, argv, _future = batch[0]
            try:
                return [await self.client.evalsha(shas[which], len(keys), *keys, *argv)]
            except ResponseError as exc:  # as the pipeline returns it (NOSCRIPT included)
                return [exc]
        pipe = self.client.pipeline(transaction=False)
        for which, keys, argv, _future in batch:
            pipe.evalsha(shas[which], len(keys), *keys, *argv)
        return await pipe.execute(raise_on_error=False)

    async def _flush(self) -> None:
        from redis.exceptions import NoScriptError

        self.scheduled = False
        batch, self.pending = self.pending, []
        try:
            results = await self._run(batch)
            if any(isinstance(r, NoScriptError) for r in results):
                # Redis lost its script cache (restart): a NOSCRIPT call did not run; rerun it.
                await self._load()
                again = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
                for i, r in zip(again, await self._run([batch[i] for i in again]), strict=True):
                    results[i] = r
        except Exception as exc:
            for *_rest, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (*_rest, future), result in zip(batch, results, strict=True):
            if future.done():
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)


_batchers: Any = None


def _batcher() -> _Batcher:
    import weakref

    from billing_platform.redis_conn import get_aredis

    global _batchers
    if _batchers is None:
        _batchers = weakref.WeakKeyDictionary()
    client = get_aredis()
    batcher = _batchers.get(client)
    if batcher is None:
        batcher = _batchers[client] = _Batcher(client)
    return batcher


async def aadmit(policy: QuotaPolicy, *, request_id: str, tier: str, zone: str,
                 prompt_tokens: int, max_output: int) -> Ticket:
    """Admit one request or raise ``QuotaExceeded``; the returned ticket must be settled."""
    for rule in policy.budgets:
        if rule.suspended:
            raise spend_limit_error(rule, {"retry-after": "60"})
    if policy.plan_exhausted:
        raise QuotaExceeded(f"Your token plan's credits are exhausted: "
                            f"{policy.plan_exhausted}. Buy a credit pack or wait.",
                            code="plan_quota_exhausted", headers={"retry-after": "60"})
    keys, argv, bkeys, _worst, norm = build_admit(
        policy, request_id=request_id, tier=tier, zone=zone, prompt_tokens=prompt_tokens,
        max_output=max_output)
    raw = await _batcher().call(0, keys, argv)
    ok, reason, retry, capacity = int(raw[0]), raw[1], int(raw[2]), raw[3]
    if not ok:
        raise explain(policy, reason, raw[4:10], retry, estimate=prompt_tokens + max_output)
    headers = rate_headers(raw[4:10])
    if capacity != "on_demand":
        headers["x-tollgate-capacity"] = capacity
    return Ticket(policy=policy, request_id=request_id, tier=tier, zone=zone,
                  estimate_tokens=prompt_tokens + max_output, estimate_norm=norm,
                  capacity=capacity, headers=headers, budget_keys=bkeys,
                  window_key=(window_key(policy.org_id, policy.window.subscription_id)
                              if policy.window is not None else ""))


async def asettle(ticket: Ticket, *, prompt_tokens: int = 0, cached_tokens: int = 0,
                  completion_tokens: int = 0) -> None:
    """Replace the ticket's reservation with the actual tokens and cost (once)."""
    if ticket.settled:
        return
    ticket.settled = True
    keys, argv = ticket.settle_args(prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                                    completion_tokens=completion_tokens)
    await _batcher().call(1, keys, argv)


# --- read-only state for answers that were not admitted ------------------------------------

Limits = tuple[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]]
_limits: dict[int, tuple[float, Limits]] = {}
_peek_script: Any = None


async def alimits(*, org_id: int, project_id: int, key_id: int) -> Limits:
    """Return the key's (rpm, tpm) limits per scope, from a cached policy or PostgreSQL."""
    import time

    from asgiref.sync import sync_to_async

    from plans.quotas import limits_of

    now = time.monotonic()
    hit = _limits.get(key_id)
    if hit is not None and now - hit[0] < POLICY_TTL_S:
        return hit[1]
    rpm, tpm, _regions = await sync_to_async(limits_of, thread_sensitive=False)(
        organization_id=org_id, project_id=project_id, key_id=key_id)
    if len(_limits) > 50_000:
        _limits.clear()
    _limits[key_id] = (now, (rpm, tpm))
    return rpm, tpm


async def apeek_headers(*, org_id: int, project_id: int, key_id: int) -> dict[str, str]:
    """Return the key's ``x-ratelimit-*`` headers now, consuming nothing."""
    from billing_platform.redis_conn import get_aredis

    global _peek_script
    rpm, tpm = await alimits(org_id=org_id, project_id=project_id, key_id=key_id)
    client = get_aredis()
    if _peek_script is None:
        _peek_script = client.register_script(PEEK_LUA)
    keys = [rpm_key(org_id, s) for s, _ in rpm] + [tpm_key(org_id, s) for s, _ in tpm]
    argv = [len(rpm), len(tpm), *(v for _, v in rpm), *(v for _, v in tpm)]
    raw = await _peek_script(keys=keys, args=argv, client=client)
    return rate_headers(raw)
