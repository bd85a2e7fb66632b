-- Adopt the view's generation, creating it when absent (a new view, or one lost): the
-- partitions named (ARGV[2..]) are then marked as being rebuilt from the log, with the
-- creation, atomically. Returns {generation, 1 if created here else 0}.
-- KEYS: 1 gen, 2 rebuild; ARGV: 1 the new generation, 2.. the partitions.
local g = redis.call('GET', KEYS[1])
if g then return {g, 0} end
g = ARGV[1]
redis.call('SET', KEYS[1], g)
for i = 2, #ARGV do redis.call('HSET', KEYS[2], ARGV[i], -1) end
return {g, 1}
