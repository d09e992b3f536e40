"""The Lua that runs inside Redis: every quota check and every change of a live counter.

Why a module of its own: the scripts share one prelude (Redis's clock, releasing reservations,
the request window, the token bucket) and each has a wire contract with the Python that builds
its KEYS and ARGV (``decision.admit_op``, ``Ticket.settle_op``, ``runtime.apeek_headers``,
``plans.quotas.budget_reconcile``). An admission's and a settlement's ARGV list the policy's
values first and the request's last, so that the gateway packs the policy's once (``wire``).
Keeping all of them here, and nothing else, lets a reader check a contract in one place and
change the Lua without reading the Python around it.

Why Lua at all: a check followed by a separate write lets two gateway processes both pass the
check (budgets exceeded under concurrency, rate limits multiplied by the replica count). A
script runs atomically inside Redis, so every gateway process shares one exact view. Key names
and units are ``policy``'s.

Length: the admission, the settlement and a lease's giveback (``lease``) are one script that
shares its prelude and runs in one call; split over modules, each contract's two sides (what
one operation writes and what the next one reads) would no longer sit together.
"""

# The scripts share this prelude: Redis's clock in ms and s, and the reservation helpers.
# A reservation is one member of the org's ``res`` ZSET, scored by its expiry:
# "<request id> <key> <micro> [<key> <micro> ...]" (what it holds, per budget or window key).
PRELUDE_LUA = r"""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local sec = math.floor(now / 1000)
local LONG = 40 * 86400000
local RATE_TTL = 120000
-- a lease takes at most 1/LEASE_SHARE of what a limit has left, and at least LEASE_MIN
-- requests' worth or none (so a limit is never leased within LEASE_SHARE x LEASE_MIN requests
-- of its end); one taken in the last LEASE_MIN_MS of a second counts its requests in the next
-- (``plans.admission.lease``)
local LEASE_SHARE = 8
local LEASE_MIN = 8
local LEASE_MIN_MS = 50

local function int(x) return string.format('%d', x) end
local secf = int(sec)  -- the current second's bucket (a field name)
local sec_ms = sec * 1000

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

-- Give ``refund`` tokens back to a token bucket of capacity ``cap`` taken from at ``admitted``.
local function refund(key, cap, amount, admitted)
  if amount > 0 and now - admitted < RATE_TTL - 20000 then
    -- The bucket's key outlives its admission by RATE_TTL: it exists. Adding to the stored
    -- level equals adding to the refilled one, as levels are capped when read.
    redis.call('HINCRBYFLOAT', key, 't', amount)
  elseif amount ~= 0 then
    local h = redis.call('HMGET', key, 't', 'ts')
    if h[1] then
      redis.call('HSET', key, 't', math.min(cap, bucket_level(h[1], h[2], cap) + amount),
                 'ts', now)
    end
  end
end
"""

ADMIT_LUA = r"""
-- Budgets and the token plan's window: the first that this request's worst case would
-- overrun, and what each would take.
local function spend_check(ki, ai, di, n_bud, has_win, lease)
  local bud, win = {}, nil
  for i = 1, n_bud do
    local key, o = KEYS[ki + i - 1], ai + (i - 1) * 3
    local limit, worst, hard = tonumber(ARGV[o]), tonumber(ARGV[di + i - 1]), ARGV[o + 2] == '1'
    local b = redis.call('HMGET', key, 'spent', 'reserved')
    local spent, reserved = tonumber(b[1] or ARGV[o + 1]), tonumber(b[2] or '0')
    bud[i] = {key, hard and worst or 0, not b[1], ARGV[o + 1]}
    if lease and hard and worst > 0 then
      lease.n = math.min(lease.n, math.floor((limit - spent - reserved) / (LEASE_SHARE * worst)))
    end
    if hard and spent + reserved + worst > limit then
      if spent + worst > limit then return 'budget:' .. i, -1, bud, win end
      return 'budget:' .. i, 1000, bud, win
    end
  end
  if has_win then
    local key, o = KEYS[ki + n_bud], ai + n_bud * 3
    local limit, worst, wms, seed = tonumber(ARGV[o]), tonumber(ARGV[di + n_bud]),
      tonumber(ARGV[o + 1]), ARGV[o + 2]
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
-- ARGV, the policy's: ttl, n_rate, n_bud, has_prov, has_win; per rate key: rpm (-1: none),
--   tpm (-1: none); per budget: limit, seed, hard; window: limit, ms, seed; provisioned:
--   tokens per minute, reject overflow; then the request's: request id, estimate, (a lease:
--   requests wanted), per budget its worst case, window: worst case, provisioned: need
-- A lease (``leasing``: no window, no provisioned) takes ``n`` requests' worth at once: at
-- most 1/LEASE_SHARE of what each limit has left, at least LEASE_MIN, or it is refused
-- ('lease');
-- the answer's 13th value is ``n``, its 12th the start of the second its requests count in
-- (this one's, or the next one's in this one's last LEASE_MIN_MS).
local function admit(ki, ai, leasing)
  local res = KEYS[ki]
  local ttl, n_rate, n_bud = tonumber(ARGV[ai]), tonumber(ARGV[ai + 1]), tonumber(ARGV[ai + 2])
  local has_prov, has_win = ARGV[ai + 3] == '1', ARGV[ai + 4] == '1'
  ki, ai = ki + 1, ai + 5
  local di = ai + 2 * n_rate + 3 * n_bud + (has_win and 3 or 0) + (has_prov and 2 or 0)
  local rid, est = ARGV[di], tonumber(ARGV[di + 1])
  di = di + 2
  local lease, bucketf, stamp = nil, secf, now
  if leasing then
    lease = {n = tonumber(ARGV[di])}
    di = di + 1
    -- near the end of a second, the lease's requests count in the next one (a second later
    -- out of the window: never early), and it lives until that one ends
    if now - sec_ms > 1000 - LEASE_MIN_MS then bucketf, stamp = int(sec + 1), sec_ms + 1000 end
  end

  -- 1. check everything; write nothing yet (but drop request buckets that left the window)
  local reject, retry, req_retry = false, 0, nil
  local lim_req, rem_req, reset_req = -1, -1, 0
  local lim_tok, rem_tok, reset_tok = -1, -1, 0
  local rate = {}
  for i = 1, n_rate do
    local key, limit, cap = KEYS[ki], tonumber(ARGV[ai]), tonumber(ARGV[ai + 1])
    ki, ai = ki + 1, ai + 2
    local h = redis.call('HMGET', key, 'n', 'lo', bucketf, 't', 'ts')
    local ts = tonumber(h[5])
    -- the key's TTL is renewed by the first admission of each second (it outlives the
    -- second's bucket by far), not by every admission
    local r = {key, nil, nil, nil, nil, not ts or ts < sec_ms or ts >= sec_ms + 1000}
    if limit >= 0 then
      local lo0 = tonumber(h[2])
      local n, lo = tonumber(h[1]) or 0, lo0 or sec
      if lo < sec - 60 then n, lo = window(key, n, lo, true) end
      local reset = (lo + 61) * 1000 - now
      if n >= limit and req_retry == nil then req_retry = reset end
      if lease then lease.n = math.min(lease.n, math.floor((limit - n) / LEASE_SHARE)) end
      local rem = limit - n - 1
      if rem < 0 then rem = 0 end
      if rem_req < 0 or rem < rem_req then lim_req, rem_req, reset_req = limit, rem, reset end
      local c = tonumber(h[3]) or 0
      r[2], r[4], r[6] = n, c, c == 0
      if lo0 ~= lo then r[3] = lo end  -- written only when it moved
    end
    if cap >= 0 then
      local level = cap
      if h[4] and ts then
        level = tonumber(h[4]) + (now - ts) * cap / 60000
        if level > cap then level = cap end
      end
      if lease and est > 0 then
        lease.n = math.min(lease.n, math.floor(level / (LEASE_SHARE * est)))
      end
      if est > cap then
        if not reject then reject = 'too_large'; retry = 0 end
      elseif est > level and not reject then
        reject = 'tokens'; retry = math.ceil((est - level) * 60000 / cap)
      end
      local left = level - est
      if left < 0 then left = 0 end
      local rem = math.floor(left)
      if rem_tok < 0 or rem < rem_tok then
        lim_tok, rem_tok = cap, rem
        reset_tok = math.ceil((cap - left) * 60000 / cap)
      end
      r[5] = level
    end
    rate[i] = r
  end
  if req_retry ~= nil then reject, retry = 'requests', req_retry end

  local bud, win = {}, nil
  if n_bud > 0 or has_win then
    local why, wait
    why, wait, bud, win = spend_check(ki, ai, di, n_bud, has_win, lease)
    -- Reservations of crashed requests only matter when they would refuse this one.
    if why and not reject and release_expired(res) > 0 then
      why, wait, bud, win = spend_check(ki, ai, di, n_bud, has_win, lease)
    end
    if why and not reject then reject, retry = why, wait end
    ki = ki + n_bud + (has_win and 1 or 0)
  end
  ai = ai + n_bud * 3 + (has_win and 3 or 0)
  di = di + n_bud + (has_win and 1 or 0)

  local capacity, prov = 'on_demand', nil
  if has_prov then
    local key = KEYS[ki]
    local cap, need, rej = tonumber(ARGV[ai]), tonumber(ARGV[di]), ARGV[ai + 1] == '1'
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

  local cnt = 1
  if lease then
    cnt = lease.n
    if cnt < LEASE_MIN or reject then reject, retry = 'lease', 1000 - (now - sec_ms) end
  end
  if reject then
    if rem_req >= 0 and reject ~= 'requests' then rem_req = rem_req + 1 end
    return {0, reject, retry, capacity, lim_req, rem_req, reset_req, lim_tok, rem_tok,
            reset_tok, ''}
  end

  -- 2. all passed: take everything (a lease: ``cnt`` requests' worth)
  if cnt > 1 then
    est = est * cnt
    for _, b in ipairs(bud) do b[2] = b[2] * cnt end
  end
  local renewed = false
  for _, r in ipairs(rate) do
    -- one HSET per key, no table to build (numbers: Redis writes integers without a point)
    if r[2] and r[5] then
      if r[3] then
        redis.call('HSET', r[1], 'n', r[2] + cnt, bucketf, r[4] + cnt, 't', r[5] - est,
                   'ts', now, 'lo', r[3])
      else
        redis.call('HSET', r[1], 'n', r[2] + cnt, bucketf, r[4] + cnt, 't', r[5] - est,
                   'ts', now)
      end
    elseif r[2] then
      if r[3] then
        redis.call('HSET', r[1], 'n', r[2] + cnt, bucketf, r[4] + cnt, 'lo', r[3])
      else
        redis.call('HSET', r[1], 'n', r[2] + cnt, bucketf, r[4] + cnt)
      end
    elseif r[5] then
      redis.call('HSET', r[1], 't', r[5] - est, 'ts', now)
    end
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
          stamp, cnt}
end

-- KEYS: res, budget keys, window key?, token bucket keys (the TPM scopes'), provisioned key?
-- ARGV, the policy's: n_bud, has_win, n_tok, has_prov, window: ms; capacity per bucket,
--   provisioned: capacity; then the request's: reservation member ('' when none), admitted at
--   (ms), tokens unused (each bucket's refund), per budget: actual, window: actual,
--   provisioned: refund
local function settle(ki, ai)
  local res = KEYS[ki]
  local n_bud, has_win, n_tok = tonumber(ARGV[ai]), ARGV[ai + 1] == '1', tonumber(ARGV[ai + 2])
  local has_prov = ARGV[ai + 3] == '1'
  local wms = has_win and tonumber(ARGV[ai + 4]) or 0
  local ci = ai + 4 + (has_win and 1 or 0)  -- capacities
  local di = ci + n_tok + (has_prov and 1 or 0)
  local member, admitted, unused = ARGV[di], tonumber(ARGV[di + 1]), tonumber(ARGV[di + 2])
  ki, ai = ki + 1, di + 3
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
    local actual = tonumber(ARGV[ai]); ai = ai + 1
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
  for i = 1, n_tok + (has_prov and 1 or 0) do
    local amount = unused
    if i > n_tok then amount = tonumber(ARGV[ai]) end  -- provisioned: its own refund
    refund(KEYS[ki], tonumber(ARGV[ci + i - 1]), amount, admitted)
    ki = ki + 1
  end
  return released
end

-- The end of a lease (``plans.admission.lease``): what it did not hand out goes back, and the
-- spend of its settled requests is added. With ``kept``, the requests still in flight keep
-- their reservations under that member (same expiry); a final giveback releases it.
-- KEYS: res, rate keys, budget keys (the lease's admission's)
-- ARGV, the policy's: n_rate, n_bud; per rate key: rpm (-1: none), tpm (-1: none); then the
--   lease's: member, kept member ('' when none), admitted at (ms), requests unused, tokens
--   unused, per budget: actual spend, amount kept
local function giveback(ki, ai)
  local res = KEYS[ki]
  local n_rate, n_bud = tonumber(ARGV[ai]), tonumber(ARGV[ai + 1])
  local ri, di = ai + 2, ai + 2 + 2 * n_rate
  local member, kept, admitted = ARGV[di], ARGV[di + 1], tonumber(ARGV[di + 2])
  local reqs, toks = tonumber(ARGV[di + 3]), tonumber(ARGV[di + 4])
  local held, score = {}, redis.call('ZSCORE', res, member)
  if score then  -- not yet released as expired
    redis.call('ZREM', res, member)
    for key, amt in string.gmatch(member, ' (%S+) (%S+)') do held[key] = tonumber(amt) end
    if kept ~= '' then redis.call('ZADD', res, score, kept) end
  end
  -- requests counted but not used: out of the second they were counted in, while it counts
  local field = int(math.floor(admitted / 1000))
  for i = 1, n_rate do
    local key, rpm, tpm = KEYS[ki + i], tonumber(ARGV[ri]), tonumber(ARGV[ri + 1])
    ri = ri + 2
    if rpm >= 0 and reqs > 0 and redis.call('HEXISTS', key, field) == 1 then
      redis.call('HINCRBY', key, field, 0 - reqs)
      redis.call('HINCRBY', key, 'n', 0 - reqs)
    end
    if tpm >= 0 then refund(key, tpm, toks, admitted) end
  end
  ki, ai = ki + 1 + n_rate, di + 5
  for i = 1, n_bud do
    local key, actual, keep = KEYS[ki + i - 1], tonumber(ARGV[ai]), tonumber(ARGV[ai + 1])
    ai = ai + 2
    local back = score and (held[key] or 0) - keep or 0
    if actual > 0 or back ~= 0 then
      local b = redis.call('HMGET', key, 'spent', 'reserved')
      if b[1] then  -- a missing key is seeded from PostgreSQL at the next admission
        redis.call('HSET', key, 'spent', int(tonumber(b[1]) + actual),
                   'reserved', int(tonumber(b[2] or '0') - back))
      end
    end
  end
  return 1
end
"""

# One call runs a batch of admissions and settlements, in order, each on its own: ARGV[1] is
# the count, then per operation its kind ('a': admit, 's': settle, 'l': a lease's admission,
# 'r': a lease's giveback), its KEYS count and ARGV count, and its
# ARGV; KEYS are the operations' keys in order. One failing operation (an error) answers an
# error in its place and leaves the others alone.
STEP_LUA = PRELUDE_LUA + ADMIT_LUA + r"""
local OPS = {a = admit, s = settle, r = giveback,
             l = function(ki, ai) return admit(ki, ai, true) end}
local out, ki, ai = {}, 1, 2
for i = 1, tonumber(ARGV[1]) do
  local kind, nk, na = ARGV[ai], tonumber(ARGV[ai + 1]), tonumber(ARGV[ai + 2])
  local ok, r = pcall(OPS[kind], ki, ai + 3)
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

# Raise a budget's settled spend to PostgreSQL's when Redis is behind (a lost or flushed
# Redis; the beat sweep's drift fix): max, never lower, as Redis is ahead by the events not yet
# ingested. KEYS: the budget key; ARGV: PostgreSQL's spend in micro-units.
RAISE_SPENT_LUA = (
    "local c = tonumber(redis.call('HGET', KEYS[1], 'spent') or '-1') "
    "if c < tonumber(ARGV[1]) then redis.call('HSET', KEYS[1], 'spent', ARGV[1]) "
    "redis.call('HSETNX', KEYS[1], 'reserved', 0) "
    "redis.call('PEXPIRE', KEYS[1], 3456000000) end return 1")
