-- The server's clock inside the snapshot's MULTI/EXEC: a keyless TIME cannot be routed in a
-- cluster transaction, a script declaring a key of the namespace can. KEYS: 1 gen (unused).
return redis.call('TIME')
