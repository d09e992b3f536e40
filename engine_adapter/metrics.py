"""Parse an engine's Prometheus /metrics into the load figures the router uses."""

from __future__ import annotations

NAMES = {
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "queued",
    "sglang:token_usage": "token_usage",
    "sglang:cache_hit_rate": "cache_hit_rate",
    "sglang:max_running_requests": "max_running",
}


def parse_engine_load(text: str) -> dict[str, float]:
    """Return {running, queued, token_usage, cache_hit_rate} summed over label sets."""
    load: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        key = NAMES.get(name)
        if key is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        load[key] = load.get(key, 0.0) + value
    return load
