-- The routing read done server-side (`conductor bench view-read`'s lua_walk): GET each block key
-- of the chain in order and stop at the first one nobody holds (no key).
-- KEYS: the chain's block keys; ARGV: none. Returns the holder entries of the blocks before that one.
local out = {}
for i = 1, #KEYS do
  local v = redis.call('GET', KEYS[i])
  if not v then break end
  out[#out + 1] = v
end
return out
