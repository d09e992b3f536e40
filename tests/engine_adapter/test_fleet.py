"""The fleet manager with real processes: spec -> engines up, health, crash restart, down."""

from __future__ import annotations

import os
import signal
from io import StringIO

import httpx
import pytest
from django.core.management import CommandError, call_command

from engine_adapter import services
from engine_adapter.choices import EngineStatus
from engine_adapter.models import EngineInstance
from engine_adapter.selectors import fleet_snapshot, zone_regions
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
    assert "running" in EngineInstance.objects.get(engine_id="small-us-0").load

    # down stops every engine we launched
    call_command("fleet", "down", stdout=StringIO())
    for e in EngineInstance.objects.all():
        assert e.status == EngineStatus.STOPPED
        wait_until(lambda e=e: not services.pid_alive(e.pid), timeout=10, what="engine exit")


def test_unhealthy_engine_is_marked_and_left_out_of_routing(spec_file):
    call_command("fleet", "up", "--spec", str(spec_file), stdout=StringIO())
    eu = EngineInstance.objects.get(engine_id="small-eu-0")
    os.killpg(eu.pid, signal.SIGSTOP)  # alive but not answering
    try:
        states = services.fleet_health_check(timeout=0.5)
        assert states["small-eu-0"] == EngineStatus.UNHEALTHY
        assert "small-eu-0" not in fleet_snapshot().healthy
    finally:
        os.killpg(eu.pid, signal.SIGCONT)


def test_bad_spec_gives_a_clear_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[regions]\nus-east = "us"\n[[pools]]\nname = "x"\nmodel = "m"\n'
                   'region = "mars"\nlaunch = "sim"\n')
    with pytest.raises(CommandError, match="region 'mars' is not in"):
        call_command("fleet", "up", "--spec", str(bad), stdout=StringIO())
