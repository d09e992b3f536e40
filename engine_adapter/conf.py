"""The engine adapter's environment reads, all of them (``billing_platform/env.py`` reads the
platform's).

``engine_adapter`` imports nothing of the platform (DESIGN.md), so it cannot use the platform's
``env.py``; and part of it runs before Django does (``python -m engine_adapter.sglang_cpu
setup``), so this module imports neither Django nor django-environ. Each value is read when
asked for, so a test can change the environment of its own process (``monkeypatch.setenv``).
Unset means the default (and for the two paths, empty does too).
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def state_dir() -> Path:
    """Return where engines' logs and the CPU SGLang build live (``TOLLGATE_ROOT``)."""
    return Path(os.environ.get("TOLLGATE_ROOT") or REPO_ROOT / ".tollgate")


def fleet_spec_path() -> Path:
    """Return the fleet spec ``manage.py fleet`` loads by default (``TOLLGATE_FLEET_SPEC``)."""
    return Path(os.environ.get("TOLLGATE_FLEET_SPEC")
                or REPO_ROOT / "engine_adapter" / "fleets" / "dev.toml")


def fleet_refresh_s() -> float:
    """Return the oldest a process's view of the fleet may be (``TOLLGATE_FLEET_REFRESH_S``)."""
    return float(os.environ.get("TOLLGATE_FLEET_REFRESH_S", "2"))


def fleet_max_stale_s() -> float:
    """Return how old a process's fleet view may grow while PostgreSQL cannot be read
    (``TOLLGATE_FLEET_MAX_STALE_S``): past it, requests get a 503 instead of an old view."""
    return float(os.environ.get("TOLLGATE_FLEET_MAX_STALE_S", "300"))


def router_policy() -> str:
    """Return the routing policy of the gateway's router (``TOLLGATE_ROUTER_POLICY``)."""
    return os.environ.get("TOLLGATE_ROUTER_POLICY", "cache_aware")


def engine_health_timeout_s() -> float:
    """Return how long one health probe may take (``TOLLGATE_ENGINE_HEALTH_TIMEOUT_S``).

    SGLang answers its probe after at least a second (it polls its scheduler once a second),
    so this stays well above 1.
    """
    return float(os.environ.get("TOLLGATE_ENGINE_HEALTH_TIMEOUT_S", "5"))


def engine_unhealthy_after() -> int:
    """Return how many health checks in a row an engine may fail before it leaves routing and,
    if Tollgate launched it, is restarted (``TOLLGATE_ENGINE_UNHEALTHY_AFTER``)."""
    return max(1, int(os.environ.get("TOLLGATE_ENGINE_UNHEALTHY_AFTER", "3")))


def engine_start_timeout_s() -> float:
    """Return how long a starting engine's failed probes are not counted
    (``TOLLGATE_ENGINE_START_TIMEOUT_S``): real SGLang loads its model for minutes."""
    return float(os.environ.get("TOLLGATE_ENGINE_START_TIMEOUT_S", "600"))


def sim_health_check_timeout_s() -> float:
    """Return how long the simulator's ``/health_generate`` waits for its probe before a 503
    (``SGLANG_HEALTH_CHECK_TIMEOUT``: the simulator reads the variable real SGLang reads)."""
    return float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT") or 20)


def engine_sample_retention_s() -> float:
    """Return how long engines' scraped counters are kept (``TOLLGATE_ENGINE_SAMPLE_RETENTION_S``):
    reconciliation and cost-to-serve read the last few hours of them."""
    return float(os.environ.get("TOLLGATE_ENGINE_SAMPLE_RETENTION_S", str(3 * 86400)))
