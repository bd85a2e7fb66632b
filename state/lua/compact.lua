-- Drop the holder entries of retired slots from a batch of block keys (a key left with none is
-- deleted); returns {tier marks cleared, keys deleted}. Only slots still retired are touched: a
-- slot freed (and maybe reused) since the caller listed it is left alone.
-- KEYS: 1 retired, then the block keys; ARGV: 1 the listed slots, comma-separated.
local retired, any = {}, false
for s in string.gmatch(ARGV[1], '[^,]+') do
  if redis.call('SISMEMBER', KEYS[1], s) == 1 then retired[tonumber(s)] = true; any = true end
end
if not any then return {0, 0} end
local cleared, deleted = 0, 0
for i = 2, #KEYS do
  local k = KEYS[i]
  local v = redis.call('GET', k)
  if v then
    local keep, dropped = {}, false
    for j = 1, #v, 2 do
      local lo, hi = string.byte(v, j, j + 1)
      if retired[hi * 32 + math.floor(lo / 8)] then
        local t = lo % 8
        cleared = cleared + (t % 2) + (math.floor(t / 2) % 2) + math.floor(t / 4)
        dropped = true
      else
        keep[#keep + 1] = string.sub(v, j, j + 1)
      end
    end
    if dropped then
      if #keep == 0 then
        redis.call('DEL', k)
        deleted = deleted + 1
      else
        redis.call('SET', k, table.concat(keep))
      end
    end
  end
end
return {cleared, deleted}
