-- Give a producer id's claim back (state/claim.py) if this process still holds it: KEYS[1] the
-- claim, ARGV[1] this process's token. Reply: 1 deleted, 0 not held by this process.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
