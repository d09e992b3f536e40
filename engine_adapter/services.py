"""Fleet operations: load the spec, launch and stop engines, check health (recording each
engine's load and its own usage counters), restart crashed and hung engines."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
from django.db import transaction
from django.utils import timezone

from engine_adapter import conf
from engine_adapter.choices import EngineStatus, Launch
from engine_adapter.conf import REPO_ROOT
from engine_adapter.metrics import parse_engine_counters, parse_engine_load
from engine_adapter.models import EngineCounterSample, EngineInstance, Pool
from engine_adapter.selectors import sample_counters
from engine_adapter.sim.config import sim_command
from engine_adapter.spec import FleetSpec, PoolSpec, SpecError
from engine_adapter.types import EngineCounters

SGLANG_MODEL_MARKER = "@sglang-cpu-model"
Progress = Callable[[str], None]
log = logging.getLogger(__name__)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours still "exists"; reap it if it is one.
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    return True


@transaction.atomic
def fleet_sync_spec(*, spec: FleetSpec, sim_only: bool = False) -> list[Pool]:
    """Upsert the spec's pools; pools no longer in the spec are marked, not deleted."""
    pools = []
    for p in spec.pools:
        launch = Launch.SIM if sim_only and p.launch == Launch.SGLANG else p.launch
        pool, _ = Pool.objects.update_or_create(name=p.name, defaults={
            "model": p.model, "model_path": p.model_path, "region": p.region, "zone": p.zone,
            "gpu_type": p.gpu_type, "gpu_hourly_cost": p.gpu_hourly_cost,
            "gpus_per_replica": p.gpus_per_replica, "replicas": p.replicas, "launch": launch,
            "engine_python": p.engine_python, "extra_args": list(p.extra_args),
            "external_urls": list(p.external_urls), "max_total_tokens": p.max_total_tokens,
            "vocab_size": p.vocab_size, "in_spec": True,
        })
        pools.append(pool)
    Pool.objects.exclude(name__in=[p.name for p in spec.pools]).update(in_spec=False)
    return pools


def launch_command(pool: Pool | PoolSpec, port: int) -> tuple[list[str], dict[str, str]]:
    """Return argv and environment that start one replica of ``pool`` on ``port``."""
    if pool.launch == Launch.SIM:
        argv = sim_command(port=port, served_model_name=pool.model,
                           max_total_tokens=pool.max_total_tokens)
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
        return [*argv, *pool.extra_args], env
    if pool.launch != Launch.SGLANG:
        raise SpecError(f"pool {pool.name} is {pool.launch}; Tollgate does not launch it")
    common = ["--max-total-tokens", str(pool.max_total_tokens), *pool.extra_args]
    if pool.engine_python:  # a GPU host with a normal SGLang install
        argv = [pool.engine_python, "-m", "sglang.launch_server", "--model-path",
                pool.model_path, "--served-model-name", pool.model, "--host", "127.0.0.1",
                "--port", str(port), "--enable-cache-report", "--enable-metrics",
                "--enable-priority-scheduling", *common]
        return argv, dict(os.environ)
    from engine_adapter import sglang_cpu

    paths = sglang_cpu.resolve_paths(conf.state_dir())
    model_dir = (paths.model_dir if pool.model_path in ("", SGLANG_MODEL_MARKER)
                 else Path(pool.model_path))
    return sglang_cpu.launch_spec(model_dir=model_dir, port=port, served_model_name=pool.model,
                                  extra_args=common, root=paths.root)


def _spawn(pool: Pool, port: int, log_path: Path) -> int:
    argv, env = launch_command(pool, port)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, env=env, cwd=REPO_ROOT, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    return proc.pid


def engine_launch(*, pool: Pool, replica: int) -> EngineInstance:
    """Start one replica of ``pool`` (replacing a dead instance of that replica)."""
    port = _free_port()
    engine_id = f"{pool.name}-{replica}"
    log_path = conf.state_dir() / "logs" / "engines" / f"{engine_id}.log"
    pid = _spawn(pool, port, log_path)
    instance, _ = EngineInstance.objects.update_or_create(
        pool=pool, replica=replica, defaults={
            "engine_id": engine_id, "url": f"http://127.0.0.1:{port}", "pid": pid,
            "launched": True, "status": EngineStatus.STARTING, "started_at": timezone.now(),
            "last_error": "", "failures": 0, "log_path": str(log_path), "load": {},
        })
    return instance


def _healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def fleet_up(*, spec: FleetSpec, sim_only: bool = False, wait: bool = True,
             timeout: float = 300.0, progress: Progress = print) -> list[EngineInstance]:
    """Start every replica the spec asks for that is not already running; wait until ready."""
    pools = fleet_sync_spec(spec=spec, sim_only=sim_only)
    if any(p.launch == Launch.SGLANG and not p.engine_python for p in pools):
        from engine_adapter import sglang_cpu

        sglang_cpu.ensure_ready(conf.state_dir(), log=lambda msg: progress(f"sglang-cpu: {msg}"))
    instances = []
    for pool in pools:
        if pool.launch == Launch.EXTERNAL:
            for n, url in enumerate(pool.external_urls):
                inst, _ = EngineInstance.objects.update_or_create(
                    pool=pool, replica=n, defaults={"engine_id": f"{pool.name}-{n}",
                                                    "url": url.rstrip("/"), "launched": False})
                instances.append(inst)
            continue
        for replica in range(pool.replicas):
            inst = EngineInstance.objects.filter(pool=pool, replica=replica).first()
            if inst and inst.status != EngineStatus.STOPPED and pid_alive(inst.pid):
                progress(f"{inst.engine_id}: already running at {inst.url}")
                instances.append(inst)
                continue
            inst = engine_launch(pool=pool, replica=replica)
            progress(f"{inst.engine_id}: launched {pool.launch} engine for {pool.model} "
                     f"in {pool.region} at {inst.url} (log {inst.log_path})")
            instances.append(inst)
    if wait:
        _wait_ready(instances, timeout=timeout, progress=progress)
    return instances


def _wait_ready(instances: list[EngineInstance], *, timeout: float, progress: Progress) -> None:
    pending = {i.engine_id: i for i in instances}
    start = time.monotonic()
    last_note = 0.0
    while pending and time.monotonic() - start < timeout:
        for engine_id, inst in list(pending.items()):
            if _healthy(inst.url, timeout=1.0):
                inst.status, inst.last_seen_at = EngineStatus.HEALTHY, timezone.now()
                inst.save(update_fields=["status", "last_seen_at"])
                progress(f"{engine_id}: ready after {time.monotonic() - start:.0f}s")
                del pending[engine_id]
            elif inst.launched and not pid_alive(inst.pid):
                inst.status = EngineStatus.CRASHED
                inst.last_error = "exited during start-up"
                inst.save(update_fields=["status", "last_error"])
                raise RuntimeError(f"engine {engine_id} exited during start-up; "
                                   f"see {inst.log_path}")
        if pending and time.monotonic() - last_note > 10:
            last_note = time.monotonic()
            progress(f"waiting for {', '.join(sorted(pending))} "
                     f"({time.monotonic() - start:.0f}s elapsed)")
        time.sleep(0.3)
    if pending:
        raise TimeoutError(f"engines not ready after {timeout:.0f}s: {', '.join(sorted(pending))};"
                           f" see their logs under {conf.state_dir() / 'logs' / 'engines'}")


def _terminate(pid: int, timeout: float = 15.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if pid_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def fleet_down(*, pool_names: list[str] | None = None, progress: Progress = print) -> int:
    """Stop the engines we launched (all, or those of ``pool_names``); return how many."""
    qs = EngineInstance.objects.select_related("pool").exclude(status=EngineStatus.STOPPED)
    if pool_names:
        qs = qs.filter(pool__name__in=pool_names)
    count = 0
    for inst in qs:
        if inst.launched and inst.pid:
            _terminate(inst.pid)
            count += 1
            progress(f"{inst.engine_id}: stopped")
        inst.status = EngineStatus.STOPPED
        inst.save(update_fields=["status"])
    return count


@dataclass(frozen=True)
class _Probe:
    ok: bool
    error: str
    load: dict[str, float] | None
    counters: EngineCounters | None = None
    at: datetime | None = None  # when /metrics answered


def _probe(url: str, timeout: float) -> _Probe:
    """Ask the engine for one generated token (``/health_generate``) and scrape its load.

    ``/health`` says only that the HTTP process is up; a hung scheduler passes it. The load
    is scraped either way: a sick engine's queue is worth seeing too.
    """
    try:
        health = httpx.get(f"{url}/health_generate", timeout=timeout)
    except httpx.TimeoutException:
        ok, error = False, f"/health_generate did not answer within {timeout:g}s"
    except httpx.HTTPError as exc:
        ok, error = False, f"unreachable: {exc!r}"
    else:
        ok = health.status_code == 200
        error = "" if ok else f"/health_generate answered {health.status_code}"
    load = counters = at = None
    try:
        metrics = httpx.get(f"{url}/metrics", timeout=timeout)
        if metrics.status_code == 200:
            at = timezone.now()
            load = parse_engine_load(metrics.text)
            counters = parse_engine_counters(metrics.text)
            _capacity_figures(url, load, counters, timeout)
    except httpx.HTTPError:
        pass  # the probe's outcome is what counts
    return _Probe(ok, error, load, counters, at)


def _capacity_figures(url: str, load: dict[str, float], counters: EngineCounters | None,
                      timeout: float) -> None:
    """Add to a scraped load what a pool's capacity is reckoned from: the running cap
    (SGLang's /metrics lacks it: /get_server_info says it) and one running request's decode
    rate, the reciprocal of the engine's mean time per output token (its own counters, over
    its life). The gateway holds reserved capacity back with them
    (``billing_platform.gateway.capacity``).

    The cap is asked on every probe, not remembered per URL: an engine relaunched at the
    same address with another ``--max-running-requests`` would otherwise keep its old cap
    (one more small GET per engine per probe interval).
    """
    if not load.get("max_running"):
        info = httpx.get(f"{url}/get_server_info", timeout=timeout)
        try:
            cap = int(info.json().get("max_running_requests") or 0) if (
                info.status_code == 200) else 0
        except (ValueError, AttributeError, TypeError):
            cap = 0  # an engine that does not say: the gateway assumes a default
        if cap:
            load["max_running"] = float(cap)
    if counters is not None and counters.tpot_requests and counters.tpot_seconds > 0:
        load["decode_tokens_per_s"] = round(counters.tpot_requests
                                            / float(counters.tpot_seconds), 3)


def _engine_replace(inst: EngineInstance, *, why: str) -> EngineInstance:
    """Stop what is left of an engine we launched and start its replica afresh."""
    if pid_alive(inst.pid):
        _terminate(inst.pid)
    fresh = engine_launch(pool=inst.pool, replica=inst.replica)
    EngineInstance.objects.filter(pk=fresh.pk).update(restarts=inst.restarts + 1,
                                                      last_error=why)
    log.warning("engine %s restarted (%s); log %s", inst.engine_id, why, fresh.log_path)
    return fresh


def fleet_health_check(*, restart: bool = True, timeout: float | None = None) -> dict[str, str]:
    """Probe every engine, record its load, and take the failing ones out of routing.

    Each engine gets a real 1-token generation (``/health_generate``), all engines at once so
    a hung one costs the round its ``timeout`` only. An engine that fails
    ``conf.engine_unhealthy_after()`` probes in a row leaves routing; one Tollgate launched
    is then restarted (so is one whose process exited, at once). One started elsewhere
    (``external``) stays out of routing, logged and on ``/metrics``, until it passes a probe
    again. A starting engine's failures count only after ``conf.engine_start_timeout_s()``.
    Return each engine's state: its status, or ``restarted``.
    """
    timeout = conf.engine_health_timeout_s() if timeout is None else timeout
    states: dict[str, str] = {}
    probed: list[EngineInstance] = []
    for inst in EngineInstance.objects.select_related("pool").exclude(
            status=EngineStatus.STOPPED).order_by("engine_id"):
        if inst.launched and not pid_alive(inst.pid):
            if restart:
                _engine_replace(inst, why="the process exited")
                states[inst.engine_id] = "restarted"
                continue
            inst.status, inst.last_error = EngineStatus.CRASHED, "process exited"
            inst.save(update_fields=["status", "last_error"])
            states[inst.engine_id] = inst.status
            continue
        probed.append(inst)
    if probed:
        with ThreadPoolExecutor(max_workers=min(32, len(probed))) as executor:
            probes = list(executor.map(lambda i: _probe(i.url, timeout), probed))
        for inst, probe in zip(probed, probes, strict=True):
            states[inst.engine_id] = _health_record(inst, probe, restart=restart)
    return states


def _health_record(inst: EngineInstance, probe: _Probe, *, restart: bool) -> str:
    """Record one probe's outcome; restart or take out of routing at the limit."""
    now = timezone.now()
    if probe.load is not None:
        inst.load = probe.load
    if probe.counters is not None and probe.at is not None:
        engine_counters_record(instance=inst, counters=probe.counters, at=probe.at)
    fields = ["status", "failures", "last_seen_at", "last_error", "load"]
    if probe.ok:
        if inst.status == EngineStatus.UNHEALTHY:
            log.warning("engine %s passes its health check again: back in routing",
                        inst.engine_id)
        inst.status, inst.failures, inst.last_seen_at = EngineStatus.HEALTHY, 0, now
        inst.last_error = ""
        inst.save(update_fields=fields)
        return inst.status
    inst.last_error = probe.error
    booting = (inst.status == EngineStatus.STARTING
               and (now - inst.started_at).total_seconds() < conf.engine_start_timeout_s())
    if not booting:
        inst.failures += 1
    limit = conf.engine_unhealthy_after()
    if inst.failures < limit:  # one slow probe is not an outage: still routed
        inst.save(update_fields=fields)
        return inst.status
    why = f"failed {inst.failures} health checks in a row, the last: {probe.error}"
    if inst.launched and restart:
        _engine_replace(inst, why=why)
        return "restarted"
    if inst.status != EngineStatus.UNHEALTHY:
        log.warning("engine %s %s: out of routing; %s", inst.engine_id, why,
                    "the next health check restarts it" if inst.launched else
                    "Tollgate did not launch it, so it cannot restart it: restart it where "
                    "it runs (it rejoins once it passes a health check)")
    inst.status = EngineStatus.UNHEALTHY
    inst.save(update_fields=fields)
    return inst.status


@transaction.atomic
def engine_counters_record(*, instance: EngineInstance, counters: EngineCounters,
                           at: datetime) -> EngineCounterSample:
    """Store one scrape of an engine's counters, in the epoch of its current process.

    A new epoch starts when the fleet manager relaunched the engine since the last sample, or
    when a counter went down (an engine restarted by someone else: external ones). The engine
    row is locked so two health checks running at once number epochs once.
    """
    EngineInstance.objects.select_for_update().filter(pk=instance.pk).first()
    last = (EngineCounterSample.objects.filter(engine_id=instance.engine_id)
            .order_by("-at", "-id").first())
    epoch = 1
    if last is not None:
        relaunched = (last.process_started_at is not None
                      and last.process_started_at != instance.started_at)
        epoch = last.epoch + (relaunched or counters.decreased_from(sample_counters(last)))
    return EngineCounterSample.objects.create(
        engine_id=instance.engine_id, at=at, epoch=epoch,
        process_started_at=instance.started_at, **dataclasses.asdict(counters))


def engine_counter_samples_prune(*, before: datetime) -> int:
    """Delete counter samples taken before ``before``; return how many."""
    deleted, _ = EngineCounterSample.objects.filter(at__lt=before).delete()
    return deleted


def fleet_restart(*, pool_name: str, progress: Progress = print) -> list[EngineInstance]:
    """Stop and start every replica of one pool."""
    pool = Pool.objects.get(name=pool_name)
    fleet_down(pool_names=[pool_name], progress=progress)
    instances = [engine_launch(pool=pool, replica=r) for r in range(pool.replicas)]
    _wait_ready(instances, timeout=300, progress=progress)
    return instances
