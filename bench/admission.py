"""Admission benchmark: decisions per second from one process, and the latency admission adds.

Each decision is the gateway's real admission step (``plans.admission.aadmit``: one Lua call
checking RPM for org, project and key, TPM for org and key, and a hard budget with a
worst-case reservation), against the real Redis at ``REDIS_URL``. Policies are built in memory
(what the gateway caches), so PostgreSQL is not involved.

1. latency: ``--latency-n`` sequential admissions; ``p50_ms``/``p99_ms`` are what one request
   waits for its decision (settlement runs after the response, so it is not added latency);
   ``latency_leased_fraction`` how many of them came from a quota lease instead of Redis.
2. throughput: ``--concurrency`` asyncio workers admit and settle for ``--seconds``;
   ``decisions_per_s`` counts admissions (each followed by its settlement, as in production;
   waited for, as the gateway does, or with ``--settle-nowait`` not: ``asettle(wait=False)``).
   The admissions and settlements of one event-loop tick share script calls, as in the
   gateway. ``redis_script_us_per_decision`` is Redis's own time per admission + settlement
   (from ``INFO commandstats``), ``python_cpu_us_per_decision`` this process's CPU time per
   admission + settlement (the rate headers read, as the gateway reads them): which of the
   two is the limit, and each side's cost whatever share of the cores other work leaves it.
3. the floor, in the same run: the same workers make one call per turn of a script that does
   nothing (``NOOP_LUA``) through the same client stack (the pipelined connection and the
   batcher: one EVALSHA per loop tick, as the decisions' calls), for as long as the decisions
   run, taking turns with them. ``redis_floor_per_s`` is what a decision cannot beat on this
   machine now; ``decisions_per_floor`` = decisions_per_s / redis_floor_per_s, the figure
   that shared, noisy cores leave comparable. ``floor_p50_ms``/``floor_p99_ms`` are one
   sequential no-op call's.

Prints one JSON line: ``{"decisions_per_s", "redis_floor_per_s", "decisions_per_floor",
"p50_ms", "p99_ms", ...}``.

    REDIS_URL=redis://127.0.0.1:6379/8 .venv/bin/python bench/admission.py
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import time
import uuid
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _policies(n_orgs: int):
    from plans.admission import BudgetRule, QuotaPolicy
    from plans.pricing import ModelPricing, PriceSet

    prices = PriceSet(Decimal("0.50"), Decimal("0.05"), Decimal("1.50"), Decimal("0.50"))
    pricing = ModelPricing(version_id=1, currency="USD", model="bench", base=prices, bands=(),
                           tier={"priority": Decimal("2"), "flex": Decimal("0.5")}, zone={})
    out = []
    base = 10_000_000 + os.getpid() * 1000  # ids of our own, far from real orgs
    for i in range(n_orgs):
        org = base + i
        out.append(QuotaPolicy(
            org_id=org, project_id=org, key_id=org,
            rpm=((f"o{org}", 10**9), (f"p{org}", 10**9), (f"k{org}", 10**9)),
            tpm=((f"o{org}", 10**12), (f"k{org}", 10**12)),
            budgets=(BudgetRule(budget_id=org, scope="organization", limit=Decimal("1000000"),
                                hard=True, spent_seed=Decimal("0"), suspended=False),),
            pricing=pricing, allowed_regions=None))
    return out


# The floor's script: it answers each operation of a batch and does nothing else. It is called
# as the admission script is (one EVALSHA per batch of one loop tick, framed as STEP_LUA frames
# its operations: the count, then per operation its kind, KEYS count and ARGV count).
NOOP_LUA = r"""
local out = {}
for i = 1, tonumber(ARGV[1]) do out[i] = 1 end
return out
"""


async def run(args: argparse.Namespace) -> dict:
    from billing_platform.redis_conn import get_pipelined
    from plans import admission
    from plans.admission.runtime import batcher_for
    from plans.admission.wire import pack_op

    policies = _policies(args.orgs)
    # the no-op calls go through a batcher of their own on the decisions' connection
    noop = batcher_for(get_pipelined(), NOOP_LUA)
    # one key (its slot routes the call), packed once as the policies' static parts are
    noop_ops = [pack_op("a", [p.rate_scopes[0][0]], []) for p in policies]

    # Request ids are the gateway's (made before admission, for x-request-id too): unique ones
    # made here cheaply, so that uuid4 (~5 % of a decision's CPU) is not counted as admission's
    run_tag = uuid.uuid4().hex[:12]
    ids = itertools.count()

    async def one(i: int, *, settle: bool) -> float:
        policy = policies[i % len(policies)]
        request_id = f"req_{run_tag}{next(ids):012x}"
        t0 = time.perf_counter()
        ticket = await admission.aadmit(policy, request_id=request_id,
                                        tier="default", zone="global", prompt_tokens=500,
                                        max_output=200)
        elapsed = time.perf_counter() - t0
        ticket.headers  # noqa: B018 (built when first read, as the gateway reads them)
        if settle:
            await admission.asettle(ticket, prompt_tokens=480, cached_tokens=100,
                                    completion_tokens=150, wait=not args.settle_nowait)
        return elapsed

    async def floor_one(i: int, *, settle: bool = False) -> float:
        t0 = time.perf_counter()
        await noop.call(noop_ops[i % len(noop_ops)])
        return time.perf_counter() - t0

    def quantiles(samples: list[float]) -> tuple[float, float]:
        samples.sort()
        return (round(statistics.median(samples) * 1000, 3),
                round(samples[int(len(samples) * 0.99) - 1] * 1000, 3))

    for i in range(200):  # warm up: scripts loaded, connections open
        await one(i, settle=True)
        await floor_one(i)
    before = _leased_count()
    p50, p99 = quantiles([await one(i, settle=False) for i in range(args.latency_n)])
    latency_leased = _leased_count() - before
    floor_p50, floor_p99 = quantiles([await floor_one(i) for i in range(args.latency_n)])

    async def throughput(op, seconds: float) -> tuple[int, float, float]:
        done = 0
        cpu = time.process_time()
        deadline = time.perf_counter() + seconds

        async def worker(w: int) -> None:
            nonlocal done
            i = w
            while time.perf_counter() < deadline:
                await op(i, settle=True)
                done += 1
                i += args.concurrency

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(args.concurrency)))
        return done, time.perf_counter() - t0, time.process_time() - cpu

    # The floor and the decisions take turns (--rounds of each), so that the load other
    # processes put on the shared cores falls on both alike.
    done = floor_done = 0
    elapsed = floor_elapsed = cpu = floor_cpu = 0.0
    redis_us = 0
    for _round in range(args.rounds):
        n, t, c = await throughput(floor_one, args.seconds / args.rounds)
        floor_done, floor_elapsed, floor_cpu = floor_done + n, floor_elapsed + t, floor_cpu + c
        redis_before = await _script_usec()
        n, t, c = await throughput(one, args.seconds / args.rounds)
        redis_us += await _script_usec() - redis_before
        done, elapsed, cpu = done + n, elapsed + t, cpu + c
    decisions_per_s = done / elapsed
    floor_per_s = floor_done / floor_elapsed
    return {
        "bench": "admission", "decisions_per_s": round(decisions_per_s),
        "redis_floor_per_s": round(floor_per_s),
        "decisions_per_floor": round(decisions_per_s / floor_per_s, 3),
        "p50_ms": p50, "p99_ms": p99, "floor_p50_ms": floor_p50, "floor_p99_ms": floor_p99,
        "latency_n": args.latency_n,
        # the share of the latency phase's decisions taken from a quota lease (no Redis): the
        # phase cycles through --orgs policies, so whether they lease depends on how fast the
        # machine turns them (a policy leases after 4 decisions within 0.1 s)
        "latency_leased_fraction": round(latency_leased / args.latency_n, 3),
        "throughput_decisions": done,
        "concurrency": args.concurrency, "orgs": args.orgs, "rounds": args.rounds,
        "checks_per_decision": "3 rpm + 2 tpm + 1 hard budget",
        "settle": "not waited for" if args.settle_nowait else "waited for",
        # Redis's own time in EVALSHA per decision (admission + settlement; the Redis server
        # is shared, so other clients' scripts count too): the ceiling Redis's one thread
        # puts on any number of gateway processes is 1e6 / this
        "redis_script_us_per_decision": round(redis_us / max(done, 1), 1),
        "redis_busy_fraction": round(redis_us / 1e6 / elapsed, 2),
        # this process's CPU (user + system) per decision and per no-op call: what the Python
        # side costs, whatever share of the cores other processes leave it
        "python_cpu_us_per_decision": round(cpu * 1e6 / max(done, 1), 1),
        "python_cpu_us_per_floor_call": round(floor_cpu * 1e6 / max(floor_done, 1), 1),
        "python_busy_fraction": round(cpu / elapsed, 2),
    }


def _leased_count() -> float:
    """Decisions this process took from a quota lease so far (``tollgate_admission_seconds``)."""
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("tollgate_admission_seconds_count",
                                     {"outcome": "leased"}) or 0.0


async def _script_usec() -> int:
    """Return the microseconds Redis has spent in EVALSHA since its stats were reset."""
    from billing_platform.redis_conn import get_aredis

    stats = await get_aredis().info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("usec", 0))


async def cleanup(n_orgs: int) -> None:
    from billing_platform.redis_conn import get_aredis

    r = get_aredis()
    base = 10_000_000 + os.getpid() * 1000
    for i in range(n_orgs):
        keys = [k async for k in r.scan_iter(match=f"tg:q:{{o{base + i}}}:*", count=1000)]
        if keys:
            await r.delete(*keys)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--latency-n", type=int, default=5000)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--orgs", type=int, default=100)
    p.add_argument("--settle-nowait", action="store_true",
                   help="settle without waiting (asettle(wait=False): the settlement rides "
                        "with the next admissions' script call)")
    p.add_argument("--rounds", type=int, default=5,
                   help="turns of floor and decisions the --seconds of each are split into")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "billing_platform.settings")
    import django

    django.setup()

    async def both() -> dict:
        try:
            return await run(args)
        finally:
            await cleanup(args.orgs)

    print(json.dumps(asyncio.run(both())))


if __name__ == "__main__":
    main()
