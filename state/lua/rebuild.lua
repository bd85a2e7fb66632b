-- Partitions being rebuilt under generation ARGV[1]: pairs (topic:partition, end offset);
-- a partition whose fence has reached end - 1 (or end <= 0) is done and leaves the hash.
-- KEYS: 1 gen, 2 wm, 3 rebuild. Returns the partitions still rebuilding, -1 under another generation.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
for i = 2, #ARGV, 2 do
  local tp, target = ARGV[i], tonumber(ARGV[i + 1])
  local cur = tonumber(redis.call('HGET', KEYS[2], tp) or '-1')
  if cur >= target - 1 then redis.call('HDEL', KEYS[3], tp)
  else redis.call('HSET', KEYS[3], tp, target) end
end
return redis.call('HLEN', KEYS[3])
