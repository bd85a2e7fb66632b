-- Take or renew a producer id's claim (state/claim.py). KEYS[1] the claim; ARGV[1] this process's
-- token; ARGV[2] the claim's life in ms; ARGV[3] a holder's token this process may replace (it
-- stopped renewing: a killed earlier run), '' for none. Reply: 1 renewed (held by this process),
-- 2 taken (it was free: never taken, given back, or lapsed), 3 taken over from ARGV[3],
-- 0 held by another process (left as it is).
local held = redis.call('GET', KEYS[1])
if held == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not held then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 2
end
if ARGV[3] ~= '' and held == ARGV[3] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 3
end
return 0
