"""The Lua scripts of the maintenance leases (:mod:`gateway.coord.leases`; declarative).

Each runs atomically in the store, so replicas racing for the same backend get one answer.
Times are the store's clock (``TIME``, in milliseconds). Keys and fields: the module
docstring of :mod:`gateway.coord.leases`.
"""

from __future__ import annotations

_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: lease of b, record of b, records of the peers (ARGV's peer_ids order).
# ARGV[1]: JSON {backend, holder, cycle, reason, phase, ttl_ms, takes_out (0/1), force (0/1),
# known_start_ms, drain_ms (-1: none), peer_ids, groups: [{model, peers, limit, out}]}.
# Returns {token, now_ms} when granted, {0, why} when refused.
ACQUIRE = _NOW_MS + """
local a = cjson.decode(ARGV[1])
local holder = redis.call('GET', KEYS[1])
if holder then return {0, 'the lease is held by ' .. holder} end
if redis.call('HGET', KEYS[2], 'open') == '1' then
  return {0, 'an unfinished cycle waits for its hand-over'}
end
local started = tonumber(redis.call('HGET', KEYS[2], 'started_' .. a.cycle) or '0')
if started > tonumber(a.known_start_ms) then
  local by = redis.call('HGET', KEYS[2], 'started_by_' .. a.cycle) or '?'
  return {0, 'a ' .. a.cycle .. ' cycle was started by ' .. by .. ' meanwhile'}
end
if a.takes_out == 1 and a.force == 0 then
  local leased = {}
  for i, id in ipairs(a.peer_ids) do
    local h = redis.call('HMGET', KEYS[2 + i], 'open', 'takes_out')
    if h[1] == '1' and h[2] == '1' then leased[id] = true end
  end
  for _, g in ipairs(a.groups) do
    local out, n = {}, 0
    for _, id in ipairs(g.out) do
      if id ~= a.backend and not out[id] then out[id] = true; n = n + 1 end
    end
    for _, id in ipairs(g.peers) do
      if id ~= a.backend and leased[id] and not out[id] then out[id] = true; n = n + 1 end
    end
    if #g.peers - 1 - n <= 0 or n + 1 > g.limit then
      return {0, 'staggered: ' .. n .. ' of the ' .. #g.peers .. ' backends of ' .. g.model
        .. ' are out (at most ' .. g.limit .. ', never the last warm one)'}
    end
  end
end
local token = redis.call('HINCRBY', KEYS[2], 'token', 1)
redis.call('SET', KEYS[1], a.holder, 'PX', a.ttl_ms)
local kinds = {a.cycle}
if a.cycle == 'long' then kinds = {'long', 'medium', 'short'}
elseif a.cycle == 'medium' then kinds = {'medium', 'short'} end
for _, k in ipairs(kinds) do
  redis.call('HSET', KEYS[2], 'started_' .. k, now, 'started_by_' .. k, a.holder)
end
local drain = ''
if tonumber(a.drain_ms) >= 0 then drain = now + tonumber(a.drain_ms) end
redis.call('HSET', KEYS[2], 'holder', a.holder, 'cycle', a.cycle, 'reason', a.reason,
  'phase', a.phase, 'open', '1', 'takes_out', a.takes_out, 'drain_deadline', drain,
  'rest_end', '', 'slept', '0', 'reset_done', '0', 'since', now)
return {token, now}
"""

# KEYS: lease, record. ARGV: holder, token, ttl_ms, JSON {cycle, reason, phase, takes_out,
# drain_in_ms, rest_in_ms (-1: none), slept, reset_done}. Returns 1 (renewed, or written
# back into an empty store) or 0 (the cycle moved on: another replica holds it now).
RENEW = _NOW_MS + """
local f = cjson.decode(ARGV[4])
local tok = redis.call('HGET', KEYS[2], 'token')
if tok then
  if tok ~= ARGV[2] or redis.call('HGET', KEYS[2], 'open') ~= '1' then return 0 end
  local cur = redis.call('GET', KEYS[1])
  if cur and cur ~= ARGV[1] then return 0 end
end
local function at(ms) if tonumber(ms) < 0 then return '' end return now + tonumber(ms) end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
redis.call('HSET', KEYS[2], 'token', ARGV[2], 'holder', ARGV[1], 'cycle', f.cycle,
  'reason', f.reason, 'phase', f.phase, 'open', '1', 'takes_out', f.takes_out,
  'drain_deadline', at(f.drain_in_ms), 'rest_end', at(f.rest_in_ms), 'slept', f.slept,
  'reset_done', f.reset_done)
return 1
"""

# KEYS: lease, record. ARGV: holder, token. The cycle ends: record closed (its last phase
# kept: a follower that missed a restart still sees it), lease deleted.
RELEASE = _NOW_MS + """
if redis.call('HGET', KEYS[2], 'token') ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[2], 'open', '0', 'ended', now)
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""

# KEYS: lease, record. ARGV: holder, ttl_ms, token seen. Only an open cycle whose lease
# expired, still at the token the caller read. Returns {token, now_ms, record flat} or nil.
TAKE_OVER = _NOW_MS + """
if redis.call('HGET', KEYS[2], 'open') ~= '1' then return nil end
if redis.call('EXISTS', KEYS[1]) == 1 then return nil end
if redis.call('HGET', KEYS[2], 'token') ~= ARGV[3] then return nil end
local token = redis.call('HINCRBY', KEYS[2], 'token', 1)
local prev = redis.call('HGET', KEYS[2], 'holder') or ''
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('HSET', KEYS[2], 'holder', ARGV[1], 'handed_over_from', prev)
local out = {token, now}
for _, v in ipairs(redis.call('HGETALL', KEYS[2])) do table.insert(out, v) end
return out
"""

# KEYS: record. ARGV: kind, ms, by, ... (triples). Writes back the starts a replica adopted
# (after the store lost them), never moving one earlier.
RESTORE_STARTS = """
for i = 1, #ARGV, 3 do
  local cur = tonumber(redis.call('HGET', KEYS[1], 'started_' .. ARGV[i]) or '0')
  if tonumber(ARGV[i + 1]) > cur then
    redis.call('HSET', KEYS[1], 'started_' .. ARGV[i], ARGV[i + 1],
      'started_by_' .. ARGV[i], ARGV[i + 2])
  end
end
return 1
"""
