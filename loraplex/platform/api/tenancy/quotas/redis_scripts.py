"""The Lua scripts of ``RedisQuotaLimiter``: one script per decision, so each is atomic in Redis.

Keys of one tenant (all share the hash tag ``{tenant}``, so a script's keys sit in one cluster slot):

| key | type | holds |
|---|---|---|
| ``<p>:{t}:rpm`` | ZSET | slot id -> admission time (ms), one entry per admitted request |
| ``<p>:{t}:tpm`` | ZSET | slot id -> admission time (ms) |
| ``<p>:{t}:tpm:tokens`` | HASH | slot id -> tokens counted (reserved, then used once settled) |
| ``<p>:{t}:tpm:sum`` | STRING | sum of ``tpm:tokens`` over the window (kept so admission is O(log n)) |
| ``<p>:{t}:slots`` | ZSET | slot id -> lease deadline (ms) of a request in flight |

Why a sliding *log* and not a sliding-window counter: the counter interpolates the previous
fixed window as if its requests were spread evenly, so under bursts it refuses early or admits
late (by up to the whole previous window). The log is exact -- a limit of N refuses exactly the
(N+1)-th request in any window -- and costs one ZSET entry per admitted request, at most ``rpm``
per tenant (``tpm`` entries are bounded by admitted requests, each at least one prompt token).

Time is Redis server ``TIME`` (ms), never a replica's clock, so replicas with skewed clocks agree.
Scripts that call ``TIME`` and then write need effect replication: Redis >= 5 (the default there).
All numbers passed to ``redis.call`` are integers below 2^53; Redis formats them with full
precision (Lua string concatenation would not, so none is done with numbers).
"""

from __future__ import annotations

# Shared by admit and settle: KEYS[1..5] as in the table above, in that order.
_PRELUDE = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- An admission at t counts while now < t + window: entries at or before now - window go.
local function trim(now, window)
  local cutoff = now - window
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', cutoff)
  local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', cutoff)
  if #expired > 0 then
    local freed = 0
    for i = 1, #expired do
      freed = freed + (tonumber(redis.call('HGET', KEYS[3], expired[i])) or 0)
    end
    -- unpack() is bounded by Lua's C stack: delete in chunks.
    for i = 1, #expired, 500 do
      redis.call('HDEL', KEYS[3], unpack(expired, i, math.min(i + 499, #expired)))
    end
    redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', cutoff)
    -- INCRBY keeps the key's expiry.
    if redis.call('INCRBY', KEYS[4], -freed) <= 0 then
      redis.call('DEL', KEYS[4])
    end
  end
  -- Slots whose lease ran out belong to a replica that stopped refreshing them (it died).
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
end
"""

ADMIT = (
    _PRELUDE
    + """
-- ARGV: slot id, rpm, tpm, max_concurrency (-1 = unlimited), reserve tokens, window ms, lease ms
-- Returns {admitted 0/1, rpm retry ms (-1 = not full), tpm retry ms (-1 = not full), slots full 0/1}.
local slot = ARGV[1]
local rpm, tpm, conc = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local reserve, window, lease = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local now = now_ms()
trim(now, window)

local rpm_retry, tpm_retry, slots_full = -1, -1, 0
if rpm >= 0 then
  local count = redis.call('ZCARD', KEYS[1])
  if count >= rpm then
    -- The admission whose expiry brings the count below the limit.
    local entry = redis.call('ZRANGE', KEYS[1], count - rpm, count - rpm, 'WITHSCORES')
    rpm_retry = tonumber(entry[2]) + window - now
  end
end
if tpm >= 0 then
  local need = (tonumber(redis.call('GET', KEYS[4])) or 0) + reserve - tpm
  if need > 0 then
    -- Walk the log oldest first until enough tokens have aged out (only on refusal).
    tpm_retry = window
    local entries = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
    local freed = 0
    for i = 1, #entries, 2 do
      freed = freed + (tonumber(redis.call('HGET', KEYS[3], entries[i])) or 0)
      if freed >= need then
        tpm_retry = tonumber(entries[i + 1]) + window - now
        break
      end
    end
  end
end
if conc >= 0 and redis.call('ZCARD', KEYS[5]) >= conc then
  slots_full = 1
end
if rpm_retry >= 0 or tpm_retry >= 0 or slots_full == 1 then
  return {0, rpm_retry, tpm_retry, slots_full}
end

-- Keys outlive their newest entry by the window (or the lease) plus a second, then vanish.
if rpm >= 0 then
  redis.call('ZADD', KEYS[1], now, slot)
  redis.call('PEXPIRE', KEYS[1], window + 1000)
end
if tpm >= 0 then
  redis.call('ZADD', KEYS[2], now, slot)
  redis.call('HSET', KEYS[3], slot, reserve)
  redis.call('INCRBY', KEYS[4], reserve)
  for i = 2, 4 do
    redis.call('PEXPIRE', KEYS[i], window + 1000)
  end
end
if conc >= 0 then
  redis.call('ZADD', KEYS[5], now + lease, slot)
  redis.call('PEXPIRE', KEYS[5], lease + 1000)
end
return {1, -1, -1, 0}
"""
)

SETTLE = (
    _PRELUDE
    + """
-- ARGV: slot id, used tokens, window ms. Idempotent: a second settle finds the used count already.
local slot, used, window = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
trim(now_ms(), window)
redis.call('ZREM', KEYS[5], slot)
-- Gone from the log when the request outlived the window: its tokens already aged out.
local counted = tonumber(redis.call('HGET', KEYS[3], slot))
if counted and counted ~= used then
  redis.call('HSET', KEYS[3], slot, used)
  if redis.call('INCRBY', KEYS[4], used - counted) <= 0 then
    redis.call('DEL', KEYS[4])
  else
    redis.call('PEXPIRE', KEYS[4], window + 1000)
  end
end
return 1
"""
)

REFRESH = """
-- KEYS[1]: the tenant's slots ZSET. ARGV: lease ms, slot ids held by the calling replica.
-- XX: a slot already settled (or lost with a Redis restart) is not brought back.
local t = redis.call('TIME')
local deadline = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
local refreshed = 0
for i = 2, #ARGV do
  refreshed = refreshed + redis.call('ZADD', KEYS[1], 'XX', 'CH', deadline, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]) + 1000)
return refreshed
"""
