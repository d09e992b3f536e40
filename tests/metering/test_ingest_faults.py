"""Fault tests with real processes: the consumer SIGKILLed mid-batch, then restarted."""

from __future__ import annotations

import os
import queue
import signal
import threading

import pytest
from django.db.models import Sum

from metering import conf, services, stream
from metering.models import UsageEvent, UsageRollupHourly
from tests.metering.conftest import metering_env


def _lines(proc) -> queue.Queue[str]:
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line.strip())

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _wait_for_line(lines: queue.Queue[str], prefix: str, *, timeout: float) -> str:
    while True:
        line = lines.get(timeout=timeout)
        if line.startswith(prefix):
            return line


@pytest.mark.parametrize("point", ["before_commit", "after_commit"])
def test_consumer_killed_mid_batch_records_every_event_exactly_once(
        transactional_db, tenant, settings, manage, point):
    # given 2,000 events on the stream
    n = 2000
    for i in range(n):
        assert services.usage_event_append(tenant.event(f"req-{i}")) == "redis"

    # when a consumer (two writers) is SIGKILLed in a batch of 500: with the batch written
    # but not committed, or committed but not acknowledged on the stream
    first = manage("ingest_usage", "--batch-size", "500", "--claim-idle-ms", "1000",
                   env=metering_env(settings, TOLLGATE_INGEST_STALL_AT=f"{point}:2"))
    _wait_for_line(_lines(first), "STALLED", timeout=60)
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=20)

    assert UsageEvent.objects.count() < n
    r = stream.client()
    assert r.xpending(conf.stream_key(), conf.consumer_group())["pending"] >= 500

    # and a new consumer runs until the stream is drained
    second = manage("ingest_usage", "--batch-size", "500", "--claim-idle-ms", "1000",
                    "--drain", env=metering_env(settings))
    out, _ = second.communicate(timeout=120)
    assert second.returncode == 0, second.log_path.read_text()

    # then every event is recorded exactly once, rollups included, and nothing is pending
    ids = list(UsageEvent.objects.values_list("request_id", flat=True))
    assert len(ids) == len(set(ids)) == n
    assert UsageRollupHourly.objects.aggregate(n=Sum("requests"))["n"] == n
    assert r.xpending(conf.stream_key(), conf.consumer_group())["pending"] == 0
    # the dead consumer's entries were reclaimed; the batch it had committed came back as
    # duplicates (the other writer may have committed one more before the kill)
    stats = _stats(out)
    assert stats["reclaimed"] >= 500
    if point == "after_commit":
        assert stats["duplicates"] >= 500


def _stats(out: str) -> dict[str, int]:
    line = next(x for x in out.splitlines() if " batches, " in x)
    parts = line.split(": ", 1)[1].split(", ")
    return {p.split(" ", 1)[1].replace("-", "_"): int(p.split(" ", 1)[0]) for p in parts}
