"""The Batch API end to end through the official openai SDK, a live gateway, simulated engines
and a real Celery worker on the ``batch`` queue: 5,000 lines to ``completed``, each completed
line one usage event at tier ``batch`` carrying the batch id; malformed files fail with
line-level errors; a worker SIGKILLed mid-batch loses and repeats nothing.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal

import openai
import pytest

from billing_platform.gateway.models import Batch, BatchLine
from engine_adapter.sim.testing import FAST_RATES, SimProcess, start_sim
from metering.models import UsageEvent
from tests.conftest import wait_until
from tests.factories import OrganizationFactory, ProjectFactory, make_key, make_price_book
from tests.gateway.conftest import (
    LiveGateway,
    drain_usage,
    register_engine,
    start_gateway,
    stop_gateway,
)

MODEL = "small"


@dataclass
class BatchStack:
    gateway: LiveGateway
    sims: list[SimProcess]
    env: dict[str, str]

    def client(self, scopes=("inference", "batch")) -> openai.OpenAI:
        org = OrganizationFactory()
        _key, secret = make_key(project=ProjectFactory(organization=org), scopes=list(scopes))
        return openai.OpenAI(base_url=f"{self.gateway.url}/v1", api_key=secret, max_retries=0)


def batch_env(settings, tmp_path, metering_stream, **extra: str) -> dict[str, str]:
    """Environment shared by the gateway, the worker and this process.

    The runner's host-CPU ceiling is off (1.0): the suite's own processes and whatever else
    runs on the box keep the CPU busy, and a runner holding every line back for that is the
    one test about the ceiling, not every batch test waiting on the machine's load."""
    settings.FILES_DIR = str(tmp_path / "files")
    settings.BATCH_HOST_CPU_CEILING = 1.0
    return {**metering_stream, "TOLLGATE_FILES_DIR": settings.FILES_DIR,
            "TOLLGATE_BATCH_SWEEP_S": "0.5", "TOLLGATE_BATCH_LEASE_S": "3",
            "TOLLGATE_FLEET_HEALTH_S": "3600", "TOLLGATE_BATCH_HOST_CPU_CEILING": "1.0",
            **extra}


def start_stack(tmp_path, env: dict[str, str], sims: list[SimProcess]) -> BatchStack:
    make_price_book(prices=[{"model": MODEL, "input": "0.50", "output": "1.50"}])
    for i, sim in enumerate(sims):
        register_engine(sim, pool=f"{MODEL}-{i}", region="us-east", zone="us")
    return BatchStack(start_gateway(tmp_path, env=env), sims, env)


def fast_stack(tmp_path, settings, metering_stream) -> Iterator[BatchStack]:
    """Two fast simulated engines of ``small`` behind a live gateway (no worker yet)."""
    sims = [start_sim(served_model_name=MODEL, **FAST_RATES) for _ in range(2)]
    stack = start_stack(tmp_path, batch_env(settings, tmp_path, metering_stream), sims)
    yield stack
    stop_gateway(stack.gateway)
    for sim in sims:
        sim.stop()


@pytest.fixture
def stack(transactional_db, tmp_path, settings, metering_stream) -> Iterator[BatchStack]:
    yield from fast_stack(tmp_path, settings, metering_stream)


def request_line(i: int, *, model: str = MODEL, max_tokens: int = 4, url=None,
                 custom_id=None) -> dict:
    return {"custom_id": f"req-{i}" if custom_id is None else custom_id, "method": "POST",
            "url": url or "/v1/chat/completions",
            "body": {"model": model, "max_tokens": max_tokens,
                     "messages": [{"role": "user", "content": f"Summarise item {i}."}]}}


def upload(client: openai.OpenAI, lines: list) -> str:
    raw = b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n"
                   for x in lines)
    return client.files.create(file=("batch.jsonl", io.BytesIO(raw)), purpose="batch").id


def run_here(client: openai.OpenAI, lines: list, endpoint: str) -> Batch:
    """Create a batch of ``lines`` through the SDK and run it in this process, as a worker
    would (validation, then runner slices until it ends, a minute at most)."""
    from billing_platform.gateway.batch import runner
    from billing_platform.gateway.batch import services as batch_services

    created = client.batches.create(input_file_id=upload(client, lines), endpoint=endpoint,
                                    completion_window="24h")
    batch = batch_services.batch_validate(batch_id=Batch.objects.get(public_id=created.id).pk)
    deadline = time.monotonic() + 60
    while Batch.objects.get(pk=batch.pk).status == "in_progress" and (
            time.monotonic() < deadline):
        runner.batch_run(batch_id=batch.pk, slice_s=2)
    batch.refresh_from_db()
    return batch


def wait_status(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...],
                timeout: float = 60):
    def done():
        batch = client.batches.retrieve(batch_id)
        return batch if batch.status in statuses else None

    return wait_until(done, timeout=timeout, what=f"batch {batch_id} in {statuses}")


def results(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def batch_events(batch_id: str, expected: int) -> list[UsageEvent]:
    def recorded():
        drain_usage()
        events = list(UsageEvent.objects.filter(batch_id=batch_id))
        return events if len(events) >= expected else None

    if expected:
        wait_until(recorded, timeout=30, what=f"{expected} usage events of {batch_id}")
    drain_usage()
    return list(UsageEvent.objects.filter(batch_id=batch_id))


def test_sdk_runs_5000_lines_on_the_simulator(stack, celery_worker_process):
    # given a worker on the batch queue and a 5,000-line file
    celery_worker_process(queues="batch", beat=True, env=stack.env)
    client = stack.client()
    lines = [request_line(i) for i in range(5000)]
    lines[7]["body"]["user"] = "end-user-7"  # a reseller's end user, stored on its event
    file_id = upload(client, lines)

    # when the batch is created and polled
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = wait_status(client, batch.id, ("completed", "failed"), timeout=240)

    # then every line answered once, in the output file, and was metered once at tier batch
    assert done.status == "completed", done
    assert done.request_counts.total == 5000 and done.request_counts.completed == 5000
    assert done.request_counts.failed == 0 and done.error_file_id is None
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    rows = results(client, done.output_file_id)
    assert sorted(r["custom_id"] for r in rows) == sorted(f"req-{i}" for i in range(5000))
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in rows)
    assert all(r["response"]["body"]["choices"][0]["message"]["content"] for r in rows)
    events = batch_events(batch.id, 5000)
    assert len(events) == 5000
    assert {e.service_tier for e in events} == {"batch"}
    assert {e.end_user for e in events} == {None, "end-user-7"}
    assert [e.end_user for e in events if e.end_user] == ["end-user-7"]
    by_id = {r["response"]["request_id"]: r["response"]["body"]["usage"] for r in rows}
    assert all(by_id[e.request_id]["completion_tokens"] == e.completion_tokens
               and by_id[e.request_id]["prompt_tokens"] == e.prompt_tokens for e in events)
    # rated at half the standard price, cached-token pricing (0.1 x input) stacking
    assert any(e.cached_tokens for e in events)
    for event in events:
        standard = ((event.prompt_tokens - event.cached_tokens) * Decimal("0.50")
                    + event.cached_tokens * Decimal("0.05")
                    + event.completion_tokens * Decimal("1.50")) / 1_000_000
        assert event.amount == (Decimal("0.5") * standard).quantize(event.amount), (
            event.amount, standard)

    listed = client.batches.list(limit=1)
    assert [b.id for b in listed.data] == [batch.id]


def test_malformed_file_fails_with_line_level_errors(stack, celery_worker_process):
    celery_worker_process(queues="batch", beat=False, env=stack.env)
    client = stack.client()
    lines = [
        request_line(0),
        b"{not json",
        {k: v for k, v in request_line(2).items() if k != "custom_id"},
        request_line(3, custom_id="req-0"),
        request_line(4, url="/v1/embeddings"),
        request_line(5, model="other-model"),
    ]
    batch = client.batches.create(input_file_id=upload(client, lines),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    failed = wait_status(client, batch.id, ("failed", "in_progress", "completed"))
    assert failed.status == "failed" and failed.failed_at
    errors = {(e.line, e.code) for e in failed.errors.data}
    assert errors == {(2, "invalid_json_line"), (3, "missing_required_parameter"),
                      (4, "duplicate_custom_id"), (5, "invalid_url"), (6, "mismatched_model")}
    assert not BatchLine.objects.filter(batch__public_id=batch.id).exists()
    assert batch_events(batch.id, 0) == []


def test_create_rejects_bad_parameters_and_other_orgs_ids(stack):
    client, other = stack.client(), stack.client()
    file_id = upload(client, [request_line(0)])
    with pytest.raises(openai.BadRequestError) as window:
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                              completion_window="48h")  # type: ignore[arg-type]
    assert window.value.body["param"] == "completion_window"
    with pytest.raises(openai.BadRequestError) as endpoint:
        client.batches.create(input_file_id=file_id,
                              endpoint="/v1/moderations",  # type: ignore[arg-type]
                              completion_window="24h")
    assert endpoint.value.body["param"] == "endpoint"
    with pytest.raises(openai.NotFoundError):
        other.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                             completion_window="24h")
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    assert list(other.batches.list()) == []
    # cursor pagination: newest first, `after` continues
    second = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                   completion_window="24h")
    assert [b.id for b in client.batches.list(limit=1).data] == [second.id]
    assert [b.id for b in client.batches.list(after=second.id).data] == [batch.id]


def _worker_children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def test_worker_killed_mid_batch_leaves_one_result_and_one_event_per_line(
        transactional_db, tmp_path, settings, metering_stream, celery_worker_process):
    # given engines slow enough that the batch is still running when the worker dies
    sims = [start_sim(served_model_name=MODEL, prefill_tokens_per_s=1_000_000,
                      decode_tokens_per_s=100, max_running_requests=8) for _ in range(2)]
    stack = start_stack(tmp_path, batch_env(settings, tmp_path, metering_stream), sims)
    try:
        client = stack.client()
        file_id = upload(client, [request_line(i, max_tokens=8) for i in range(600)])
        worker = celery_worker_process(queues="batch", beat=True, env=stack.env)
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 100,
                   timeout=60, what="a hundred lines done")

        # when the worker and its pool child are SIGKILLed mid-batch, then a new one starts
        for pid in [*_worker_children(worker.pid), worker.pid]:
            os.kill(pid, signal.SIGKILL)
        worker.wait(timeout=10)
        in_flight = BatchLine.objects.filter(batch__public_id=batch.id,
                                             state="running").count()
        before = client.batches.retrieve(batch.id)
        assert before.status == "in_progress" and before.request_counts.completed < 600
        celery_worker_process(queues="batch", beat=True, env=stack.env)
        done = wait_status(client, batch.id, ("completed",), timeout=120)

        # then every line has exactly one result and exactly one usage event
        rows = results(client, done.output_file_id)
        assert sorted(r["custom_id"] for r in rows) == sorted(f"req-{i}" for i in range(600))
        assert done.request_counts.completed == 600 and done.error_file_id is None
        events = batch_events(batch.id, 600)
        assert len(events) == 600
        assert sorted(e.request_id for e in events) == sorted(
            r["response"]["request_id"] for r in rows)
        # the lines the dead worker held were claimed again, once
        assert in_flight == 0 or BatchLine.objects.filter(
            batch__public_id=batch.id, attempts__gt=1).exists()
    finally:
        stop_gateway(stack.gateway)
        for sim in sims:
            sim.stop()


def _start_under_a_worker(stack: BatchStack, celery_worker_process, *, lines: int,
                          **env: str):
    """Start a batch of ``lines`` short requests with a real worker on the batch queue."""
    client = stack.client()
    file_id = upload(client, [request_line(i, max_tokens=2) for i in range(lines)])
    celery_worker_process(queues="batch", beat=True, env={**stack.env, **env})
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    wait_status(client, batch.id, ("in_progress", "failed"))
    return client, batch


def runner_kept_looking(batch_id: str, beats: int = 4) -> None:
    """Wait until the batch's runner has heartbeated ``beats`` more times: each heartbeat is
    one more second of its loop, which probes the engines' (and host's) room every 0.2 s."""
    seen: set = set()

    def looked() -> bool:
        seen.add(Batch.objects.get(public_id=batch_id).heartbeat_at)
        return len(seen) > beats

    wait_until(looked, timeout=60, what=f"{beats} heartbeats of the runner of {batch_id}")


def test_saturated_engines_get_no_batch_line_until_traffic_stops(
        transactional_db, tmp_path, settings, metering_stream, celery_worker_process):
    import threading

    # given one engine with two running slots, saturated by interactive traffic
    sim = start_sim(served_model_name=MODEL, max_running_requests=2,
                    prefill_tokens_per_s=1_000_000, decode_tokens_per_s=100)
    stack = start_stack(tmp_path, batch_env(settings, tmp_path, metering_stream), [sim])
    stop = threading.Event()
    try:
        interactive = stack.client()

        def hammer():
            while not stop.is_set():
                interactive.chat.completions.create(
                    model=MODEL, max_tokens=20,
                    messages=[{"role": "user", "content": "interactive"}])

        threads = [threading.Thread(target=hammer, daemon=True) for _ in range(6)]
        for thread in threads:
            thread.start()
        client, batch = _start_under_a_worker(stack, celery_worker_process, lines=20)

        # when the worker has been looking for capacity for a while
        runner_kept_looking(batch.id)
        # then no line was ever claimed, so none reached an engine
        lines = BatchLine.objects.filter(batch__public_id=batch.id)
        assert lines.count() == 20
        assert not lines.filter(attempts__gt=0).exists()

        # when interactive traffic stops, the batch runs to the end
        stop.set()
        for thread in threads:
            thread.join(timeout=10)
        done = wait_status(client, batch.id, ("completed",), timeout=60)
        assert done.request_counts.completed == 20
    finally:
        stop.set()
        stop_gateway(stack.gateway)
        sim.stop()


class FakeHost:
    """A host's CPU counters in /proc/stat's format, advanced by a thread: every core busy or
    every core idle, as the test says (``test_batch_guard.py``). The worker reads them
    (TOLLGATE_BATCH_HOST_STAT), so what the test asserts does not depend on what else this
    machine runs (a suite under load kept the real host busy after the test's own busy loops
    stopped, and the batch waited)."""

    CORES = 64  # the worker's own CPU use, left out of "others", is a sliver of this host

    def __init__(self, path):
        import threading

        self.path, self.busy, self.user, self.idle = path, True, 0, 0
        self.hz = os.sysconf("SC_CLK_TCK")
        self.stop = threading.Event()
        self.write()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def write(self) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:  # user nice system idle iowait irq softirq steal ...
            f.write(f"cpu  {self.user} 0 0 {self.idle} 0 0 0 0 0 0\n")
        os.replace(tmp, self.path)

    def run(self) -> None:
        while not self.stop.wait(0.02):
            ticks = round(self.hz * 0.02 * self.CORES)
            if self.busy:
                self.user += ticks
            else:
                self.idle += ticks
            self.write()


def test_host_cpu_counts_what_others_kept_busy(tmp_path):
    from billing_platform.gateway.batch.guard import HostCpu

    stat = tmp_path / "stat"
    hz = os.sysconf("SC_CLK_TCK")

    def write(user: int, idle: int) -> None:
        # user nice system idle iowait irq softirq steal guest guest_nice
        stat.write_text(f"cpu  {user} 0 0 {idle} 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n")

    write(user=1000, idle=1000)
    host = HostCpu(str(stat))
    # a window shorter than a few clock ticks says nothing yet
    write(user=1000 + 3 * hz, idle=1000 + hz)
    assert host.busy() is None
    # when others kept 3 of 4 CPU-seconds busy since the first reading
    time.sleep(HostCpu.MIN_WINDOW_S)
    # then the host was 75 % busy (less the little this process used meanwhile)
    assert host.busy() == pytest.approx(0.75, abs=0.02)
    # and an unreadable file says nothing
    stat.unlink()
    assert host.busy() is None
    # the default reads the kernel's own counters
    real = HostCpu()
    time.sleep(HostCpu.MIN_WINDOW_S)
    assert 0.0 <= real.busy() <= 1.0
