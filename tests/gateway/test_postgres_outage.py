"""PostgreSQL restarts and stops under live SDK traffic: /v1 never answers 500.

The test runs its own PostgreSQL (``billing_platform.embedded``) so it can stop it, a live
gateway on it, and a simulated engine. While PostgreSQL is away the gateway serves from its
last good fleet view and cached policies and keys, and answers a retryable 503 once the view
is older than ``TOLLGATE_FLEET_MAX_STALE_S``; after PostgreSQL returns it serves again within
seconds (its executor threads' broken connections are recycled), /v1/files and /v1/batches
included, and every served request's usage event is recorded exactly once.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import openai
import psycopg
import pytest

from billing_platform.embedded import EmbeddedPostgres, free_port, remove_state
from engine_adapter.sim.testing import FAST_RATES, start_sim
from tests.conftest import wait_until
from tests.gateway.conftest import ROOT, start_gateway, stop_gateway

MAX_STALE_S = 4  # the gateway's TOLLGATE_FLEET_MAX_STALE_S here


@pytest.fixture
def own_postgres(tmp_path):
    """A migrated PostgreSQL of this test's own, which it may stop and start."""
    pg = EmbeddedPostgres(tmp_path / "pg", free_port())
    pg.start()
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT,
                   env={**_env(), "DATABASE_URL": pg.url}, check=True, timeout=600)
    yield pg
    pg.stop(mode="immediate")
    remove_state(tmp_path / "pg")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


@dataclass
class Traffic:
    """Requests sent by the openai SDK from a thread, each answer tagged with the phase."""

    client: openai.OpenAI
    phase: str = "up"
    # (phase, HTTP status or 0 for no answer, error code)
    answers: list[tuple[str, int, str | None]] = field(default_factory=list)
    served: list[str] = field(default_factory=list)  # x-request-id of each 200
    stop: threading.Event = field(default_factory=threading.Event)

    def count(self, phase: str, status: int | None = None) -> int:
        return sum(1 for p, s, _code in list(self.answers) if p == phase
                   and (status is None or s == status))

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            phase, i = self.phase, i + 1
            try:
                if i % 2:
                    raw = self.client.chat.completions.with_raw_response.create(
                        model="small", max_tokens=4,
                        messages=[{"role": "user", "content": f"hello {i}"}])
                    raw.parse()
                else:
                    raw = self.client.chat.completions.with_raw_response.create(
                        model="small", max_tokens=4, stream=True,
                        stream_options={"include_usage": True},
                        messages=[{"role": "user", "content": f"stream {i}"}])
                    chunks = list(raw.parse())
                    assert chunks[-1].usage is not None
                self.served.append(raw.headers["x-request-id"])
                self.answers.append((phase, 200, None))
            except openai.APIStatusError as exc:
                self.answers.append((phase, exc.status_code, exc.code))
                time.sleep(0.05)
            except (openai.APIError, AssertionError) as exc:  # no answer, or a broken stream
                self.answers.append((phase, 0, repr(exc)))
                time.sleep(0.05)


def _files_and_batches(client: openai.OpenAI) -> tuple[list[str], list[str]] | None:
    """Return the ids /v1/files and /v1/batches list, or None while either answers 503."""
    try:
        return ([f.id for f in client.files.list()], [b.id for b in client.batches.list()])
    except openai.APIStatusError as exc:
        if (exc.status_code, exc.code) != (503, "service_unavailable"):
            raise
        return None


def test_postgres_restart_and_outage_under_traffic(own_postgres, tmp_path, metering_stream):
    pg = own_postgres
    sim = start_sim(served_model_name="small", **FAST_RATES)
    seeded = subprocess.run(
        [sys.executable, "tests/gateway/outage_seed.py", sim.base_url], cwd=ROOT,
        env={**_env(), "DATABASE_URL": pg.url}, check=True, timeout=120, capture_output=True,
        text=True)
    first_key, unused_key = json.loads(seeded.stdout.strip().splitlines()[-1])["keys"]
    gateway = start_gateway(tmp_path, env={
        **metering_stream, "DATABASE_URL": pg.url, "TOLLGATE_FILES_DIR": str(tmp_path / "files"),
        "TOLLGATE_FLEET_MAX_STALE_S": str(MAX_STALE_S)})
    traffic = Traffic(openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=first_key,
                                    max_retries=0, timeout=20))
    thread = threading.Thread(target=traffic.run, daemon=True)
    thread.start()
    try:
        # given traffic being served, and a file stored through /v1/files
        wait_until(lambda: traffic.count("up", 200) >= 20, timeout=60, what="traffic")
        batch_api = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=first_key,
                                  max_retries=0, timeout=20)
        stored = batch_api.files.create(file=("in.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
        listed = ([stored.id], [])
        assert _files_and_batches(batch_api) == listed

        # when PostgreSQL restarts (fast stop, start)
        traffic.phase = "restarting"
        pg.stop(mode="fast")
        pg.start()
        traffic.phase = "restarted"
        # then /v1 goes on serving
        wait_until(lambda: traffic.count("restarted", 200) >= 20, timeout=30,
                   what="requests served after the restart")
        # and so do /v1/files and /v1/batches (their connections are checked too)
        assert wait_until(lambda: _files_and_batches(batch_api), timeout=30,
                          what="/v1/files and /v1/batches after the restart") == listed

        # when PostgreSQL stays away for longer than the fleet view may be stale
        traffic.phase = "stopping"
        pg.stop(mode="fast")
        traffic.phase = "down"
        # then requests are served from the last good view, then answered 503
        wait_until(lambda: traffic.count("down", 503) >= 5, timeout=60,
                   what="503s once the fleet view is too old")
        assert traffic.count("down", 200) >= 1, "served from the last good view at first"
        assert _files_and_batches(batch_api) is None  # a 503, never a 500

        # when it comes back, /v1 serves again within seconds
        pg.start()
        traffic.phase = "back"
        wait_until(lambda: traffic.count("back", 200) >= 20, timeout=30,
                   what="requests served after PostgreSQL returned")
        assert wait_until(lambda: _files_and_batches(batch_api), timeout=30,
                          what="/v1/files and /v1/batches after the outage") == listed
        # and a key the gateway never saw (a lookup in PostgreSQL, not the key cache) works
        fresh = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=unused_key,
                              max_retries=0, timeout=20)
        assert [m.id for m in fresh.models.list()] == ["small"]
    finally:
        traffic.stop.set()
        thread.join(timeout=30)
        log = gateway.log()
        stop_gateway(gateway)
        sim.stop()

    answers = Counter((status, code) for _phase, status, code in traffic.answers)
    assert set(answers) <= {(200, None), (503, "service_unavailable")}, (answers, log[-5000:])
    # the outage was said once when it began and once when it ended, not per request
    assert 1 <= log.count("reading the fleet from PostgreSQL failed") <= 2, log[-5000:]
    assert log.count("reading the fleet from PostgreSQL failed") == log.count(
        "PostgreSQL read again"), log[-5000:]

    # and every served request's usage event is recorded exactly once
    subprocess.run([sys.executable, "manage.py", "ingest_usage", "--drain", "--block-ms", "200"],
                   cwd=ROOT, env={**_env(), **metering_stream, "DATABASE_URL": pg.url},
                   check=True, timeout=120, capture_output=True)
    with psycopg.connect(pg.url) as conn:
        recorded = [r[0] for r in conn.execute("SELECT request_id FROM usage_event")]
    assert len(recorded) == len(set(recorded))
    assert set(recorded) == set(traffic.served)


# A gateway process's database thread: one job, then (after a line on stdin) another one,
# each reporting its backend's pid or the error it met.
_JOBS = """
import sys
import django
django.setup()
from django.db import connection
from billing_platform.gateway.db_connections import ConnectionCheckingExecutor

def job():
    with connection.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        return cur.fetchone()[0]

executor = ConnectionCheckingExecutor(thread_name_prefix="gateway-db")
for _ in range(2):
    try:
        print(executor.submit(job).result(), flush=True)
    except Exception as exc:
        print(type(exc).__name__, flush=True)
    sys.stdin.readline()
"""


def test_the_first_database_job_after_a_restart_runs_without_an_error(tmp_path):
    # given a gateway database thread whose kept connection served a job
    pg = EmbeddedPostgres(tmp_path / "pg", free_port())
    pg.start()
    proc = subprocess.Popen([sys.executable, "-c", _JOBS], cwd=ROOT, text=True,
                            env={**_env(), "DATABASE_URL": pg.url}, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    try:
        first = proc.stdout.readline().strip()
        assert first.isdigit(), first
        # when PostgreSQL restarts while the connection is idle
        pg.stop(mode="fast")
        pg.start()
        proc.stdin.write("\n")
        proc.stdin.flush()
        # then the next job succeeds at once, on a new backend (no SELECT 1 sent before it:
        # the thread saw on the socket that the server had ended the old one)
        second = proc.stdout.readline().strip()
        assert second.isdigit() and second != first, (first, second)
    finally:
        proc.kill()
        proc.wait(timeout=30)
        pg.stop(mode="immediate")
        remove_state(tmp_path / "pg")
