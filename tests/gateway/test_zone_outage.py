"""A model offered in the caller's data zone whose engines there are all down is a retryable
503 in OpenAI's shape (the official SDKs retry it), never a 404 and never a detour to another
zone; a 404 stays for a model not offered in the zone at all. Through the ``openai`` SDK
against a live gateway and simulated engines."""

from __future__ import annotations

import httpx
import openai
import pytest

from billing_platform.accounts.choices import DataZone
from engine_adapter import services
from engine_adapter.choices import EngineStatus
from engine_adapter.models import EngineInstance
from engine_adapter.sim.testing import FAST_RATES, start_sim
from tests.conftest import wait_until
from tests.factories import OrganizationFactory, ProjectFactory, make_key
from tests.gateway.conftest import register_engine

HELLO = [{"role": "user", "content": "hello"}]


def _eu_secret() -> str:
    org = OrganizationFactory(data_zone=DataZone.EU)
    return make_key(project=ProjectFactory(organization=org), scopes=["inference"])[1]


def _client(gateway, secret: str, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=secret, **kwargs)


def _requests(sim) -> int:
    return httpx.get(f"{sim.base_url}/sim/stats", timeout=5).json()["requests"]


def _status(client: openai.OpenAI, model: str = "small") -> int:
    try:
        client.chat.completions.create(model=model, messages=HELLO, max_tokens=2)
    except openai.APIStatusError as exc:
        return exc.status_code
    return 200


def test_eu_org_with_its_engines_stopped_gets_a_retryable_503_not_404(live_gateway):
    # given an EU organization, and small offered in the US and the EU
    secret = _eu_secret()
    client = _client(live_gateway, secret, max_retries=0)
    assert _status(client) == 200
    # and big-us-only offered in the US only
    big = start_sim(served_model_name="big-us-only", **FAST_RATES)
    try:
        register_engine(big, pool="big-us", region="us-east", zone="us")

        # when the EU engines are stopped (``fleet down`` of the EU pool leaves it in the spec)
        EngineInstance.objects.filter(pool__region="eu-west").update(
            status=EngineStatus.STOPPED)
        us_before = _requests(live_gateway.sims["us"])
        wait_until(lambda: _status(client) == 503, timeout=10, what="the fleet view to refresh")

        # then small answers 503 in OpenAI's error shape, with a retry-after, not 404
        with pytest.raises(openai.InternalServerError) as down:
            client.chat.completions.create(model="small", messages=HELLO, max_tokens=2)
        assert down.value.status_code == 503
        assert down.value.response.headers["retry-after"]
        error = down.value.response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "no_capacity" and error["type"] == "server_error"
        assert "us-east" not in error["message"]
        # and it never ran in the US
        assert _requests(live_gateway.sims["us"]) == us_before
        # it is still listed for the EU organization: it is offered there
        assert "small" in [m.id for m in client.models.list().data]
        # while a model not offered in the EU at all stays a 404
        with pytest.raises(openai.NotFoundError) as missing:
            client.chat.completions.create(model="big-us-only", messages=HELLO, max_tokens=2)
        assert missing.value.response.json()["error"]["code"] == "model_not_found"
        assert _requests(big) == 0
    finally:
        big.stop()


def test_sdk_retries_the_503_and_succeeds_once_an_eu_engine_is_back(live_gateway, monkeypatch):
    # given an EU organization whose only EU engine hangs and so failed its health check
    monkeypatch.setenv("TOLLGATE_ENGINE_UNHEALTHY_AFTER", "1")
    eu_sim, us_sim = live_gateway.sims["eu"], live_gateway.sims["us"]
    secret = _eu_secret()
    httpx.post(f"{eu_sim.base_url}/sim/faults", json={"hang": True}, timeout=5)
    assert services.fleet_health_check(timeout=1)["small-eu-0"] == EngineStatus.UNHEALTHY
    wait_until(lambda: _status(_client(live_gateway, secret, max_retries=0)) == 503,
               timeout=10, what="the fleet view to refresh")

    # when the SDK, retrying, is answered 503 and then the engine recovers
    answered: list[int] = []

    def on_response(response: httpx.Response) -> None:
        answered.append(response.status_code)
        if response.status_code == 503 and answered.count(503) == 1:
            httpx.post(f"{eu_sim.base_url}/sim/faults", json={"hang": False}, timeout=5)
            assert services.fleet_health_check(timeout=5)["small-eu-0"] == (
                EngineStatus.HEALTHY)

    us_before = _requests(us_sim)
    with httpx.Client(event_hooks={"response": [on_response]}, timeout=30) as http:
        client = _client(live_gateway, secret, max_retries=4, http_client=http)
        raw = client.chat.completions.with_raw_response.create(model="small", messages=HELLO,
                                                               max_tokens=2)

    # then its retry is served in the EU, and nothing ran in the US
    assert answered[0] == 503 and answered[-1] == 200
    assert raw.headers["x-tollgate-region"] == "eu-west"
    assert raw.parse().usage.completion_tokens == 2
    assert _requests(us_sim) == us_before
