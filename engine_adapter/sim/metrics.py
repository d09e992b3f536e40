"""Prometheus text exposition of the simulator, with SGLang's metric names and labels.

The fleet manager scrapes ``/metrics`` of real SGLang engines to feed the router (running and
queued requests, token usage) and its cumulative counters (reconciliation against the metered
usage, measured prefill and decode throughput for cost-to-serve); the simulator publishes the
same names with the same ``model_name`` label, counted when SGLang counts them, so one scraper
serves both. Written by hand to keep the simulator's
dependencies to starlette and uvicorn.
"""

from __future__ import annotations

from engine_adapter.sim.engine import Engine
from engine_adapter.sim.stats import Histogram


def _labels(model: str, extra: str = "") -> str:
    escaped = model.replace("\\", "\\\\").replace('"', '\\"')
    return "{" + extra + f'model_name="{escaped}"' + "}"


def _histogram(lines: list[str], name: str, doc: str, hist: Histogram, model: str,
               extra: str = "") -> None:
    lines.append(f"# HELP {name} {doc}")
    lines.append(f"# TYPE {name} histogram")
    lines.append(f"{name}_sum{_labels(model, extra)} {hist.total}")
    for bound, count in zip(hist.buckets, hist.cumulative(), strict=True):
        labels = _labels(model, extra + 'le="' + str(bound) + '",')
        lines.append(f"{name}_bucket{labels} {float(count)}")
    labels = _labels(model, extra + 'le="+Inf",')
    lines.append(f"{name}_bucket{labels} {float(hist.count)}")
    lines.append(f"{name}_count{_labels(model, extra)} {float(hist.count)}")


def render_metrics(engine: Engine) -> str:
    """Return the Prometheus text for the engine's current state."""
    model = engine.config.served_model_name
    stats = engine.stats
    hit_rate = stats.cached_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0
    lines: list[str] = []

    def sample(name: str, kind: str, doc: str, value: float) -> None:
        lines.append(f"# HELP {name} {doc}")
        lines.append(f"# TYPE {name} {kind}")
        lines.append(f"{name}{_labels(model)} {float(value)}")

    sample(
        "sglang:num_running_reqs", "gauge", "The number of running requests.", len(engine.running)
    )
    sample(
        "sglang:num_queue_reqs",
        "gauge",
        "The number of requests in the waiting queue.",
        engine.num_waiting,
    )
    sample(
        "sglang:num_used_tokens",
        "gauge",
        "The number of used tokens.",
        engine.used_tokens - engine.cache.evictable_tokens,
    )
    sample("sglang:token_usage", "gauge", "The token usage.", engine.token_usage)
    sample(
        "sglang:max_total_num_tokens",
        "gauge",
        "Maximum total number of tokens.",
        engine.config.max_total_tokens,
    )
    sample("sglang:cache_hit_rate", "gauge", "The prefix cache hit rate.", hit_rate)
    # Counted per finished request, as SGLang's tokenizer manager counts them.
    finished = stats.finished
    sample(
        "sglang:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        finished.prompt_tokens,
    )
    sample(
        "sglang:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        finished.generation_tokens,
    )
    sample(
        "sglang:cached_tokens_total",
        "counter",
        "Number of cached prompt tokens.",
        finished.cached_tokens,
    )
    sample(
        "sglang:num_requests_total", "counter", "Number of requests processed.", finished.requests
    )
    sample(
        "sglang:num_aborted_requests_total", "counter", "Number of requests aborted.", stats.aborted
    )
    _histogram(
        lines,
        "sglang:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        stats.ttft,
        model,
    )
    _histogram(
        lines,
        "sglang:e2e_request_latency_seconds",
        "Histogram of End-to-end request latency in seconds.",
        stats.e2e,
        model,
    )
    _histogram(
        lines,
        "sglang:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        stats.itl,
        model,
    )
    _histogram(
        lines,
        "sglang:queue_time_seconds",
        "Histogram of queueing time in seconds.",
        stats.queue,
        model,
    )
    _histogram(
        lines,
        "sglang:uncached_prompt_tokens_histogram",
        "Histogram of uncached (compute) prompt token length.",
        finished.uncached_prompt,
        model,
    )
    _histogram(
        lines,
        "sglang:per_stage_req_latency_seconds",
        "The latency of each stage of requests.",
        finished.prefill_forward,
        model,
        'stage="prefill_forward",',
    )
    _histogram(
        lines,
        "sglang:request_time_per_output_token_seconds",
        "Histogram of request time per output token in seconds.",
        finished.tpot,
        model,
    )
    return "\n".join(lines) + "\n"
