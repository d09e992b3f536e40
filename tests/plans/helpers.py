"""Helpers for the plans tests: build usage facts with sensible defaults."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime

from plans.rating import UsageFacts

_ids = itertools.count()
NOON = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)


def usage(org, **kw) -> UsageFacts:
    """Return one usage event of ``org`` (defaults: test-model, default tier, global zone)."""
    fields = {
        "request_id": f"req-{next(_ids)}", "org_id": org.pk, "project_id": None,
        "api_key_id": None, "model": "test-model", "region": "us-east", "data_zone": "global",
        "service_tier": "default", "capacity_source": "on_demand", "prompt_tokens": 0,
        "cached_tokens": 0, "completion_tokens": 0, "event_time": NOON,
    }
    fields.update(kw)
    return UsageFacts(**fields)
