"""The simulated engine core: admission queue, running cap, prefix cache and time model.

This is what makes the simulator useful beyond a canned HTTP stub. Requests wait while the
running set is full (higher ``priority`` first, FIFO within a priority, as SGLang's priority
scheduling does), take prefill time for the tokens the radix cache does not hold, then decode
one token per ``1 / decode_tokens_per_s`` seconds. Every running request pins its cache path;
finished requests insert prompt and output so later requests with the same prefix hit. Faults
(errors, stalls, crashes, cut streams, a hung scheduler) are decided here so every endpoint
behaves alike.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import os
import random
import time
from collections.abc import AsyncIterator, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine_adapter.sim.config import Faults, SimConfig
from engine_adapter.sim.radix import Node, RadixCache
from engine_adapter.sim.stats import Stats
from engine_adapter.sim.tokenizer import EOS_TOKEN_ID, completion_stream, piece_id, split_pieces

START_ORDER_KEEP = 1000
CRASH_EXIT_CODE = 17


@dataclass(eq=False)
class SimRequest:
    """One generation request and its progress through the engine."""

    rid: str
    prompt_ids: list[int]
    max_new_tokens: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    priority: int = 0
    namespace: Hashable = None
    request_seed: int | None = None
    # the text a grammar makes the engine write (``sim.structured``), instead of free text
    fixed_text: str | None = None
    log_metrics: bool = True  # SGLang's flag: False for health probes, which count nowhere
    # progress
    state: str = "new"  # new -> waiting -> running -> finished
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: dict[str, Any] | None = None
    created_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished_at: float | None = None
    prefilled: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    aborted: bool = False
    _node: Node | None = None
    _sleep: asyncio.Future[None] | None = None  # resolved when a timed sleep must end early
    _private_tokens: int = 0
    _uncached: int = 0

    @property
    def e2e_latency(self) -> float:
        """Seconds from arrival to finish (or to now while running)."""
        return (self.finished_at or time.monotonic()) - self.created_at

    def abort(self, message: str = "Abort request") -> None:
        """Ask the engine to stop this request at its next step."""
        if self.finish_reason is None:
            self.finish_reason = {"type": "abort", "message": message}
        self.aborted = True
        self.wake.set()
        _resolve(self._sleep)


def _resolve(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


class Engine:
    """Scheduler, KV accounting and fault decisions of one simulated engine."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.faults: Faults = config.faults or Faults()
        self.cache = RadixCache(config.max_total_tokens)
        self.stats = Stats()
        self.started_at = time.time()
        self.running: set[SimRequest] = set()
        self.num_waiting = 0
        self.private_tokens = 0
        self._waiting: list[tuple[int, int, SimRequest]] = []
        self._seq = itertools.count()
        self._by_rid: dict[str, set[SimRequest]] = {}
        self._fault_rng = random.Random(config.seed)  # noqa: S311 - fault dice, not crypto
        self._requests_since_faults = 0
        self._hung_waiters: set[asyncio.Future[None]] = set()

    # --- faults -----------------------------------------------------------------------------

    def set_faults(self, changes: dict[str, Any]) -> None:
        """Apply fault settings; setting ``crash_after`` restarts its count from now."""
        for name, value in changes.items():
            setattr(self.faults, name, value)
        if "crash_after" in changes:
            self._requests_since_faults = 0
        if not self.faults.hang:  # the scheduler steps again: everything frozen resumes
            waiters, self._hung_waiters = self._hung_waiters, set()
            for waiter in waiters:
                _resolve(waiter)
            self._schedule()

    async def _while_hung(self, req: SimRequest | None = None) -> None:
        """Block while the hang fault is on (or until ``req`` is aborted)."""
        loop = asyncio.get_running_loop()
        while self.faults.hang and not (req is not None and req.aborted):
            wake = loop.create_future()
            self._hung_waiters.add(wake)
            if req is not None:
                req._sleep = wake  # abort() resolves it
            try:
                await wake
            finally:
                self._hung_waiters.discard(wake)
                if req is not None:
                    req._sleep = None

    async def health_check(self, *, timeout_s: float) -> bool:
        """Return whether the scheduler answers within ``timeout_s``, as SGLang's probe judges.

        SGLang's scheduler does not queue a probe behind work: while anything runs or waits,
        it acknowledges the probe on its next step (the running requests carry the health
        signal); an idle one runs a real 1-token generation of input ``[0]``. A hung scheduler
        does neither.
        """
        try:
            async with asyncio.timeout(timeout_s):
                await self._while_hung()
                if not self.idle:
                    return True
                probe = SimRequest(rid=f"HEALTH_CHECK_{os.urandom(16).hex()}", prompt_ids=[0],
                                   max_new_tokens=1, ignore_eos=True, log_metrics=False)
                async for _ in self.generate(probe, paced=False):
                    pass
                return probe.finish_reason is not None and not probe.aborted
        except TimeoutError:
            return False

    def count_request(self) -> bool:
        """Count one generation request; crash if due; return True if it must fail (500)."""
        self.stats.requests += 1
        self._requests_since_faults += 1
        crash_after = self.faults.crash_after
        if crash_after is not None and self._requests_since_faults >= crash_after:
            # A crashed engine does not flush buffers or answer: exit the process on the spot.
            os._exit(CRASH_EXIT_CODE)
        if self.faults.error_rate > 0 and self._fault_rng.random() < self.faults.error_rate:
            self.stats.errors_injected += 1
            return True
        return False

    # --- memory -----------------------------------------------------------------------------

    @property
    def used_tokens(self) -> int:
        """KV tokens held: the radix tree plus tokens private to running requests."""
        return self.cache.tree_tokens + self.private_tokens

    @property
    def token_usage(self) -> float:
        """Fraction of capacity that cannot be freed by eviction (SGLang's token_usage)."""
        pinned = self.used_tokens - self.cache.evictable_tokens
        return pinned / self.config.max_total_tokens

    def _make_room(self, tokens: int) -> None:
        over = self.used_tokens + tokens - self.config.max_total_tokens
        if over > 0:
            self.cache.evict(over)

    # --- scheduling -------------------------------------------------------------------------

    def _queue_key(self, priority: int) -> int:
        return priority if self.config.low_priority_values_first else -priority

    def _schedule(self) -> None:
        if self.faults.hang:
            return  # a hung scheduler starts nothing
        while self._waiting and len(self.running) < self.config.max_running_requests:
            _, _, req = self._waiting[0]
            if req.state != "waiting":
                heapq.heappop(self._waiting)
                continue
            matched, node = self.cache.match_prefix(req.namespace, req.prompt_ids[:-1])
            uncached = len(req.prompt_ids) - matched
            pinned = self.used_tokens - self.cache.evictable_tokens
            if self.running and pinned + uncached > self.config.max_total_tokens:
                break  # wait for memory, as SGLang does when the KV pool is full
            heapq.heappop(self._waiting)
            self.num_waiting -= 1
            self.cache.lock(node)
            self._make_room(uncached)
            req._node = node
            req._uncached = uncached
            req._private_tokens = uncached
            self.private_tokens += uncached
            req.cached_tokens = matched
            req.state = "running"
            self.running.add(req)
            if req.log_metrics:
                self.stats.start_order.append({"rid": req.rid, "priority": req.priority})
                self.stats.queue.observe(time.monotonic() - req.created_at)
                del self.stats.start_order[:-START_ORDER_KEEP]
            req.wake.set()

    def abort(self, rid: str | None = None, *, abort_all: bool = False) -> int:
        """Abort requests by id (or all); return how many were found."""
        if abort_all:
            targets = [req for reqs in self._by_rid.values() for req in reqs]
        else:
            targets = list(self._by_rid.get(rid or "", ()))
        for req in targets:
            req.abort()
        return len(targets)

    @property
    def idle(self) -> bool:
        """True when nothing runs or waits."""
        return not self.running and self.num_waiting == 0

    # --- the request lifecycle --------------------------------------------------------------

    async def _sleep_until(self, req: SimRequest, deadline: float) -> None:
        """Sleep until ``deadline`` or until the request is aborted.

        A timer on a bare future: ``asyncio.wait_for`` on the wake event made a task per
        step and cancelled it at every timeout, ~0.3 ms of CPU per generated token on a
        small machine, which made the simulator, not the platform, the main CPU user in
        benchmarks that share the machine with it.
        """
        delay = deadline - time.monotonic()
        if delay <= 0.001 or req.aborted:
            return
        loop = asyncio.get_running_loop()
        req._sleep = wake = loop.create_future()
        timer = loop.call_later(delay, _resolve, wake)
        try:
            await wake
        finally:
            timer.cancel()
            req._sleep = None

    async def generate(self, req: SimRequest, *, paced: bool = True) -> AsyncIterator[str]:
        """Run ``req`` through queue, prefill and decode; yield each new piece of text.

        Closing the iterator early (client gone) aborts the request and frees its slot.
        ``paced=False`` is for callers that answer only once the request is done (not
        streaming): the tokens are decoded up front and the request sleeps once, until its
        last token is due, instead of waking per token; its timing, output, counts and
        abort behaviour are the same, at a fraction of the CPU.
        """
        req.state = "waiting"
        self._by_rid.setdefault(req.rid, set()).add(req)
        heapq.heappush(self._waiting, (self._queue_key(req.priority), next(self._seq), req))
        self.num_waiting += 1
        try:
            self._schedule()
            while req.state == "waiting" and not req.aborted:
                req.wake.clear()
                await req.wake.wait()
            if req.aborted:
                return
            await self._sleep_until(
                req, time.monotonic() + req._uncached / self.config.prefill_tokens_per_s
            )
            if self.faults.hang:
                await self._while_hung(req)
            if req.aborted:
                return
            self._finish_prefill(req)
            if paced:
                async for piece in self._decode(req):
                    yield piece
                return
            started = time.monotonic()
            pieces = [piece async for piece in self._decode(req, paced=False)]
            rate = self.config.decode_tokens_per_s
            try:
                await self._sleep_until(req, started + len(req.output_ids) / rate)
                if self.faults.hang:
                    await self._while_hung(req)
            except asyncio.CancelledError:  # the client went away: an abort too
                self._cut_to_now(req, pieces, started)
                raise
            if req.aborted:
                self._cut_to_now(req, pieces, started)
                return
            for piece in pieces:
                yield piece
        finally:
            self._release(req)

    def _cut_to_now(self, req: SimRequest, pieces: list[str], started: float) -> None:
        """Abort an unpaced request, keeping what a paced one would have decoded by now."""
        done = int((time.monotonic() - started) * self.config.decode_tokens_per_s)
        extra = max(0, len(req.output_ids) - done)
        self.private_tokens -= extra
        req._private_tokens -= extra
        del req.output_ids[done:]
        req.text = "".join(pieces[:done])
        req.aborted = True
        req.finish_reason = {"type": "abort", "message": "Abort request"}

    def _finish_prefill(self, req: SimRequest) -> None:
        node, _ = self.cache.insert(req.namespace, req.prompt_ids)
        self.cache.lock(node)
        if req._node is not None:
            self.cache.unlock(req._node)
        req._node = node
        self.private_tokens -= req._private_tokens
        req._private_tokens = 0
        req.prefilled = True
        if not req.log_metrics:
            return
        self.stats.prompt_tokens += len(req.prompt_ids)
        self.stats.cached_tokens += req.cached_tokens
        self.stats.finished.prefill_forward.observe(
            req._uncached / self.config.prefill_tokens_per_s)
        if req.cached_tokens:
            self.stats.cache_hit_requests += 1

    async def _decode(self, req: SimRequest, *, paced: bool = True) -> AsyncIterator[str]:
        config = self.config
        limit = config.context_length - len(req.prompt_ids)
        if req.max_new_tokens is not None:
            limit = min(limit, req.max_new_tokens)
        started = time.monotonic()
        last = started
        tokens = _fixed_stream(req.fixed_text) if req.fixed_text is not None else (
            completion_stream(server_seed=config.seed, request_seed=req.request_seed,
                              prompt_ids=req.prompt_ids, ignore_eos=req.ignore_eos))
        longest_stop = max((len(s) for s in req.stop), default=0)
        for step, (token_id, piece) in enumerate(tokens, start=1):
            if step > limit:
                req.finish_reason = {"type": "length", "length": limit}
                return
            due = started + step / config.decode_tokens_per_s
            if paced:
                await self._sleep_until(req, due)
                if self.faults.hang:
                    await self._while_hung(req)
            if step % 64 == 0:
                await asyncio.sleep(0)  # let other requests and disconnects be seen
            if req.aborted:
                return
            now = time.monotonic() if paced else due  # unpaced: when the token is due
            if req.first_token_at is None:
                req.first_token_at = now
                if req.log_metrics:
                    self.stats.ttft.observe(now - req.created_at)
            elif req.log_metrics:
                self.stats.itl.observe(now - last)
            last = now
            self._make_room(1)
            self.private_tokens += 1
            req._private_tokens += 1
            req.output_ids.append(token_id)
            if req.log_metrics:
                self.stats.generation_tokens += 1
            if token_id == EOS_TOKEN_ID:
                req.finish_reason = {"type": "stop", "matched": EOS_TOKEN_ID}
                return
            if token_id in req.stop_token_ids:
                req.finish_reason = {"type": "stop", "matched": token_id}
                return
            candidate = req.text + piece
            if longest_stop:
                window = max(0, len(req.text) - longest_stop + 1)
                hits = [(candidate.find(s, window), s) for s in req.stop]
                hits = [(at, s) for at, s in hits if at >= 0]
                if hits:
                    at, matched = min(hits)
                    delta = candidate[len(req.text) : at] if at > len(req.text) else ""
                    req.text = candidate[: max(at, len(req.text))]
                    if delta:
                        yield delta
                    req.finish_reason = {"type": "stop", "matched": matched}
                    return
            req.text = candidate
            yield piece

    def _release(self, req: SimRequest) -> None:
        if req.finish_reason is None:
            req.abort()
        was_aborted = req.finish_reason is not None and req.finish_reason["type"] == "abort"
        if req.state == "waiting":
            self.num_waiting -= 1  # lazily dropped from the heap by _schedule
        elif req.state == "running":
            self.running.discard(req)
            if req.prefilled:
                node, _ = self.cache.insert(req.namespace, req.prompt_ids + req.output_ids)
                self.cache.lock(node)
                if req._node is not None:
                    self.cache.unlock(req._node)
                self.cache.unlock(node)
            elif req._node is not None:
                self.cache.unlock(req._node)
            req._node = None
            self.private_tokens -= req._private_tokens
            req._private_tokens = 0
            self._make_room(0)
        req.state = "finished"
        req.finished_at = time.monotonic()
        if req.log_metrics and was_aborted:
            self.stats.aborted += 1
        elif req.log_metrics:
            self.stats.completed += 1
            self.stats.e2e.observe(req.e2e_latency)
        if req.log_metrics:
            self.stats.finished.observe(req)
        rids = self._by_rid.get(req.rid)
        if rids is not None:
            rids.discard(req)
            if not rids:
                del self._by_rid[req.rid]
        self._schedule()

    def flush_cache(self) -> bool:
        """Drop the prefix cache if the engine is idle; return whether it did."""
        if not self.idle:
            return False
        self.cache.reset()
        return True


def _fixed_stream(text: str) -> Iterator[tuple[int, str]]:
    """Yield (token id, piece) of a grammar's text, then EOS: a grammar that reaches its end
    stops the generation whatever ``ignore_eos`` says, as SGLang's does."""
    for piece in split_pieces(text):
        yield piece_id(piece), piece
    yield EOS_TOKEN_ID, ""
