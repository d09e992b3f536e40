"""The batch guard: a batch fills an idle fleet, and falls to its floor once interactive TTFT
(published by the gateways through Redis) says it costs interactive requests.

Real parts only: a live gateway and simulated engines, a Celery worker on the batch queue, the
TTFT signal in the test Redis written the way the gateways write it (``ttft_signal.note``).
Assertions are on counts and the guard's decisions, never on durations.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from billing_platform.gateway import ttft_signal
from billing_platform.gateway.batch.guard import Scavenger, batch_share
from billing_platform.gateway.models import BatchLine
from engine_adapter.metrics import parse_engine_load
from engine_adapter.sim.testing import start_sim
from engine_adapter.types import EngineLoad
from tests.conftest import wait_until
from tests.gateway.conftest import stop_gateway
from tests.gateway.test_batch_api import (
    MODEL,
    FakeHost,
    _start_under_a_worker,
    batch_env,
    fast_stack,
    request_line,
    runner_kept_looking,
    start_stack,
    upload,
    wait_status,
)


def slots(now: float, seconds: float = 3.0) -> list[ttft_signal.Slot]:
    return asyncio.run(ttft_signal.aslots(MODEL, seconds=seconds, now=now))


def publish(ttfts_ms: list[float], *, at: float) -> None:
    """Publish interactive TTFTs as a gateway process does: noted, then flushed to Redis."""
    async def run() -> None:
        for ms in ttfts_ms:
            ttft_signal.note(MODEL, ms, now=at)
        await ttft_signal.aflush()

    asyncio.run(run())


def running(sim) -> int:
    return int(parse_engine_load(httpx.get(f"{sim.base_url}/metrics", timeout=5).text)
               .get("running", 0))


@pytest.fixture
def stack(transactional_db, tmp_path, settings, metering_stream):
    yield from fast_stack(tmp_path, settings, metering_stream)


@pytest.fixture
def slow_sims():
    """Two engines of eight slots whose lines last a while (20 tokens at 100 tokens/s)."""
    sims = [start_sim(served_model_name=MODEL, max_running_requests=8,
                      prefill_tokens_per_s=1_000_000, decode_tokens_per_s=100)
            for _ in range(2)]
    yield sims
    for sim in sims:
        sim.stop()


def test_a_v1_request_publishes_its_ttft_and_ends_the_idle_share(stack):
    # given a guard that saw no interactive request: the fleet is idle, batch may fill it
    guard = Scavenger.from_settings()
    assert guard.decide(slots(time.time()), queued=False) == 1.0
    # when one interactive request goes through the gateway
    stack.client().chat.completions.create(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hello"}])
    # then its TTFT reaches Redis (the gateway flushes it off the request path)
    seen = wait_until(lambda: sum(s.requests for s in slots(time.time())) or None,
                      timeout=10, what="the request's TTFT in the signal")
    assert seen == 1
    # and the guard's next decision falls to the floor: interactive traffic is back
    assert guard.decide(slots(time.time()), queued=False) == guard.floor
    assert guard.reason == "arrival"


def test_rising_interactive_ttft_takes_the_share_to_the_floor_at_the_next_probe(db):
    guard = Scavenger(floor=1 / 16, step=1 / 16, tolerance=0.05, idle_s=2.0, window_s=0.6,
                      min_samples=20, cpu_ceiling=1.0)
    t = (time.time() // ttft_signal.SLOT_S) * ttft_signal.SLOT_S - 30  # whole slots, past
    guard.decide(slots(t), queued=False, now=t)  # idle
    # given steady interactive traffic at 10 ms, batch at its floor learning that baseline
    fractions = []
    for i in range(40):  # 8 s of 0.2 s slots, 30 requests each
        now = t + i * ttft_signal.SLOT_S  # (noted mid-slot, read later in it: float-safe)
        publish([10.0] * 30, at=now + 0.05)
        fractions.append(guard.decide(slots(now + 0.15), queued=False, now=now + 0.15))
    assert fractions[0] == guard.floor  # traffic arrived: the floor, whatever came before
    assert guard.baseline is not None
    assert guard.baseline.mean_ms == pytest.approx(10.0)
    assert guard.baseline.typical_ms == pytest.approx(10.0)
    # then each step that left TTFT where it was allowed the next: batch grew past the floor
    grown = guard.fraction
    assert grown >= 4 * guard.floor
    assert fractions == sorted(fractions)
    # when interactive TTFT rises 20 % in the newest slot
    now = t + 40 * ttft_signal.SLOT_S
    publish([12.0] * 30, at=now + 0.05)
    # then the next probe takes batch back to the floor
    assert guard.decide(slots(now + 0.15), queued=False, now=now + 0.15) == guard.floor
    assert guard.reason == "ttft"
    # and an engine with a queue does too, whatever TTFT says
    guard.fraction = grown
    later = now + 5
    publish([10.0] * 30, at=later + 0.05)
    assert guard.decide(slots(later + 0.15), queued=True, now=later + 0.15) == guard.floor
    assert guard.reason == "queued"


def test_the_share_keeps_free_slots_and_never_goes_below_the_floor():
    loads = [EngineLoad(running=2, max_running=16), EngineLoad(running=0, max_running=16)]
    # idle: every slot but one per engine, less what the engines run besides our own 2
    assert batch_share(loads, fraction=1.0, floor=1 / 16, free_slots=1, ours=2) == 30
    # at the floor: one slot per engine, taken by interactive requests first
    assert batch_share(loads, fraction=1 / 16, floor=1 / 16, free_slots=1, ours=0) == 0
    assert batch_share(loads, fraction=1 / 16, floor=1 / 16, free_slots=1, ours=2) == 2
    # an engine with a queue offers nothing; no guard (floor 1.0) offers every slot
    queued = EngineLoad(running=16, queued=1, max_running=16)
    assert batch_share([queued, loads[1]], fraction=1.0, floor=1 / 16, free_slots=1,
                       ours=0) == 15
    assert batch_share(loads, fraction=1.0, floor=1.0, free_slots=1, ours=2) == 32


def test_an_idle_fleet_runs_many_more_batch_lines_at_once_than_the_floor(
        transactional_db, tmp_path, settings, metering_stream, celery_worker_process,
        slow_sims):
    # given two idle engines of 8 slots: the old fixed share (1/16) ran one line on each
    stack = start_stack(tmp_path, batch_env(settings, tmp_path, metering_stream), slow_sims)
    try:
        # when a batch of 120 lines of 20 tokens runs with no interactive traffic
        completed, most = _most_running(stack, celery_worker_process, slow_sims, lines=120)
        # then it ran on (nearly) every slot of the engines, not on the floor's two
        assert completed == 120
        assert most > 2 * 4
        assert most <= 2 * (8 - settings.BATCH_FREE_SLOTS)
    finally:
        stop_gateway(stack.gateway)


def test_batch_leaves_a_pools_reserved_slots_free(
        transactional_db, tmp_path, settings, metering_stream, celery_worker_process,
        slow_sims):
    # given the same idle pool (two engines of 8 slots), of which four reservations hold a
    # slot each (a reservation holds at least one slot: these are small)
    from plans import services as plan_services
    from tests.factories import OrganizationFactory, make_offering

    stack = start_stack(tmp_path, batch_env(settings, tmp_path, metering_stream), slow_sims)
    offering = make_offering(model=MODEL, region="us-east", tokens_per_minute_per_unit=100,
                             output_burndown="1")
    for _ in range(4):
        plan_services.reservation_create(organization=OrganizationFactory(), offering=offering,
                                         units=1, term="monthly")
    try:
        # when a batch of 120 lines runs with no interactive traffic
        completed, most = _most_running(stack, celery_worker_process, slow_sims, lines=120)
        # then it filled the engines but for their free slots and the four reserved ones
        assert completed == 120
        assert 0 < most <= 2 * (8 - settings.BATCH_FREE_SLOTS) - 4
    finally:
        stop_gateway(stack.gateway)


def _most_running(stack, celery_worker_process, sims, *, lines: int) -> tuple[int, int]:
    """Run a batch of ``lines`` long lines to its end; return how many completed and the most
    requests the engines ran at once meanwhile."""
    most = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            most[0] = max(most[0], sum(running(sim) for sim in sims))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        client, batch = _run_long_lines(stack, celery_worker_process, lines=lines)
        finished = wait_status(client, batch.id, ("completed",), timeout=120)
    finally:
        done.set()
        watcher.join()
    return finished.request_counts.completed, most[0]


def _run_long_lines(stack, celery_worker_process, *, lines: int):
    client = stack.client()
    file_id = upload(client, [request_line(i, max_tokens=20) for i in range(lines)])
    celery_worker_process(queues="batch", beat=True, env=stack.env)
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    wait_status(client, batch.id, ("in_progress", "completed"))
    return client, batch


def test_under_interactive_traffic_a_host_with_busy_cpus_gets_no_batch_line(
        stack, celery_worker_process, tmp_path):
    # given interactive requests served through the gateway without pause, on a host whose
    # every core is busy (as a gateway and engines at full load keep a shared host busy)
    host = FakeHost(str(tmp_path / "stat"))
    stop = threading.Event()
    interactive = stack.client()

    def hammer() -> None:
        while not stop.is_set():
            interactive.chat.completions.create(
                model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])

    thread = threading.Thread(target=hammer, daemon=True)
    thread.start()
    try:
        wait_until(lambda: sum(s.requests for s in slots(time.time(), 1.0)), timeout=10,
                   what="interactive TTFTs in the signal")
        client, batch = _start_under_a_worker(stack, celery_worker_process, lines=20,
                                              TOLLGATE_BATCH_HOST_CPU_CEILING="0.9",
                                              TOLLGATE_BATCH_HOST_STAT=host.path)
        # when the runner has been looking for spare capacity for a while
        runner_kept_looking(batch.id)
        # then it claimed no line: the engines' free slots are not spare while the CPU is not
        assert not BatchLine.objects.filter(batch__public_id=batch.id, attempts__gt=0).exists()

        # when interactive traffic stops, the fleet is idle: the batch runs to the end on the
        # busy host (nothing of ours to protect there)
        stop.set()
        thread.join(timeout=10)
        done = wait_status(client, batch.id, ("completed",), timeout=60)
        assert done.request_counts.completed == 20
    finally:
        stop.set()
        host.stop.set()
        host.thread.join()
