"""Scale benchmark: gateway requests/s with 1, 2 and 4 gateway processes, limits and usage
exactly once across them, and ingest events/s with 1 and 2 consumer processes.

Everything runs on this machine, in one run, against servers of the run's own: a fresh
PostgreSQL database (named after ``DATABASE_URL``'s with ``_bench_scale`` appended, dropped
at the end), a private Redis (the embedded default's ``redis-server``, append-only file on, as
in production; the shared one is never touched), ``--engines`` simulated engines of one pool
(``--sims-per-process`` of them per process, each its own port and engine), ``--orgs``
organizations with a key each (created in bulk), and the usage stream sharded by organization
into ``--shards`` streams (``TOLLGATE_USAGE_STREAM_SHARDS``).

1. Gateway. For each N of ``--processes``, N gateway processes (uvicorn serving the real ASGI
   app, DEBUG off, each its own port as N hosts behind a load balancer; the clients'
   connections are spread round-robin over them) are started, warmed (one request of each
   organization: its key in the Redis key cache, connections open), then sent ``--requests``
   chat completions from ``--concurrency`` concurrent clients, spread evenly over the
   organizations. A quota policy is cached per process for ``TOLLGATE_QUOTA_POLICY_TTL_S``
   (2 s): with 1,000 orgs each org's requests are further apart than that, so nearly every
   request also reloads its policy from PostgreSQL (off the request path), as a gateway with
   many quiet tenants does.
   ``throughput_by_processes`` is requests/s per N and ``throughput_ratio_vs_1`` its ratio to
   one process; ``cpu_ms_per_request`` is CPU time per request of the gateways, the engines,
   the client and Redis (from /proc and Redis's INFO), and ``redis_commands_per_request`` the
   commands Redis ran per request. On a machine with few cores the processes share them with
   the engines and the client: ``cores`` says how many there were.
2. Limits. In each N's run, ``--limited-orgs`` organizations of their own have an RPM limit of
   ``--rpm`` and are sent 1.5 x that many requests, early in the run and all within the
   minute; ``limits_exact`` is whether each was admitted exactly ``--rpm`` times across the N
   processes (``limits`` has the counts).
3. Exactly once. No consumer runs while the gateways serve (the events wait in the stream);
   then ``max(--consumers)`` ``manage.py ingest_usage`` processes drain them. ``lost_events``
   counts admitted (200) responses whose ``x-request-id`` has no row in ``usage_event``,
   ``doubled_events`` request ids with more than one row there (counted from the rows, not
   from the idempotency table).
4. Ingest. For each C of ``--consumers``, C ``manage.py ingest_usage --shards ...`` processes
   split the shards (round-robin), are started and stopped (SIGSTOP) once ready, the streams
   are filled with ``--ingest-events`` events through ``metering.stream.append_many`` (the
   gateway's wire form, each event to its organization's shard), and the consumers resumed;
   ``ingest_events_per_s`` is events over the time from the resume to the last row present
   in PostgreSQL, per C.

Prints one JSON line. Progress goes to stderr. Every process and the database are removed at
the end, also on Ctrl-C.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/tollgate \\
        .venv/bin/python bench/scale.py            # 64 engines, 1,000 orgs, ~7 min on 2 cores
    .venv/bin/python bench/scale.py --quick        # a smoke run, ~1 min
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlunparse

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.procs import cpu_seconds

MODEL = "bench"
PROMPT = [{"role": "user", "content": "Say hello to the scale benchmark."}]
CHILDREN: list[subprocess.Popen] = []  # every process this run started, ended at exit


def log(msg: str) -> None:
    print(f"[scale] {msg}", file=sys.stderr, flush=True)


def _ints(value: str) -> list[int]:
    return [int(v) for v in value.split(",") if v.strip()]


# --- the simulated engines: several per process --------------------------------------------

def host_sims(spec: dict[str, Any]) -> None:
    """Sim-host role: serve one simulated engine per port of ``spec`` in this one process.

    Each engine is the simulator's own app (its own scheduler, KV cache and counters) on its
    own port; sharing a process only saves the interpreter per engine.
    """
    import uvicorn

    from engine_adapter.sim.app import create_app
    from engine_adapter.sim.config import parse_args

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # one handler below stops them all
            yield

    servers = []
    for port in spec["ports"]:
        config = parse_args(["--port", str(port), "--served-model-name", spec["model"],
                             *spec["flags"]])
        servers.append(Server(uvicorn.Config(
            create_app(config), host="127.0.0.1", port=port, log_level="warning",
            access_log=False, lifespan="off", timeout_graceful_shutdown=1)))

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: [setattr(s, "should_exit", True)
                                                  for s in servers])
        await asyncio.gather(*(s.serve() for s in servers))

    asyncio.run(serve())


def start_sims(count: int, per_process: int, logs: Path) -> list[str]:
    """Start ``count`` simulated engines, ``per_process`` per process; return their URLs."""
    from engine_adapter.sim.testing import FAST_RATES, free_port

    flags = ["--max-running-requests", "256"]
    for name, value in FAST_RATES.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    ports = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    for i in range(0, count, per_process):
        spec = {"ports": ports[i:i + per_process], "model": MODEL, "flags": flags}
        CHILDREN.append(subprocess.Popen(
            [sys.executable, __file__, "--host-sims", json.dumps(spec)], cwd=ROOT,
            stdout=open(logs / f"sims-{i}.log", "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
            start_new_session=True))
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    _wait_http([f"{u}/health" for u in urls], timeout=60, what="simulated engines")
    return urls


def _wait_http(urls: list[str], *, timeout: float, what: str) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    waiting = list(urls)
    while waiting and time.monotonic() < deadline:
        try:
            if httpx.get(waiting[0], timeout=1).status_code < 500:
                waiting.pop(0)
                continue
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    if waiting:
        raise RuntimeError(f"{what} did not answer within {timeout:.0f} s: {waiting[0]}")


# --- processes ----------------------------------------------------------------------------

def stop_children(procs: list[subprocess.Popen] | None = None) -> None:
    """End the given processes (default: all of this run's), each by its process group."""
    procs = list(CHILDREN if procs is None else procs)
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGCONT)  # a stopped consumer must see its TERM
                os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        if proc in CHILDREN:
            CHILDREN.remove(proc)


@dataclass
class Env:
    database_url: str
    redis_url: str
    shards: int
    logs: Path
    sims: list[subprocess.Popen] = field(default_factory=list)

    def child(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "DATABASE_URL": self.database_url, "REDIS_URL": self.redis_url,
                "TOLLGATE_USAGE_STREAM_SHARDS": str(self.shards), "DEBUG": "0",
                "PYTHONUNBUFFERED": "1", **extra}


def start_gateways(env: Env, n: int) -> tuple[list[subprocess.Popen], list[str]]:
    from engine_adapter.sim.testing import free_port

    procs, urls = [], []
    for i in range(n):
        port = free_port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "billing_platform.asgi:application", "--host",
             "127.0.0.1", "--port", str(port), "--lifespan", "on", "--no-access-log",
             "--log-level", "warning"], cwd=ROOT, env=env.child(),
            stdout=open(env.logs / f"gateway-{n}-{i}.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT, start_new_session=True))
        urls.append(f"http://127.0.0.1:{port}")
    CHILDREN.extend(procs)
    _wait_http([f"{u}/v1/models" for u in urls], timeout=90, what="gateways")
    return procs, urls


def start_consumers(env: Env, count: int, tag: str) -> list[subprocess.Popen]:
    """Start ``count`` ingest consumers splitting the shards round-robin; return once each
    says it consumes."""
    procs, logs = [], []
    for i in range(count):
        shards = ",".join(str(s) for s in range(env.shards) if s % count == i)
        path = env.logs / f"ingest-{tag}-{i}.log"
        procs.append(subprocess.Popen(
            [sys.executable, "manage.py", "ingest_usage", "--shards", shards, "--block-ms",
             "100", "--name", f"bench-{tag}-{i}"], cwd=ROOT, env=env.child(),
            stdout=open(path, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
            start_new_session=True))
        logs.append(path)
    CHILDREN.extend(procs)
    deadline = time.monotonic() + 60
    while not all(b"ingest_usage: consumer" in p.read_bytes() for p in logs):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError("ingest consumers did not start:\n" + "\n".join(
                p.read_text(errors="replace")[-2000:] for p in logs))
        time.sleep(0.1)
    return procs


# --- set-up ---------------------------------------------------------------------------------

def bench_database_url(base: str) -> str:
    parsed = urlparse(base)
    name = f"{parsed.path.lstrip('/') or 'tollgate'}_bench_scale"
    return urlunparse(parsed._replace(path=f"/{name}"))


@dataclass
class Org:
    id: int
    project_id: int
    key_id: int
    secret: str
    rpm: int | None = None


def setup_platform(engine_urls: list[str], n_orgs: int) -> list[Org]:
    """Migrate, register the engines as one pool, price the model, create the orgs."""
    from decimal import Decimal

    from django.core.management import call_command
    from django.db import transaction

    from bench.pricing import price_model
    from billing_platform.accounts import services as accounts
    from billing_platform.accounts.models import Organization, Project, public_id
    from engine_adapter.choices import EngineStatus, Launch
    from engine_adapter.models import EngineInstance, Pool

    t0 = time.monotonic()
    call_command("migrate", "--noinput", verbosity=0)
    log(f"migrated in {time.monotonic() - t0:.0f} s")
    pool = Pool.objects.create(name="bench", model=MODEL, region="us-east", zone="us",
                               launch=Launch.EXTERNAL, gpu_hourly_cost=Decimal("2.00"),
                               max_total_tokens=200_000, external_urls=engine_urls)
    EngineInstance.objects.bulk_create([
        EngineInstance(pool=pool, replica=i, engine_id=f"bench-{i}", url=url,
                       status=EngineStatus.HEALTHY) for i, url in enumerate(engine_urls)])
    price_model(MODEL)
    t0 = time.monotonic()
    with transaction.atomic():
        orgs = Organization.objects.bulk_create([
            Organization(name=f"Scale {i}", slug=f"scale-{i}", public_id=public_id("org"),
                         billing_email="bench@tollgate.local") for i in range(n_orgs)])
        projects = Project.objects.bulk_create([
            Project(organization=o, name="Default project", public_id=public_id("proj"))
            for o in orgs])
        out = []
        for org, project in zip(orgs, projects, strict=True):
            # the service, not a copy of its key format: 1,000 of these take a few seconds
            key, secret = accounts.api_key_create(project=project, name="bench",
                                                  scopes=["inference"])
            out.append(Org(org.id, project.id, key.id, secret))
    log(f"{n_orgs} organizations with a key each in {time.monotonic() - t0:.1f} s")
    return out


def limit_orgs(orgs: list[Org], rpm: int) -> None:
    from billing_platform.accounts.models import Organization
    from plans import limits

    for org in orgs:
        limits.quota_limit_set(organization=Organization.objects.get(pk=org.id), rpm=rpm)
        org.rpm = rpm


# --- traffic --------------------------------------------------------------------------------

@dataclass
class Reply:
    org: Org
    status: int
    request_id: str | None
    sent_at: float


async def drive(urls: list[str], plan: list[Org], *, concurrency: int, max_tokens: int
                ) -> tuple[list[Reply], float]:
    """Send one chat completion per entry of ``plan`` from ``concurrency`` clients, client i
    to gateway i mod N; return the replies and the seconds it took."""
    import aiohttp

    todo = iter(plan)
    replies: list[Reply] = []
    errors: Counter[str] = Counter()
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        async def client(i: int) -> None:
            url = f"{urls[i % len(urls)]}/v1/chat/completions"
            for org in todo:
                sent = time.monotonic()
                body = {"model": MODEL, "messages": PROMPT, "max_tokens": max_tokens}
                try:
                    async with http.post(url, json=body, headers={
                            "Authorization": f"Bearer {org.secret}"}) as r:
                        await r.read()
                        replies.append(Reply(org, r.status, r.headers.get("x-request-id"),
                                             sent))
                except aiohttp.ClientError as exc:
                    errors[type(exc).__name__] += 1
                    replies.append(Reply(org, 0, None, sent))

        t0 = time.monotonic()
        await asyncio.gather(*(client(i) for i in range(concurrency)))
        elapsed = time.monotonic() - t0
    if errors:
        log(f"transport errors: {dict(errors)}")
    return replies, elapsed


def traffic_plan(free: list[Org], limited: list[Org], requests: int, rpm: int,
                 seed: int) -> list[Org]:
    """``requests`` requests spread evenly over ``free``; each limited org's 1.5 x rpm
    requests mixed into the first quarter, so they all fall within the minute."""
    rng = random.Random(seed)
    extra = [o for o in limited for _ in range(rpm * 3 // 2)]
    rest = list(itertools.islice(itertools.cycle(free), max(0, requests - len(extra))))
    rng.shuffle(rest)
    head_len = min(len(rest), max(len(extra) * 3, len(rest) // 4))
    head = rest[:head_len] + extra
    rng.shuffle(head)
    return head + rest[head_len:]


def redis_stats(url: str) -> tuple[int, float]:
    """Return Redis's commands processed and CPU seconds so far."""
    import redis

    r = redis.Redis.from_url(url)
    stats, cpu = r.info("stats"), r.info("cpu")
    return int(stats["total_commands_processed"]), float(
        cpu["used_cpu_user"] + cpu["used_cpu_sys"])


def gateway_phase(env: Env, n: int, free: list[Org], limited: list[Org], args
                  ) -> tuple[dict[str, Any], list[Reply]]:
    procs, urls = start_gateways(env, n)
    try:
        # warm-up: every free org once, round-robin over the processes (the key cache in
        # Redis, connections); the limited orgs are left alone, their minute starts in the run
        warm = list(free)
        warm_replies, _ = asyncio.run(drive(urls, warm, concurrency=min(args.concurrency,
                                                                        len(warm)),
                                            max_tokens=args.max_tokens))
        bad = Counter(r.status for r in warm_replies if r.status != 200)
        if bad:
            log(f"N={n}: warm-up answers other than 200: {dict(bad)}")
        # what the processes spend with no traffic (fleet view refresh, shared loads, ...)
        idle0, t_idle = cpu_seconds(procs), time.monotonic()
        time.sleep(2.0)
        idle_ms_per_s = (cpu_seconds(procs) - idle0) / (time.monotonic() - t_idle) * 1000
        plan = traffic_plan(free, limited, args.requests, args.rpm, seed=n)
        commands0, redis_cpu0 = redis_stats(env.redis_url)
        cpu0 = (cpu_seconds(procs), cpu_seconds(env.sims), time.process_time())
        replies, elapsed = asyncio.run(drive(urls, plan, concurrency=args.concurrency,
                                             max_tokens=args.max_tokens))
        cpu1 = (cpu_seconds(procs), cpu_seconds(env.sims), time.process_time())
        commands1, redis_cpu1 = redis_stats(env.redis_url)
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{len(dead)} gateway process(es) died; see {env.logs}")
    finally:
        stop_children(procs)
    codes = Counter(r.status for r in replies)
    per_org = Counter(r.org.id for r in replies if r.status == 200)
    spans = {}
    for org in limited:
        sent = [r.sent_at for r in replies if r.org is org]
        spans[org.id] = max(sent) - min(sent)
    served = [r for r in replies if r.org.rpm is None]
    count = len(replies)
    out = {
        "rps": round(count / elapsed, 1),
        "seconds": round(elapsed, 2),
        "statuses": {str(k): v for k, v in sorted(codes.items())},
        "free_orgs_all_200": all(r.status == 200 for r in served),
        "cpu_ms_per_request": {
            "gateways": round((cpu1[0] - cpu0[0]) / count * 1000, 3),
            "engines": round((cpu1[1] - cpu0[1]) / count * 1000, 3),
            "client": round((cpu1[2] - cpu0[2]) / count * 1000, 3),
            "redis": round((redis_cpu1 - redis_cpu0) / count * 1000, 3),
        },
        "redis_commands_per_request": round((commands1 - commands0) / count, 2),
        "idle_cpu_ms_per_s": round(idle_ms_per_s, 1),  # all N processes together
        "limits": [{"org": o.id, "rpm": o.rpm, "sent": args.rpm * 3 // 2,
                    "admitted": per_org[o.id], "span_s": round(spans[o.id], 1)}
                   for o in limited],
    }
    log(f"N={n}: {out['rps']} requests/s over {count} requests in {out['seconds']} s, "
        f"statuses {out['statuses']}, cpu ms/request {out['cpu_ms_per_request']}, idle "
        f"cpu {out['idle_cpu_ms_per_s']} ms/s")
    return out, warm_replies + replies


# --- usage: exactly once, and ingest --------------------------------------------------------

def _rows(cur, request_ids: list[str]) -> tuple[int, int]:
    """Return (ids with no row, ids with more than one row) among ``request_ids``."""
    cur.execute("""SELECT count(*) FILTER (WHERE n IS NULL), count(*) FILTER (WHERE n > 1)
                     FROM unnest(%s::text[]) AS ids(id)
                     LEFT JOIN (SELECT request_id, count(*) AS n FROM usage_event
                                 WHERE request_id = ANY(%s) GROUP BY request_id) AS e
                       ON e.request_id = ids.id""", [request_ids, request_ids])
    lost, doubled = cur.fetchone()
    return int(lost), int(doubled)


def _event_count(cur) -> int:
    cur.execute("SELECT count(*) FROM usage_event")
    return int(cur.fetchone()[0])


def drain_gateway_events(env: Env, replies: list[Reply], consumers: int) -> dict[str, Any]:
    """Run ``consumers`` consumers until every admitted request has its row (or no more
    arrive for 30 s); return the lost and doubled counts."""
    from django.db import connection

    admitted = [r.request_id for r in replies if r.status == 200 and r.request_id]
    missing_id = sum(1 for r in replies if r.status == 200 and not r.request_id)
    procs = start_consumers(env, consumers, "gateway")
    t0 = time.monotonic()
    try:
        with connection.cursor() as cur:
            last, last_change = -1, time.monotonic()
            while time.monotonic() - last_change < 30:
                lost, _ = _rows(cur, admitted)
                if lost == 0:
                    break
                if lost != last:
                    last, last_change = lost, time.monotonic()
                time.sleep(0.5)
            time.sleep(1.0)  # anything recorded twice would show by now
            lost, doubled = _rows(cur, admitted)
    finally:
        stop_children(procs)
    log(f"gateway events: {len(admitted)} admitted, {lost} lost, {doubled} doubled "
        f"(drained in {time.monotonic() - t0:.1f} s by {consumers} consumer(s))")
    return {"admitted_requests": len(admitted), "lost_events": lost + missing_id,
            "doubled_events": doubled}


def fill_stream(orgs: list[Org], events: int) -> None:
    """Append ``events`` gateway-shaped events, each to its organization's shard."""
    from datetime import UTC, datetime

    from metering import conf, stream
    from metering import events as usage_events

    now = datetime.now(UTC)
    by_key: dict[str, list[bytes]] = {}
    for i in range(events):
        org = orgs[i % len(orgs)]
        event = usage_events.UsageEventData(
            request_id=usage_events.new_request_id(), org_id=org.id, project_id=org.project_id,
            api_key_id=org.key_id, model=MODEL, region="us-east", engine=f"bench-{i % 64}",
            event_time=now, prompt_tokens=40 + i % 200, cached_tokens=i % 40,
            completion_tokens=1 + i % 64, queue_ms=1, ttft_ms=3, total_ms=9)
        by_key.setdefault(conf.stream_key_of(org.id), []).append(usage_events.encode(event))
    for key, payloads in by_key.items():
        for i in range(0, len(payloads), 500):
            stream.append_many(payloads[i:i + 500], key=key)


def ingest_phase(env: Env, orgs: list[Org], consumers: int, events: int) -> dict[str, Any]:
    from django.db import connection

    procs = start_consumers(env, consumers, f"c{consumers}")
    try:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGSTOP)
        with connection.cursor() as cur:
            expected = _event_count(cur) + events
            t_fill = time.monotonic()
            fill_stream(orgs, events)
            log(f"C={consumers}: {events} events in the streams in "
                f"{time.monotonic() - t_fill:.1f} s; consumers resumed")
            t0 = time.monotonic()
            for proc in procs:
                os.killpg(proc.pid, signal.SIGCONT)
            rows = 0
            while time.monotonic() - t0 < 600:
                rows = _event_count(cur)
                if rows >= expected:
                    break
                time.sleep(0.1)
            elapsed = time.monotonic() - t0
            time.sleep(0.5)
            rows = _event_count(cur)
    finally:
        stop_children(procs)
    rate = round(events / elapsed)
    log(f"C={consumers}: {rate} events/s ({events} in {elapsed:.1f} s), rows "
        f"{'as expected' if rows == expected else f'{rows} of {expected}'}")
    return {"events_per_s": rate, "seconds": round(elapsed, 2), "rows_exact": rows == expected}


# --- the run --------------------------------------------------------------------------------

def bench(args: argparse.Namespace) -> dict[str, Any]:
    from engine_adapter.sim.testing import free_port

    load_at_start = os.getloadavg()[0]
    base_url = os.environ.get("DATABASE_URL") or "postgres://postgres@127.0.0.1:5432/tollgate"
    work = Path(tempfile.mkdtemp(prefix="tollgate-scale-"))
    logs = work / "logs"
    logs.mkdir()
    port = free_port()
    env = Env(database_url=bench_database_url(base_url),
              redis_url=f"redis://127.0.0.1:{port}/0", shards=args.shards, logs=logs)
    # before anything of the platform is imported: billing_platform/env.py reads them once
    os.environ.update({"DATABASE_URL": env.database_url, "REDIS_URL": env.redis_url,
                       "DEBUG": "0", "TOLLGATE_USAGE_STREAM_SHARDS": str(args.shards)})
    for name in ("REDIS_CLUSTER_URL", "CELERY_BROKER_URL", "TOLLGATE_USAGE_REDIS_URL",
                 "DATABASE_REPLICA_URL"):
        os.environ.pop(name, None)
    from bench.invoice_run import bench_django, drop_database
    from billing_platform.embedded import EmbeddedRedis

    redis_server = EmbeddedRedis(data_dir=work / "redis", port=port)
    redis_server.start()
    try:
        bench_django(env.database_url)
        log(f"database {urlparse(env.database_url).path[1:]}, Redis {env.redis_url}, "
            f"logs {logs}")
        t0 = time.monotonic()
        engine_urls = start_sims(args.engines, args.sims_per_process, logs)
        env.sims = list(CHILDREN)
        log(f"{len(engine_urls)} simulated engines in {len(env.sims)} processes "
            f"({time.monotonic() - t0:.1f} s)")
        orgs = setup_platform(engine_urls, args.orgs)
        groups = {n: orgs[i * args.limited_orgs:(i + 1) * args.limited_orgs]
                  for i, n in enumerate(args.processes)}
        limit_orgs([o for g in groups.values() for o in g], args.rpm)
        free = [o for o in orgs if o.rpm is None]

        phases, replies = {}, []
        for n in args.processes:
            phases[n], got = gateway_phase(env, n, free, groups[n], args)
            replies += got
        usage = drain_gateway_events(env, replies, max(args.consumers))
        ingest = {c: ingest_phase(env, orgs, c, args.ingest_events) for c in args.consumers}

        one = phases[args.processes[0]]["rps"]
        limits = [row for p in phases.values() for row in p["limits"]]
        return {
            "bench": "scale",
            "throughput_by_processes": {str(n): p["rps"] for n, p in phases.items()},
            f"throughput_ratio_vs_{args.processes[0]}": {
                str(n): round(p["rps"] / one, 3) for n, p in phases.items()},
            "limits_exact": all(r["admitted"] == r["rpm"] and r["span_s"] < 60
                                for r in limits),
            "lost_events": usage["lost_events"],
            "doubled_events": usage["doubled_events"],
            "ingest_events_per_s": {str(c): i["events_per_s"] for c, i in ingest.items()},
            "ingest_ratio_vs_1": ({str(c): round(i["events_per_s"]
                                                 / ingest[args.consumers[0]]["events_per_s"], 3)
                                   for c, i in ingest.items()}),
            "cores": os.cpu_count(),
            "note": (f"all processes share this machine's {os.cpu_count()} cores (gateways, "
                     f"{args.engines} simulated engines, the client, Redis, PostgreSQL): "
                     "past as many gateway processes as cores, little gain is expected"),
            "engines": args.engines, "engine_processes": len(env.sims), "orgs": args.orgs,
            "requests_per_run": args.requests, "concurrency": args.concurrency,
            "max_tokens": args.max_tokens, "shards": args.shards,
            # a key's cached quota policy is reloaded from PostgreSQL once older than this:
            # with many orgs each seen less often, nearly every request reloads its own
            "quota_policy_ttl_s": float(os.environ.get("TOLLGATE_QUOTA_POLICY_TTL_S", "2")),
            "ingest_events": args.ingest_events,
            "admitted_requests": usage["admitted_requests"],
            "gateway": {str(n): {k: v for k, v in p.items() if k != "limits"}
                        for n, p in phases.items()},
            "limits": limits,
            "ingest": {str(c): i for c, i in ingest.items()},
            # the machine's load from others too: a busy machine lowers every figure
            "load_avg_1m": {"start": round(load_at_start, 2),
                            "end": round(os.getloadavg()[0], 2)},
        }
    finally:
        stop_children()
        with contextlib.suppress(Exception):
            drop_database(env.database_url)
        redis_server.kill()
        import shutil

        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=64)
    p.add_argument("--sims-per-process", type=int, default=8,
                   help="simulated engines served by one process (each its own port)")
    p.add_argument("--orgs", type=int, default=1000)
    p.add_argument("--processes", type=_ints, default=[1, 2, 4],
                   help="gateway process counts, comma-separated")
    p.add_argument("--consumers", type=_ints, default=[1, 2],
                   help="ingest consumer process counts, comma-separated")
    p.add_argument("--shards", type=int, default=4, help="usage stream shards")
    p.add_argument("--requests", type=int, default=3000, help="timed requests per N")
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--limited-orgs", type=int, default=10, help="RPM-limited orgs per N")
    p.add_argument("--rpm", type=int, default=20)
    p.add_argument("--ingest-events", type=int, default=60_000, help="events per consumer run")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 8 engines, 50 orgs, N 1,2, 600 requests, 5,000 events")
    p.add_argument("--host-sims", help=argparse.SUPPRESS)
    if "--quick" in sys.argv[1:]:  # smaller defaults; options given still win
        p.set_defaults(engines=8, orgs=50, processes=[1, 2], requests=600, concurrency=32,
                       ingest_events=5000, limited_orgs=3, rpm=10)
    args = p.parse_args()
    if args.host_sims:
        host_sims(json.loads(args.host_sims))
        return
    if args.processes[0] != 1:
        log("note: ratios are to the first process count given")
    if args.orgs < args.limited_orgs * len(args.processes) + 1:
        raise SystemExit("--orgs must exceed --limited-orgs x the number of process counts")

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)  # cleaned up like Ctrl-C
    try:
        print(json.dumps(bench(args)), flush=True)
    except KeyboardInterrupt:
        log("interrupted: every process and the database removed")
        sys.exit(130)


if __name__ == "__main__":
    main()
