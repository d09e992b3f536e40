"""Failed authentications are cheap and throttled: a client presenting made-up, deleted or
forged API keys costs the platform at most one PostgreSQL lookup per key it invents, and after
``TOLLGATE_AUTH_FAILURE_LIMIT`` failures in a window its address is answered 429 (OpenAI's
shape) without any lookup at all, while other clients, and working keys already in the cache,
go on being served.

What counts is the live gateway's own ``tollgate_api_key_lookups_total`` on /metrics: every
key lookup that reaches PostgreSQL increments ``source="database"``. Clients on other
addresses connect from other loopback addresses (127.0.0.2, ...), which uvicorn reports as
theirs.
"""

from __future__ import annotations

import secrets

import httpx
import pytest
from django.db import transaction
from prometheus_client.parser import text_string_to_metric_families

from billing_platform.accounts.metrics import KEY_LOOKUPS
from billing_platform.accounts.models import ApiKey
from billing_platform.accounts.services import api_key_cache_refresh
from tests.factories import OrganizationFactory, ProjectFactory, make_key
from tests.gateway.conftest import live_gateway  # noqa: F401

LIMIT = 5
BODY = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
def gateway_env() -> dict[str, str]:
    return {"TOLLGATE_AUTH_FAILURE_LIMIT": str(LIMIT), "TOLLGATE_AUTH_FAILURE_WINDOW_S": "600"}


def _from(address: str) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=30)


def _made_up_key() -> str:
    return f"tg-{secrets.token_hex(6)}_{secrets.token_urlsafe(32)}"


def _chat(client: httpx.Client, gateway, secret: str) -> httpx.Response:
    return client.post(f"{gateway.url}/v1/chat/completions", json=BODY,
                       headers={"Authorization": f"Bearer {secret}"})


def _sample(gateway, name: str, **labels: str) -> float:
    """Return one sample of the live gateway's /metrics (0 when the series does not exist)."""
    scrape = httpx.get(f"{gateway.url}/metrics", timeout=30).text
    return sum(sample.value for family in text_string_to_metric_families(scrape)
               for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def _lookups(gateway, source: str = "database") -> float:
    return _sample(gateway, "tollgate_api_key_lookups_total", source=source)


def test_a_flood_of_made_up_keys_is_throttled_without_reaching_the_database(live_gateway):  # noqa: F811
    gateway = live_gateway
    _key, good = make_key(ProjectFactory(organization=OrganizationFactory()))
    _key, unused = make_key(ProjectFactory(organization=OrganizationFactory()))
    attacker, neighbour = _from("127.0.0.1"), _from("127.0.0.2")
    start = _lookups(gateway)

    # when one address presents LIMIT made-up keys (a new prefix each: no cache can hold them)
    first = [_chat(attacker, gateway, _made_up_key()) for _ in range(LIMIT)]

    # then each is a 401 and costs one lookup
    assert [r.status_code for r in first] == [401] * LIMIT
    assert {r.json()["error"]["code"] for r in first} == {"invalid_api_key"}
    assert _lookups(gateway) == start + LIMIT

    # when it goes on: 20 more made-up keys
    more = [_chat(attacker, gateway, _made_up_key()) for _ in range(20)]

    # then every one is a 429 in OpenAI's shape with a distinct code and a Retry-After, and
    # none of them reached the database
    assert [r.status_code for r in more] == [429] * 20
    error = more[0].json()["error"]
    assert error["code"] == "too_many_failed_authentications"
    assert error["type"] == "rate_limit_error" and "API key" in error["message"]
    assert 0 < int(more[0].headers["retry-after"]) <= 600
    assert _lookups(gateway) == start + LIMIT

    # and a working key from another address is served (its first use is one lookup)
    served = _chat(neighbour, gateway, good)
    assert served.status_code == 200, served.text
    assert _lookups(gateway) == start + LIMIT + 1

    # and from the throttled address, that key (now in the cache) still works, while a key the
    # cache does not hold yet waits for the window like the made-up ones: no lookup either way
    assert _chat(attacker, gateway, good).status_code == 200
    assert _chat(attacker, gateway, unused).status_code == 429
    assert _lookups(gateway) == start + LIMIT + 1
    # the 429s are counted by reason for the operator
    assert _sample(gateway, "tollgate_gateway_requests_total", status="429",
                   code="too_many_failed_authentications") == 21


def test_repeated_unknown_deleted_and_forged_keys_are_answered_from_the_cache(live_gateway):  # noqa: F811
    gateway = live_gateway
    victim, victim_secret = make_key(ProjectFactory(organization=OrganizationFactory()))
    deleted, deleted_secret = make_key(ProjectFactory(organization=OrganizationFactory()))
    client = _from("127.0.0.3")
    assert _chat(client, gateway, victim_secret).status_code == 200  # the victim's key, cached
    assert _chat(client, gateway, deleted_secret).status_code == 200
    with transaction.atomic():  # deleted as the Django admin deletes a key
        api_key_cache_refresh(prefixes=[deleted.prefix])
        ApiKey.objects.filter(pk=deleted.pk).delete()
    unknown = _made_up_key()
    forged = f"tg-{victim.prefix}_{secrets.token_urlsafe(32)}"  # a real prefix, a guessed secret
    start = _lookups(gateway)

    # when a client (under the throttle's limit) repeats one made-up key, the deleted key and
    # a forgery of the victim's key, twice each
    answers = [_chat(client, gateway, secret).status_code
               for secret in (unknown, deleted_secret, forged, unknown, deleted_secret)]

    # then all are refused, and only the first sight of each missing prefix was a query
    assert answers == [401] * 5
    assert _lookups(gateway) == start + 2
    assert _lookups(gateway, "negative_cache") == 2
    # and the victim's key still works
    assert _chat(_from("127.0.0.4"), gateway, victim_secret).status_code == 200


def test_the_management_api_caches_unknown_keys_too(api_client, db):
    # given a made-up key
    unknown = _made_up_key()
    database = KEY_LOOKUPS.labels("database")
    start = database._value.get()

    # when it is presented three times to /api/v1
    answers = [api_client.get("/api/v1/organizations/", HTTP_AUTHORIZATION=f"Bearer {unknown}")
               .status_code for _ in range(3)]

    # then it is refused each time, and looked up in PostgreSQL once
    assert answers == [401] * 3
    assert database._value.get() == start + 1
