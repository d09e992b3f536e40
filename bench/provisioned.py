"""Provisioned capacity benchmark: a reservation holder's TTFT and throughput while on-demand
traffic saturates the same pool, against the same holder on the idle pool, in one run.

Prints one JSON line: ``reserved_ttft_p50_ratio`` (the holder's TTFT p50 with the pool
saturated by on-demand traffic / on the idle pool; goal at most 1.2) and
``reserved_throughput_ratio`` (normalized tokens per minute the holder got while the pool was
saturated / its reservation's; goal at least 0.95), with the on-demand requests' outcomes
(``on_demand``: served, refused with 429 ``pool_at_capacity``, other) and the most requests the
engine had queued meanwhile. The holder sends open-loop at its reserved rate (requests of known
size at fixed intervals); its throughput is what it got over the span from its first request to
its last answer. On-demand clients send closed-loop, twice as many as the engine has slots,
retrying a refusal after a short pause.

    .venv/bin/python bench/provisioned.py [--seconds 40] [--max-running 16] [--control]

``--control`` runs the saturated phase again on a gateway with the hold-back off
(``control_without_hold_back``): reserved requests then keep only their engine priority, which
a non-preempting engine honours only when a slot frees.

Needs PostgreSQL and Redis (DATABASE_URL / REDIS_URL, or ``./tollgate services``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "billing_platform.settings")

from bench.pricing import price_model
from engine_adapter.sim.testing import free_port, start_sim

MODEL = "bench-prov"
REGION = "us-east"


def log(msg: str) -> None:
    print(f"[provisioned-bench] {msg}", file=sys.stderr, flush=True)


def setup_platform(sim, *, units: int, tpm_per_unit: int) -> tuple[str, str]:
    """Register the engine, price the model, create the holder (with its reservation) and an
    on-demand organization; return their keys."""
    import django

    django.setup()
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)
    from django.core.management import call_command

    from billing_platform.accounts import services
    from billing_platform.accounts.models import User
    from engine_adapter.choices import EngineStatus, Launch
    from engine_adapter.models import EngineInstance, Pool
    from plans import services as plan_services
    from plans.limits import quota_limit_set
    from plans.models import Reservation

    call_command("migrate", "--noinput", verbosity=0)
    EngineInstance.objects.filter(pool__model=MODEL).delete()
    Pool.objects.filter(model=MODEL).delete()
    Reservation.objects.filter(model=MODEL).delete()
    pool = Pool.objects.create(name=f"{MODEL}-0", model=MODEL, region=REGION, zone="us",
                               launch=Launch.EXTERNAL, external_urls=[sim.base_url])
    EngineInstance.objects.create(pool=pool, replica=0, engine_id=f"{MODEL}-0-0",
                                  url=sim.base_url, status=EngineStatus.HEALTHY)
    price_model(MODEL)
    user = User.objects.filter(email="prov-bench@tollgate.local").first() or \
        User.objects.create_user(email="prov-bench@tollgate.local", password=None)
    secrets = []
    for who in ("holder", "on-demand"):
        org = services.organization_create(name=f"Prov bench {who} {uuid.uuid4().hex[:6]}",
                                           owner=user)
        quota_limit_set(organization=org, rpm=10**7, tpm=10**10)
        _key, secret = services.api_key_create(project=org.projects.get(), name="bench",
                                               scopes=["inference"])
        secrets.append(secret)
        if who == "holder":
            offering = plan_services.provisioned_offering_create(
                code=f"bench-prov-{uuid.uuid4().hex[:6]}", name="bench units", model=MODEL,
                region=REGION, tokens_per_minute_per_unit=tpm_per_unit,
                hourly_unit_price="1.00", monthly_unit_price="100.00", output_burndown="1")
            plan_services.reservation_create(organization=org, offering=offering,
                                             units=units, term="monthly")
    return secrets[0], secrets[1]


def probe_engine() -> None:
    """Record the engine's running cap and measured decode rate, as the health beat does."""
    from engine_adapter.models import EngineInstance
    from engine_adapter.services import _health_record, _probe

    for inst in EngineInstance.objects.filter(pool__model=MODEL):
        _health_record(inst, _probe(inst.url, 5.0), restart=False)


def body(n: int | str, max_tokens: int, stream: bool) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None,
            "messages": [{"role": "user", "content": f"Request {n}: go"}]}


async def holder(url: str, secret: str, *, seconds: float, interval: float, max_tokens: int
                 ) -> dict:
    """Send at fixed intervals for ``seconds``; return TTFTs, tokens and the span.

    Throughput is judged between answers: the normalized tokens of every answer but the first
    to end, over the time from the first answer's end to the last's, so neither the first
    request's wait nor the last one's tail is counted against the pool. Prompts are new to
    the engine's cache in every phase (a cached prompt burns down nothing at burndown 0)."""
    headers = {"Authorization": f"Bearer {secret}"}
    ttfts: list[float] = []
    normalized = 0
    marks: dict[str, int] = {}
    failed = 0
    ends: list[tuple[float, int]] = []
    phase = uuid.uuid4().hex[:8]

    async def one(http: httpx.AsyncClient, n: int) -> None:
        nonlocal normalized, failed
        b = {k: v for k, v in body(f"{phase}-{n}", max_tokens, True).items()
             if v is not None}
        tokens = 0
        t0 = time.perf_counter()
        ttft = None
        async with http.stream("POST", url, json=b, headers=headers) as r:
            if r.status_code != 200:
                failed += 1
                await r.aread()
                return
            mark = r.headers.get("x-tollgate-capacity", "on_demand")
            marks[mark] = marks.get(mark, 0) + 1
            async for line in r.aiter_lines():
                if ttft is None and line.startswith("data: {") and '"content"' in line:
                    ttft = time.perf_counter() - t0
                if line.startswith("data: {") and '"usage":{' in line:
                    usage = json.loads(line[6:]).get("usage") or {}
                    tokens = (usage.get("prompt_tokens", 0)
                              - usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
                              + usage.get("completion_tokens", 0))  # burndown 1
        normalized += tokens
        ends.append((time.perf_counter(), tokens))
        ttfts.append((ttft or 0) * 1000)

    async with httpx.AsyncClient(timeout=120) as http:
        start = time.perf_counter()
        tasks = []
        n = 0
        while time.perf_counter() - start < seconds:
            tasks.append(asyncio.create_task(one(http, n)))
            n += 1
            await asyncio.sleep(max(0.0, start + n * interval - time.perf_counter()))
        await asyncio.gather(*tasks)
    ends.sort()
    span = ends[-1][0] - ends[0][0] if len(ends) > 1 else float("inf")
    steady = sum(tokens for _, tokens in ends[1:])
    return {"ttfts": ttfts, "normalized": normalized, "span_s": span, "sent": n,
            "failed": failed, "marks": marks, "tpm": steady / (span / 60),
            "steady_per_request": steady / max(1, len(ends) - 1)}


def on_demand_process(url: str, secret: str, clients: int, max_tokens: int, seconds: float,
                      out: multiprocessing.Queue) -> None:
    """Run the on-demand clients for ``seconds`` in a process of their own (the holder's
    TTFTs are measured on an event loop nothing else uses); put their outcomes on ``out``."""
    async def run() -> dict[str, int]:
        stop = asyncio.Event()
        outcomes: dict[str, int] = {}
        asyncio.get_running_loop().call_later(seconds, stop.set)
        await on_demand(url, secret, stop=stop, clients=clients, max_tokens=max_tokens,
                        outcomes=outcomes)
        return outcomes

    out.put(asyncio.run(run()))


async def on_demand(url: str, secret: str, *, stop: asyncio.Event, clients: int,
                    max_tokens: int, outcomes: dict[str, int]) -> None:
    headers = {"Authorization": f"Bearer {secret}"}

    async def worker(http: httpx.AsyncClient, w: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            b = {k: v for k, v in body(n * 1000 + w, max_tokens, False).items()
                 if v is not None}
            try:
                r = await http.post(url, json=b, headers=headers)
            except httpx.HTTPError:
                outcomes["error"] = outcomes.get("error", 0) + 1
                continue
            if r.status_code == 200:
                outcomes["served"] = outcomes.get("served", 0) + 1
            elif r.status_code == 429:  # wait as told, as OpenAI's SDKs do
                code = (r.json().get("error") or {}).get("code", "?")
                outcomes[f"429_{code}"] = outcomes.get(f"429_{code}", 0) + 1
                await asyncio.sleep(float(r.headers.get("retry-after", "1")))
            else:
                outcomes[str(r.status_code)] = outcomes.get(str(r.status_code), 0) + 1

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(
            max_connections=clients + 4)) as http:
        await asyncio.gather(*(worker(http, w) for w in range(clients)))


async def watch_engine(sim_url: str, stop: asyncio.Event, seen: dict[str, int]) -> None:
    async with httpx.AsyncClient(timeout=5) as http:
        while not stop.is_set():
            stats = (await http.get(f"{sim_url}/sim/stats")).json()
            seen["max_running"] = max(seen.get("max_running", 0), stats["running"])
            seen["max_queued"] = max(seen.get("max_queued", 0), stats["queued"])
            await asyncio.sleep(0.2)


async def saturated(url: str, sim_url: str, holder_secret: str, od_secret: str, *,
                    args: argparse.Namespace, interval: float) -> tuple[dict, dict, dict]:
    stop = asyncio.Event()
    seen: dict[str, int] = {}
    queue: multiprocessing.Queue = multiprocessing.Queue()
    od = multiprocessing.Process(target=on_demand_process, args=(
        url, od_secret, 2 * args.max_running, args.max_tokens, args.seconds + 6, queue))
    od.start()
    await asyncio.sleep(3)  # the pool fills first
    watch = asyncio.create_task(watch_engine(sim_url, stop, seen))
    result = await holder(url, holder_secret, seconds=args.seconds, interval=interval,
                          max_tokens=args.max_tokens)
    stop.set()
    await watch
    outcomes = await asyncio.to_thread(queue.get)
    od.join()
    return result, outcomes, seen


def start_gateway(env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """Start the gateway; return it and its chat completions URL once it answers."""
    port = free_port()
    gateway = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "billing_platform.asgi:application", "--host",
         "127.0.0.1", "--port", str(port), "--lifespan", "on", "--no-access-log",
         "--log-level", "warning"], cwd=ROOT, env=env, start_new_session=True)
    gw = f"http://127.0.0.1:{port}"
    for _ in range(150):
        try:
            httpx.get(f"{gw}/v1/models", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.2)
    return gateway, f"{gw}/v1/chat/completions"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--decode-tokens-per-s", type=float, default=50.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--units", type=int, default=4)
    p.add_argument("--control", action="store_true",
                   help="also run the saturated phase with the hold-back off "
                        "(TOLLGATE_PROVISIONED_HOLD_BACK=0): what priority alone gives")
    args = p.parse_args()

    sim = start_sim(served_model_name=MODEL, max_running_requests=args.max_running,
                    prefill_tokens_per_s=200_000, decode_tokens_per_s=args.decode_tokens_per_s)
    # one unit = what one running request serves at the engine's decode rate (burndown 1)
    tpm_per_unit = int(60 * args.decode_tokens_per_s)
    reserved_tpm = args.units * tpm_per_unit
    holder_secret, od_secret = setup_platform(sim, units=args.units, tpm_per_unit=tpm_per_unit)
    probe_engine()
    env = {**os.environ, "DEBUG": "0",
           "TOLLGATE_USAGE_STREAM": f"tg:usage:bench:{uuid.uuid4().hex[:8]}",
           "TOLLGATE_FLEET_HEALTH_S": "3600", "TOLLGATE_FLEET_REFRESH_S": "1"}
    gateway, url = start_gateway(env)
    control = None
    try:
        # the holder sends exactly its reserved normalized tokens per minute: requests of the
        # size the warm-up measured (uncached prompt + output), at the interval that makes
        # (the first request of a phase also fills the cache with the phase's prefix: left out)
        warm = asyncio.run(holder(url, holder_secret, seconds=6, interval=0.25,
                                  max_tokens=args.max_tokens))
        per_request = warm["steady_per_request"]
        interval = 60.0 * per_request / reserved_tpm
        probe_engine()  # the engine has measured its decode rate now
        time.sleep(2)  # the gateway's fleet view has it
        log(f"warm-up: {warm['sent']} requests, marks {warm['marks']}; "
            f"{per_request:.1f} normalized tokens a request, one every {interval:.3f} s")
        idle = asyncio.run(holder(url, holder_secret, seconds=args.seconds,
                                  interval=interval, max_tokens=args.max_tokens))
        time.sleep(1)
        busy, outcomes, seen = asyncio.run(saturated(url, sim.base_url, holder_secret,
                                                     od_secret, args=args, interval=interval))
        if args.control:
            # the same load on a gateway with the hold-back off: priority scheduling alone
            gateway.terminate()
            gateway.wait(timeout=10)
            time.sleep(2 * args.max_tokens / args.decode_tokens_per_s)  # the engine drains
            gateway, url = start_gateway({**env, "TOLLGATE_PROVISIONED_HOLD_BACK": "0"})
            control = asyncio.run(saturated(url, sim.base_url, holder_secret, od_secret,
                                            args=args, interval=interval))
    finally:
        gateway.terminate()
        gateway.wait(timeout=10)
        sim.stop()
    idle_p50 = statistics.median(idle["ttfts"])
    busy_p50 = statistics.median(busy["ttfts"]) if busy["ttfts"] else float("inf")
    got_tpm, idle_tpm = busy["tpm"], idle["tpm"]
    print(json.dumps({
        "reserved_ttft_p50_ratio": round(busy_p50 / idle_p50, 3),
        "reserved_throughput_ratio": round(got_tpm / reserved_tpm, 3),
        "idle_ttft_p50_ms": round(idle_p50, 2),
        "saturated_ttft_p50_ms": round(busy_p50, 2),
        "saturated_ttft_p99_ms": round(sorted(busy["ttfts"])[
            int(0.99 * (len(busy["ttfts"]) - 1))], 2) if busy["ttfts"] else None,
        "reserved_tpm": reserved_tpm, "holder_tpm_saturated": round(got_tpm),
        # the same measure on the idle pool
        "idle_throughput_ratio": round(idle_tpm / reserved_tpm, 3),
        "holder_normalized": {"idle": idle["normalized"], "saturated": busy["normalized"]},
        "holder_span_s": {"idle": round(idle["span_s"], 2),
                          "saturated": round(busy["span_s"], 2)},
        "holder_requests": {"idle": idle["sent"], "saturated": busy["sent"],
                            "saturated_failed": busy["failed"],
                            "saturated_capacity": busy["marks"],
                            "idle_capacity": idle["marks"]},
        "on_demand": outcomes, "on_demand_clients": 2 * args.max_running,
        "on_demand_queued": 0,  # the gateway refuses past the share; it does not queue
        "engine": {"max_running_requests": args.max_running,
                   "decode_tokens_per_s": args.decode_tokens_per_s, **seen},
        "control_without_hold_back": None if control is None else {
            "reserved_ttft_p50_ratio": round(statistics.median(control[0]["ttfts"])
                                             / idle_p50, 3),
            "reserved_throughput_ratio": round(control[0]["tpm"] / reserved_tpm, 3),
            "on_demand": control[1], "engine": control[2]},
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }))


if __name__ == "__main__":
    main()
