"""Batch interference benchmark: interactive TTFT through the gateway with and without a large
batch running on the same simulated engines, in one run on one machine.

Prints one JSON line with ``ttft_p50_ratio`` and ``ttft_p99_ratio`` (with batch / without;
goal: both at most 1.10) and how many batch lines ran while the "with" phase was measured.
The two phases alternate in short rounds (the batch worker paused with SIGSTOP for "without")
so that drift in the machine's other load falls on both alike.

First, on the same engines with no interactive traffic at all, it measures how fast a batch
runs with the guard (``gateway/batch/guard.py``: the fleet is idle, batch may fill it) and with
no guard (every slot, no TTFT or host-CPU check), in alternating slices of a runner in this
process: ``batch_idle_fill_ratio`` is guarded / unguarded lines per second (goal: at least 0.8),
with a 90 % bootstrap interval over the rounds (``batch_idle_fill_90pct_interval``): on a host
shared with other work one slice can read twice another of the same kind, so many short
alternating slices (``--idle-rounds 6 --idle-slice-s 3``) say more than a few long ones.

    .venv/bin/python bench/batch_interference.py [--requests 4000] [--concurrency 4]

Each ratio comes with a 90 % bootstrap interval (``ttft_ratio_90pct_interval``): at 4,000
requests the p99 ratio's is about +-8 %, so judge the goal on ``--requests 16000 --rounds 160``
(about 10 minutes), whose interval is about +-4 %.

Needs PostgreSQL and Redis (DATABASE_URL / REDIS_URL, or the embedded servers started by
``./tollgate services``). The Celery batch worker runs at the CPU priority ``./tollgate up`` gives
it (``devstack.background_priority``: SCHED_IDLE on Linux, in a session group of nice 19), as
on any host it shares with the gateway and engines; a large deployment runs it elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "billing_platform.settings")

from bench.pricing import price_model
from billing_platform.devstack import background_priority
from engine_adapter.sim.testing import free_port, start_sim

MODEL = "bench-batch"


def log(msg: str) -> None:
    print(f"[batch-bench] {msg}", file=sys.stderr, flush=True)


class CpuMeter:
    """CPU seconds used by each part of the set-up, and by the whole machine, per phase.

    Shows whether the machine's two cores were saturated while TTFT was measured (then any
    extra work, batch included, lengthens TTFT however the engines schedule it).
    """

    def __init__(self, parts: dict[str, list[int]], *, own: str,
                 servers: dict[str, str]) -> None:
        import psutil

        self.parts = {name: [psutil.Process(pid) for pid in pids] for name, pids in parts.items()}
        self.own = own  # the part that is this process: its children are the other parts
        self.servers = servers  # part -> process name (PostgreSQL's and Redis's processes)
        self.totals: dict[str, dict[str, float]] = {}

    def _read(self) -> dict[str, float]:
        import psutil

        out = {}
        for name, procs in self.parts.items():
            used = 0.0
            for proc in procs:
                with contextlib.suppress(psutil.Error):
                    kids = [] if name == self.own else proc.children(recursive=True)
                    for p in [proc, *kids]:
                        t = p.cpu_times()
                        used += t.user + t.system
            out[name] = used
        for name in self.servers:
            out[name] = 0.0
        wanted = {process: name for name, process in self.servers.items()}
        for proc in psutil.process_iter(["name"]):
            name = wanted.get(proc.info["name"])
            if name is not None:
                with contextlib.suppress(psutil.Error):
                    t = proc.cpu_times()
                    out[name] += t.user + t.system
        t = psutil.cpu_times()
        out["machine_busy"] = sum(t) - t.idle - getattr(t, "iowait", 0.0)
        out["wall"] = time.monotonic()
        return out

    @contextlib.contextmanager
    def phase(self, name: str):
        before = self._read()
        yield
        after = self._read()
        total = self.totals.setdefault(name, {})
        for k in after:
            total[k] = total.get(k, 0.0) + after[k] - before[k]

    def report(self) -> dict[str, dict[str, float]]:
        """Return per phase: cores used by each part and by the machine (of os.cpu_count())."""
        return {phase: {**{k: round(v / t["wall"], 2) for k, v in t.items() if k != "wall"},
                        "seconds": round(t["wall"], 1)}
                for phase, t in self.totals.items()}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def ratio_interval(rounds: list[tuple[list[float], list[float]]], q: float, *,
                   resamples: int = 400, seed: int = 1) -> list[float]:
    """Return a 90 % bootstrap interval of the with/without ratio of the ``q`` quantile.

    ``rounds`` holds each round's (without, with) TTFTs; whole rounds are resampled, both
    phases together, since a stall of the machine hits the requests of one round alike. A
    p99 from a few thousand samples rests on a few dozen of them, so the interval says how
    far one run's ratio can be trusted (an A/A run, ``--calibrate``, shows it too).
    """
    import random

    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        picked = rng.choices(rounds, k=len(rounds))
        ratios.append(pct([t for _, w in picked for t in w], q)
                      / pct([t for wo, _ in picked for t in wo], q))
    ratios.sort()
    return [round(ratios[int(0.05 * resamples)], 3), round(ratios[int(0.95 * resamples)], 3)]


async def ttfts(url: str, secret: str, *, requests: int, concurrency: int) -> list[float]:
    """Send ``requests`` streaming chats, ``concurrency`` at a time; return TTFTs in ms."""
    headers = {"Authorization": f"Bearer {secret}"}
    out: list[float] = []
    counter = iter(range(requests))

    async def worker(http: httpx.AsyncClient) -> None:
        for n in counter:
            body = {"model": MODEL, "max_tokens": 16, "stream": True,
                    "messages": [{"role": "user", "content": f"Interactive {n}: hello"}]}
            t0 = time.perf_counter()
            ttft = None
            async with http.stream("POST", url, json=body, headers=headers) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if ttft is None and line.startswith("data: {") and '"content"' in line:
                        ttft = time.perf_counter() - t0
            out.append((ttft or 0) * 1000)

    async with httpx.AsyncClient(timeout=60) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return out


def setup_platform(sims) -> str:
    """Migrate, create an org with a batch-capable key, register the engines; return the key."""
    import django

    django.setup()
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)
    from django.core.management import call_command

    from billing_platform.accounts import services
    from billing_platform.accounts.models import User
    from engine_adapter.choices import EngineStatus, Launch
    from engine_adapter.models import EngineInstance, Pool
    from plans.limits import quota_limit_set

    call_command("migrate", "--noinput", verbosity=0)
    EngineInstance.objects.filter(pool__model=MODEL).delete()
    Pool.objects.filter(model=MODEL).delete()
    for i, sim in enumerate(sims):
        pool = Pool.objects.create(name=f"{MODEL}-{i}", model=MODEL, region="us-east",
                                   zone="us", launch=Launch.EXTERNAL,
                                   external_urls=[sim.base_url])
        EngineInstance.objects.create(pool=pool, replica=0, engine_id=f"{MODEL}-{i}-0",
                                      url=sim.base_url, status=EngineStatus.HEALTHY)
    price_model(MODEL)
    user = User.objects.filter(email="batch-bench@tollgate.local").first() or \
        User.objects.create_user(email="batch-bench@tollgate.local", password=None)
    org = services.organization_create(name=f"Batch bench {uuid.uuid4().hex[:6]}", owner=user)
    # limits far above the offered load: this bench measures interference, not rate limits
    quota_limit_set(organization=org, rpm=10**7, tpm=10**10)
    _key, secret = services.api_key_create(project=org.projects.get(), name="bench",
                                           scopes=["inference", "batch"])
    return secret


def batch_lines(n: int, prefix: str = "b") -> bytes:
    return b"".join(json.dumps({
        "custom_id": f"{prefix}{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL, "max_tokens": 16, "messages": [
            {"role": "user", "content": f"Batch item {prefix}{i}: summarise."}]}}).encode()
        + b"\n" for i in range(n))


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def idle_fill(client, *, rounds: int, slice_s: float, lines: int) -> dict[str, list[float]]:
    """Run one batch on the idle fleet in alternating slices of this process's runner, with
    the guard and with none (floor 1.0: every slot; no host-CPU check); return each kind's
    lines per second, slice by slice. No interactive request runs meanwhile, and the batch
    worker is not started yet; the batch is cancelled afterwards."""
    from django.conf import settings

    from billing_platform.gateway.batch import runner
    from billing_platform.gateway.batch import services as batch_services
    from billing_platform.gateway.batch.guard import scavengers_forget
    from billing_platform.gateway.models import Batch, BatchLine, LineState

    file = client.files.create(file=("idle.jsonl", io.BytesIO(batch_lines(lines, "i"))),
                               purpose="batch")
    created = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                    completion_window="24h")
    pk = Batch.objects.get(public_id=created.id).pk
    batch_services.batch_validate(batch_id=pk)
    guarded = (settings.BATCH_MAX_RUNNING_FRACTION, settings.BATCH_HOST_CPU_CEILING)
    kinds = {"guarded": guarded, "unguarded": (1.0, 1.0)}
    out: dict[str, list[float]] = {kind: [] for kind in kinds}

    def completed() -> int:
        return BatchLine.objects.filter(batch_id=pk, state=LineState.COMPLETED).count()

    try:
        runner.batch_run(batch_id=pk, slice_s=1.0)  # warm: connections, the fleet view
        for i in range(rounds):
            order = list(kinds) if i % 2 == 0 else list(kinds)[::-1]
            for kind in order:
                settings.BATCH_MAX_RUNNING_FRACTION, settings.BATCH_HOST_CPU_CEILING = kinds[kind]
                scavengers_forget()
                before, t0 = completed(), time.monotonic()
                runner.batch_run(batch_id=pk, slice_s=slice_s)
                out[kind].append((completed() - before) / (time.monotonic() - t0))
                log(f"idle fleet, {kind}: {out[kind][-1]:.0f} lines/s")
    finally:
        settings.BATCH_MAX_RUNNING_FRACTION, settings.BATCH_HOST_CPU_CEILING = guarded
        scavengers_forget()
        if client.batches.retrieve(created.id).status == "in_progress":
            client.batches.cancel(created.id)  # (a short bench may have run it to the end)
    return out


def fill_interval(idle: dict[str, list[float]], *, resamples: int = 400,
                  seed: int = 1) -> list[float] | None:
    """Return a 90 % bootstrap interval of guarded / unguarded mean lines per second, whole
    rounds (one slice of each kind, run back to back) resampled."""
    import random

    pairs = list(zip(idle["guarded"], idle["unguarded"], strict=False))
    if len(pairs) < 2:
        return None
    rng = random.Random(seed)
    ratios = sorted(mean([g for g, _ in picked]) / mean([u for _, u in picked])
                    for picked in (rng.choices(pairs, k=len(pairs)) for _ in range(resamples)))
    return [round(ratios[int(0.05 * resamples)], 3), round(ratios[int(0.95 * resamples)], 3)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--lines", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--decode-tokens-per-s", type=float, default=500.0)
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--idle-rounds", type=int, default=6,
                   help="idle-fleet slices of each kind (guarded, unguarded); 0: skip")
    p.add_argument("--idle-slice-s", type=float, default=3.0)
    p.add_argument("--calibrate", action="store_true",
                   help="keep the batch paused in both phases: the ratios then show the "
                        "bench's own noise (an A/A run)")
    args = p.parse_args()

    import logging

    import openai

    logging.getLogger("httpx").setLevel(logging.WARNING)
    sims = [start_sim(served_model_name=MODEL, max_running_requests=args.max_running,
                      prefill_tokens_per_s=200_000,
                      decode_tokens_per_s=args.decode_tokens_per_s)
            for _ in range(2)]
    files_dir = tempfile.mkdtemp(prefix="tollgate-batch-bench-")
    # DEBUG off, as in production: Django's debug cursor records every query it runs. This
    # process runs the idle-fleet slices itself, under the same settings.
    os.environ.update({"DEBUG": "0", "TOLLGATE_FILES_DIR": files_dir,
                       "TOLLGATE_BATCH_SWEEP_S": "5",
                       "TOLLGATE_USAGE_STREAM": f"tg:usage:bench:{uuid.uuid4().hex[:8]}",
                       "TOLLGATE_FLEET_HEALTH_S": "3600", "TOLLGATE_FLEET_REFRESH_S": "1"})
    env = dict(os.environ)
    secret = setup_platform(sims)
    from django.conf import settings as live

    # this process read billing_platform/env.py on import, before the lines above
    live.FILES_DIR, live.DEBUG = files_dir, False
    port = free_port()
    gateway = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "billing_platform.asgi:application", "--host",
         "127.0.0.1", "--port", str(port), "--lifespan", "on", "--no-access-log",
         "--log-level", "warning"], cwd=ROOT, env=env, start_new_session=True)
    gw = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{gw}/v1", api_key=secret, max_retries=2)
    batch_id = None
    worker = None
    idle: dict[str, list[float]] = {"guarded": [], "unguarded": []}
    try:
        for _ in range(150):
            try:
                httpx.get(f"{gw}/v1/models", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        if args.idle_rounds:
            # enough lines for every slice at 1,000 lines/s (a batch that ran out mid-slice
            # counted as a slow slice), within the Batch API's 50,000
            idle = idle_fill(client, rounds=args.idle_rounds, slice_s=args.idle_slice_s,
                             lines=min(50_000, round(2 * args.idle_rounds
                                                     * (args.idle_slice_s + 1) * 1000)))
        worker_log = open(Path(files_dir) / "worker.log", "wb")  # noqa: SIM115
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "billing_platform",
             "worker", "-Q", "batch", "--concurrency", "1", "-l", "INFO", "--without-gossip",
             "--without-mingle", "-n", f"batch-bench-{os.getpid()}@%h"],
            cwd=ROOT, env=env, stdout=worker_log, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=background_priority)
        url = f"{gw}/v1/chat/completions"
        asyncio.run(ttfts(url, secret, requests=50, concurrency=args.concurrency))  # warm-up
        file = client.files.create(file=("bench.jsonl", io.BytesIO(batch_lines(args.lines))),
                                   purpose="batch")
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        batch_id = batch.id
        deadline = time.monotonic() + 600  # the worker validates 20,000 lines at SCHED_IDLE
        while client.batches.retrieve(batch_id).request_counts.completed < 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the batch did not start running")
            time.sleep(0.5)
        # Alternate short blocks without (worker paused with SIGSTOP, its in-flight lines
        # drained) and with the batch running, so drift in the machine's load hits both.
        rounds: list[tuple[list[float], list[float]]] = []  # (without, with) TTFTs
        ran = 0
        block = max(1, args.requests // args.rounds)
        cpu = CpuMeter({"gateway": [gateway.pid], "batch_worker": [worker.pid],
                        "engines": [sim.process.pid for sim in sims],
                        "bench_client": [os.getpid()]}, own="bench_client",
                       servers={"postgres": "postgres", "redis": "redis-server"})
        for _ in range(args.rounds):
            os.killpg(worker.pid, signal.SIGSTOP)
            time.sleep(0.5)
            with cpu.phase("without"):
                alone = asyncio.run(ttfts(url, secret, requests=block,
                                          concurrency=args.concurrency))
            if not args.calibrate:
                os.killpg(worker.pid, signal.SIGCONT)
            time.sleep(0.5)
            before = client.batches.retrieve(batch_id).request_counts.completed
            with cpu.phase("with"):
                rounds.append((alone, asyncio.run(ttfts(url, secret, requests=block,
                                                        concurrency=args.concurrency))))
            ran += client.batches.retrieve(batch_id).request_counts.completed - before
        after = client.batches.retrieve(batch_id)
        without = [t for alone, _ in rounds for t in alone]
        with_batch = [t for _, shared in rounds for t in shared]
        log(f"without batch: p50 {pct(without, 0.5):.2f} ms, p99 {pct(without, 0.99):.2f} ms")
        log(f"with batch: p50 {pct(with_batch, 0.5):.2f} ms, p99 "
            f"{pct(with_batch, 0.99):.2f} ms; {ran} batch lines ran meanwhile "
            f"(status {after.status})")
    finally:
        if batch_id is not None:
            with contextlib.suppress(openai.OpenAIError):
                client.batches.cancel(batch_id)
        for proc in (worker, gateway):
            if proc is None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        for sim in sims:
            sim.stop()

    from django.conf import settings

    print(json.dumps({
        "requests": args.requests, "concurrency": args.concurrency, "batch_lines": args.lines,
        "calibration": args.calibrate,  # True: no batch ran in either phase (A/A)
        "ttft_p50_ratio": round(pct(with_batch, 0.5) / pct(without, 0.5), 3),
        "ttft_p99_ratio": round(pct(with_batch, 0.99) / pct(without, 0.99), 3),
        "ttft_ratio_90pct_interval": {"p50": ratio_interval(rounds, 0.5),
                                      "p99": ratio_interval(rounds, 0.99)},
        "ttft_ms": {phase: {f"p{round(q * 100)}": round(pct(values, q), 3)
                            for q in (0.5, 0.9, 0.95, 0.99)}
                    for phase, values in (("without", without), ("with", with_batch))},
        "batch_lines_during_with_phase": ran, "rounds": args.rounds,
        # idle fleet: batch lines/s with the guard over lines/s with none, same engines
        "batch_idle_fill_ratio": (round(mean(idle["guarded"]) / mean(idle["unguarded"]), 3)
                                  if idle["unguarded"] else None),
        "batch_idle_fill_90pct_interval": fill_interval(idle),
        "idle_batch_lines_per_s": {kind: {"mean": round(mean(v), 1) if v else None,
                                          "slices": [round(x, 1) for x in v]}
                                   for kind, v in idle.items()},
        "batch_still_running": after.status == "in_progress",
        "batch_max_running_fraction": settings.BATCH_MAX_RUNNING_FRACTION,  # the guard's floor
        "batch_free_slots": settings.BATCH_FREE_SLOTS,
        "batch_ttft_tolerance": settings.BATCH_TTFT_TOLERANCE,
        "worker_priority": "SCHED_IDLE" if hasattr(os, "SCHED_IDLE") else "nice 19",
        "engine_max_running": args.max_running,
        "decode_tokens_per_s": args.decode_tokens_per_s,
        # cores each part used while TTFT was measured, and the whole machine's (of
        # os.cpu_count()); a machine near its core count is CPU-bound in that phase
        "cores_used": cpu.report(), "cpu_count": os.cpu_count(),
    }), flush=True)


if __name__ == "__main__":
    main()
