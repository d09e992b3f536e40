"""Fixtures of the metering tests: priced models, a keyed org, isolated stream and spool.

Each test gets its own stream key and spool directory, so a consumer left over from another
test can never take its events. Processes of ours (consumers, appenders) get the same settings
through ``TOLLGATE_*`` environment variables.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest
from django.db import connection

from metering import stream

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("test-model", "big-model")


@pytest.fixture(autouse=True)
def metering_isolation(settings, tmp_path) -> Iterator[None]:
    settings.METERING_STREAM_KEY = f"tg:usage:test:{uuid.uuid4().hex[:10]}"
    settings.METERING_SPOOL_DIR = str(tmp_path / "spool")
    settings.METERING_REDIS_URL = settings.REDIS_URL
    stream.reset_clients()
    yield
    stream.reset_clients()


@pytest.fixture
def priced(db):
    """Return the default USD price book pricing ``test-model`` and ``big-model``."""
    from tests.factories import make_price_book

    return make_price_book(prices=[
        {"model": "test-model", "input": "1.00", "output": "2.00"},
        {"model": "big-model", "input": "3.00", "output": "15.00"},
    ])


@dataclass
class Tenant:
    org: object
    project: object
    key: object
    secret: str
    project2: object
    key2: object

    def event(self, request_id: str, **overrides) -> dict:
        """Return a valid gateway usage event of this tenant."""
        event = {
            "request_id": request_id, "org_id": self.org.id, "project_id": self.project.id,
            "api_key_id": self.key.id, "model": "test-model", "region": "us-east",
            "data_zone": self.org.data_zone, "engine": "sim-0", "prompt_tokens": 1000,
            "cached_tokens": 200, "completion_tokens": 100, "queue_ms": 1, "ttft_ms": 20,
            "total_ms": 300, "event_time": datetime.now(UTC), "cost_to_serve": "0.0000123",
        }
        event.update(overrides)
        return event


@pytest.fixture
def tenant(priced) -> Tenant:
    from tests.factories import ProjectFactory, make_key

    project = ProjectFactory()
    key, secret = make_key(project, scopes=["inference", "admin"])
    project2 = ProjectFactory(organization=project.organization)
    key2, _ = make_key(project2)
    return Tenant(project.organization, project, key, secret, project2, key2)


def db_url() -> str:
    """Return the URL of the test database (for processes of ours)."""
    s = connection.settings_dict
    return (f"postgres://{s['USER'] or 'postgres'}@{s['HOST'] or '127.0.0.1'}:"
            f"{s['PORT'] or 5432}/{s['NAME']}")


def metering_env(settings, **extra: str) -> dict[str, str]:
    """Return the environment that points a child process at this test's stream and spool."""
    return {
        **os.environ, "DATABASE_URL": db_url(), "PYTHONUNBUFFERED": "1",
        "TOLLGATE_USAGE_STREAM": settings.METERING_STREAM_KEY,
        "TOLLGATE_USAGE_REDIS_URL": settings.METERING_REDIS_URL,
        "TOLLGATE_SPOOL_DIR": settings.METERING_SPOOL_DIR,
        **extra,
    }


@pytest.fixture
def manage(tmp_path) -> Iterator[Callable[..., subprocess.Popen]]:
    """Start ``manage.py <args>`` as a real process; kill leftovers at the end."""
    procs: list[subprocess.Popen] = []

    def start(*args: str, env: dict[str, str]) -> subprocess.Popen:
        log = tmp_path / f"{args[0]}-{len(procs)}.log"
        proc = subprocess.Popen(
            [sys.executable, "manage.py", *args], cwd=ROOT, env=env, text=True,
            stdout=subprocess.PIPE, stderr=open(log, "w"),  # noqa: SIM115 - the child owns it
        )
        proc.log_path = log  # type: ignore[attr-defined]
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=20)
