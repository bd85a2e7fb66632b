-- Apply a batch of folded groups to the view, each atomically with its fence (state/redis_view.py).
-- Every script declares every key it touches (KEYS), all of one namespace and so of one
-- cluster slot (state.keys: the {ns} hash tag).
-- KEYS: 1 gen, 2 nodes, 3 wm, 4 slots, 5 meta, 6 free, 7 retired, 8 ver, 9 chg, then the block keys
-- the operations name; ARGV: 1 the groups (msgpack), 2 the generation the write was folded on.
-- A group is {fence key, offset, operations, stream conditions, the fence it continues from (-2: unchecked)};
-- a block operation is {code, node, tier, index of its first block key in KEYS, count}.
-- Returns per group: 0 fenced, 1 applied, 2 conflict, 3 hole, 4 lost (another generation), 5 no slot left.
-- The loader puts state.keys' slot limit in place of the word MAX_SLOTS below.
local groups = cmsgpack.unpack(ARGV[1])
-- generation check: a write folded on another generation of the view (lost, replaced) is refused whole
if ARGV[2] ~= redis.call('GET', KEYS[1]) then
  local lost = {}
  for gi = 1, #groups do lost[gi] = 4 end
  return lost
end
local nodes, wmkey, slotkey, metakey, freekey, retiredkey = KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local SEP = '\31'
local slots = {}
local function slot_of(node, create)
  local s = slots[node]
  if s then return s end
  s = redis.call('HGET', nodes, node .. SEP .. 'slot')
  if s then
    s = tonumber(s)
  elseif create then
    local free = redis.call('ZPOPMIN', freekey)
    if free[1] then
      s = tonumber(free[1])
    else
      s = redis.call('HINCRBY', metakey, 'next_slot', 1) - 1
    end
    redis.call('HSET', nodes, node .. SEP .. 'slot', s)
    redis.call('HSET', slotkey, s, node)
  else
    return nil
  end
  slots[node] = s
  return s
end
-- A block key's value: its holders, one 2-byte little-endian entry slot * 8 + tiers per node
-- (bit t of tiers: held in tier t; state.keys). find(v, lim, hi, lo) is the 1-based position
-- of the entry of the slot whose entry bytes are (lo + tiers, hi) among the first lim bytes of
-- v, and its tiers; nil when the slot holds none. It jumps between the slot's high byte
-- (string.find, in C) and checks alignment and the low byte.
local function find(v, lim, hi, lo)
  local c = string.char(hi)
  local p = 2
  while true do
    p = string.find(v, c, p, true)
    if not p or p > lim then return nil end
    if p % 2 == 0 then
      local b = string.byte(v, p - 1)
      if b >= lo and b < lo + 8 then return p - 1, b - lo end
      p = p + 2
    else
      p = p + 1
    end
  end
end
local function has(t, bit) return t % (2 * bit) >= bit end
-- Can every node this group adds blocks for have a slot? (A slot must fit a holder entry.)
local function room(ops)
  local need, seen = 0, {}
  for oi = 1, #ops do
    local node = ops[oi][2]
    if ops[oi][1] == 1 and not seen[node] then
      seen[node] = true
      if not slot_of(node, false) then need = need + 1 end
    end
  end
  if need == 0 then return true end
  local taken = tonumber(redis.call('HGET', metakey, 'next_slot') or '0')
  return need <= MAX_SLOTS - taken + redis.call('ZCARD', freekey)
end
local out, fence, halted, touched = {}, {}, false, {}
for gi = 1, #groups do
  local g = groups[gi]
  local fk, off, ops, conds = g[1], g[2], g[3], g[4]
  local ok = 1
  if halted then
    ok = 2
  else
    if fk ~= '' then
      local cur = fence[fk]
      if cur == nil then cur = tonumber(redis.call('HGET', wmkey, fk) or '-1') end
      if off <= cur then ok = 0 end
      -- contiguity check: g[5] is the fence the record continues from (-2: unchecked)
      if ok == 1 and g[5] ~= -2 and g[5] ~= cur then
        ok = 3
        halted = true
      end
    end
    -- compare-and-set on the stream state the record was folded from
    if ok == 1 and conds then
      for ci = 1, #conds do
        local c = conds[ci]
        if (redis.call('HGET', nodes, c[1]) or c[3]) ~= c[2] then
          ok = 2
          halted = true
          break
        end
      end
    end
    -- no slot left for a new node: refuse the group (and the rest of the call) before it writes
    if ok == 1 and not room(ops) then
      ok = 5
      halted = true
    end
    if ok == 1 and fk ~= '' then fence[fk] = off end
  end
  out[gi] = ok
  if ok == 1 then
    for oi = 1, #ops do
      local op = ops[oi]
      local code, node = op[1], op[2]
      touched[node] = true
      if code == 1 or code == 2 then
        local tier, first, last = op[3], op[4], op[4] + op[5] - 1
        local s = slot_of(node, code == 1)
        if s then
          local bit = 2 ^ tier
          local hi, lo = math.floor(s / 32), (s % 32) * 8
          local entry = string.char(lo + bit, hi)
          local delta = 0
          -- Per piece of at most 4000 keys (unpack() takes at most ~8000 values): one MGET of the
          -- values, the new ones worked out here, one MSET of those that change and one DEL of
          -- those left without holders (a call per key cost more than the work it did). sets
          -- holds key, value, key, value...; a key named twice sees its own earlier change (at).
          for p = first, last, 4000 do
            local q = math.min(p + 3999, last)
            local vals = redis.call('MGET', unpack(KEYS, p, q))
            local sets, at, n, emptied = {}, {}, 0, false
            for i = p, q do
              local k = KEYS[i]
              local j = at[k]
              local v
              if j then v = sets[j] else v = vals[i - p + 1] end
              local nv = nil
              if code == 1 then
                if not v or v == '' then
                  nv = entry
                  delta = delta + 1
                else
                  local e, t = find(v, #v, hi, lo)
                  if not e then
                    nv = v .. entry
                    delta = delta + 1
                  elseif not has(t, bit) then
                    nv = string.sub(v, 1, e - 1) .. string.char(lo + t + bit, hi) .. string.sub(v, e + 2)
                    delta = delta + 1
                  end
                end
              elseif v and v ~= '' then
                local e, t = find(v, #v, hi, lo)
                if e and has(t, bit) then
                  delta = delta - 1
                  if t ~= bit then
                    nv = string.sub(v, 1, e - 1) .. string.char(lo + t - bit, hi) .. string.sub(v, e + 2)
                  else
                    nv = string.sub(v, 1, e - 1) .. string.sub(v, e + 2)
                    if nv == '' then emptied = true end
                  end
                end
              end
              if nv then
                if j then
                  sets[j] = nv
                else
                  sets[n + 1] = k
                  sets[n + 2] = nv
                  n = n + 2
                  at[k] = n
                end
              end
            end
            if emptied then  -- the last holder left: the key goes
              local kept, dels = {}, {}
              for j = 1, n, 2 do
                if sets[j + 1] == '' then
                  dels[#dels + 1] = sets[j]
                else
                  kept[#kept + 1] = sets[j]
                  kept[#kept + 1] = sets[j + 1]
                end
              end
              sets, n = kept, #kept
              if #dels > 0 then redis.call('DEL', unpack(dels)) end
            end
            for j = 1, n, 4000 do redis.call('MSET', unpack(sets, j, math.min(j + 3999, n))) end
          end
          if delta ~= 0 then redis.call('HINCRBY', nodes, node .. SEP .. 'b' .. tier, delta) end
        end
      elseif code == 3 then
        local s = slot_of(node, false)
        if s then
          redis.call('HDEL', nodes, node .. SEP .. 'slot')
          redis.call('SADD', retiredkey, s)
          slots[node] = nil
        end
        redis.call('HDEL', nodes, node .. SEP .. 'b0', node .. SEP .. 'b1', node .. SEP .. 'b2')
      else
        redis.call('HSET', nodes, node .. SEP .. op[3], op[4])
      end
    end
  end
end
for fk, off in pairs(fence) do redis.call('HSET', wmkey, fk, off) end
-- Readers re-read the node hash only when this moved, and then only the nodes scored above their version.
local ver = redis.call('INCR', KEYS[8])
for node in pairs(touched) do redis.call('ZADD', KEYS[9], ver, node) end
return out
