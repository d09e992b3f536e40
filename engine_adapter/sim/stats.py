"""The simulator's counters: what ``/sim/stats`` and ``/metrics`` report, kept by hand so the
simulator needs no metrics library.

``Stats`` moves as work happens (arrivals, prefills, tokens); ``Finished`` counts as SGLang's
tokenizer manager counts, once per request when it finishes, so the counters reconciliation
reads (``sglang:num_requests_total`` and the token totals) and the throughput cost-to-serve
reads (prefill forward time, time per output token) mean what they mean on real SGLang.
"""

from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine_adapter.sim.engine import SimRequest

LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 25.0, 30.0,
)  # fmt: skip
# SGLang's token-count buckets (a subset of ``prompt_tokens_histogram``'s defaults)
TOKEN_BUCKETS = (
    100.0, 300.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0, 50000.0, 100000.0,
)  # fmt: skip


@dataclass
class Histogram:
    """A Prometheus histogram kept by hand, so the simulator needs no metrics library.

    ``counts[i]`` holds the observations in bucket ``i`` alone (one increment per
    observation: ITL is observed per token); ``cumulative()`` gives Prometheus' ``le`` counts.
    """

    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if len(self.counts) != len(self.buckets):
            self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        """Record one observation."""
        self.total += value
        self.count += 1
        i = bisect.bisect_left(self.buckets, value)  # the first bound >= value
        if i < len(self.counts):
            self.counts[i] += 1

    def cumulative(self) -> list[int]:
        """Return the count of observations <= each bound."""
        return list(itertools.accumulate(self.counts))


@dataclass
class Finished:
    """What SGLang's ``/metrics`` counts, counted as SGLang counts it: once per request, when
    it finishes (aborted ones too), so its counters match the usage answered per request."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    uncached_prompt: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    # per request: the seconds its prefill took, and its time per output token
    prefill_forward: Histogram = field(default_factory=Histogram)
    tpot: Histogram = field(default_factory=Histogram)

    def observe(self, req: SimRequest) -> None:
        """Count one finished request."""
        self.requests += 1
        self.prompt_tokens += len(req.prompt_ids)
        self.cached_tokens += req.cached_tokens
        self.generation_tokens += len(req.output_ids)
        self.uncached_prompt.observe(float(len(req.prompt_ids) - req.cached_tokens))
        outputs = len(req.output_ids)
        finished = req.finish_reason is not None and req.finish_reason["type"] != "abort"
        if finished and outputs > 1 and req.first_token_at is not None:
            decode_s = (req.finished_at or time.monotonic()) - req.first_token_at
            if decode_s > 0:  # SGLang's get_time_per_output_token
                self.tpot.observe(decode_s / (outputs - 1))


@dataclass
class Stats:
    """Counters the tests and ``/metrics`` read. ``requests``, ``prompt_tokens``,
    ``cached_tokens`` and ``generation_tokens`` move as work happens (arrivals, prefills,
    tokens: ``/sim/stats``); ``finished`` holds SGLang's per-finished-request counters."""

    requests: int = 0
    completed: int = 0
    aborted: int = 0
    errors_injected: int = 0
    cache_hit_requests: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    start_order: list[dict[str, Any]] = field(default_factory=list)
    ttft: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=Histogram)
    itl: Histogram = field(default_factory=Histogram)
    queue: Histogram = field(default_factory=Histogram)
    finished: Finished = field(default_factory=Finished)
