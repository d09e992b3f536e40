"""Ingest benchmark: usage events/s from the Redis stream into PostgreSQL, and end-to-end lag.

A producer process XADDs gateway-shaped events (the wire form of ``metering.events``) to a
fresh stream while this process runs the real consumer (``metering.ingest.Ingestor``: read,
COPY, dedup, rating through ``plans.rating``, hourly rollups, XACK); with ``--consumers N`` the
stream is sharded by organization into N streams (``TOLLGATE_USAGE_STREAM_SHARDS``) and each
shard has its own consumer process, as a deployment would run them. Two phases:

1. throughput: ``--events`` offered as fast as the producer can (or at ``--rate``);
   ``events_per_s`` is events over the time from the first XADD to the last commit, so the
   consumer's backlog counts against it;
2. lag: ``--lag-events`` offered at a steady ``--lag-rate`` (default 80 % of the measured
   throughput), as live gateway traffic would be. An event's lag is its batch's commit time
   minus the Redis time of its XADD (from the entry id); ``lag_p50_s``/``lag_p99_s`` come
   from this phase (the throughput phase's, which mostly measure the backlog, are reported as
   ``saturated_lag_*``).

Between the phases it measures the ceiling the consumer works against, in the same run: a plain
``COPY`` of the rows the throughput phase recorded (same columns, same values) into an
unindexed, unpartitioned table (``copy_limit_rows_per_s``, the best of text and binary format
on one connection and binary over as many connections as the consumers write with), and reports
``events_per_copy_limit`` = ``events_per_s`` / ``copy_limit_rows_per_s``.

Where the CPU goes, to tell what bounds the ratio: ``cpu_us_per_event`` splits the throughput
phase's CPU an event between PostgreSQL (every server process, WAL writer and checkpointer
included), Redis, the consumers and the producer's sending (``machine`` is every core's busy
time, the producer's set-up included), and ``copy_limit_cpu_us_per_row`` is the same for the
COPY limit's best try. ``postgres_cpu_per_copy_limit`` is PostgreSQL's CPU an event over its
CPU a row in the plain COPY: on a machine whose cores are all busy, the ratio cannot pass its
inverse even if the consumers cost nothing. ``events_per_copy_limit_ceiling`` is the ratio the
run would reach with every core busy if the consumers cost nothing and PostgreSQL did no more
per event than the plain COPY of its row: the stream's Redis work and the producer's sending
are all that is left, and they alone bound it.

Prints one JSON line: ``{"events", "events_per_s", "copy_limit_rows_per_s",
"events_per_copy_limit", "lag_p50_s", "lag_p99_s", "cpu_us_per_event", ...}``.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/tollgate_bench REDIS_URL=redis://... \\
        .venv/bin/python bench/ingest.py --events 1000000

The database is migrated first. ``--reset`` empties the usage tables first (only in a database
whose name contains "bench"). The events belong to organizations created for the run (with a
default USD price book for the bench models), and the run checks that exactly the produced
number of rows and rollup requests arrived (``exactly_once``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.procs import CpuMeter

MODELS = ("llama-3.1-8b-instruct", "qwen2.5-7b-instruct", "mistral-7b-instruct",
          "llama-3.1-70b-instruct", "deepseek-v3")
REGIONS = ("us-east", "us-west", "eu-west")
TIERS = ("default", "default", "default", "priority", "flex", "batch")


XADD_LUA = """
for i = 1, #ARGV do redis.call('XADD', KEYS[1], '*', 'e', ARGV[i]) end
return #ARGV
"""


def produce(args: argparse.Namespace) -> None:
    """Producer role: XADD ``--events`` events; print the achieved rate as JSON."""
    import redis

    spec = json.loads(args.spec)
    r = redis.Redis.from_url(spec["redis_url"])
    streams, run = spec["streams"], spec["run"]
    keys = spec["keys"]  # [org_id, project_id, key_id]
    rng = random.Random(run)  # ids differ between runs and phases
    # the wire form of metering.events.encode, built by a template for speed; the parent
    # checked this template against the real encoder before starting us
    template = spec["template"]
    n, chunk, rate = args.events, 500, args.rate
    # "gateway": the gateway's ids (metering.events.new_request_id: "req_", 12 hex digits of
    # the ms, 80 random bits); "random": 128 random bits (the gateway's ids before they were
    # time-ordered); "ordered": a sequence
    ids = spec["ids"]
    # Every payload is built before the first XADD and sent by a script, many per call: the
    # producer shares the cores with the consumer, and building and packing one command per
    # event in Python held the offered rate below what the consumer drains.
    now = datetime.now(UTC).isoformat()
    ms = time.time_ns() // 1_000_000
    chunks: list[dict[str, list[bytes]]] = []
    for first in range(0, n, chunk):
        per_stream: dict[str, list[bytes]] = {}
        for i in range(first, min(first + chunk, n)):
            org, project, api_key = keys[i % len(keys)]
            prompt = rng.randrange(20, 4000)
            payload = template % (
                org, (f"req_{ms:012x}{rng.getrandbits(80):020x}" if ids == "gateway" else
                      f"req_{rng.getrandbits(128):032x}" if ids == "random" else
                      f"req_{run}{i:012d}"),
                project, api_key, MODELS[i % len(MODELS)],
                REGIONS[i % len(REGIONS)], f"engine-{i % 8}", TIERS[i % len(TIERS)],
                prompt, prompt // 3, rng.randrange(1, 800), rng.randrange(0, 50),
                rng.randrange(5, 400), rng.randrange(100, 9000), now,
            )
            per_stream.setdefault(streams[org % len(streams)], []).append(payload.encode())
        chunks.append(per_stream)
        ms += 1  # ids stay in time order as the gateway's would
    add = r.register_script(XADD_LUA)
    start, cpu = time.perf_counter(), time.process_time()
    sent = 0
    for per_stream in chunks:
        pipe = r.pipeline(transaction=False)
        for stream_key, payloads in per_stream.items():
            add(keys=[stream_key], args=payloads, client=pipe)
            sent += len(payloads)
        pipe.execute()
        if rate:
            ahead = sent / rate - (time.perf_counter() - start)
            if ahead > 0:
                time.sleep(ahead)
    elapsed = time.perf_counter() - start
    print(json.dumps({"produced": sent, "producer_events_per_s": round(sent / elapsed),
                      "producer_cpu_s": time.process_time() - cpu}))


TEMPLATE = ('[1,%d,"%s",%d,%d,"%s","%s","global","%s","%s","on_demand",%d,%d,%d,%d,%d,%d,'
            '"ok","0.0000100000","%s",null,"gateway"]')


def _check_template() -> None:
    from metering import events

    row = events.decode_row(TEMPLATE % (1, "r", 2, 3, "m", "us-east", "e", "default",
                                        10, 3, 5, 1, 2, 3, "2026-01-01T00:00:00+00:00"))
    expect = events.UsageEventData(
        org_id=1, request_id="r", project_id=2, api_key_id=3, model="m", region="us-east",
        data_zone="global", engine="e", prompt_tokens=10, cached_tokens=3, completion_tokens=5,
        queue_ms=1, ttft_ms=2, total_ms=3, cost_to_serve=events.Decimal("0.0000100000"),
        event_time=datetime(2026, 1, 1, tzinfo=UTC),
    )
    assert events.decode_row(events.encode(expect)) == row, "bench template drifted from encode"


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _setup_orgs(n_orgs: int, run: str) -> list[list[int]]:
    """Create the run's organizations, projects and keys, and a default USD price book."""
    from billing_platform.accounts import services as accounts
    from billing_platform.accounts.models import Organization, Project
    from plans import services as plans

    book = plans.price_book_create(code=f"bench-{run}", name=f"bench {run}", currency="USD",
                                   is_default=True)
    plans.price_version_create(
        price_book=book, effective_from=datetime(2025, 1, 1, tzinfo=UTC), allow_backdate=True,
        prices=[{"model": m, "input": "0.15", "output": "0.60"} for m in MODELS],
    )
    keys = []
    for i in range(n_orgs):
        org = Organization.objects.create(name=f"bench {run} {i}", slug=f"bench-{run}-{i}",
                                          billing_email="bench@example.com")
        for j in range(2):
            project = Project.objects.create(organization=org, name=f"p{j}")
            key, _secret = accounts.api_key_create(project=project, name="bench",
                                                   scopes=["inference"])
            keys.append([org.id, project.id, key.id])
    return keys


def _consume(args: argparse.Namespace, *, expected: int, shard: int | None) -> dict:
    """Consumer role: run an ``Ingestor`` (on one shard, or every stream) until ``expected``
    events of it were recorded; return its counts and each event's lag."""
    from metering import stream
    from metering.ingest import Ingestor

    lags: list[float] = []
    done: dict[str, Any] = {"n": 0, "dups": 0, "dead": 0, "first": None, "last": 0.0}
    ingestor: Ingestor

    def observer(batch, result, committed: float) -> None:
        first = min(stream.entry_ms(i) for i in batch.ids) / 1000
        done["first"] = first if done["first"] is None else min(done["first"], first)
        lags.extend(committed - int(i[:i.index(b"-")]) / 1000 for i in batch.ids)
        done["n"] += len(result.recorded)
        done["dups"] += len(result.duplicates)
        done["dead"] += len(result.dead_lettered)
        done["last"] = committed
        if done["n"] + done["dups"] + done["dead"] >= expected:
            ingestor.stop()

    ingestor = Ingestor(batch_size=args.batch_size, observer=observer, claim_idle_ms=600_000,
                        writers=args.writers, shards=None if shard is None else [shard])
    for key in ingestor.keys:
        stream.ensure_group(ingestor.redis, key)
    cpu = time.process_time()
    stats = ingestor.run()
    return {**done, "lags": lags, "batches": stats.batches, "cpu_s": time.process_time() - cpu}


def consume(args: argparse.Namespace) -> None:
    """Consumer process of one shard (``--consumers`` > 1): its result as JSON in a file."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "billing_platform.settings")
    import django

    django.setup()
    from metering.ingest import Ingestor  # noqa: F401  (imported before saying ready)

    spec = json.loads(args.spec)
    Path(spec["ready"]).touch()
    result = _consume(args, expected=spec["expected"], shard=spec["shard"])
    Path(spec["out"]).write_text(json.dumps(result))


def _phase(args: argparse.Namespace, *, events: int, rate: int, run: str, keys: list) -> dict:
    """Produce ``events`` at ``rate`` (0: as fast as possible) while consuming them, with one
    consumer process per stream shard (``--consumers``)."""
    import tempfile

    os.environ["TOLLGATE_USAGE_STREAM"] = f"bench:usage:{run}"
    from metering import conf

    conf.reread()  # metering.conf reads knobs once: this phase's stream name

    shards = conf.stream_keys()
    per_shard = [0] * len(shards)
    for i in range(events):  # the producer's org of event i is keys[i % len(keys)][0]
        per_shard[keys[i % len(keys)][0] % len(shards)] += 1
    spec = {"redis_url": conf.redis_url(), "streams": shards, "run": run,
            "keys": keys, "template": TEMPLATE, "ids": args.ids}
    workdir = Path(tempfile.mkdtemp(prefix="bench-ingest-"))
    consumers = [
        subprocess.Popen(
            [sys.executable, __file__, "--consume", "--batch-size", str(args.batch_size or 0),
             "--writers", str(args.writers),
             "--spec", json.dumps({"expected": per_shard[s], "shard": s,
                                   "out": str(workdir / f"{s}.json"),
                                   "ready": str(workdir / f"{s}.ready")})])
        for s in range(1, len(shards))
    ]
    # Offer nothing before every consumer is up: one that starts behind catches up at only
    # 20 % of its rate in the lag phase, so its start-up showed as seconds of lag.
    deadline = time.monotonic() + 300
    while not all((workdir / f"{s}.ready").exists() for s in range(1, len(shards))):
        if any(child.poll() is not None for child in consumers):
            raise RuntimeError("a consumer exited before it was ready")
        if time.monotonic() > deadline:
            raise RuntimeError("the consumers were not ready within 300 s")
        time.sleep(0.05)
    meter = CpuMeter()
    with meter:  # until the consumers have exited (their backends' last samples taken)
        producer = subprocess.Popen(
            [sys.executable, __file__, "--produce", "--events", str(events), "--rate",
             str(rate), "--spec", json.dumps(spec)],
            stdout=subprocess.PIPE, text=True,
        )
        started = time.time()
        parts = [_consume(args, expected=per_shard[0], shard=0 if len(shards) > 1 else None)]
        produced = json.loads(producer.communicate(timeout=900)[0].strip().splitlines()[-1])
        for s, child in enumerate(consumers, start=1):
            if child.wait(timeout=900) != 0:
                raise RuntimeError(f"the consumer of shard {s} failed")
            parts.append(json.loads((workdir / f"{s}.json").read_text()))
    from metering import stream

    stream.client().delete(*shards)
    lags = sorted(lag for part in parts for lag in part["lags"])
    n = sum(part["n"] for part in parts)
    firsts = [part["first"] for part in parts if part["first"] is not None]
    span = max(part["last"] for part in parts) - (min(firsts) if firsts else started)
    return {
        "events": n,
        "events_per_s": round(n / span) if span > 0 else None,
        "lag_p50_s": round(_percentile(lags, 0.50), 3),
        "lag_p99_s": round(_percentile(lags, 0.99), 3),
        "lag_max_s": round(lags[-1], 3) if lags else None,
        "duration_s": round(span, 2),
        "batches": sum(part["batches"] for part in parts),
        "offered_rate": rate or "max",
        **produced,
        "duplicates": sum(part["dups"] for part in parts),
        "dead_lettered": sum(part["dead"] for part in parts),
        "cpu_us_per_event": {name: round(seconds * 1e6 / n, 2) if n else None for name, seconds in {
            "machine": meter.machine_s, "postgres": meter.by_name["postgres"],
            "redis": meter.by_name["redis-server"],
            "consumers": sum(part["cpu_s"] for part in parts),
            "producer": produced.pop("producer_cpu_s")}.items()},
    }


COPY_LIMIT_TABLE = "bench_copy_limit"
COPY_CHUNK = 1 << 20  # bytes per write, as large as a consumer's batch write


def _lines_chunked(blob: bytes) -> list[bytes]:
    """Cut COPY text into chunks of about ``COPY_CHUNK`` bytes, each ending at a row's end."""
    chunks, start = [], 0
    while start < len(blob):
        end = blob.find(b"\n", start + COPY_CHUNK)
        end = len(blob) if end < 0 else end + 1
        chunks.append(blob[start:end])
        start = end
    return chunks


def _copy_limit(org_ids: list[int], *, connections: int) -> dict:
    """Time a plain COPY of the run's rows into an unindexed table: the ceiling of ingest.

    The rows are the ones the throughput phase recorded, read back from ``usage_event`` with
    the columns the consumer COPYs (``metering.recording.EVENT_COLUMNS``), so values, widths
    and types are the same. The target is an ordinary (logged) table made ``LIKE usage_event``
    with its defaults and identity (``id`` and ``recorded_at`` are computed per row as
    there) but no index, no partitioning and no check constraint: what is left is PostgreSQL
    parsing and writing the rows. Each try is one COPY per connection and its commit, timed
    from the first byte sent to the last commit, with the data already in memory: text format
    (what the consumer sends today) and binary format on one connection, and binary split over
    ``connections`` concurrent connections (as many as the consumer writes with). The limit
    is the best of them, so the ratio never flatters the consumer.
    """
    import threading

    from django.db import connection

    from metering.recording import EVENT_COLUMNS

    columns = ", ".join(EVENT_COLUMNS)
    connection.ensure_connection()
    pg = connection.connection
    select = (f"COPY (SELECT {columns} FROM usage_event "  # noqa: S608
              "WHERE organization_id = ANY(%s) AND id %% %s = %s) TO STDOUT")

    def export(fmt: str, n: int) -> list[list[bytes]]:
        """Return the rows in ``fmt``, as ``n`` shares (by id) of about 1 MiB chunks."""
        shares = []
        for i in range(n):
            buf = bytearray()
            with pg.cursor() as cur, cur.copy(select + f" (FORMAT {fmt})",
                                              (org_ids, n, i)) as copy:
                for data in copy:
                    buf += data
            # binary is one stream (header, rows, trailer): cut anywhere; text ends in rows
            shares.append([bytes(buf[j:j + COPY_CHUNK]) for j in range(0, len(buf), COPY_CHUNK)]
                          if fmt == "binary" else _lines_chunked(bytes(buf)))
        pg.commit()
        return shares

    from psycopg import connect

    dsn = pg.info.dsn
    password = pg.info.password
    extra = {"password": password} if password else {}

    def copy_in(conn: Any, parts: list[bytes], fmt: str) -> None:
        with conn.cursor() as cur, cur.copy(f"COPY {COPY_LIMIT_TABLE} ({columns}) FROM STDIN "
                                            f"(FORMAT {fmt})") as copy:
            for part in parts:
                copy.write(part)
        conn.commit()

    def timed(fmt: str, n: int) -> tuple[float, CpuMeter]:
        shares = export(fmt, n)
        conns = [connect(dsn, **extra) for _ in range(n)]
        try:
            with conns[0].cursor() as cur:
                cur.execute(f"DROP TABLE IF EXISTS {COPY_LIMIT_TABLE}")
                cur.execute(f"CREATE TABLE {COPY_LIMIT_TABLE} (LIKE usage_event "
                            "INCLUDING DEFAULTS INCLUDING IDENTITY)")
            conns[0].commit()
            threads = [threading.Thread(target=copy_in, args=(c, share, fmt))
                       for c, share in zip(conns, shares, strict=True)]
            with CpuMeter() as meter:
                start = time.perf_counter()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                elapsed = time.perf_counter() - start
            with conns[0].cursor() as cur:
                cur.execute(f"SELECT count(*) FROM {COPY_LIMIT_TABLE}")  # noqa: S608
                copied = cur.fetchone()[0]
                cur.execute(f"DROP TABLE {COPY_LIMIT_TABLE}")
            conns[0].commit()
            if copied != rows:
                raise RuntimeError(f"copy limit: {copied} rows copied, {rows} expected")
            return elapsed, meter
        finally:
            for c in conns:
                c.close()

    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM usage_event WHERE organization_id = ANY(%s)",
                    [org_ids])
        rows = cur.fetchone()[0]
    tries = {"text_x1": timed("text", 1), "binary_x1": timed("binary", 1)}
    if connections > 1:
        tries[f"binary_x{connections}"] = timed("binary", connections)
    per_s = {name: round(rows / s) for name, (s, _) in tries.items()}
    best = max(per_s, key=lambda k: per_s[k])
    meter = tries[best][1]
    return {"copy_limit_rows_per_s": per_s[best], "copy_limit_method": best,
            "copy_limit_rows": rows, "copy_limit_tries": per_s,
            "copy_limit_cpu_us_per_row": {"machine": round(meter.machine_s * 1e6 / rows, 2),
                                          "postgres": round(meter.by_name["postgres"] * 1e6
                                                            / rows, 2)}}


def bench(args: argparse.Namespace) -> dict:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "billing_platform.settings")
    import django

    django.setup()
    from django.conf import settings
    from django.core.management import call_command
    from django.db import connection

    from metering import conf

    _check_template()
    call_command("migrate", verbosity=0)
    if args.reset:
        if "bench" not in connection.settings_dict["NAME"]:
            raise SystemExit("--reset only empties a database whose name contains 'bench'")
        with connection.cursor() as cur:
            cur.execute("TRUNCATE usage_event, usage_event_id, usage_rollup_hourly")
    run = uuid.uuid4().hex[:8]
    keys = _setup_orgs(args.orgs, run)
    org_ids = sorted({k[0] for k in keys})

    # 1. throughput: the whole run offered as fast as the producer can (or at --rate)
    load = _phase(args, events=args.events, rate=args.rate, run=f"{run}a", keys=keys)
    # the ceiling, right after: a plain COPY of the rows just recorded
    limit = _copy_limit(org_ids, connections=args.writers * args.consumers)
    # 2. lag: events offered at a steady rate below the throughput, as a gateway would
    lag_rate = args.lag_rate or int((load["events_per_s"] or 1000) * 0.8)
    lag = (_phase(args, events=args.lag_events, rate=lag_rate, run=f"{run}b", keys=keys)
           if args.lag_events else load)

    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM usage_event WHERE organization_id = ANY(%s)",
                    [org_ids])
        rows = cur.fetchone()[0]
        cur.execute("SELECT coalesce(sum(requests), 0) FROM usage_rollup_hourly "
                    "WHERE organization_id = ANY(%s)", [org_ids])
        rollup_requests = int(cur.fetchone()[0])
    expected = args.events + (args.lag_events or 0)
    cpu, copy_cpu = load["cpu_us_per_event"], limit["copy_limit_cpu_us_per_row"]
    # What stays on the machine's cores per event however ingest is built: the stream's Redis
    # work (the producer's XADDs included) and the producer's sending, plus PostgreSQL doing no
    # more than the plain COPY of the row (no key claimed, no index, no rating, no rollup)
    floor_us = cpu["redis"] + cpu["producer"] + copy_cpu["postgres"]
    return {
        "events": load["events"],
        "events_per_s": load["events_per_s"],
        "copy_limit_rows_per_s": limit["copy_limit_rows_per_s"],
        "events_per_copy_limit": (round(load["events_per_s"] / limit["copy_limit_rows_per_s"], 3)
                                  if load["events_per_s"] else None),
        "lag_p50_s": lag["lag_p50_s"],
        "lag_p99_s": lag["lag_p99_s"],
        "lag_max_s": lag["lag_max_s"],
        "lag_offered_rate": lag["offered_rate"],
        "lag_events": lag["events"],
        "saturated_lag_p50_s": load["lag_p50_s"],
        "saturated_lag_p99_s": load["lag_p99_s"],
        "duration_s": load["duration_s"],
        "copy_limit_method": limit["copy_limit_method"],
        "copy_limit_tries": limit["copy_limit_tries"],
        # where the time goes: the throughput phase's CPU an event by process, beside the
        # COPY limit's CPU a row; PostgreSQL's share alone bounds the ratio on a busy machine
        "cpu_us_per_event": load["cpu_us_per_event"],
        "copy_limit_cpu_us_per_row": limit["copy_limit_cpu_us_per_row"],
        "postgres_cpu_per_copy_limit": (
            round(load["cpu_us_per_event"]["postgres"]
                  / limit["copy_limit_cpu_us_per_row"]["postgres"], 2)
            if limit["copy_limit_cpu_us_per_row"]["postgres"] else None),
        # the ratio this run would reach with consumers that cost nothing and a PostgreSQL
        # that only COPYs each event, all cores busy: what the machine leaves the design
        "events_per_copy_limit_ceiling": (
            round(os.cpu_count() * 1e6 / floor_us / limit["copy_limit_rows_per_s"], 3)
            if floor_us and os.cpu_count() else None),
        "producer_events_per_s": load["producer_events_per_s"],
        "batches": load["batches"],
        "batch_size": args.batch_size or conf.batch_size(),
        "writers": args.writers,
        "consumers": args.consumers,
        "request_ids": args.ids,
        "duplicates": load["duplicates"] + (lag["duplicates"] if args.lag_events else 0),
        "dead_lettered": load["dead_lettered"] + (lag["dead_lettered"] if args.lag_events else 0),
        "rows_in_usage_event": rows,
        "rollup_requests": rollup_requests,
        "exactly_once": rows == expected == rollup_requests,
        "postgres": connection.pg_version,
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "database": settings.DATABASES["default"]["NAME"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--rate", type=int, default=0,
                        help="offered events/s of the throughput phase (0: max)")
    parser.add_argument("--lag-events", type=int, default=200_000,
                        help="events of the lag phase (0: report the throughput phase's lag)")
    parser.add_argument("--lag-rate", type=int, default=0,
                        help="offered events/s of the lag phase (0: 80%% of the throughput)")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--orgs", type=int, default=10)
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--consumers", type=int, default=2,
                        help="consumer processes, one per shard of the stream (sharded by org)")
    parser.add_argument("--ids", choices=["gateway", "random", "ordered"], default="gateway",
                        help="request ids: the gateway's (time first, 80 random bits), "
                             "all random (the gateway's before) or a sequence")
    parser.add_argument("--reset", action="store_true", help="empty the usage tables first")
    parser.add_argument("--produce", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--consume", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.produce:
        produce(args)
        return
    if args.consume:
        args.batch_size = args.batch_size or None
        consume(args)
        return
    if args.consumers > 1:  # every process reads it (this one again at each phase)
        os.environ["TOLLGATE_USAGE_STREAM_SHARDS"] = str(args.consumers)
    print(json.dumps(bench(args)))


if __name__ == "__main__":
    main()
