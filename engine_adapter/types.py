"""The typed interface the rest of the platform sees: engines, calls, results, errors.

Nothing outside ``engine_adapter`` ever holds an engine URL; it holds an ``EngineInfo`` chosen
by the ``Router`` and hands it back to the ``EngineClient``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal


@dataclass(frozen=True)
class EngineInfo:
    """One engine replica as the router sees it."""

    engine_id: str
    pool: str
    model: str
    region: str
    url: str
    gpu_hourly_cost: Decimal = Decimal("0")
    gpus: int = 1
    max_total_tokens: int = 8192


@dataclass(frozen=True)
class ModelTraits:
    """What a served model is, from its pools in the spec.

    ``embedding``: its engines run with SGLang's ``--is-embedding`` and answer /v1/embeddings
    only. ``vocab_size`` (the spec's, when it gives one): the bound of the token ids a client
    may send in place of text. SGLang does not check input ids against the vocabulary, and an
    id past it fails the engine's forward pass, so with no bound known only text is taken.
    """

    embedding: bool = False
    vocab_size: int | None = None


@dataclass
class EngineLoad:
    """Scraped load of one engine (from its /metrics), refreshed by the health loop."""

    running: int = 0
    queued: int = 0
    token_usage: float = 0.0  # fraction of KV cache in use; a gauge, never money
    max_running: int | None = None
    # generated tokens per second of ONE running request (1 / the engine's mean time per
    # output token, from its own counters); None until it has finished a request
    decode_tokens_per_s: float | None = None

    @classmethod
    def from_metrics(cls, raw: dict[str, float], *, max_running: int | None = None
                     ) -> EngineLoad:
        """Build from ``metrics.parse_engine_load``'s figures; ``max_running`` when the
        metrics lack the engine's running cap (SGLang's do)."""
        return cls(running=int(raw.get("running", 0)), queued=int(raw.get("queued", 0)),
                   token_usage=float(raw.get("token_usage", 0.0)),
                   max_running=int(raw.get("max_running") or 0) or max_running,
                   decode_tokens_per_s=float(raw.get("decode_tokens_per_s") or 0) or None)

    def low_priority_slots(self, *, fraction: float, default_max_running: int = 64) -> int:
        """Return how many of the engine's running slots low-priority work may fill (>= 1)."""
        return max(1, int((self.max_running or default_max_running) * fraction))

    def spare_room(self, *, fraction: float = 1.0, default_max_running: int = 64) -> int:
        """Return how many more requests may start below ``fraction`` of the engine's slots.

        None while anything waits in its queue: low-priority work (flex, batch) only fills
        troughs, so any queue at all means there is no trough.
        """
        if self.queued > 0:
            return 0
        return max(0, self.low_priority_slots(fraction=fraction,
                                              default_max_running=default_max_running)
                   - self.running)

    def saturated(self, *, queue_factor: float) -> bool:
        """Return True when the queue holds ``queue_factor`` batches' worth of requests."""
        return self.queued >= queue_factor * max(self.max_running or self.running, 1)


@dataclass(frozen=True)
class EngineCounters:
    """An engine's own cumulative counters, as one scrape of its ``/metrics`` reported them.

    SGLang counts a request when it finishes (``observe_one_finished_request``): its prompt,
    cached and generated tokens all at once, so these move only when requests end. The last
    four feed its measured throughput: uncached prompt tokens per second of prefill forward
    (``per_stage_req_latency_seconds{stage="prefill_forward"}``) and decode tokens per second
    from the mean time per output token. Seconds are decimal strings' values, never money.
    """

    requests: int
    prompt_tokens: int
    cached_tokens: int
    generation_tokens: int
    uncached_prompt_tokens: int = 0
    prefill_seconds: Decimal = Decimal("0")
    tpot_seconds: Decimal = Decimal("0")  # sum over requests of their time per output token
    tpot_requests: int = 0

    def decreased_from(self, earlier: EngineCounters) -> bool:
        """Return whether any counter went down since ``earlier``: the engine restarted."""
        return any(getattr(self, name) < getattr(earlier, name) for name in COUNTER_FIELDS)


COUNTER_FIELDS = ("requests", "prompt_tokens", "cached_tokens", "generation_tokens",
                  "uncached_prompt_tokens", "prefill_seconds", "tpot_seconds", "tpot_requests")


@dataclass
class CallResult:
    """What one engine call produced: the engine's usage counts and timings.

    Its cost-to-serve is not known when the call ends: it is the call's share of the engine's
    GPU time over the intervals it ran in, attributed afterwards from the engine's own counters
    (``engine_adapter.cost``, ``metering.costs``).
    """

    engine: EngineInfo
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0  # all choices', reasoning included
    reasoning_tokens: int = 0  # of completion_tokens, what the reasoning parser counted
    finish_reason: str | None = None
    status: str = "ok"  # ok | client_aborted | engine_error
    error: str | None = None
    queue_ms: float = 0.0
    ttft_ms: float | None = None
    total_ms: float = 0.0
    attempts: int = 1
    response_id: str | None = None


class EngineError(Exception):
    """Base of the adapter's errors; ``status`` is what the gateway should answer."""

    status = 502
    code = "engine_error"


class NoCapacity(EngineError):
    """No healthy engine of the model in the allowed regions (never routed elsewhere)."""

    status = 503
    code = "no_capacity"


class ModelNotServed(EngineError):
    """No engine anywhere serves this model."""

    status = 404
    code = "model_not_found"


class EngineTimeout(EngineError):
    status = 504
    code = "engine_timeout"


class EngineBadRequest(EngineError):
    """The engine rejected the request as invalid (its 4xx); the client's fault, not ours."""

    status = 400
    code = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        # OpenAI names this case; SGLang and vLLM only say it in the message.
        if "context length" in message.lower():
            self.code = "context_length_exceeded"


def low_priority_share(loads: Iterable[EngineLoad | None], *, fraction: float, ours: int,
                       default_max_running: int = 64) -> int:
    """Return how many low-priority requests of one caller may be running at once now.

    Low-priority work (batch) may fill ``fraction`` of each engine's running slots, less
    what interactive traffic uses there; ``ours`` is how many of the caller's requests are
    running now (the engines count them with the rest). An engine with anything in its
    queue, or whose load is unknown (None: it did not answer), offers nothing: there is no
    trough to fill.
    """
    budget = running = 0
    for load in loads:
        if load is None or load.queued > 0:
            continue
        budget += load.low_priority_slots(fraction=fraction,
                                          default_max_running=default_max_running)
        running += load.running
    return max(0, budget - max(0, running - ours))
