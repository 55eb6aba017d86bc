"""The Redis tier's Lua scripts: what must change a namespace's metadata atomically, on its node.

Each runs on the node holding the namespace's metadata keys (all tagged ``{ns}``: one slot; see
:mod:`llama_cache.caches.redis_keys`). Passed to ``EVAL`` / ``register_script`` as text; no state here.
"""

from __future__ import annotations

__all__ = ["STORE_SCRIPT", "TOUCH_SCRIPT"]

# Links a new entry to its chain, drops the entry it replaces, absorbs partial tails and evicts LRU
# entries until the unique bytes fit. KEYS: entry, lru, refs, info, bytes, clock (all tagged {ns}: one
# slot). ARGV: key prefix, entry member, head, capacity, chain length, chunk length, then per chunk: id
# hex, size, prev hex, tokens. Returns 1 when the entry itself did not fit (it is then dropped), the ids
# of the chunks freed and the number of entries evicted. It deletes the in-flight markers of the chain's
# chunks (`w:<prev>`, see LlamaRedisCache.announce).
#
# A partial chunk (fewer tokens than the chunk length: always a chain's last) records the entries ending
# on it in the set `u:<id>`. When a new chunk with the same predecessor extends its tokens (the next
# turn of a conversation), it is *absorbed*: those entries' chains end on the new chunk instead (it holds
# the same KV for those positions; a lookup uses the part it needs) and it is freed.
STORE_SCRIPT = """
local entry, lru, refs, info, bytes, clock = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local prefix, member, head = ARGV[1], ARGV[2], ARGV[3]
local capacity, n, chunk_tokens = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local freed = {}
-- The store has landed: lookups waiting for it (in-flight markers, set by announce) may go on.
local markers = {}
for i = 0, n - 1 do
  markers[#markers + 1] = prefix .. 'w:' .. ARGV[9 + 4 * i]
  if #markers == 512 or i == n - 1 then redis.call('DEL', unpack(markers)); markers = {} end
end
local function release(id)
  if redis.call('HINCRBY', refs, id, -1) <= 0 then
    redis.call('HDEL', refs, id)
    local meta = redis.call('HGET', info, id)
    if meta then
      local size, prev = string.match(meta, '^(%d+):(%x*)$')
      prev = prev or ''
      local tokens = redis.call('HGET', prefix .. 't:' .. prev, id)
      if tokens then
        for at = 4, #tokens, 4 do
          local field = string.sub(tokens, 1, at)
          if redis.call('HGET', prefix .. 'p:' .. prev, field) == id then
            redis.call('HDEL', prefix .. 'p:' .. prev, field)
          end
        end
      end
      redis.call('HDEL', info, id)
      redis.call('HDEL', prefix .. 't:' .. prev, id)
      redis.call('DECRBY', bytes, tonumber(size or '0'))
    end
    freed[#freed + 1] = id
  end
end
local function drop(m)
  local key = prefix .. 'e:' .. m
  local record = redis.call('HMGET', key, 'chain', 'size')
  if record[1] then
    local chain = record[1]
    if #chain >= 32 then redis.call('SREM', prefix .. 'u:' .. string.sub(chain, -32), m) end
    for at = 1, #chain, 32 do release(string.sub(chain, at, at + 31)) end
    redis.call('DECRBY', bytes, tonumber(record[2] or '0'))
  end
  redis.call('DEL', key)
  redis.call('ZREM', lru, m)
end
local ids, new, made = {}, {}, {}
for i = 0, n - 1 do
  local id, size, prev, tokens = ARGV[7 + 4 * i], ARGV[8 + 4 * i], ARGV[9 + 4 * i], ARGV[10 + 4 * i]
  if redis.call('HINCRBY', refs, id, 1) == 1 then
    made[id] = true
    redis.call('HSET', info, id, size .. ':' .. prev)
    redis.call('HSET', prefix .. 't:' .. prev, id, tokens)
    -- Every prefix of its tokens names it (unless another chunk holding that prefix already does):
    -- a lookup finds the child sharing most of its remaining tokens in one HMGET, whatever the
    -- number of children. A predecessor made by this store has no other child: one HSET, and
    -- nothing to absorb.
    if made[prev] then
      local fields = {}
      for at = 4, #tokens, 4 do
        fields[#fields + 1] = string.sub(tokens, 1, at); fields[#fields + 1] = id
        if #fields == 512 or at + 4 > #tokens then redis.call('HSET', prefix .. 'p:' .. prev, unpack(fields)); fields = {} end
      end
    else
      new[#new + 1] = {id, prev, tokens}
      for at = 4, #tokens, 4 do
        redis.call('HSETNX', prefix .. 'p:' .. prev, string.sub(tokens, 1, at), id)
      end
    end
    redis.call('INCRBY', bytes, tonumber(size))
  end
  ids[#ids + 1] = id
end
drop(member)
redis.call('HSET', entry, 'head', head, 'chain', table.concat(ids), 'size', #head)
redis.call('INCRBY', bytes, #head)
redis.call('ZADD', lru, redis.call('INCR', clock), member)
local function partial(id, prev)
  local tokens = redis.call('HGET', prefix .. 't:' .. prev, id)
  return tokens and #tokens < 4 * chunk_tokens
end
local last = ids[#ids]
if last and partial(last, n > 1 and ids[n - 1] or '') then redis.call('SADD', prefix .. 'u:' .. last, member) end
for _, chunk in ipairs(new) do
  local id, prev, tokens = chunk[1], chunk[2], chunk[3]
  local extends = partial(id, prev)
  local absorbed = false
  for at = 4, #tokens - 4, 4 do
    local shorter = redis.call('HGET', prefix .. 'p:' .. prev, string.sub(tokens, 1, at))
    if shorter and shorter ~= id and #(redis.call('HGET', prefix .. 't:' .. prev, shorter) or '') == at then
      for _, m in ipairs(redis.call('SMEMBERS', prefix .. 'u:' .. shorter)) do
        local key = prefix .. 'e:' .. m
        local chain = redis.call('HGET', key, 'chain')
        if chain and string.sub(chain, -32) == shorter then
          redis.call('HSET', key, 'chain', string.sub(chain, 1, -33) .. id)
          redis.call('HINCRBY', refs, id, 1)
          if extends then redis.call('SADD', prefix .. 'u:' .. id, m) end
          release(shorter)
        end
      end
      redis.call('DEL', prefix .. 'u:' .. shorter)
      absorbed = true
    end
  end
  if absorbed then
    for at = 4, #tokens, 4 do redis.call('HSETNX', prefix .. 'p:' .. prev, string.sub(tokens, 1, at), id) end
  end
end
-- An entry larger than the whole capacity evicts nothing: it is dropped at once.
local own = #head
for _, id in ipairs(ids) do
  local size = string.match(redis.call('HGET', info, id) or '', '^(%d+):')
  own = own + tonumber(size or '0')
end
if own > capacity then
  drop(member)
  return {1, freed, 0}
end
local evicted = 0
while tonumber(redis.call('GET', bytes) or '0') > capacity do
  local oldest = redis.call('ZRANGE', lru, 0, 0)[1]
  if not oldest or oldest == member then break end
  drop(oldest)
  evicted = evicted + 1
end
local over = 0
if tonumber(redis.call('GET', bytes) or '0') > capacity then
  drop(member)
  over = 1
end
return {over, freed, evicted}
"""


# Makes an entry the most recently used, if it still exists. KEYS: lru, clock. ARGV: entry member.
TOUCH_SCRIPT = """
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  redis.call('ZADD', KEYS[1], redis.call('INCR', KEYS[2]), ARGV[1])
end
return 0
"""
