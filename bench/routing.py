"""Routing benchmark: cache hit rate, load balance and queueing per policy, on one workload.

Workload (seeded): tenants of Zipf-skewed size, each with its own long system prompt; multi-turn
conversations (each turn's prompt extends the previous one); conversations run concurrently.
The same workload is sent, per policy, over the same engines (caches flushed between runs):
Tollgate's router with ``cache_aware``, ``least_load`` and ``round_robin``, and the published
``sglang-router`` (``python -m sglang_router.launch_router``) with its ``cache_aware`` policy.

Prints one JSON line per fleet:
{"fleet": "sim"|"sglang", "max_possible_hit_rate": x, "policies": {"cache_aware": {"hit_rate",
"hit_rate_of_possible", "imbalance", "mean_queue_ms"}, ...}}; hit_rate_of_possible is
hit_rate / max_possible_hit_rate (issue 22's goal: >= 0.97 at imbalance <= 1.2); imbalance =
max/mean requests per engine (from each engine's own request counter); mean_queue_ms from the
engines' queue-time histograms.
``max_possible_hit_rate`` is the workload's bound: per request, the longest prefix it shares
with an earlier request of the same tenant, over all prompt text. ``cache_aware_xN`` sends the
workload round-robin through N router processes (as N gateway processes: each its own OS
process and event loop, prefix indexes and in-flight counts, loads and placements shared
through Redis as the gateway shares them), with ``hit_rate_vs_one_process`` its hit rate over
one router's (issue 21's goal: within 2 %; ``--processes``, default 4; ``--redis-url``,
default ``REDIS_URL``). ``hit_rate_per_imbalance`` (hit rate / imbalance) puts a policy that buys
hits by piling work on a few engines beside one that spreads it; ``vs_sglang_router`` is each
policy's over sglang-router's in the same run (issue 22's goal on real SGLang: above 1).

The default workload is 960 conversations (about 2,400 requests, a few seconds per policy):
at 240 the run lasted under a second, mostly the cold start of 40 tenants, and four router
processes' hit rate over one's ranged 0.954-0.983 over seeds 7-9 on this machine, a spread
wider than the 2 % it is judged on; at 960 it ranged 0.984-0.989 over seeds 7-10.

    .venv/bin/python bench/routing.py --fleet sim            # 8 simulated engines, ~2 min
    .venv/bin/python bench/routing.py --fleet sglang         # 2 real SGLang CPU engines
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine_adapter.client import EngineClient
from engine_adapter.load_share import LoadShare
from engine_adapter.metrics import parse_engine_load
from engine_adapter.router import Router
from engine_adapter.sim.testing import free_port, start_sim
from engine_adapter.types import EngineInfo

WORDS = ("alpha beta gamma delta ledger token invoice meter quota region tenant cache prefix "
         "engine router budget tier plan credit usage stream batch flex priority zone").split()


def log(msg: str) -> None:
    print(f"[routing] {msg}", file=sys.stderr, flush=True)


@dataclass
class Conversation:
    tenant: str
    turns: list[list[dict[str, str]]]  # the messages of each turn, growing


def make_workload(*, tenants: int, conversations: int, turns: int, system_chars: int,
                  seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** 1.1 for i in range(tenants)]
    systems = {}
    for t in range(tenants):
        words = [rng.choice(WORDS) for _ in range(system_chars // 6)]
        systems[f"tenant-{t}"] = f"You are the assistant of tenant {t}. " + " ".join(words)
    convs = []
    for c in range(conversations):
        tenant = f"tenant-{rng.choices(range(tenants), weights)[0]}"
        messages = [{"role": "system", "content": systems[tenant]}]
        history = []
        for k in range(rng.randint(1, turns)):
            question = f"Question {k} of conversation {c}: " + " ".join(
                rng.choice(WORDS) for _ in range(rng.randint(8, 30)))
            messages = [*messages, {"role": "user", "content": question}]
            history.append(list(messages))
            messages = [*messages, {"role": "assistant",
                                    "content": " ".join(rng.choice(WORDS) for _ in range(12))}]
        convs.append(Conversation(tenant, history))
    return convs


def render(messages: list[dict[str, str]]) -> str:
    return "".join(f"<{m['role']}>{m['content']}\n" for m in messages)


def max_possible_hit_rate(convs: list[Conversation]) -> float:
    """Share of prompt text that some earlier request of the same tenant already covered."""
    seen: dict[str, list[str]] = {}
    hit = total = 0
    for conv in convs:  # conversations are issued in this order; turns in order
        for messages in conv.turns:
            text = render(messages)
            best = 0
            for earlier in seen.get(conv.tenant, ()):
                n = os.path.commonprefix([earlier, text])  # noqa: RUF071 - characters on purpose
                best = max(best, len(n))
            hit += min(best, len(text) - 1)
            total += len(text)
            seen.setdefault(conv.tenant, []).append(text)
    return hit / total


def scrape(urls: list[str]) -> dict[str, dict[str, float]]:
    out = {}
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        vals = parse_engine_load(text)
        for line in text.splitlines():
            for name in ("sglang:num_requests_total", "sglang:queue_time_seconds_sum",
                         "sglang:queue_time_seconds_count"):
                if line.startswith(name):
                    vals[name] = vals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        out[url] = vals
    return out


def summarize(before, after, hits: int, prompts: int) -> dict[str, float | None]:
    counts = [after[u].get("sglang:num_requests_total", 0) - before[u].get(
        "sglang:num_requests_total", 0) for u in after]
    mean = sum(counts) / len(counts)
    qsum = sum(after[u].get("sglang:queue_time_seconds_sum", 0) - before[u].get(
        "sglang:queue_time_seconds_sum", 0) for u in after)
    qcount = sum(after[u].get("sglang:queue_time_seconds_count", 0) - before[u].get(
        "sglang:queue_time_seconds_count", 0) for u in after)
    return {"hit_rate": round(hits / prompts, 4) if prompts else 0.0,
            "imbalance": round(max(counts) / mean, 3) if mean else None,
            "mean_queue_ms": round(qsum / qcount * 1000, 2) if qcount else None,
            "requests_per_engine": counts}


async def run_conversations(convs, send, concurrency: int) -> tuple[int, int]:
    queue: asyncio.Queue[Conversation] = asyncio.Queue()
    for conv in convs:
        queue.put_nowait(conv)
    totals = [0, 0]

    async def worker():
        while not queue.empty():
            conv = queue.get_nowait()
            for messages in conv.turns:
                usage = await send(conv.tenant, messages)
                totals[0] += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                totals[1] += usage["prompt_tokens"]

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return totals[0], totals[1]


def flush(urls: list[str]) -> None:
    for url in urls:
        httpx.post(f"{url}/flush_cache", timeout=30)


class RouterProcess:
    """One router in a process of its own, as one gateway process routes: its ``Router``,
    ``EngineClient`` and, with a Redis URL, ``LoadShare`` (``--serve-router``)."""

    def __init__(self, engines: list[EngineInfo], *, policy: str, bound: float,
                 rate_bound: float, redis_url: str | None, key: str) -> None:
        self.router = Router(engines, policy=policy, bound=bound, rate_bound=rate_bound)
        self.client = EngineClient(self.router, first_byte_timeout=600)
        self.share = LoadShare(self.router, redis_url, key=key) if redis_url else None
        self.model = engines[0].model

    async def send(self, tenant: str, messages: list[dict[str, str]], max_tokens: int) -> dict:
        if self.share:
            self.share.note_activity()
            # as the gateway does before routing: the other processes' placements of this
            # prompt's prefixes, in one round trip
            await self.share.lookup(namespace=tenant, prompt=render(messages))
        async with self.client.call(model=self.model, path="/v1/chat/completions",
                                    body={"messages": messages, "max_tokens": max_tokens,
                                          "temperature": 0},
                                    namespace=tenant, prompt_text=render(messages)) as call:
            pass
        r = call.result
        return {"prompt_tokens": r.prompt_tokens,
                "prompt_tokens_details": {"cached_tokens": r.cached_tokens}}


async def run_policy(policy: str, engines: list[EngineInfo], convs, *, concurrency: int,
                     max_tokens: int, bound: float, rate_bound: float) -> tuple[int, int]:
    """Send the workload through one router in this process."""
    one = RouterProcess(engines, policy=policy, bound=bound, rate_bound=rate_bound,
                        redis_url=None, key="")
    try:
        return await run_conversations(
            convs, lambda tenant, messages: one.send(tenant, messages, max_tokens), concurrency)
    finally:
        await one.client.aclose()


def serve_router(spec: dict) -> None:
    """``--serve-router``: route JSON lines ``{"tenant", "messages", "max_tokens"}`` from
    every connection, one at a time per connection, answering each with its usage."""
    engines = [EngineInfo(**e) for e in spec["engines"]]
    one = RouterProcess(engines, policy="cache_aware", bound=spec["bound"],
                        rate_bound=spec["rate_bound"], redis_url=spec["redis_url"],
                        key=spec["key"])

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            ask = json.loads(line)
            usage = await one.send(ask["tenant"], ask["messages"], ask["max_tokens"])
            writer.write(json.dumps(usage).encode() + b"\n")
            await writer.drain()
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0, limit=2**24)
        print(server.sockets[0].getsockname()[1], flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


async def run_processes(engines: list[EngineInfo], convs, *, processes: int, concurrency: int,
                        max_tokens: int, bound: float, rate_bound: float,
                        redis_url: str) -> tuple[int, int]:
    """Send the workload round-robin through ``processes`` router processes, as a load
    balancer spreads requests over that many gateway processes, whatever their tenant."""
    key = f"tg:router:bench:{uuid.uuid4().hex[:8]}"
    fields = ("engine_id", "pool", "model", "region", "url", "max_total_tokens")
    spec = json.dumps({"engines": [{f: getattr(e, f) for f in fields} for e in engines],
                       "bound": bound, "rate_bound": rate_bound,
                       "redis_url": redis_url, "key": key})
    procs = [subprocess.Popen([sys.executable, __file__, "--serve-router", spec],
                              stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    try:
        ports = [int(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
        turn = itertools.count()
        links: dict[tuple[int, int], tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}

        async def send(tenant, messages):
            i = next(turn) % processes
            # one connection per (caller, process): a caller's requests go one at a time
            task = id(asyncio.current_task())
            if (task, i) not in links:
                links[task, i] = await asyncio.open_connection("127.0.0.1", ports[i],
                                                               limit=2**24)
            reader, writer = links[task, i]
            writer.write(json.dumps({"tenant": tenant, "messages": messages,
                                     "max_tokens": max_tokens}).encode() + b"\n")
            await writer.drain()
            return json.loads(await reader.readline())

        try:
            return await run_conversations(convs, send, concurrency)
        finally:
            for _reader, writer in links.values():
                writer.close()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
        import redis

        client = redis.Redis.from_url(redis_url)
        client.delete(key, f"{key}:routes")
        placed = list(client.scan_iter(f"{{{key}}}:at:*", count=10000))
        for start in range(0, len(placed), 1000):
            client.delete(*placed[start:start + 1000])


async def run_sglang_router(urls: list[str], model: str, convs, *, concurrency: int,
                            max_tokens: int) -> tuple[int, int] | None:
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        log("sglang-router not installed (pip install sglang-router); skipping its policy")
        return None
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls,
         "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
        async with httpx.AsyncClient(timeout=600) as http:
            # The router answers /health before it has registered its workers: wait for them.
            for _ in range(240):
                probe = await http.post(f"{base}/v1/chat/completions", json={
                    "model": model, "messages": [{"role": "user", "content": "ping"}],
                    "max_tokens": 1})
                if probe.status_code == 200:
                    break
                await asyncio.sleep(0.5)
            flush(urls)

            async def send(tenant, messages):
                r = await http.post(f"{base}/v1/chat/completions", json={
                    "model": model, "messages": messages, "max_tokens": max_tokens,
                    "temperature": 0, "cache_salt": tenant})
                r.raise_for_status()
                return r.json()["usage"]

            return await run_conversations(convs, send, concurrency)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def bench_fleet(name: str, urls: list[str], model: str, convs, args) -> dict:
    engines = [EngineInfo(engine_id=f"e{i}", pool=name, model=model, region="r", url=u,
                          max_total_tokens=args.engine_tokens) for i, u in enumerate(urls)]
    result = {"fleet": name, "engines": len(urls),
              "requests": sum(len(c.turns) for c in convs),
              "max_possible_hit_rate": round(max_possible_hit_rate(convs), 4), "policies": {}}
    for policy in ("cache_aware", "least_load", "round_robin", "sglang_router_cache_aware",
                   *(f"cache_aware_x{n}" for n in args.processes if n > 1)):
        flush(urls)
        before = scrape(urls)
        t0 = time.monotonic()
        if policy.startswith("sglang_router"):
            totals = await run_sglang_router(urls, model, convs, concurrency=args.concurrency,
                                             max_tokens=args.max_tokens)
            if totals is None:
                continue
        elif policy.startswith("cache_aware_x"):
            totals = await run_processes(engines, convs, processes=int(policy.rsplit("x", 1)[1]),
                                         concurrency=args.concurrency,
                                         max_tokens=args.max_tokens, bound=args.bound,
                                         rate_bound=args.rate_bound, redis_url=args.redis_url)
        else:
            totals = await run_policy(policy, engines, convs, concurrency=args.concurrency,
                                      max_tokens=args.max_tokens, bound=args.bound,
                                      rate_bound=args.rate_bound)
        summary = summarize(before, scrape(urls), *totals)
        summary["seconds"] = round(time.monotonic() - t0, 1)
        possible = result["max_possible_hit_rate"]
        summary["hit_rate_of_possible"] = (round(summary["hit_rate"] / possible, 4)
                                           if possible else None)
        if policy.startswith("cache_aware_x"):
            one = result["policies"]["cache_aware"]["hit_rate"]
            summary["hit_rate_vs_one_process"] = (round(summary["hit_rate"] / one, 4)
                                                  if one else None)
        if summary["imbalance"]:
            summary["hit_rate_per_imbalance"] = round(summary["hit_rate"] / summary["imbalance"], 4)
        result["policies"][policy] = summary
        log(f"{name} {policy}: {summary}")
    theirs = result["policies"].get("sglang_router_cache_aware", {}).get("hit_rate_per_imbalance")
    if theirs:
        result["vs_sglang_router"] = {
            policy: round(s["hit_rate_per_imbalance"] / theirs, 3)
            for policy, s in result["policies"].items()
            if s.get("hit_rate_per_imbalance") and not policy.startswith("sglang_router")}
    return result


def main() -> None:
    if sys.argv[1:2] == ["--serve-router"]:  # one router process of cache_aware_xN
        serve_router(json.loads(sys.argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fleet", choices=["sim", "sglang", "both"], default="sim")
    p.add_argument("--engines", type=int, default=8, help="simulated engines")
    p.add_argument("--tenants", type=int, default=40)
    p.add_argument("--conversations", type=int, default=960)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-chars", type=int, default=2400)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--engine-tokens", type=int, default=60000, help="KV tokens per sim engine")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--bound", type=float, default=2.0, help="cache_aware in-flight bound")
    p.add_argument("--rate-bound", type=float, default=1.1,
                   help="cache_aware bound on requests routed per engine")
    p.add_argument("--processes", type=lambda v: [int(n) for n in v.split(",")], default=[4],
                   help="also run cache_aware through this many gateway processes' routers "
                        "(comma-separated; reported as cache_aware_xN)")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
                   help="Redis the routers share their loads through (one hash, removed after)")
    p.add_argument("--sglang-conversations", type=int, default=48,
                   help="conversations on the real SGLang fleet (CPU engines are slow)")
    args = p.parse_args()

    if args.fleet in ("sim", "both"):
        convs = make_workload(tenants=args.tenants, conversations=args.conversations,
                              turns=args.turns, system_chars=args.system_chars, seed=args.seed)
        sims = [start_sim(served_model_name="bench", max_total_tokens=args.engine_tokens,
                          max_running_requests=8, prefill_tokens_per_s=40000,
                          decode_tokens_per_s=2000) for _ in range(args.engines)]
        log(f"started {len(sims)} simulated engines")
        try:
            out = asyncio.run(bench_fleet("sim", [s.base_url for s in sims], "bench", convs,
                                          args))
        finally:
            for s in sims:
                s.stop()
        print(json.dumps(out), flush=True)
    if args.fleet in ("sglang", "both"):
        print(json.dumps(asyncio.run(bench_sglang(args))), flush=True)


async def bench_sglang(args) -> dict:
    from engine_adapter import sglang_cpu

    paths = sglang_cpu.ensure_ready(log=lambda m: log(f"sglang-cpu: {m}"))
    convs = make_workload(tenants=6, conversations=args.sglang_conversations, turns=3,
                          system_chars=1200, seed=args.seed)
    procs, urls = [], []
    for _ in range(2):
        port = free_port()
        argv, env = sglang_cpu.launch_spec(model_dir=paths.model_dir, port=port,
                                           served_model_name="tiny", root=paths.root)
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        for url in urls:
            sglang_cpu.wait_healthy(url, timeout=300)
        log("2 real SGLang engines ready")
        small = argparse.Namespace(**{**vars(args), "concurrency": 4, "max_tokens": 4,
                                      "engine_tokens": 8192})
        return await bench_fleet("sglang", urls, "tiny", convs, small)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
