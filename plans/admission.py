"""Admission: ONE atomic Redis step per request that checks and reserves every quota together.

Why one Lua script: a check followed by a separate write lets two gateway processes both pass
the check (budgets exceeded under concurrency, rate limits multiplied by the replica count).
The script runs atomically inside Redis, so every gateway process shares one exact view.

The gateway sends the admissions and settlements of one event-loop tick in one script call
(``_Batcher``); the script runs them one after the other, each as if alone.

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

Time is Redis's own clock (``TIME``), so gateway hosts with skewed clocks agree.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import ROUND_CEILING, Decimal
from functools import cached_property
from typing import Any

from django.conf import settings

from billing_platform.errors import DomainError

RESERVATION_TTL_MS = int(settings.QUOTA_RESERVATION_TTL_S * 1000)
MICRO = Decimal("1000000")

# The scripts share this prelude: Redis's clock in ms and s, and the reservation helpers.
# A reservation is one member of the org's ``res`` ZSET, scored by its expiry:
# "<request id> <key> <micro> [<key> <micro> ...]" (what it holds, per budget or window key).
PRELUDE_LUA = r"""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local sec = math.floor(now / 1000)
local LONG = 40 * 86400000
local RATE_TTL = 120000

local function int(x) return string.format('%d', x) end
local secf = int(sec)  -- the current second's bucket (a field name)

local function release(member)
  for key, amt in string.gmatch(member, ' (%S+) (%S+)') do
    if redis.call('EXISTS', key) == 1 then
      redis.call('HINCRBY', key, 'reserved', 0 - tonumber(amt))
    end
  end
end

-- Release the reservations of requests that never settled (crashed gateways).
local function release_expired(res)
  local n = 0
  while true do
    local expired = redis.call('ZRANGEBYSCORE', res, '-inf', now, 'LIMIT', 0, 100)
    for _, m in ipairs(expired) do
      release(m)
      redis.call('ZREM', res, m)
    end
    n = n + #expired
    if #expired < 100 then return n end
  end
end

-- A rate key's request count: buckets of one second; a bucket counts while any of it lies in
-- the last 60 s (61 buckets), so the count never misses an admission. Returns the count and
-- the oldest counted second; with ``write``, buckets that left the window are dropped and
-- ``n`` and ``lo`` follow (whether or not this request is admitted).
local function window(key, n, lo, write)
  if lo >= sec - 60 then return n, lo end
  local h = redis.call('HGETALL', key)
  local gone, drop, first = 0, {}, nil
  for j = 1, #h, 2 do
    local s = tonumber(h[j])  -- nil for the other fields: n, lo, t, ts
    if s then
      if s < sec - 60 then
        gone = gone + tonumber(h[j + 1]); drop[#drop + 1] = h[j]
      elseif first == nil or s < first then
        first = s
      end
    end
  end
  n, first = math.max(n - gone, 0), first or sec
  if write and #h > 0 then
    if #drop > 0 then redis.call('HDEL', key, unpack(drop)) end
    redis.call('HSET', key, 'n', int(n), 'lo', int(first))
  end
  return n, first
end

local function bucket_level(h_t, h_ts, cap)
  if not (h_t and h_ts) then return cap end
  return math.min(cap, tonumber(h_t) + (now - tonumber(h_ts)) * cap / 60000)
end
"""

ADMIT_LUA = r"""
-- Budgets and the token plan's window: the first that this request's worst case would
-- overrun, and what each would take.
local function spend_check(ki, ai, n_bud, has_win)
  local bud, win = {}, nil
  for i = 1, n_bud do
    local key, o = KEYS[ki + i - 1], ai + (i - 1) * 4
    local limit, worst, hard = tonumber(ARGV[o]), tonumber(ARGV[o + 1]), ARGV[o + 3] == '1'
    local b = redis.call('HMGET', key, 'spent', 'reserved')
    local spent, reserved = tonumber(b[1] or ARGV[o + 2]), tonumber(b[2] or '0')
    bud[i] = {key, hard and worst or 0, not b[1], ARGV[o + 2]}
    if hard and spent + reserved + worst > limit then
      if spent + worst > limit then return 'budget:' .. i, -1, bud, win end
      return 'budget:' .. i, 1000, bud, win
    end
  end
  if has_win then
    local key, o = KEYS[ki + n_bud], ai + n_bud * 4
    local limit, worst, wms, seed = tonumber(ARGV[o]), tonumber(ARGV[o + 1]),
      tonumber(ARGV[o + 2]), ARGV[o + 3]
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
    win = {key, worst, wms}
    if used + reserved + worst > limit then
      if oldest and used + worst > limit then
        return 'window', math.max((oldest + 1) * 60000 + wms - now, 1000), bud, win
      end
      return 'window', 1000, bud, win
    end
  end
  return false, 0, bud, win
end

-- KEYS: res, rate keys, budget keys, window key?, provisioned key?
-- ARGV: request id, ttl, estimate, n_rate, n_bud, has_prov, has_win;
--   per rate key: rpm (-1: none), tpm (-1: none); per budget: limit, worst, seed, hard;
--   window: limit, worst, ms, seed; provisioned: tokens per minute, need, reject overflow
local function admit(ki, ai)
  local res = KEYS[ki]
  local rid, ttl, est = ARGV[ai], tonumber(ARGV[ai + 1]), tonumber(ARGV[ai + 2])
  local n_rate, n_bud = tonumber(ARGV[ai + 3]), tonumber(ARGV[ai + 4])
  local has_prov, has_win = ARGV[ai + 5] == '1', ARGV[ai + 6] == '1'
  ki, ai = ki + 1, ai + 7

  -- 1. check everything; write nothing yet (but drop request buckets that left the window)
  local reject, retry, req_retry = false, 0, nil
  local lim_req, rem_req, reset_req = -1, -1, 0
  local lim_tok, rem_tok, reset_tok = -1, -1, 0
  local rate = {}
  for i = 1, n_rate do
    local key, limit, cap = KEYS[ki], tonumber(ARGV[ai]), tonumber(ARGV[ai + 1])
    ki, ai = ki + 1, ai + 2
    local h = redis.call('HMGET', key, 'n', 'lo', secf, 't', 'ts')
    -- the key's TTL is renewed by the first admission of each second (it outlives the
    -- second's bucket by far), not by every admission
    local renew = not h[5] or math.floor(tonumber(h[5]) / 1000) ~= sec
    local r = {key, nil, nil, nil, nil, renew}
    if limit >= 0 then
      local n, lo = window(key, tonumber(h[1]) or 0, tonumber(h[2]) or sec, true)
      local reset = (lo + 61) * 1000 - now
      if n >= limit and req_retry == nil then req_retry = reset end
      local rem = math.max(limit - n - 1, 0)
      if rem_req < 0 or rem < rem_req then lim_req, rem_req, reset_req = limit, rem, reset end
      r[2], r[3], r[4] = n, lo, tonumber(h[3]) or 0
      r[6] = r[4] == 0
    end
    if cap >= 0 then
      local level = bucket_level(h[4], h[5], cap)
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
      r[5] = level
    end
    rate[i] = r
  end
  if req_retry ~= nil then reject, retry = 'requests', req_retry end

  local bud, win = {}, nil
  if n_bud > 0 or has_win then
    local why, wait
    why, wait, bud, win = spend_check(ki, ai, n_bud, has_win)
    -- Reservations of crashed requests only matter when they would refuse this one.
    if why and not reject and release_expired(res) > 0 then
      why, wait, bud, win = spend_check(ki, ai, n_bud, has_win)
    end
    if why and not reject then reject, retry = why, wait end
    ki = ki + n_bud + (has_win and 1 or 0)
    ai = ai + n_bud * 4 + (has_win and 4 or 0)
  end

  local capacity, prov = 'on_demand', nil
  if has_prov then
    local key = KEYS[ki]
    local cap, need, rej = tonumber(ARGV[ai]), tonumber(ARGV[ai + 1]), ARGV[ai + 2] == '1'
    local h = redis.call('HMGET', key, 't', 'ts')
    local level = bucket_level(h[1], h[2], cap)
    if need <= level then
      capacity = 'provisioned'; prov = {key, level - need}
    elseif rej then
      if not reject then reject = 'provisioned'; retry = math.ceil((need - level) * 60000 / cap) end
    else
      capacity = 'spillover'
    end
  end

  if reject then
    if rem_req >= 0 and reject ~= 'requests' then rem_req = rem_req + 1 end
    return {0, reject, retry, capacity, lim_req, rem_req, reset_req, lim_tok, rem_tok,
            reset_tok, ''}
  end

  -- 2. all passed: take everything
  local renewed = false
  for _, r in ipairs(rate) do
    local f = {}
    if r[2] then
      f = {'n', int(r[2] + 1), 'lo', int(r[3]), secf, int(r[4] + 1)}
    end
    if r[5] then f[#f + 1] = 't'; f[#f + 1] = r[5] - est; f[#f + 1] = 'ts'; f[#f + 1] = now end
    redis.call('HSET', r[1], unpack(f))
    if r[6] then redis.call('PEXPIRE', r[1], RATE_TTL); renewed = true end
  end
  local held = {rid}
  for _, b in ipairs(bud) do
    if b[3] then  -- first use this month: seed the settled spend from PostgreSQL
      redis.call('HSET', b[1], 'spent', b[4], 'reserved', int(b[2]))
      redis.call('PEXPIRE', b[1], LONG)
    elseif b[2] > 0 then
      redis.call('HINCRBY', b[1], 'reserved', b[2])
    end
    if b[2] > 0 then held[#held + 1] = b[1]; held[#held + 1] = int(b[2]) end
  end
  if win then
    redis.call('HINCRBY', win[1], 'reserved', win[2])
    redis.call('PEXPIRE', win[1], win[3] + 3600000)
    if win[2] > 0 then held[#held + 1] = win[1]; held[#held + 1] = int(win[2]) end
  end
  local member = ''
  if #held > 1 then
    member = table.concat(held, ' ')
    redis.call('ZADD', res, now + ttl, member)
    -- its TTL only collects what crashed requests leave behind: renewed with the rate keys'
    if renewed or n_rate == 0 then redis.call('PEXPIRE', res, LONG) end
  end
  if prov then
    redis.call('HSET', prov[1], 't', prov[2], 'ts', now); redis.call('PEXPIRE', prov[1], RATE_TTL)
  end
  return {1, '', 0, capacity, lim_req, rem_req, reset_req, lim_tok, rem_tok, reset_tok, member,
          now}
end

-- KEYS: res, budget keys, window key?, token bucket keys (rate keys, provisioned)
-- ARGV: reservation member ('' when none), n_bud, has_win, n_buckets, admitted at (ms);
--   per budget: actual; window: actual, ms; per bucket: capacity, refund
local function settle(ki, ai)
  local res, member = KEYS[ki], ARGV[ai]
  local n_bud, has_win, n_tok = tonumber(ARGV[ai + 1]), ARGV[ai + 2] == '1', tonumber(ARGV[ai + 3])
  local admitted = tonumber(ARGV[ai + 4])
  ki, ai = ki + 1, ai + 5
  local held, released = {}, 0
  if member ~= '' and redis.call('ZREM', res, member) == 1 then
    released = 1
    for key, amt in string.gmatch(member, ' (%S+) (%S+)') do held[key] = tonumber(amt) end
  end
  for i = 1, n_bud do
    local key, actual = KEYS[ki], tonumber(ARGV[ai]); ki, ai = ki + 1, ai + 1
    local amt = held[key] or 0
    held[key] = nil
    if actual > 0 or amt > 0 then
      local b = redis.call('HMGET', key, 'spent', 'reserved')
      -- a missing key is seeded from PostgreSQL at the next admission
      if b[1] then
        redis.call('HSET', key, 'spent', int(tonumber(b[1]) + actual),
                   'reserved', int(tonumber(b[2] or '0') - amt))
      end
    end
  end
  if has_win then
    local key = KEYS[ki]; ki = ki + 1
    local actual, wms = tonumber(ARGV[ai]), tonumber(ARGV[ai + 1]); ai = ai + 2
    local amt = held[key] or 0
    held[key] = nil
    -- A missing key is seeded from the ledger at the next admission (this request included
    -- once it is ingested); writing here would make a key that skips the seed.
    if (actual > 0 or amt > 0) and redis.call('EXISTS', key) == 1 then
      if actual > 0 then redis.call('HINCRBY', key, 'm' .. math.floor(now / 60000), actual) end
      if amt > 0 then redis.call('HINCRBY', key, 'reserved', 0 - amt) end
      redis.call('PEXPIRE', key, wms + 3600000)
    end
  end
  for key, amt in pairs(held) do  -- held under a key this settlement no longer names
    if redis.call('EXISTS', key) == 1 then redis.call('HINCRBY', key, 'reserved', 0 - amt) end
  end
  for i = 1, n_tok do
    local key = KEYS[ki]; ki = ki + 1
    local cap, refund = tonumber(ARGV[ai]), tonumber(ARGV[ai + 1]); ai = ai + 2
    if refund > 0 and now - admitted < RATE_TTL - 20000 then
      -- The bucket's key outlives its admission by RATE_TTL: it exists. Adding to the stored
      -- level equals adding to the refilled one, as levels are capped when read.
      redis.call('HINCRBYFLOAT', key, 't', refund)
    elseif refund ~= 0 then
      local h = redis.call('HMGET', key, 't', 'ts')
      if h[1] then
        redis.call('HSET', key, 't', math.min(cap, bucket_level(h[1], h[2], cap) + refund),
                   'ts', now)
      end
    end
  end
  return released
end
"""

# One call runs a batch of admissions and settlements, in order, each on its own: ARGV[1] is
# the count, then per operation its kind ('a' | 's'), its KEYS count and ARGV count, and its
# ARGV; KEYS are the operations' keys in order. One failing operation (an error) answers an
# error in its place and leaves the others alone.
STEP_LUA = PRELUDE_LUA + ADMIT_LUA + r"""
local out, ki, ai = {}, 1, 2
for i = 1, tonumber(ARGV[1]) do
  local kind, nk, na = ARGV[ai], tonumber(ARGV[ai + 1]), tonumber(ARGV[ai + 2])
  local ok, r = pcall(kind == 'a' and admit or settle, ki, ai + 3)
  if ok then
    out[i] = r
  else
    out[i] = {err = type(r) == 'table' and r.err or tostring(r)}
  end
  ki, ai = ki + nk, ai + 3 + na
end
return out
"""

# Release expired reservations of one org without admitting anything (the beat sweep).
PURGE_LUA = PRELUDE_LUA + r"""
return release_expired(KEYS[1])
"""

# Report the rate-limit state of a key without taking anything (every /v1 answer that did not
# go through admission: model lists, errors, refusals before admission). Read-only.
# KEYS: rate keys; ARGV: per key: rpm (-1: none), tpm (-1: none)
PEEK_LUA = PRELUDE_LUA + r"""
local lim_req, rem_req, reset_req = -1, -1, 0
local lim_tok, rem_tok, reset_tok = -1, -1, 0
for i = 1, #KEYS do
  local key, limit, cap = KEYS[i], tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i])
  local h = redis.call('HMGET', key, 'n', 'lo', 't', 'ts')
  if limit >= 0 then
    local n, lo = window(key, tonumber(h[1]) or 0, tonumber(h[2]) or sec, false)
    local reset = 0
    if n > 0 then reset = (lo + 61) * 1000 - now end
    local rem = math.max(limit - n, 0)
    if rem_req < 0 or rem < rem_req then lim_req, rem_req, reset_req = limit, rem, reset end
  end
  if cap >= 0 then
    local level = bucket_level(h[3], h[4], cap)
    local rem = math.max(math.floor(level), 0)
    if rem_tok < 0 or rem < rem_tok then
      lim_tok, rem_tok = cap, rem
      reset_tok = math.ceil((cap - math.max(level, 0)) * 60000 / cap)
    end
  end
end
return {lim_req, rem_req, reset_req, lim_tok, rem_tok, reset_tok}
"""

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
    return _budget_key(org_id, rule.budget_id, month)


def rate_key(org_id: int, scope: str) -> str:
    """Return the key holding one scope's request window and token bucket."""
    return f"{_tag(org_id)}:rl:{scope}"


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

    @cached_property
    def rate_scopes(self) -> tuple[tuple[str, int, int], ...]:
        """Return (rate key, rpm or -1, tpm or -1) per scope, RPM scopes first."""
        rpm, tpm = dict(self.rpm), dict(self.tpm)
        scopes = list(rpm) + [s for s in tpm if s not in rpm]
        return tuple((rate_key(self.org_id, s), rpm.get(s, -1), tpm.get(s, -1))
                     for s in scopes)

    @cached_property
    def static_admit(self) -> tuple[list[str], list[Any]]:
        """Return the KEYS and ARGV of the rate limits, which every admission repeats."""
        keys = [reservations_key(self.org_id)] + [k for k, _r, _t in self.rate_scopes]
        argv: list[Any] = []
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
    """Return the worst-case cost of a request in micro-units (no cache hit).

    Priced at the dearest band the prompt can reach: a band applies when the prompt exceeds
    its threshold, and the prompt has at most ``prompt_tokens``, so a band at or above that
    bound can never apply (pricing every request at the top band made a hard budget stop far
    short of its limit).
    """
    if pricing is None:
        return 0
    sets = [pricing.base, *[p for above, p in pricing.bands if prompt_tokens > above]]
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
    reservation: str = ""  # the member of the org's reservation ZSET ("" when none)
    admitted_ms: int = 0  # Redis's clock at admission
    settled: bool = False
    window_key: str = ""

    def settle_args(self, *, prompt_tokens: int, cached_tokens: int,
                    completion_tokens: int) -> tuple[list[str], list[Any]]:
        p = self.policy
        cost = actual_micro(p.pricing, tier=self.tier, zone=self.zone,
                            prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                            completion_tokens=completion_tokens)
        keys = [reservations_key(p.org_id), *self.budget_keys]
        refunds = [(k, tpm) for k, _rpm, tpm in p.rate_scopes if tpm >= 0]
        provisioned = self.capacity == "provisioned" and p.provisioned is not None
        argv: list[Any] = [self.reservation, len(self.budget_keys), int(bool(self.window_key)),
                           len(refunds) + int(provisioned), self.admitted_ms]
        for rule in p.budgets:
            argv.append(cost if rule.coefficients is None else credits_micro(
                rule.coefficients, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                completion_tokens=completion_tokens))
        if self.window_key and p.window is not None:
            keys.append(self.window_key)
            argv += [credits_micro(p.window.coefficients, prompt_tokens=prompt_tokens,
                                   cached_tokens=cached_tokens,
                                   completion_tokens=completion_tokens), p.window.window_ms]
        unused = self.estimate_tokens - prompt_tokens - completion_tokens
        for key, cap in refunds:
            keys.append(key)
            argv += [cap, unused]
        if provisioned:
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


def build_admit(policy: QuotaPolicy, *, request_id: str, tier: str, zone: str,
                prompt_tokens: int, max_output: int, month: str | None = None
                ) -> tuple[list[str], list[Any], list[str], int]:
    """Return (KEYS, ARGV, budget keys, normalized estimate) of one admission.

    The window key, when the policy has one, follows the budget keys in KEYS.
    """
    p = policy
    est = prompt_tokens + max_output
    static_keys, static_argv = p.static_admit
    keys = list(static_keys)
    argv: list[Any] = [request_id, RESERVATION_TTL_MS, est, len(p.rate_scopes),
                       len(p.budgets), int(p.provisioned is not None),
                       int(p.window is not None), *static_argv]
    bkeys: list[str] = []
    if p.budgets:
        worst = worst_case_micro(p.pricing, tier=tier, zone=zone, prompt_tokens=prompt_tokens,
                                 max_output=max_output)
        bkeys = p.budget_keys(month or month_tag())
        keys += bkeys
        for b, (limit, seed, hard) in zip(p.budgets, p.budget_static, strict=True):
            rule_worst = worst if b.coefficients is None else credits_micro(
                b.coefficients, prompt_tokens=prompt_tokens, cached_tokens=0,
                completion_tokens=max_output)
            argv += [limit, rule_worst, seed, hard]
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
    return keys, argv, bkeys, norm


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


# --- the runtime the gateway calls ----------------------------------------------------------

Limits = tuple[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]]
POLICY_TTL_S = settings.QUOTA_POLICY_TTL_S
# How long past its TTL a policy may still be served while its reload runs; older than that,
# a request waits for the reload (a key idle for a while gets no stale limits).
POLICY_STALE_S = 30.0


class _Reloading:
    """Values read from PostgreSQL, fresh for ``POLICY_TTL_S``, reloaded off the request path.

    Past its TTL a value is still served while ONE task per key reloads it, so no request
    waits for the reload (~15 ms of queries) and concurrent requests do not each start one;
    a change (limits, budgets, suspension) takes effect within the TTL plus one reload. Past
    ``POLICY_STALE_S`` more, or when nothing is cached, the request waits for the reload.
    A reload that fails leaves the old value in place and is tried again by the next request.
    """

    def __init__(self, load: Any) -> None:
        self.load = load
        self.items: dict[Any, tuple[float, Any]] = {}
        self.loading: dict[Any, Any] = {}

    async def get(self, key: Any, **kwargs: Any) -> Any:
        import asyncio

        now = time.monotonic()
        hit = self.items.get(key)
        if hit is not None and now - hit[0] < POLICY_TTL_S:
            return hit[1]
        loop = asyncio.get_running_loop()
        task = self.loading.get(key)
        if task is None or task.get_loop() is not loop:
            task = self.loading[key] = loop.create_task(self._reload(key, kwargs))
            task.add_done_callback(self._done)
        if hit is not None and now - hit[0] < POLICY_TTL_S + POLICY_STALE_S:
            return hit[1]
        return await asyncio.shield(task)

    async def _reload(self, key: Any, kwargs: dict[str, Any]) -> Any:
        import asyncio

        from asgiref.sync import sync_to_async

        started = time.monotonic()
        try:
            value = await sync_to_async(self.load, thread_sensitive=False)(**kwargs)
        finally:
            if self.loading.get(key) is asyncio.current_task():
                del self.loading[key]
        if len(self.items) > 50_000:  # keys x models seen by this process
            self.items.clear()
        self.items[key] = (started, value)
        return value

    @staticmethod
    def _done(task: Any) -> None:
        import logging

        if not task.cancelled() and task.exception() is not None:
            logging.getLogger(__name__).warning("quota policy reload failed: %r",
                                                task.exception())


def _load_policy(**kwargs: Any) -> QuotaPolicy:
    from plans.quotas import quota_policy_load

    return quota_policy_load(**kwargs)


def _load_limits(**kwargs: Any) -> Limits:
    from plans.quotas import limits_of

    rpm, tpm, _regions = limits_of(**kwargs)
    return rpm, tpm


_policies = _Reloading(_load_policy)
_limits = _Reloading(_load_limits)


async def apolicy(*, org_id: int, project_id: int, key_id: int, model: str) -> QuotaPolicy:
    """Return the (key, model) policy, re-read from PostgreSQL about every POLICY_TTL_S."""
    return await _policies.get((key_id, model), organization_id=org_id,
                               project_id=project_id, key_id=key_id, model=model)


class _Batcher:
    """Send the admissions and settlements of one event-loop tick as ONE script call.

    The script runs them one after the other, each exactly as it would run alone (a batch
    only shares the round trip, the command parsing and the script's start-up, which is what
    bounds decisions per second from one process); an operation that fails answers its own
    error. A request waits at most one loop iteration longer than it would alone.
    All keys of one organization share a hash tag; a batch mixes organizations, so this
    client targets one Redis server (a Redis Cluster client would batch per hash slot).
    """

    def __init__(self, connection: Any) -> None:
        self.connection = connection  # a redis_conn.PipelinedConnection
        self.pending: list[tuple[str, list[str], list[Any], Any]] = []
        self.scheduled = False
        self.flushing: set[Any] = set()
        self.sha: str | None = None

    async def call(self, kind: str, keys: list[str], argv: list[Any]) -> Any:
        import asyncio

        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.pending.append((kind, keys, argv, future))
        if len(self.pending) >= MAX_BATCH:
            # A full batch goes now: Redis runs it while this process prepares the next one.
            self._spawn(loop, self.pending)
            self.pending = []
        elif not self.scheduled:
            # The flush's first step runs at the next loop iteration, after every other
            # call() made in this one has joined the batch.
            self.scheduled = True
            self._spawn(loop, None)
        return await future

    def _spawn(self, loop: Any, batch: list[Any] | None) -> None:
        task = loop.create_task(self._flush(batch))
        self.flushing.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self.flushing.discard)

    async def _run(self, batch: list[tuple[str, list[str], list[Any], Any]]) -> list[Any]:
        from redis.exceptions import NoScriptError

        all_keys: list[str] = []
        all_argv: list[Any] = [len(batch)]
        for kind, keys, argv, _future in batch:
            all_keys += keys
            all_argv += [kind, len(keys), len(argv), *argv]
        if self.sha is None:
            self.sha = await self.connection.execute("SCRIPT", "LOAD", STEP_LUA)
        try:
            return await self.connection.execute(
                "EVALSHA", self.sha, len(all_keys), *all_keys, *all_argv)
        except NoScriptError:
            # Redis lost its script cache (a restart): nothing ran; load it and run again.
            self.sha = await self.connection.execute("SCRIPT", "LOAD", STEP_LUA)
            return await self.connection.execute(
                "EVALSHA", self.sha, len(all_keys), *all_keys, *all_argv)

    async def _flush(self, batch: list[Any] | None) -> None:
        if batch is None:
            self.scheduled = False
            batch, self.pending = self.pending, []
            if not batch:
                return
        try:
            results = await self._run(batch)
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


# Operations per script call: big enough to share the round trip, small enough that two
# batches overlap (Redis runs one while this process answers the other).
MAX_BATCH = 32
_batchers: Any = None
_last: tuple[Any, _Batcher] | None = None


def _batcher() -> _Batcher:
    """Return the batcher of the running loop's pipelined Redis connection (one per loop)."""
    import asyncio
    import weakref

    from billing_platform.redis_conn import get_pipelined

    global _batchers, _last
    loop = asyncio.get_running_loop()
    if _last is not None and _last[0] is loop:
        return _last[1]
    if _batchers is None:
        _batchers = weakref.WeakKeyDictionary()
    connection = get_pipelined()
    batcher = _batchers.get(connection)
    if batcher is None:
        batcher = _batchers[connection] = _Batcher(connection)
    _last = (loop, batcher)
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
    keys, argv, bkeys, norm = build_admit(
        policy, request_id=request_id, tier=tier, zone=zone, prompt_tokens=prompt_tokens,
        max_output=max_output)
    raw = await _batcher().call("a", keys, argv)
    ok, reason, retry, capacity = int(raw[0]), raw[1], int(raw[2]), raw[3]
    if not ok:
        raise explain(policy, reason, raw[4:10], retry, estimate=prompt_tokens + max_output)
    headers = rate_headers(raw[4:10])
    if capacity != "on_demand":
        headers["x-tollgate-capacity"] = capacity
    return Ticket(policy=policy, request_id=request_id, tier=tier, zone=zone,
                  estimate_tokens=prompt_tokens + max_output, estimate_norm=norm,
                  capacity=capacity, headers=headers, budget_keys=bkeys, reservation=raw[10],
                  admitted_ms=int(raw[11]),
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
    await _batcher().call("s", keys, argv)


# --- read-only state for answers that were not admitted ------------------------------------

_peek_script: Any = None


async def alimits(*, org_id: int, project_id: int, key_id: int) -> Limits:
    """Return the key's (rpm, tpm) limits per scope, from a cached policy or PostgreSQL."""
    return await _limits.get(key_id, organization_id=org_id, project_id=project_id,
                             key_id=key_id)


async def apeek_headers(*, org_id: int, project_id: int, key_id: int) -> dict[str, str]:
    """Return the key's ``x-ratelimit-*`` headers now, consuming nothing."""
    from billing_platform.redis_conn import get_aredis

    global _peek_script
    rpm, tpm = await alimits(org_id=org_id, project_id=project_id, key_id=key_id)
    client = get_aredis()
    if _peek_script is None:
        _peek_script = client.register_script(PEEK_LUA)
    rpm_of, tpm_of = dict(rpm), dict(tpm)
    scopes = list(rpm_of) + [s for s in tpm_of if s not in rpm_of]
    keys = [rate_key(org_id, s) for s in scopes]
    argv = [v for s in scopes for v in (rpm_of.get(s, -1), tpm_of.get(s, -1))]
    raw = await _peek_script(keys=keys, args=argv, client=client)
    return rate_headers(raw)
