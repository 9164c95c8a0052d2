"""The optional shared placement store (Redis): which engine each anchor lives on.

Without it, affinity is stateless (policy.py): every replica hashes an anchor to the
same engine, and the spread of a few dozen anchors over the engines is the luck of the
hash (docs/routing.md, "The offline replay", Balance). With `store_url` set, a new
anchor goes to the engine with the lowest expected load among the engines the stateless
rule would choose from (the hot-prefix spread is kept), ties by rendezvous order: its
recent requests, plus the requests its anchors are still expected to bring, decaying
with `store_decay` seconds (both recorded in the store), plus its requests now
(`Engine.busy`: this process's in flight now, the other processes' as last scraped; so a
new prompt's first prefill does not meet another request while an engine it may go to is
idle and not much more loaded). When every engine it may go to reports its prefix
cache's counters (engine_load.py), that load is in tokens instead: the tokens each
engine recomputed lately, as measured (a template's cold prefill, partial blocks and
evictions included), plus its expected and current requests at the mean tokens per
request. Every replica and worker then reads that placement while its engine is still
one of those. A placement never takes a request outside them: when a hot prompt's
stretch of engines moves (policy.py), the conversations left outside it are placed anew
inside it, as the stateless rule would move them, so no engine keeps a prompt's copy for
a few stray conversations (under eviction those re-read the prompt on every turn;
docs/routing.md, "The store keeps to the stretch").

One round trip per request: a Lua script, atomic on the Redis server, so concurrent
replicas cannot record two placements for one anchor (the first script to run records
it, the later ones read it). It reads the anchor's engine and, when that is still
among the engines the request may go to (healthy, serving the model, in its stretch),
refreshes its TTL; otherwise places it anew; then counts the request for the engine.

A conversation is kept where its first turn went, whichever anchor decided there: when
the deciding anchor is shorter than the request's first user message (a system prompt
that this process does not count as hot, or an image it does not), the first user
message's record is read first and used when it is among them, and a new one is recorded with
the engine chosen. So a replica that has not yet seen a prompt shared (it started a
moment ago) sends a conversation's turns where a replica that has seen it sent the
first, and the other way round (docs/routing.md, "A new replica"). Keys (`<prefix>` is
`store_prefix`, so deployments can share a Redis):

    <prefix>:a:<anchor digest, hex>   hash: the engine's URL, the anchor's remaining
                                      credit, its time and the key that placed it;
                                      TTL store_ttl, refreshed (a conversation's
                                      record: the same, without credit)
    <prefix>:engines                  hash: per engine URL its decayed requests, credit
                                      and time; the mean requests per anchor
    <prefix>:k:<key digest's first 8 bytes, hex>:anchors
                                      sorted set: the anchors this key placed, by the
                                      time of their last use; TTL store_ttl

A key holds at most `store_anchors_per_key` anchors: each anchor belongs to the key that
placed it, and past the bound the key's least recently used anchor is deleted. So one
key's unique prefixes displace only anchors it placed itself, never another key's, and
the store's size is bounded by the keys times the bound, whatever a key sends.

Only digests and engine URLs are stored, never prompt text. A store that fails or
answers slower than `store_timeout` leaves that request to the stateless rule, and is
left alone for `store_retry` seconds (the shared client's breaker, gateway/store/client.py);
every request placed without the store is counted.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.routing.settings import RoutingSettings
from gateway.store.client import StoreClient

# KEYS: the anchor's hash, the engines' hash, the request key's anchors (a sorted set),
# and the conversation's hash (the first user message's; the anchor's own when that
# decided). ARGV: the anchor's TTL (ms), the decay time constant (s), the engines'
# hash TTL (ms), the key's digest (hex), the anchors a key may hold, the anchor's digest
# (hex), the store's prefix with its colon, the conversation's digest (hex), the number
# n of engines the request may go to, their n URLs best (rendezvous) first, then their
# n loads now, then their n recently recomputed tokens (-1: not measured). Returns the
# engine's URL, 1 if the placement was read (0 if made here), and the number of the
# key's anchors deleted for the bound.
#
# An engine's expected load is its recent requests plus the credit of its anchors,
# both decaying with the time constant, plus its requests now (the calling process's in
# flight now, plus the others' as the engine last reported them: `Engine.busy`): a new
# anchor brings a credit of the mean requests per anchor (measured over ten time
# constants), which its requests use up. Without the credit, a burst of new
# conversations would be placed by their first turns alone, before the later turns that
# make most of their load; without the load now, a new anchor's first prefill (the
# whole prompt, uncached) could meet another request on one engine while another
# engine it may go to is idle. Requests are not the work, though: a new template's
# first request prefills all of it, a question under it only its own part. So when
# every engine the request may go to has measured its recomputed tokens (each replica
# reads the same engine counters, decayed with the same constant), the load is in
# tokens: the engine's measured tokens, plus its credit and requests now at the
# choices' measured tokens per recorded request. An engine with nothing running comes
# first, though, while its load is within a tenth of the least loaded choice's, plus
# one request's worth: a busy engine that recomputed a little less would otherwise take
# the new anchor's whole first prefill beside its running request. Past that margin the
# least loaded wins, idle or not: under eviction, an engine that recomputes more than
# the others would otherwise keep taking new conversations whenever it is the idle one,
# and recompute more still.
#
# Each anchor belongs to the key that placed it (its field `k`, kept while the anchor
# lives): that key's set holds it, scored by its last use by any key, so another key's
# use keeps it fresh but never makes it that key's. When a key places an anchor, its set
# drops what has expired (the anchor's TTL runs from its last use, the score) and then,
# past the bound, its least recently used members, deleting each anchor it placed. Key
# names are built here from the prefix, so Redis Cluster's rule that a script names its
# keys up front does not hold (Cluster is not supported).
PLACE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local tau = tonumber(ARGV[2])
local function decayed(constant, value, at)
  value = tonumber(value or '0')
  if value == 0 then return 0 end
  return value * math.exp(-(now - tonumber(at or now)) / constant)
end
local owner = ARGV[4]
local bound = tonumber(ARGV[5])
local anchor = ARGV[6]
local prefix = ARGV[7]
local talk = ARGV[8]
local n = tonumber(ARGV[9])
local first = 10
local last = first - 1 + n
local function choosable(url)
  if not url then return false end
  for i = first, last do
    if ARGV[i] == url then return true end
  end
  return false
end
local function touch(name, placer)
  if placer ~= owner then
    local theirs = prefix .. 'k:' .. placer .. ':anchors'
    redis.call('ZADD', theirs, 'XX', now, name)
    redis.call('PEXPIRE', theirs, ARGV[1])
  else
    redis.call('ZADD', KEYS[3], now, name)
  end
end
local function count(url, e, engine_credit, requests, anchors)
  redis.call('HSET', KEYS[2],
    'r' .. url, decayed(tau, e[1], e[3]) + 1, 'c' .. url, engine_credit, 't' .. url, now,
    'R', requests + 1, 'A', anchors, 'T', now)
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
local g = redis.call('HMGET', KEYS[2], 'R', 'A', 'T')
local long = 10 * tau
local requests = decayed(long, g[1], g[3])
local anchors = decayed(long, g[2], g[3])
local held = false
if talk ~= anchor then
  held = redis.call('HMGET', KEYS[4], 'u', 'k')
  if choosable(held[1]) then
    local url = held[1]
    local e = redis.call('HMGET', KEYS[2], 'r' .. url, 'c' .. url, 't' .. url)
    count(url, e, decayed(tau, e[2], e[3]), requests, anchors)
    redis.call('HSET', KEYS[4], 't', now)
    redis.call('PEXPIRE', KEYS[4], ARGV[1])
    touch(talk, held[2] or owner)
    redis.call('PEXPIRE', KEYS[3], ARGV[1])
    return {url, 1, 0}
  end
end
local home = redis.call('HMGET', KEYS[1], 'u', 'c', 't', 'k')
local chosen = false
local credit = 0
if choosable(home[1]) then
  chosen = home[1]
  credit = decayed(tau, home[2], home[3])
end
local found = 1
local e = nil
if not chosen then
  found = 0
  local best = nil
  local figures = {}
  local done = 0
  local measured = 0
  local known = true
  for i = first, last do
    local url = ARGV[i]
    local f = redis.call('HMGET', KEYS[2], 'r' .. url, 'c' .. url, 't' .. url)
    local recent = decayed(tau, f[1], f[3])
    local tokens = tonumber(ARGV[i + 2 * n])
    local busy = tonumber(ARGV[i + n])
    -- Its recent requests and recomputed tokens; what it is still expected to take; its
    -- requests now.
    figures[i] = {f, recent, tokens, decayed(tau, f[2], f[3]) + busy, busy}
    done = done + recent
    if tokens < 0 then known = false end
    measured = measured + tokens
  end
  -- With every choice's recomputed tokens measured (and requests recorded to weigh them
  -- by), the load is in tokens: each engine's own, plus its expected and current
  -- requests at the choices' mean tokens per request.
  local per = 0
  if known and measured > 0 and done > 0 then per = measured / done end
  -- The least loaded choice; but the least loaded idle one while its load is within a
  -- tenth of that, plus one request's worth, so that the new anchor's first prefill
  -- (its whole prompt) meets no other request.
  local slack = 1
  if per > 0 then slack = per end
  local idle_best = nil
  local idle_chosen = nil
  local idle_e = nil
  for i = first, last do
    local c = figures[i]
    local load
    if per > 0 then
      load = c[3] + per * c[4]
    else
      load = c[2] + c[4]
    end
    if best == nil or load < best then
      best = load
      chosen = ARGV[i]
      e = c[1]
    end
    if c[5] <= 0 and (idle_best == nil or load < idle_best) then
      idle_best = load
      idle_chosen = ARGV[i]
      idle_e = c[1]
    end
  end
  if idle_best ~= nil and idle_best <= best * 1.1 + slack then
    chosen = idle_chosen
    e = idle_e
  end
  credit = 1
  if anchors >= 1 then credit = math.max(1, requests / anchors) end
  anchors = anchors + 1
else
  e = redis.call('HMGET', KEYS[2], 'r' .. chosen, 'c' .. chosen, 't' .. chosen)
end
local engine_credit = decayed(tau, e[2], e[3])
if found == 0 then engine_credit = engine_credit + credit end
local used = math.min(1, credit)
credit = credit - used
engine_credit = math.max(0, engine_credit - used)
count(chosen, e, engine_credit, requests, anchors)
local placer = home[4] or owner
redis.call('HSET', KEYS[1], 'u', chosen, 'c', credit, 't', now, 'k', placer)
redis.call('PEXPIRE', KEYS[1], ARGV[1])
touch(anchor, placer)
if held then
  -- The conversation's record: where its turns go from now on, in every replica.
  local talker = held[2] or owner
  redis.call('HSET', KEYS[4], 'u', chosen, 't', now, 'k', talker)
  redis.call('PEXPIRE', KEYS[4], ARGV[1])
  touch(talk, talker)
end
local dropped = 0
if placer == owner or (held and (held[2] or owner) == owner) then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. (now - tonumber(ARGV[1]) / 1000))
  local over = redis.call('ZCARD', KEYS[3]) - bound
  if over > 0 then
    local oldest = redis.call('ZPOPMIN', KEYS[3], over)
    for i = 1, #oldest, 2 do
      local gone = prefix .. 'a:' .. oldest[i]
      if redis.call('HGET', gone, 'k') == owner then
        redis.call('DEL', gone)
        dropped = dropped + 1
      end
    end
  end
  redis.call('PEXPIRE', KEYS[3], ARGV[1])
end
return {chosen, found, dropped}
"""


class PlacementStore:
    """Anchor placements shared through Redis. `place` never raises: None means "decide
    without the store" (counted in `fallback`)."""

    def __init__(self, client: StoreClient, settings: RoutingSettings) -> None:
        self.client = client
        self.where = client.where
        self._ttl_ms = str(int(settings.store_ttl * 1000))
        self._decay = str(settings.store_decay)
        # Unused for a hundred time constants, the engines' figures have decayed to nothing.
        self._engines_ttl_ms = str(int(settings.store_decay * 100_000))
        prefix = client.prefix
        self._prefix = f"{prefix}:"
        self._anchor_prefix = f"{prefix}:a:"
        self._engines_key = f"{prefix}:engines"
        self._bound = str(settings.store_anchors_per_key)
        self._script = client.script(PLACE)
        # Placements by outcome, plain integer adds read at scrape time (observability/metrics.py):
        # the anchor's recorded engine was used, a new anchor (or one whose engine the
        # request may no longer go to) was placed, or the store failed, was slow or is
        # being left alone: stateless.
        self.read = 0
        self.placed = 0
        self.fallback = 0
        # Anchors deleted because their key held more than `store_anchors_per_key`.
        self.dropped = 0

    @property
    def up(self) -> bool:
        return self.client.up

    async def warm(self) -> None:
        """Connect and load the placement script, so that the first request placed pays
        neither (a failure is the store's, as a request's would be)."""
        await self.client.attempt(lambda: self.client.redis.script_load(PLACE))

    async def place(
        self,
        anchor: bytes,
        choices: Sequence[str],
        key_digest: bytes | None,
        conversation: bytes | None,
        loads: Sequence[int],
        recomputed: Sequence[float | None] | None = None,
    ) -> str | None:
        """The engine URL for `anchor`: the recorded engine of `conversation` (the
        request's first user message, when shorter anchors decided) when that is in
        `choices` (the engines the request may go to, best first); else the anchor's
        recorded engine when that is; else the least busy of `choices` (by what the store
        recorded plus `loads`, each choice's requests now; in tokens when `recomputed` gives
        every choice's recently recomputed tokens, None where not measured), recorded. A
        new placement is recorded for the conversation too, and counted among the anchors
        of the key of `key_digest` (requests without a key count as one key). None: the
        store is unavailable, decide without it."""
        if not self.client.usable():
            self.fallback += 1
            return None
        name = anchor.hex()
        talk = name if conversation is None else conversation.hex()
        # A key is named by 64 bits of its digest (the limits' keys use all of it):
        # enough to tell the operator's keys apart, and 48 bytes less per anchor.
        owner = key_digest[:8].hex() if key_digest else "anonymous"
        args = [self._ttl_ms, self._decay, self._engines_ttl_ms]
        args += [owner, self._bound, name, self._prefix, talk, str(len(choices)), *choices]
        args += [str(load) for load in loads]
        # Unknown (never scraped, or not a vLLM): -1, and the load is in requests.
        tokens = recomputed or [None] * len(choices)
        args += ["-1" if t is None else f"{t:.17g}" for t in tokens]
        keys = [
            self._anchor_prefix + name,
            self._engines_key,
            f"{self._prefix}k:{owner}:anchors",
            self._anchor_prefix + talk,
        ]

        async def call() -> tuple[str, bool]:
            url, found, dropped = await self._script(keys=keys, args=args)
            self.dropped += int(dropped)
            return str(url), bool(found)

        # Never a failed request because of the store: without an answer, the request
        # is placed without it.
        answer = await self.client.attempt(call)
        if answer is None:
            self.fallback += 1
            return None
        url, found = answer
        if found:
            self.read += 1
        else:
            self.placed += 1
        return url
