"""A live gateway in front of engines registered as a fleet, for the cost-to-serve and
reconciliation tests: traffic through the official ``openai`` SDK over HTTP, the fleet's own
health check scraping the engines' ``/metrics`` into counter samples, the usage stream drained
into PostgreSQL by the real consumer.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from pathlib import Path

import openai
from django.utils import timezone

from engine_adapter import services as fleet
from engine_adapter.models import EngineCounterSample, EngineInstance, Pool
from engine_adapter.sim.testing import SimProcess
from tests.factories import OrganizationFactory, ProjectFactory, make_key, make_price_book
from tests.gateway.conftest import LiveGateway, register_engine, start_gateway, stop_gateway


@dataclass
class Engine:
    """An engine of the stack: its fleet id and the process serving it."""

    engine_id: str
    url: str
    process: SimProcess | None = None


@dataclass
class EngineStack:
    gateway: LiveGateway
    model: str
    engines: dict[str, Engine] = field(default_factory=dict)
    secret: str = ""

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.gateway.url}/v1", api_key=self.secret,
                             max_retries=0, timeout=120)

    def chat(self, *, tokens: int, stream: bool = False, prompt: str | None = None) -> str:
        """Send one chat completion of exactly ``tokens`` output tokens; return its request id."""
        body = {"model": self.model, "max_tokens": tokens, "extra_body": {"ignore_eos": True},
                "messages": [{"role": "user",
                              "content": prompt or f"Describe item {uuid.uuid4().hex}."}]}
        client = self.client()
        if stream:
            with client.chat.completions.with_streaming_response.create(
                    **body, stream=True, stream_options={"include_usage": True}) as raw:
                for _ in raw.iter_lines():
                    pass
                return raw.headers["x-request-id"]
        raw = client.chat.completions.with_raw_response.create(**body)
        raw.parse()
        return raw.headers["x-request-id"]

    def chat_at_once(self, sizes: list[int]) -> list[str]:
        """Send one request per size, all at once (half of them streamed)."""
        with ThreadPoolExecutor(max_workers=len(sizes)) as pool:
            futures = [pool.submit(self.chat, tokens=n, stream=i % 2 == 1)
                       for i, n in enumerate(sizes)]
            return [f.result() for f in futures]


def scrape() -> datetime:
    """Run the fleet's health check once (it scrapes every engine's counters); return when it
    had finished, having checked that each engine answered with counters."""
    before = EngineCounterSample.objects.count()
    states = fleet.fleet_health_check(restart=False)
    engines = EngineInstance.objects.exclude(status="stopped").count()
    assert EngineCounterSample.objects.count() == before + engines, states
    return timezone.now()


@contextmanager
def engine_stack(tmp_path: Path, env: dict[str, str], *, model: str,
                 engines: dict[str, tuple[SimProcess, int, str]]) -> Iterator[EngineStack]:
    """Register ``engines`` (pool name -> (process, GPUs, GPU hourly cost)), start a gateway,
    and yield the stack with a key of a fresh organization; stop the gateway at the end (the
    caller owns the engine processes)."""
    make_price_book(prices=[{"model": model, "input": "0.50", "output": "1.50"}])
    stack_engines = {}
    for pool, (process, gpus, cost) in engines.items():
        inst = register_engine(process, pool=pool, region="us-east", zone="us",
                               gpu_hourly_cost=cost)
        Pool.objects.filter(name=pool).update(gpus_per_replica=gpus,
                                              gpu_hourly_cost=Decimal(cost))
        stack_engines[inst.engine_id] = Engine(inst.engine_id, process.base_url, process)
    _key, secret = make_key(project=ProjectFactory(organization=OrganizationFactory()),
                            scopes=["inference", "batch"])
    gateway = start_gateway(tmp_path, env=env)
    try:
        yield EngineStack(gateway, model, stack_engines, secret)
    finally:
        stop_gateway(gateway)
