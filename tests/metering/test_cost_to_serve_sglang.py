"""Cost-to-serve against real SGLang on this CPU: its own ``/metrics`` (prefill forward time,
time per output token, the counters) weigh the requests, and every engine-interval's GPU time
is conserved exactly. Kept to a few short requests: the engine is slow on a small machine.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal

import pytest

from engine_adapter.sglang_cpu import is_ready, launch_spec, resolve_paths, wait_healthy
from metering import costs
from metering.choices import ThroughputSource
from metering.models import UsageCostInterval, UsageEvent
from metering.selectors import usage_event_costs
from tests.gateway.conftest import drain_usage
from tests.metering.engine_stack import engine_stack, scrape
from tests.metering.test_cost_to_serve import assert_conserved, assert_rollups_hold_the_shares

MODEL = "tiny-llama"

pytestmark = pytest.mark.skipif(
    not is_ready(), reason="the SGLang CPU environment is not set up; run "
                           "`python -m engine_adapter.sglang_cpu setup` first")


@dataclass
class _Server:
    """What ``register_engine`` needs of an engine process."""

    base_url: str
    model: str = MODEL


@pytest.fixture(scope="module")
def sglang(tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv, env = launch_spec(model_dir=resolve_paths().model_dir, port=port,
                            served_model_name=MODEL)
    log = tmp_path_factory.mktemp("sglang") / "server.log"
    with log.open("w") as out:
        server = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout=300,
                     is_alive=lambda: server.poll() is None)
        yield _Server(f"http://127.0.0.1:{port}")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)


def test_real_sglang_gpu_time_is_conserved_and_weighed_by_its_own_throughput(
        transactional_db, tmp_path, settings, metering_stream, sglang):
    settings.METERING_COST_INTERVAL_S = 1
    with engine_stack(tmp_path, metering_stream, model=MODEL,
                      engines={"cpu-sglang": (sglang, 1, "1.20")}) as stack:
        # given two short requests on real SGLang, its counters scraped around them
        started = scrape()
        short = stack.chat(tokens=8)
        long = stack.chat(tokens=16, stream=True)
        ended = scrape()
        drain_usage()
    events = {e.request_id: e for e in UsageEvent.objects.filter(request_id__in=[short, long])}
    assert [events[short].completion_tokens, events[long].completion_tokens] == [8, 16]

    # when the intervals are attributed
    costs.usage_costs_attribute(start=started - timedelta(seconds=1),
                                end=ended + timedelta(seconds=1))

    # then every interval is conserved to the microsecond, the requests got their shares
    intervals = list(UsageCostInterval.objects.filter(engine="cpu-sglang-0"))
    assert_conserved(intervals)
    got = usage_event_costs(event_ids=[e.id for e in events.values()])
    assert all(got[e.id].gpu_seconds > 0 for e in events.values())
    assert_rollups_hold_the_shares(events[short].organization_id)
    # weighed by what SGLang measured itself (prefill forward time, time per output token)
    busy = [iv for iv in intervals if iv.attributed_us]
    assert busy and all(iv.throughput_source == ThroughputSource.MEASURED for iv in busy)
    assert all(iv.prefill_tokens_per_s > 0 and iv.decode_tokens_per_s > Decimal(0)
               for iv in busy)
