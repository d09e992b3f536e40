"""A live gateway for /v1 tests: uvicorn serving the real ASGI app on the test database, in
front of simulated engines registered as a fleet, so the official ``openai`` SDK talks HTTP.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
from django.db import connection

from engine_adapter.choices import EngineStatus, Launch
from engine_adapter.models import EngineInstance, Pool
from engine_adapter.sim.testing import FAST_RATES, SimProcess, free_port, start_sim

ROOT = Path(__file__).resolve().parents[2]


def test_database_url() -> str:
    s = connection.settings_dict
    return f"postgres://{s['USER'] or 'postgres'}@{s['HOST']}:{s['PORT']}/{s['NAME']}"


@dataclass
class LiveGateway:
    url: str
    process: subprocess.Popen
    log_path: Path
    sims: dict[str, SimProcess] = field(default_factory=dict)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def register_engine(sim: SimProcess, *, pool: str, region: str, zone: str,
                    gpu_hourly_cost: str = "2.00", **fields: object) -> EngineInstance:
    """Register a running simulator as the one engine of ``pool`` (``fields``: more of the
    pool's columns, e.g. ``extra_args=["--is-embedding"]`` for an embedding pool)."""
    p, _ = Pool.objects.get_or_create(name=pool, defaults={
        "model": sim.model, "region": region, "zone": zone, "launch": Launch.EXTERNAL,
        "gpu_hourly_cost": Decimal(gpu_hourly_cost), "external_urls": [sim.base_url],
        **fields})
    replica = p.instances.count()
    return EngineInstance.objects.create(pool=p, replica=replica, engine_id=f"{pool}-{replica}",
                                         url=sim.base_url, status=EngineStatus.HEALTHY)


def start_gateway(tmp_path: Path, env: dict[str, str] | None = None, *,
                  host: str = "127.0.0.1") -> LiveGateway:
    port = free_port()
    log_path = tmp_path / f"gateway-{port}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "billing_platform.asgi:application", "--host",
         host, "--port", str(port), "--lifespan", "on", "--no-access-log"],
        cwd=ROOT, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
        env={**os.environ, "DATABASE_URL": test_database_url(),
             "TOLLGATE_FLEET_REFRESH_S": "0.2", **(env or {})},
    )
    gateway = LiveGateway(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{gateway.url}/v1/models", timeout=1)
            return gateway
        except httpx.HTTPError:
            if proc.poll() is not None:
                break
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"gateway did not start:\n{gateway.log()}")


def stop_gateway(gateway: LiveGateway) -> None:
    gateway.process.terminate()
    try:
        gateway.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        gateway.process.kill()


GATEWAY_MODELS = ("small", "big-us-only", "slow", "doomed")


def drain_usage() -> None:
    """Ingest everything on the usage stream into PostgreSQL (rated, rolled up)."""
    from metering.ingest import Ingestor

    Ingestor(block_ms=100).run(drain=True)


@pytest.fixture
def live_gateway(transactional_db, tmp_path, metering_stream, gateway_env
                 ) -> Iterator[LiveGateway]:
    """Two simulated engines of ``small`` (us-east, eu-west) behind a live gateway."""
    from tests.factories import make_price_book

    make_price_book(prices=[{"model": m, "input": "0.50", "output": "1.50"}
                            for m in GATEWAY_MODELS])
    sims = {
        "us": start_sim(served_model_name="small", **FAST_RATES),
        "eu": start_sim(served_model_name="small", **FAST_RATES),
    }
    register_engine(sims["us"], pool="small-us", region="us-east", zone="us")
    register_engine(sims["eu"], pool="small-eu", region="eu-west", zone="eu")
    gateway = start_gateway(tmp_path, env={**metering_stream, **gateway_env})
    gateway.sims = sims
    yield gateway
    stop_gateway(gateway)
    for sim in sims.values():
        sim.stop()
