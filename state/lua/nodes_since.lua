-- The node hash, or only what changed in it since the version a reader holds (state/reader.py).
-- KEYS: version, changes, node hash, base; ARGV: the version and base the reader holds, the
-- most changed nodes worth a delta, then the node attributes (state.keys.NODE_ATTRS).
-- Returns {version, base} when the reader is current; {version, base, changed nodes, their
-- attributes' values (HMGET, node by node)} when a few nodes moved; else {version, base,
-- HGETALL}. A namespace never written has no version (false), which never matches.
local v = redis.call('GET', KEYS[1])
local b = redis.call('GET', KEYS[4]) or ''
if v and ARGV[1] ~= '' and b == ARGV[2] then
  if v == ARGV[1] then return {v, b} end
  local most = tonumber(ARGV[3])
  if tonumber(v) > tonumber(ARGV[1]) then
    local names = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. ARGV[1], '+inf', 'LIMIT', 0, most + 1)
    if #names <= most then
      local fields = {}
      for _, n in ipairs(names) do
        for i = 4, #ARGV do fields[#fields + 1] = n .. '\31' .. ARGV[i] end
      end
      local values = {}
      for i = 1, #fields, 4000 do  -- unpack() takes at most ~8000 values
        local part = redis.call('HMGET', KEYS[3], unpack(fields, i, math.min(i + 3999, #fields)))
        for _, x in ipairs(part) do values[#values + 1] = x end
      end
      return {v, b, names, values}
    end
  end
end
return {v, b, redis.call('HGETALL', KEYS[3])}
