"""The fleet manager with real processes: spec -> engines up, health, crash and hang restarts,
down."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from io import StringIO

import httpx
import pytest
from django.core.management import CommandError, call_command

from engine_adapter import services, tasks
from engine_adapter.choices import EngineStatus
from engine_adapter.metrics import EngineCollector
from engine_adapter.models import EngineInstance
from engine_adapter.registry import Fleet
from engine_adapter.selectors import fleet_snapshot, zone_regions
from engine_adapter.sim.testing import FAST_RATES
from engine_adapter.types import EngineLoad
from tests.conftest import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

SPEC = """
[regions]
us-east = "us"
eu-west = "eu"

[[pools]]
name = "small-us"
model = "small"
region = "us-east"
gpu_hourly_cost = "1.20"
replicas = 2
launch = "sim"
extra_args = ["--decode-tokens-per-s", "100000", "--prefill-tokens-per-s", "1000000"]

[[pools]]
name = "small-eu"
model = "small"
region = "eu-west"
replicas = 1
launch = "sim"
"""


@pytest.fixture
def spec_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TOLLGATE_ROOT", str(tmp_path))
    path = tmp_path / "fleet.toml"
    path.write_text(SPEC)
    yield path
    services.fleet_down(progress=lambda _msg: None)


def test_fleet_up_status_restart_after_crash_and_down(spec_file):
    out = StringIO()
    call_command("fleet", "up", "--spec", str(spec_file), stdout=out)
    engines = EngineInstance.objects.order_by("engine_id")
    assert [e.engine_id for e in engines] == ["small-eu-0", "small-us-0", "small-us-1"]
    assert all(e.status == EngineStatus.HEALTHY for e in engines)
    assert "small-us-1" in out.getvalue() and "healthy" in out.getvalue()
    for e in engines:
        assert httpx.get(f"{e.url}/v1/models").json()["data"][0]["id"] == "small"
    assert zone_regions() == {"us": {"us-east"}, "eu": {"eu-west"}}

    # running it again starts nothing new
    pids = {e.engine_id: e.pid for e in engines}
    call_command("fleet", "up", "--spec", str(spec_file), stdout=StringIO())
    assert {e.engine_id: e.pid for e in EngineInstance.objects.all()} == pids

    # when an engine is killed, the health check notices and restarts it
    victim = EngineInstance.objects.get(engine_id="small-us-1")
    os.killpg(victim.pid, signal.SIGKILL)
    wait_until(lambda: not services.pid_alive(victim.pid), timeout=10, what="the kill")
    states = services.fleet_health_check()
    assert states["small-us-1"] == "restarted"
    fresh = EngineInstance.objects.get(engine_id="small-us-1")
    assert fresh.pid != victim.pid and fresh.restarts == 1
    wait_until(lambda: services.fleet_health_check(restart=False)["small-us-1"] == "healthy",
               timeout=20, what="the restarted engine to be healthy")

    # the health check records load scraped from /metrics, which the router sees
    snap = fleet_snapshot()
    assert {"small-us-0", "small-us-1", "small-eu-0"} <= snap.healthy
    scraped = EngineInstance.objects.get(engine_id="small-us-0").load
    assert "running" in scraped
    assert snap.loads["small-us-0"] == EngineLoad.from_metrics(scraped)
    assert snap.zones == zone_regions() == {"us": {"us-east"}, "eu": {"eu-west"}}

    # down stops every engine we launched
    call_command("fleet", "down", stdout=StringIO())
    for e in EngineInstance.objects.all():
        assert e.status == EngineStatus.STOPPED
        wait_until(lambda e=e: not services.pid_alive(e.pid), timeout=10, what="engine exit")


def test_unhealthy_engine_leaves_routing_after_n_failed_checks(spec_file, monkeypatch):
    monkeypatch.setenv("TOLLGATE_ENGINE_UNHEALTHY_AFTER", "2")
    call_command("fleet", "up", "--spec", str(spec_file), stdout=StringIO())
    eu = EngineInstance.objects.get(engine_id="small-eu-0")
    os.killpg(eu.pid, signal.SIGSTOP)  # alive but not answering
    try:
        # one failed check is not an outage: still routed
        states = services.fleet_health_check(restart=False, timeout=0.5)
        assert states["small-eu-0"] == EngineStatus.HEALTHY
        assert "small-eu-0" in fleet_snapshot().healthy
        # the second in a row takes it out
        states = services.fleet_health_check(restart=False, timeout=0.5)
        assert states["small-eu-0"] == EngineStatus.UNHEALTHY
        assert "small-eu-0" not in fleet_snapshot().healthy
        assert "did not answer within 0.5s" in EngineInstance.objects.get(
            engine_id="small-eu-0").last_error
    finally:
        os.killpg(eu.pid, signal.SIGCONT)


def _hang(url: str, hang: bool = True) -> None:
    httpx.post(f"{url}/sim/faults", json={"hang": hang}, timeout=5).raise_for_status()


def _chat_on(fleet: Fleet, n: int, regions: set[str] | None = None) -> list[str]:
    """Send ``n`` requests through the fleet's router and client (to ``regions``, None: any);
    return the engines that served them."""
    async def scenario() -> list[str]:
        used = []
        for i in range(n):
            body = {"messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 2}
            async with fleet.client.call(model="small", path="/v1/chat/completions",
                                         body=body, namespace="org", prompt_text="",
                                         allowed_regions=regions) as call:
                pass
            assert call.result.status == "ok"
            used.append(call.result.engine.engine_id)
        await fleet.client.aclose()
        return used

    return asyncio.run(scenario())


def test_hung_engine_we_launched_is_restarted_after_n_failed_checks(spec_file, monkeypatch):
    # given a fleet with two replicas of small in us-east, checked with 1 s probes
    monkeypatch.setenv("TOLLGATE_ENGINE_UNHEALTHY_AFTER", "3")
    call_command("fleet", "up", "--spec", str(spec_file), stdout=StringIO())
    victim = EngineInstance.objects.get(engine_id="small-us-1")

    # when one engine's scheduler hangs (its process still answers /health)
    _hang(victim.url)
    assert httpx.get(f"{victim.url}/health", timeout=2).status_code == 200

    # then it stays routed for two failed checks and is restarted at the third
    for _ in range(2):
        assert services.fleet_health_check(timeout=1)["small-us-1"] == EngineStatus.HEALTHY
    assert services.fleet_health_check(timeout=1)["small-us-1"] == "restarted"
    fresh = EngineInstance.objects.get(engine_id="small-us-1")
    assert fresh.pid != victim.pid and fresh.restarts == 1
    assert "failed 3 health checks in a row" in fresh.last_error
    wait_until(lambda: not services.pid_alive(victim.pid), timeout=20, what="the old process")
    # out of routing while it starts: requests go to the healthy replica
    assert "small-us-1" not in fleet_snapshot().healthy
    fleet = Fleet(policy="round_robin")
    fleet.refresh()
    assert set(_chat_on(fleet, 4, {"us-east"})) == {"small-us-0"}

    # and the fresh process passes its checks and is routed to again
    wait_until(lambda: services.fleet_health_check(timeout=2)["small-us-1"] == "healthy",
               timeout=30, what="the restarted engine to be healthy")
    fleet.refresh()
    assert set(_chat_on(fleet, 4, {"us-east"})) == {"small-us-0", "small-us-1"}


def test_hung_external_engine_leaves_routing_and_rejoins_when_it_recovers(
        tmp_path, monkeypatch, sim_factory, caplog):
    # given two engines Tollgate did not launch (external), one per replica of a pool
    monkeypatch.setenv("TOLLGATE_ROOT", str(tmp_path))
    monkeypatch.setenv("TOLLGATE_ENGINE_UNHEALTHY_AFTER", "2")
    monkeypatch.setenv("TOLLGATE_ENGINE_HEALTH_TIMEOUT_S", "1")
    sims = [sim_factory(served_model_name="small", **FAST_RATES) for _ in range(2)]
    spec = tmp_path / "external.toml"
    spec.write_text('[regions]\nus-east = "us"\n[[pools]]\nname = "ext"\nmodel = "small"\n'
                    'region = "us-east"\nlaunch = "external"\nexternal_urls = ['
                    + ", ".join(f'"{s.base_url}"' for s in sims) + "]\n")
    call_command("fleet", "up", "--spec", str(spec), stdout=StringIO())
    fleet = Fleet(policy="round_robin")
    fleet.refresh()
    assert set(_chat_on(fleet, 4)) == {"ext-0", "ext-1"}

    # when one hangs, then the scheduled health task takes it out after two failed checks
    _hang(sims[1].base_url)
    assert tasks.fleet_health_check()["ext-1"] == EngineStatus.HEALTHY
    with caplog.at_level(logging.WARNING, logger="engine_adapter.services"):
        assert tasks.fleet_health_check()["ext-1"] == EngineStatus.UNHEALTHY
    assert "ext-1 failed 2 health checks in a row" in caplog.text
    assert "Tollgate did not launch it" in caplog.text
    assert _unmanaged() == {"ext-0": 0, "ext-1": 1}
    # its process was left alone, and requests go to the healthy engine only
    assert sims[1].is_alive()
    fleet.refresh()
    hung_before = httpx.get(f"{sims[1].base_url}/sim/stats").json()["requests"]
    assert set(_chat_on(fleet, 4)) == {"ext-0"}
    assert httpx.get(f"{sims[1].base_url}/sim/stats").json()["requests"] == hung_before

    # when it recovers, the next check puts it back in routing
    _hang(sims[1].base_url, hang=False)
    assert tasks.fleet_health_check()["ext-1"] == EngineStatus.HEALTHY
    assert _unmanaged() == {"ext-0": 0, "ext-1": 0}
    fleet.refresh()
    assert set(_chat_on(fleet, 4)) == {"ext-0", "ext-1"}


def test_an_engine_relaunched_at_the_same_address_reports_its_new_running_cap(
        tmp_path, monkeypatch, sim_factory):
    # given an external engine with 4 running slots, probed once (its cap recorded)
    monkeypatch.setenv("TOLLGATE_ROOT", str(tmp_path))
    first = sim_factory(served_model_name="small", max_running_requests=4, **FAST_RATES)
    spec = tmp_path / "external.toml"
    spec.write_text('[regions]\nus-east = "us"\n[[pools]]\nname = "ext"\nmodel = "small"\n'
                    f'region = "us-east"\nlaunch = "external"\nexternal_urls = '
                    f'["{first.base_url}"]\n')
    call_command("fleet", "up", "--spec", str(spec), stdout=StringIO())
    tasks.fleet_health_check()
    assert EngineInstance.objects.get(engine_id="ext-0").load["max_running"] == 4

    # when its operator relaunches it on the same port with 2 slots
    first.stop()
    sim_factory(served_model_name="small", port=first.port, max_running_requests=2,
                **FAST_RATES)

    # then the next probe records 2: reserved capacity is reckoned from what the engine runs
    tasks.fleet_health_check()
    assert EngineInstance.objects.get(engine_id="ext-0").load["max_running"] == 2


def _unmanaged() -> dict[str, float]:
    family = next(f for f in EngineCollector().collect()
                  if f.name == "tollgate_engine_unhealthy_unmanaged")
    return {s.labels["engine"]: s.value for s in family.samples}


def test_bad_spec_gives_a_clear_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[regions]\nus-east = "us"\n[[pools]]\nname = "x"\nmodel = "m"\n'
                   'region = "mars"\nlaunch = "sim"\n')
    with pytest.raises(CommandError, match="region 'mars' is not in"):
        call_command("fleet", "up", "--spec", str(bad), stdout=StringIO())
