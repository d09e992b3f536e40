"""Who may read /metrics: an allowed client address, plus the bearer token when one is set.

Each test runs the real web process (uvicorn) with the setting under test. uvicorn takes the
client address from ``X-Forwarded-For`` only when the connection comes from a trusted proxy
(loopback by default), so a request sent from here with that header is what a reverse proxy
on this host forwards for an outside client.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.gateway.conftest import LiveGateway, start_gateway, stop_gateway

OUTSIDE = "203.0.113.7"  # TEST-NET-3: never a real client, never loopback
PROXIED_FROM_OUTSIDE = {"X-Forwarded-For": OUTSIDE}
TOKEN = "metrics-token-for-tests"


@pytest.fixture
def web(transactional_db, tmp_path) -> Iterator[Callable[..., LiveGateway]]:
    started: list[LiveGateway] = []

    def start(host: str = "127.0.0.1", **env: str) -> LiveGateway:
        gateway = start_gateway(tmp_path, env=env, host=host)
        started.append(gateway)
        return gateway

    yield start
    for gateway in started:
        stop_gateway(gateway)


def _get(gateway: LiveGateway, **headers: str) -> httpx.Response:
    return httpx.get(f"{gateway.url}/metrics", headers=headers, timeout=30)


def _refused(response: httpx.Response, status: int) -> None:
    assert response.status_code == status, response.text
    assert "tollgate_" not in response.text  # not one metric leaks with the refusal


def test_by_default_only_loopback_may_read_metrics(web):
    # given the platform with its default settings
    gateway = web()

    # when a scraper on this host reads /metrics
    response = _get(gateway)

    # then it gets every collector's metrics, read from the real PostgreSQL and Redis
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    for collector in ("MeteringCollector", "BatchCollector", "EngineCollector",
                      "BillingInvariantCollector"):
        assert f'tollgate_scrape_collector_up{{collector="{collector}"}} 1.0' in response.text
    assert "tollgate_ingest_backlog_events" in response.text

    # and a request a local proxy forwards for an outside client is refused
    _refused(_get(gateway, **PROXIED_FROM_OUTSIDE), 403)


def test_with_a_token_set_the_token_is_required_too(web):
    # given a token
    gateway = web(TOLLGATE_METRICS_TOKEN=TOKEN)

    # then none, a wrong one, another scheme or an oversized one is 401 (saying how to
    # authenticate), the right one is served
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
                    {"Authorization": "Bearer"}, {"Authorization": "Bearer " + "x" * 8000}):
        response = _get(gateway, **headers)
        _refused(response, 401)
        assert response.headers["www-authenticate"] == 'Bearer realm="metrics"'
    response = _get(gateway, Authorization=f"Bearer {TOKEN}")
    assert response.status_code == 200
    assert "tollgate_scrape_collector_up" in response.text

    # and the token does not open the endpoint to an address outside the allow-list
    _refused(_get(gateway, Authorization=f"Bearer {TOKEN}", **PROXIED_FROM_OUTSIDE), 403)
    # nor does it make /metrics writable
    post = httpx.post(f"{gateway.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"},
                      timeout=30)
    assert post.status_code == 405


def test_an_allow_list_admits_a_remote_scraper_and_only_it(web):
    # given the allow-list opened to the monitoring network only, with a token
    gateway = web(TOLLGATE_METRICS_ALLOWED_NETWORKS="203.0.113.0/24",
                  TOLLGATE_METRICS_TOKEN=TOKEN)

    # then the scraper there reads /metrics with the token
    response = _get(gateway, Authorization=f"Bearer {TOKEN}", **PROXIED_FROM_OUTSIDE)
    assert response.status_code == 200
    assert "tollgate_scrape_collector_up" in response.text
    # and another network, or loopback (no longer listed), is refused, token or not
    _refused(_get(gateway, Authorization=f"Bearer {TOKEN}",
                  **{"X-Forwarded-For": "198.51.100.9"}), 403)
    _refused(_get(gateway, Authorization=f"Bearer {TOKEN}"), 403)


def _non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the route
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") or address == "0.0.0.0" else address  # noqa: S104


def test_a_client_off_the_host_cannot_claim_to_be_loopback(web):
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address to connect from")
    # given the platform listening on every interface, default settings
    gateway = web(host="0.0.0.0")  # noqa: S104
    url = gateway.url.replace("127.0.0.1", address)

    # when a client reaches it over the network, forging the proxy header
    response = httpx.get(f"{url}/metrics", headers={"X-Forwarded-For": "127.0.0.1"},
                         timeout=30)

    # then it is refused: only a trusted proxy's header counts, and it is not one
    _refused(response, 403)
