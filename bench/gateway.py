"""Gateway overhead benchmark: the same workload straight to a simulated engine, through the
Tollgate gateway (auth, admission hook and metering on), and through the LiteLLM proxy, in one
run on one machine.

Prints one JSON line: added TTFT and total latency (p50, p99) of the gateway over direct at
concurrency 1 (streaming and non-streaming), the same for the Responses API (``/v1/responses``,
storing each answer as by default) with its added TTFT as a ratio of chat's, and throughput
at saturation as ratios gateway/direct and gateway/LiteLLM (the targets take turns in
``--rounds`` short slices, so drift in the machine's load falls on all alike; the bench org's
rate limits are lifted so that no 429 caps the gateway), with each process's CPU ms per
request at saturation (``gateway_cpu_ms_per_request``: the gateway's own, read from /proc;
direct is the ceiling, so the gateway's CPU per request is what it costs on shared cores), and
what each of its requests costs the one Redis thread all gateway processes share
(``redis_commands_per_request``, ``redis_us_per_request``, from ``INFO commandstats``).
Latency requests alternate between direct, the gateway's chat and its Responses API so that
drift in the machine's load falls on all alike; LiteLLM is stopped (SIGSTOP) while anything
else is measured. The gateway runs with DEBUG off, as in production.

    .venv/bin/python bench/gateway.py [--requests 300] [--concurrency 64]

Needs PostgreSQL and Redis (DATABASE_URL / REDIS_URL, or the embedded servers started by
``./tollgate services``) and, for the LiteLLM column, ``litellm[proxy]`` in
``.tollgate/litellm-venv`` (``python3 -m venv .tollgate/litellm-venv &&
.tollgate/litellm-venv/bin/pip install 'litellm[proxy]'``); without it that column is null.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "billing_platform.settings")

from bench.pricing import price_model
from bench.procs import cpu_seconds
from engine_adapter.sim.testing import free_port, start_sim

LITELLM = ROOT / ".tollgate" / "litellm-venv" / "bin" / "litellm"
ERRORS: list[str] = []
LITELLM_KEY = "sk-bench-" + os.urandom(16).hex()


def redis_commands() -> tuple[int, int]:
    """Return the commands Redis has run and the microseconds it spent in them (all clients:
    during a gateway slice, the gateway is the only one)."""
    from billing_platform.redis_conn import get_redis

    stats = get_redis().info("commandstats")
    return (sum(int(v["calls"]) for v in stats.values()),
            sum(int(v["usec"]) for v in stats.values()))


def log(msg: str) -> None:
    print(f"[gateway-bench] {msg}", file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def one(http: httpx.AsyncClient, url: str, headers: dict, *, stream: bool,
              n: int) -> tuple[float, float]:
    text = f"Request {n}: hello"
    if url.endswith("/v1/responses"):  # the same request in the Responses API's words
        body: dict = {"model": "bench", "input": text, "max_output_tokens": 16,
                      "stream": stream}
        first_token = '"response.output_text.delta"'  # noqa: S105
    else:
        body = {"model": "bench", "messages": [{"role": "user", "content": text}],
                "max_tokens": 16, "stream": stream}
        first_token = '"content"'  # noqa: S105
    t0 = time.perf_counter()
    ttft = None
    if stream:
        async with http.stream("POST", url, json=body, headers=headers) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if ttft is None and line.startswith("data: {") and first_token in line:
                    ttft = time.perf_counter() - t0
    else:
        r = await http.post(url, json=body, headers=headers)
        r.raise_for_status()
        ttft = time.perf_counter() - t0
    return (ttft or 0) * 1000, (time.perf_counter() - t0) * 1000


async def latency(targets: dict[str, tuple[str, dict]], *, stream: bool,
                  requests: int) -> dict[str, dict]:
    """Sequential requests to every target in turn (direct, gateway, ...), so that drift in
    the machine's load falls on all of them alike; return TTFT and total p50/p99 per target."""
    clients = {name: httpx.AsyncClient(timeout=60) for name in targets}
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in targets}
    try:
        for n in range(-10, requests):  # 10 of warm-up first: connections, caches
            for name, (url, headers) in targets.items():
                sample = await one(clients[name], url, headers, stream=stream, n=n)
                if n >= 0:
                    samples[name].append(sample)
    finally:
        for http in clients.values():
            await http.aclose()
    out = {}
    for name, got in samples.items():
        ttft = [s[0] for s in got]
        total = [s[1] for s in got]
        out[name] = {"ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99),
                     "total_p50": pct(total, 0.5), "total_p99": pct(total, 0.99)}
    return out


async def throughput(url: str, headers: dict, *, concurrency: int,
                     seconds: float) -> tuple[int, float]:
    """Saturate ``url`` for ``seconds``; return the requests done and the seconds they took.

    Each worker has a client (so a connection) of its own. On one shared pool httpx scans
    every connection of the pool for each request, with a getpeername and a poll per idle
    one: 64 workers on one pool spent 2-5.6 ms of CPU per request in the client (5 s of it
    at 170 req/s, then 520) and capped even the engine served directly at 170-520 req/s, so
    the client, not what it measured, set both throughput ratios (the earlier figures). With
    a client per worker it spends about 0.55 ms and the engine serves ~1,800 req/s. The
    clients (and their TLS context, which httpx builds per client) are made before the clock
    starts."""
    done = 0
    tls = ssl.create_default_context()
    clients = [httpx.AsyncClient(timeout=60, verify=tls) for _ in range(concurrency)]

    async def worker(w: int, http: httpx.AsyncClient) -> None:
        nonlocal done
        n = 0
        while time.perf_counter() < deadline:
            try:
                await one(http, url, headers, stream=n % 2 == 0, n=w * 100000 + n)
            except httpx.TransportError as exc:
                # e.g. a keep-alive connection the server closed as it was reused
                ERRORS.append(f"{url}: {exc!r}")
            else:
                done += 1
            n += 1

    try:
        t0 = time.perf_counter()
        deadline = t0 + seconds
        await asyncio.gather(*(worker(w, http) for w, http in enumerate(clients)))
        return done, time.perf_counter() - t0
    finally:
        for http in clients:
            await http.aclose()


def setup_platform(sim_url: str) -> str:
    """Migrate, create an org with a key, register the sim engine; return the key."""
    import django

    django.setup()
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)
    from django.core.management import call_command

    from billing_platform.accounts import services
    from billing_platform.accounts.models import User
    from engine_adapter.choices import EngineStatus, Launch
    from engine_adapter.models import EngineInstance, Pool

    call_command("migrate", "--noinput", verbosity=0)
    EngineInstance.objects.filter(pool__name="bench").delete()
    Pool.objects.filter(name="bench").delete()
    pool = Pool.objects.create(name="bench", model="bench", region="us-east", zone="us",
                               launch=Launch.EXTERNAL, external_urls=[sim_url])
    EngineInstance.objects.create(pool=pool, replica=0, engine_id="bench-0", url=sim_url,
                                  status=EngineStatus.HEALTHY)
    price_model("bench")
    user = User.objects.filter(email="bench@tollgate.local").first() or \
        User.objects.create_user(email="bench@tollgate.local", password=None)
    org = services.organization_create(name="Bench", owner=user)
    _key, secret = services.api_key_create(project=org.projects.get(), name="bench",
                                           scopes=["inference"])
    # the default usage tier's 5,000 requests a minute would cap the throughput phase
    from plans.limits import quota_limit_set

    quota_limit_set(organization=org, rpm=10**9, tpm=10**12)
    return secret


@contextlib.contextmanager
def paused(proc: subprocess.Popen | None):
    """Stop ``proc``'s process group for the block (it uses no CPU meanwhile)."""
    if proc is None:
        yield
        return
    os.killpg(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(proc.pid, signal.SIGCONT)


def start_litellm(sim_url: str) -> tuple[subprocess.Popen | None, str | None]:
    if not LITELLM.exists():
        log(f"LiteLLM not installed at {LITELLM}; skipping that column")
        return None, None
    cfg = Path(tempfile.mkdtemp()) / "litellm.yaml"
    # LiteLLM refuses to start without a master key; it authenticates like we do.
    cfg.write_text(f"model_list:\n  - model_name: bench\n    litellm_params:\n"
                   f"      model: openai/bench\n      api_base: {sim_url}/v1\n"
                   f"      api_key: none\ngeneral_settings:\n"
                   f"  master_key: {LITELLM_KEY}\n")
    port = free_port()
    proc = subprocess.Popen([str(LITELLM), "--config", str(cfg), "--port", str(port),
                             "--host", "127.0.0.1", "--num_workers", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True,
                            # no internet here: the bundled cost map; and not our database
                            env={**{k: v for k, v in os.environ.items()
                                    if k not in ("DATABASE_URL", "REDIS_URL")},
                                 "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health/liveliness", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    log("LiteLLM did not start; skipping that column")
    return None, None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seconds", type=float, default=15.0,
                   help="throughput seconds per target, in --rounds slices")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    sim = start_sim(served_model_name="bench", max_running_requests=1024,
                    prefill_tokens_per_s=10_000_000, decode_tokens_per_s=2_000)
    secret = setup_platform(sim.base_url)
    port = free_port()
    gateway = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "billing_platform.asgi:application", "--host",
         "127.0.0.1", "--port", str(port), "--lifespan", "on", "--no-access-log",
         "--log-level", "warning"], cwd=ROOT, start_new_session=True,
        env={**os.environ, "DEBUG": "0"})  # as in production
    gw = f"http://127.0.0.1:{port}"
    litellm, litellm_url = start_litellm(sim.base_url)
    try:
        for _ in range(100):
            try:
                httpx.get(f"{gw}/v1/models", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        auth = {"Authorization": f"Bearer {secret}"}
        targets = {"direct": (f"{sim.base_url}/v1/chat/completions", {}),
                   "gateway": (f"{gw}/v1/chat/completions", auth),
                   "responses": (f"{gw}/v1/responses", auth)}
        if litellm_url:
            targets["litellm"] = (f"{litellm_url}/v1/chat/completions",
                                  {"Authorization": f"Bearer {LITELLM_KEY}"})
        lat = {}
        # direct and gateway interleaved (LiteLLM stopped: its work after a request must not
        # spill into theirs), then LiteLLM on its own
        groups = [({k: targets[k] for k in ("direct", "gateway", "responses")}, litellm)]
        if "litellm" in targets:
            groups.append(({"litellm": targets["litellm"]}, None))
        for group, stopped in groups:
            with paused(stopped):
                for stream in (True, False):
                    kind = "stream" if stream else "json"
                    for name, stats in asyncio.run(latency(group, stream=stream,
                                                           requests=args.requests)).items():
                        lat[f"{name}_{kind}"] = stats
                        log(f"{name}_{kind}: {stats}")
        # CPU ms per request of each process in the path, from /proc, over the target's slices
        procs = {"engine": [sim.process], "gateway": [gateway],
                 "litellm": [litellm] if litellm else []}
        names = [name for name in targets if name != "responses"]  # its throughput is chat's
        done = dict.fromkeys(names, 0)
        elapsed = dict.fromkeys(names, 0.0)
        cpu_s: dict[str, dict[str, float]] = {name: {} for name in names}
        redis_calls = redis_us = 0  # Redis's commands and time in them over the gateway's slices
        for _round in range(args.rounds):
            for name in names:
                url, headers = targets[name]
                # one target at a time; LiteLLM is stopped (SIGSTOP) while the others run
                with paused(litellm if name != "litellm" else None):
                    cpu0 = {k: cpu_seconds(v) for k, v in procs.items() if v}
                    redis0 = redis_commands() if name == "gateway" else (0, 0)
                    client0 = time.process_time()
                    n, took = asyncio.run(throughput(url, headers, concurrency=args.concurrency,
                                                     seconds=args.seconds / args.rounds))
                    elapsed[name] += took
                    done[name] += n
                    if name == "gateway":
                        redis1 = redis_commands()
                        redis_calls += redis1[0] - redis0[0]
                        redis_us += redis1[1] - redis0[1]
                    for k, v in procs.items():
                        if v and (k == "engine" or k == name):
                            cpu_s[name][k] = cpu_s[name].get(k, 0.0) + cpu_seconds(v) - cpu0[k]
                    cpu_s[name]["client"] = (cpu_s[name].get("client", 0.0)
                                             + time.process_time() - client0)
        rps = {name: done[name] / elapsed[name] for name in names}
        cpu_ms = {name: {k: round(v * 1000 / done[name], 3) for k, v in cpu_s[name].items()}
                  for name in names}
        for name in names:
            log(f"{name}: {rps[name]:.0f} req/s at concurrency {args.concurrency}, "
                f"CPU ms/request {cpu_ms[name]}")
    finally:
        for proc in (gateway, litellm):
            if proc is not None:
                proc.terminate()
        sim.stop()

    def added(metric: str, kind: str, via: str = "gateway") -> float:
        return round(lat[f"{via}_{kind}"][metric] - lat[f"direct_{kind}"][metric], 3)

    responses_ttft = added("ttft_p50", "stream", "responses")

    print(json.dumps({
        "requests": args.requests, "concurrency": args.concurrency, "rounds": args.rounds,
        "added_ttft_p50_ms": added("ttft_p50", "stream"),
        "added_ttft_p99_ms": added("ttft_p99", "stream"),
        "added_total_p50_ms": added("total_p50", "json"),
        "added_total_p99_ms": added("total_p99", "json"),
        # /v1/responses through the same gateway, interleaved with the chat requests above
        "responses_added_ttft_p50_ms": responses_ttft,
        "responses_added_ttft_p99_ms": added("ttft_p99", "stream", "responses"),
        "responses_added_total_p50_ms": added("total_p50", "json", "responses"),
        "responses_vs_chat_added_ttft_p50": (round(responses_ttft / added("ttft_p50", "stream"),
                                                   3) if added("ttft_p50", "stream") else None),
        "throughput_ratio_vs_direct": round(rps["gateway"] / rps["direct"], 3),
        "throughput_ratio_vs_litellm": (round(rps["gateway"] / rps["litellm"], 3)
                                        if "litellm" in rps else None),
        "rps": {k: round(v, 1) for k, v in rps.items()},
        # the gateway's own CPU per request at saturation: what it adds to the engine's path
        "gateway_cpu_ms_per_request": cpu_ms["gateway"]["gateway"],
        # what each gateway request costs the one Redis thread that every gateway process
        # shares (admission, slots, metering, key reads: INFO commandstats over its slices)
        "redis_commands_per_request": round(redis_calls / done["gateway"], 2),
        "redis_us_per_request": round(redis_us / done["gateway"], 1),
        "cpu_ms_per_request": cpu_ms, "cores": os.cpu_count(),
        "transport_errors": ERRORS[:10], "transport_error_count": len(ERRORS),
        "targets": {name: url for name, (url, _h) in targets.items()},
        "latency_ms": {k: {m: round(x, 3) for m, x in v.items()} for k, v in lat.items()},
    }), flush=True)


if __name__ == "__main__":
    main()
