-- After a full compaction pass: the listed slots that are still retired become free for reuse.
-- KEYS: 1 retired, 2 free, 3 ver; ARGV: 1 the listed slots, comma-separated. Returns how many were freed.
local n = 0
for s in string.gmatch(ARGV[1], '[^,]+') do
  if redis.call('SREM', KEYS[1], s) == 1 then
    redis.call('ZADD', KEYS[2], tonumber(s), s)
    n = n + 1
  end
end
if n > 0 then redis.call('INCR', KEYS[3]) end
return n
