"""Metrics of the accounts app: where API-key lookups were answered.

A key lookup the cache cannot answer is a PostgreSQL query; ``source="database"`` rising with
failed authentications (401 and 429 ``too_many_failed_authentications`` in
``tollgate_gateway_requests_total``) is a client trying keys that do not exist.
"""

from __future__ import annotations

from prometheus_client import Counter

KEY_LOOKUPS = Counter(
    "tollgate_api_key_lookups_total",
    "API-key lookups, by where they were answered: near (the web process's own copy of the "
    "cache), cache (a key cached in Redis), negative_cache (a cached 'no such key'), database "
    "(a PostgreSQL query).", ["source"])
for _source in ("near", "cache", "negative_cache", "database"):
    KEY_LOOKUPS.labels(_source)
