"""Pick an engine for a request: residency first, then cache affinity, bounded by load.

Policies:

- ``cache_aware`` (default). Each engine gets an approximate prefix index: the prompt is cut
  into fixed-size character blocks, and each block is identified by a hash chained over the
  blocks before it *and the tenant's cache namespace*, so a match is a true shared prefix and no
  tenant is ever routed for another tenant's cache. Two load bounds, as in consistent hashing
  with bounded loads:

  * in flight (``bound``, 2.0; on a pool of two engines 1.5): an engine with more than
    ``bound`` times the pool's mean in-flight requests takes nothing new, whatever it holds:
    the latency guard;
  * requests routed (``rate_bound``, 1.1): each engine's count of requests routed to it,
    decayed with a ``RATE_HALF_LIFE_S`` half-life. The engine with the longest match wins
    among those under ``rate_bound`` times the mean count, unless an engine over it matches
    ``STAY_BLOCKS`` more (or twice as much): a request only moves when moving is cheap. What
    moves are the new conversations of a large tenant, whose system prompt other engines hold
    too; what stays is a small tenant's only copy and a short conversation.

  An in-flight bound alone spilled on momentary peaks (an engine at 7 in flight against a mean
  of 4), each spill a cold copy of some tenant's prompt elsewhere, and still left the request
  totals at max/mean 1.2-1.27: bench/routing.py measured 95.5-96 % of the workload's possible
  hit rate that way, and 96-98 % at 1.11-1.19 with both bounds (the rest is mostly requests
  that arrive while the first of their prefix is still in prefill, a miss on any engine).
  A prompt no engine matches goes where rendezvous hashing of its first block (the tenant and
  the start of its prompt) ranks the engines, the first under the bounds: every gateway
  process ranks alike, so a prefix that one process sent to an engine is sent there by the
  others too, though their indexes never saw it (see "Many processes" below).
- ``least_load``: fewest in-flight + queued requests.
- ``round_robin``.

The router is pure Python state per process; it imports nothing from Django. Engines come from
the fleet registry; loads are the router's own in-flight counts, the other gateway processes'
(``observe_peers``) and the last scraped queue.

Many processes. Each gateway process has its own router, prefix indexes and in-flight counts.
Three things keep N processes routing as one would: the rendezvous fallback (above), which makes
a new prefix's engine a function of the prefix and the engine set alone; the load bounds
computed on every process's in-flight and routed requests (``observe_peers``); and the other
processes' placements (``observe_routes``: blocks of each prompt they routed, the deepest among
them, and the engine), so the next turn of a conversation another process placed, moved by a
bound or not, goes where its previous turn is cached. ``engine_adapter.load_share`` exchanges
the loads through Redis every ``TOLLGATE_ROUTER_SHARE_S`` and looks a prompt's placements up
before it is routed. bench/routing.py ``--processes`` measures the hit rate of the same
workload through N routers against one.

What is offered where (the fleet spec's pools) is known apart from which engines run: a model
offered in a region whose engines are all down, stopped or not started yet is ``NoCapacity``
(retry: 503), while a model not offered in the allowed regions at all is ``ModelNotServed``
(404). Either way nothing is sent outside the allowed regions.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from engine_adapter.types import EngineInfo, EngineLoad, ModelNotServed, ModelTraits, NoCapacity

BLOCK_CHARS = 64  # ~16 tokens per block: fine enough for system prompts, cheap to hash
PEER_HINTS = 65536  # the other processes' placements remembered (block -> engine)
RATE_HALF_LIFE_S = 30.0  # requests routed to an engine count half after this long
STAY_BLOCKS = 8  # blocks (~128 tokens) of match a request keeps over the rate bound
POLICIES = ("cache_aware", "least_load", "round_robin")


def prefix_blocks(namespace: str, text: str, *, limit: int = 512) -> list[bytes]:
    """Return the chained block hashes of ``text`` within a tenant's ``namespace``."""
    digest = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
    blocks = []
    for start in range(0, min(len(text), limit * BLOCK_CHARS), BLOCK_CHARS):
        chunk = text[start:start + BLOCK_CHARS]
        if len(chunk) < BLOCK_CHARS:
            break  # a partial block is not a reusable prefix yet
        digest = hashlib.blake2b(digest + chunk.encode(), digest_size=16).digest()
        blocks.append(digest)
    return blocks


def published_blocks(blocks: Sequence[bytes]) -> list[bytes]:
    """Return the blocks of a routed prompt whose placement is told to the other processes:
    the deepest (the next turn of its conversation extends it) and those at depths 2**k (a
    shared system prompt of any length is found at most half its length short)."""
    depths = {len(blocks)}
    depth = 1
    while depth < len(blocks):
        depths.add(depth)
        depth *= 2
    return [blocks[d - 1] for d in sorted(depths, reverse=True)]


def _rendezvous(block: bytes, engine_id: str) -> bytes:
    """Return the engine's rendezvous score for a prefix (highest wins): the same in every
    process, and adding or removing an engine moves only the prefixes it wins or held."""
    return hashlib.blake2b(block + engine_id.encode(), digest_size=8).digest()


class PrefixIndex:
    """An LRU set of block hashes an engine probably still holds in its KV cache."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = max(16, capacity_blocks)
        self.blocks: OrderedDict[bytes, None] = OrderedDict()

    def match(self, blocks: Sequence[bytes]) -> int:
        n = 0
        for block in blocks:
            if block not in self.blocks:
                break
            n += 1
        return n

    def insert(self, blocks: Sequence[bytes]) -> None:
        for block in blocks:
            self.blocks[block] = None
            self.blocks.move_to_end(block)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


@dataclass
class Decision:
    engine: EngineInfo
    matched_blocks: int
    policy: str


class Router:
    """Route requests over a set of engines with one of ``POLICIES``."""

    def __init__(self, engines: Iterable[EngineInfo] = (), *, policy: str = "cache_aware",
                 bound: float = 2.0, rate_bound: float = 1.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose from {POLICIES}")
        self.policy = policy
        self.bound = bound
        self.rate_bound = rate_bound
        self.clock = clock
        self._lock = threading.Lock()
        self._engines: dict[str, EngineInfo] = {}
        self._offered: dict[str, set[str]] = {}  # model -> regions it is offered in
        self._traits: dict[str, ModelTraits] = {}
        self._healthy: set[str] = set()
        self._inflight: dict[str, int] = {}
        self._peer_inflight: dict[str, int] = {}  # the other processes', from load_share
        # requests routed per engine, decayed (count, when): this process's and the others'
        self._rate: dict[str, tuple[float, float]] = {}
        self._peer_rate: dict[str, float] = {}
        self._scraped: dict[str, EngineLoad] = {}
        self._index: dict[str, PrefixIndex] = {}
        # placements to tell the other processes (drained by load_share), and theirs
        self._routed: deque[tuple[bytes, str]] = deque(maxlen=4096)
        self._peer_routes: OrderedDict[bytes, str] = OrderedDict()
        self.on_route: Callable[[], None] | None = None  # called after each placement
        self._rr = itertools.count()
        self.set_engines(engines)

    # -- fleet state -------------------------------------------------------------------------

    def set_engines(self, engines: Iterable[EngineInfo], *,
                    healthy: Iterable[str] | None = None,
                    offered: Mapping[str, Iterable[str]] | None = None,
                    traits: Mapping[str, ModelTraits] | None = None) -> None:
        """Replace the known engines (all healthy unless ``healthy`` names a subset), where
        each model is offered (``offered``: model -> regions, whether or not an engine runs
        there; the engines' own models and regions are always offered) and what each model
        is (``traits``; a model not named there is a chat model with no known vocabulary)."""
        with self._lock:
            self._traits = dict(traits or {})
            engines = list(engines)
            self._engines = {e.engine_id: e for e in engines}
            self._healthy = set(healthy) if healthy is not None else set(self._engines)
            self._offered = {model: set(regions) for model, regions in (offered or {}).items()}
            for e in engines:
                self._offered.setdefault(e.model, set()).add(e.region)
            for e in engines:
                self._inflight.setdefault(e.engine_id, 0)
                # ~4 characters a token; keep as many blocks as the engine's KV cache holds.
                blocks = e.max_total_tokens * 4 // BLOCK_CHARS
                if e.engine_id not in self._index:
                    self._index[e.engine_id] = PrefixIndex(blocks)

    def mark(self, engine_id: str, *, healthy: bool) -> None:
        with self._lock:
            (self._healthy.add if healthy else self._healthy.discard)(engine_id)

    def observe_load(self, engine_id: str, load: EngineLoad) -> None:
        with self._lock:
            self._scraped[engine_id] = load

    def observe_peers(self, inflight: Mapping[str, int],
                      routed: Mapping[str, float] | None = None) -> None:
        """Take the other gateway processes' in-flight requests per engine and their decayed
        counts of requests routed (``routed_rates``), replacing the last view (empty mappings
        when there are none or their view is lost)."""
        with self._lock:
            self._peer_inflight = dict(inflight)
            self._peer_rate = dict(routed or {})

    def routed_rates(self) -> dict[str, float]:
        """Return this process's decayed count of requests routed per engine (for the others)."""
        with self._lock:
            now = self.clock()
            rates = {engine_id: self._decayed(engine_id, now) for engine_id in self._rate}
        return {engine_id: round(v, 3) for engine_id, v in rates.items() if v >= 0.001}

    def _decayed(self, engine_id: str, now: float) -> float:
        count, at = self._rate.get(engine_id, (0.0, now))
        return count * 0.5 ** ((now - at) / RATE_HALF_LIFE_S)

    def rate(self, engine_id: str) -> float:
        """Return the engine's decayed count of requests routed, by every process."""
        return self._decayed(engine_id, self.clock()) + self._peer_rate.get(engine_id, 0.0)

    def observe_routes(self, routes: Iterable[tuple[bytes, str]]) -> None:
        """Take placements the other gateway processes made: (a block of a prompt they
        routed, the engine it went to). Remembered LRU, up to ``PEER_HINTS``."""
        with self._lock:
            hints = self._peer_routes
            for block, engine_id in routes:
                hints[block] = engine_id
                hints.move_to_end(block)
            while len(hints) > PEER_HINTS:
                hints.popitem(last=False)

    def routed_hints(self) -> int:
        """Return how many of the other processes' placements this router remembers."""
        return len(self._peer_routes)

    def drain_routed(self) -> list[tuple[bytes, str]]:
        """Take this process's placements since the last call (for the other processes)."""
        with self._lock:
            routed = list(self._routed)
            self._routed.clear()
            return routed

    def inflight_counts(self) -> dict[str, int]:
        """Return this process's in-flight requests per engine (engines with none left out)."""
        with self._lock:
            return {engine_id: n for engine_id, n in self._inflight.items() if n}

    def models(self) -> set[str]:
        """Return the models offered somewhere (their engines may all be down)."""
        return {model for model, regions in self._offered.items() if regions}

    def traits(self, model: str) -> ModelTraits:
        """Return what ``model`` is (an embedding model or not, its vocabulary if known)."""
        return self._traits.get(model, ModelTraits())

    def regions_of(self, model: str) -> set[str]:
        """Return the regions ``model`` is offered in (their engines may all be down)."""
        return set(self._offered.get(model, ()))

    def scraped_load(self, engine_id: str) -> EngineLoad | None:
        """Return the engine's last scraped load (None until the health task has seen it)."""
        return self._scraped.get(engine_id)

    def load(self, engine_id: str) -> int:
        scraped = self._scraped.get(engine_id)
        return (self._inflight.get(engine_id, 0) + self._peer_inflight.get(engine_id, 0)
                + (scraped.queued if scraped else 0))

    def candidates(self, model: str, allowed_regions: set[str] | None) -> list[EngineInfo]:
        """Return healthy engines of ``model`` in ``allowed_regions`` (None: any region).

        Raise ``ModelNotServed`` if the model is not offered in those regions at all, and
        ``NoCapacity`` if it is but none of its engines there is healthy.
        """
        offered = self._offered.get(model, set())
        if allowed_regions is not None:
            offered = offered & allowed_regions
        if not offered:
            # the same words whether it runs elsewhere or nowhere: nothing about other regions
            raise ModelNotServed(f"The model {model!r} is not offered in the allowed regions.")
        ok = [e for e in self._engines.values() if e.model == model
              and e.engine_id in self._healthy
              and (allowed_regions is None or e.region in allowed_regions)]
        if not ok:
            where = ", ".join(sorted(allowed_regions)) if allowed_regions else "any region"
            raise NoCapacity(f"No healthy engine for {model!r} in the allowed regions "
                             f"({where}); the request was not sent anywhere else.")
        return ok

    # -- routing -----------------------------------------------------------------------------

    def choose(self, *, model: str, namespace: str, prompt: str,
               allowed_regions: set[str] | None = None,
               exclude: Iterable[str] = ()) -> Decision:
        """Pick an engine and count the request in flight on it (call ``release`` after)."""
        with self._lock:
            excluded = set(exclude)
            pool = [e for e in self.candidates(model, allowed_regions)
                    if e.engine_id not in excluded]
            if not pool:
                raise NoCapacity(f"Every engine for {model!r} in the allowed regions failed.")
            blocks = prefix_blocks(namespace, prompt) if self.policy == "cache_aware" else []
            engine, matched = self._pick(pool, blocks)
            engine_id = engine.engine_id
            self._inflight[engine_id] = self._inflight.get(engine_id, 0) + 1
            now = self.clock()
            self._rate[engine_id] = (self._decayed(engine_id, now) + 1, now)
            if blocks:
                self._index[engine_id].insert(blocks)
                self._routed.extend((block, engine_id) for block in published_blocks(blocks))
        if blocks and self.on_route is not None:
            self.on_route()
        return Decision(engine, matched, self.policy)

    def _pick(self, pool: list[EngineInfo], blocks: list[bytes]) -> tuple[EngineInfo, int]:
        if self.policy == "round_robin":
            return pool[next(self._rr) % len(pool)], 0
        loads = {e.engine_id: self.load(e.engine_id) for e in pool}
        rates = {e.engine_id: self.rate(e.engine_id) for e in pool}
        # Ties (an idle pool) go to the engine that has been given the least work lately, so
        # sequential traffic of many tenants spreads instead of piling onto the first engine.
        least = min(pool, key=lambda e: (loads[e.engine_id], rates[e.engine_id], e.engine_id))
        if self.policy == "least_load" or not blocks:
            return least, 0
        # +1 in both bounds so an idle pool still admits affinity; a bound of n x mean on n
        # engines is none at all, so a small pool's is halfway (two engines: 1.5)
        bound = min(self.bound, (1 + len(pool)) / 2)
        cap = math.ceil(bound * (sum(loads.values()) + 1) / len(pool))
        ok = [e for e in pool if loads[e.engine_id] + 1 <= cap]
        if not ok:
            return least, 0
        matched = {e.engine_id: self._index[e.engine_id].match(blocks) for e in ok}
        if self._peer_routes:
            # another process may have placed a longer prefix of this prompt (the previous
            # turn of a conversation it served): deepest first, blocks are chained hashes
            for depth in range(len(blocks), 0, -1):
                engine_id = self._peer_routes.get(blocks[depth - 1])
                if engine_id in matched:
                    matched[engine_id] = max(matched[engine_id], depth)
                    break
        rate_cap = self.rate_bound * (sum(rates.values()) + 1) / len(pool)
        under = [e for e in ok if rates[e.engine_id] + 1 <= rate_cap]

        def best_of(engines: list[EngineInfo]) -> EngineInfo:
            return max(engines, key=lambda e: (matched[e.engine_id], -rates[e.engine_id],
                                               -loads[e.engine_id], e.engine_id))

        best = best_of(ok)
        if under:
            best_under = best_of(under)
            # cheap: less than STAY_BLOCKS and less than half of what it has where it is (a
            # short conversation, all of it under STAY_BLOCKS, is not moved for nothing)
            loss = matched[best.engine_id] - matched[best_under.engine_id]
            if loss < min(STAY_BLOCKS, (matched[best.engine_id] + 1) // 2):
                best = best_under
        if matched[best.engine_id] == 0:  # a prefix new to this process: where all send it
            best = max(under or ok, key=lambda e: _rendezvous(blocks[0], e.engine_id))
        return best, matched[best.engine_id]

    def release(self, engine_id: str) -> None:
        """The request on ``engine_id`` finished (in any way)."""
        with self._lock:
            self._inflight[engine_id] = max(0, self._inflight.get(engine_id, 0) - 1)

    def inflight(self, engine_id: str) -> int:
        return self._inflight.get(engine_id, 0)
