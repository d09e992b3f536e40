"""The ingest backlog gauges count every shard of a sharded usage stream (real Redis)."""

from __future__ import annotations

from metering import conf, stream
from metering.metrics import MeteringCollector


def _gauges() -> dict[str, float]:
    return {m.name: m.samples[0].value for m in MeteringCollector._stream()}


def test_the_backlog_is_the_sum_over_the_shards_and_the_lag_the_oldest(settings, metering_stream):
    # given a usage stream sharded three ways: two events waiting on the first shard, three on
    # the last, one of them delivered to a consumer and not acknowledged yet
    settings.METERING_STREAM_SHARDS = 3
    first, _middle, last = conf.stream_keys()
    stream.append_many([b"a", b"b"], key=first)
    stream.append_many([b"c", b"d", b"e"], key=last)
    r = stream.client()
    stream.ensure_group(r, last)
    r.xreadgroup(conf.consumer_group(), "test-consumer", {last: ">"}, count=1)
    try:
        # when the metrics are scraped
        gauges = _gauges()
        # then the backlog and the stream length count all five, on both shards
        assert gauges["tollgate_ingest_backlog_events"] == 5
        assert gauges["tollgate_usage_stream_length_events"] == 5
        assert gauges["tollgate_ingest_lag_seconds"] >= 0
        # and once the first shard is drained only the last shard's three remain
        r.delete(first)
        assert _gauges()["tollgate_ingest_backlog_events"] == 3
    finally:
        r.delete(first, last)
