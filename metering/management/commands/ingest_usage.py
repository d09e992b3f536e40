"""``manage.py ingest_usage``: the usage stream consumer (see ``metering.ingest`` for why a
dedicated process and not Celery tasks)."""

from __future__ import annotations

import logging
import signal
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from metering import conf
from metering.ingest import Ingestor

log = logging.getLogger("metering.ingest")


def _shards(value: str | None) -> list[int] | None:
    """Return the shard indexes ``--shards`` names (None: all)."""
    if value is None:
        return None
    count = conf.stream_shards()
    try:
        shards = sorted({int(v) for v in value.split(",") if v.strip()})
    except ValueError:
        raise CommandError(f"--shards takes indexes like 0,2; got {value!r}") from None
    if not shards or not all(0 <= i < count for i in shards):
        raise CommandError(f"--shards {value!r}: the stream has {count} shard(s), 0 to "
                           f"{count - 1} (TOLLGATE_USAGE_STREAM_SHARDS)")
    return shards


class Command(BaseCommand):
    help = "Drain the Redis usage stream into PostgreSQL (batched COPY, exactly once)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--batch-size", type=int, default=None,
                            help=f"entries per transaction (default {conf.batch_size()})")
        parser.add_argument("--block-ms", type=int, default=500,
                            help="how long one XREADGROUP waits for new entries")
        parser.add_argument("--claim-idle-ms", type=int, default=None,
                            help="reclaim entries unacknowledged this long "
                                 f"(default {conf.claim_idle_ms()})")
        parser.add_argument("--writers", type=int, default=2,
                            help="batches recorded concurrently, each on its own connection")
        parser.add_argument("--name", default=None, help="consumer name (default host-pid)")
        parser.add_argument("--shards", default=None,
                            help="comma-separated shard indexes to consume (default: all "
                                 f"{conf.stream_shards()}; TOLLGATE_USAGE_STREAM_SHARDS)")
        parser.add_argument("--drain", action="store_true",
                            help="exit once the stream has nothing new and nothing pending")

    def handle(self, *args: Any, **options: Any) -> None:
        ingestor = Ingestor(
            name=options["name"], batch_size=options["batch_size"],
            block_ms=options["block_ms"], claim_idle_ms=options["claim_idle_ms"],
            writers=options["writers"], shards=_shards(options["shards"]),
        )

        def on_signal(signum: int, frame: object) -> None:
            log.info("signal %d: finishing the batches in hand", signum)
            ingestor.stop()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        self.stdout.write(f"ingest_usage: consumer {ingestor.name} of group "
                          f"{ingestor.group} on {', '.join(ingestor.keys)}")
        self.stdout.flush()
        stats = ingestor.run(drain=options["drain"])
        self.stdout.write(
            f"ingest_usage: {stats.batches} batches, {stats.events} entries, "
            f"{stats.recorded} recorded, {stats.duplicates} duplicates, "
            f"{stats.dead_lettered} dead-lettered, {stats.claimed} reclaimed"
        )
