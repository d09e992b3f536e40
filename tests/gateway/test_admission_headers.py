"""``x-ratelimit-*`` headers on every authenticated /v1 answer, as OpenAI sends them: model
lists and errors report the key's state without consuming any of it; a completion takes one.
"""

from __future__ import annotations

import httpx

from plans import limits, quotas
from tests.factories import OrganizationFactory, ProjectFactory, make_key

RATE_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
                "x-ratelimit-reset-requests", "x-ratelimit-limit-tokens",
                "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens")


def _get(gateway, path: str, secret: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    return httpx.get(f"{gateway.url}{path}", timeout=30, headers=headers)


def _chat(gateway, secret: str, **body) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {secret}"},
                      json={"model": "small", "max_tokens": 5,
                            "messages": [{"role": "user", "content": "hi"}], **body})


def test_every_authenticated_answer_carries_rate_limit_headers_and_reading_takes_nothing(
        live_gateway):
    # given a key of an organization limited to 50 requests and 10,000 tokens a minute
    org = OrganizationFactory()
    _key, secret = make_key(project=ProjectFactory(organization=org), scopes=["inference"])
    limits.quota_limit_set(organization=org, rpm=50, tpm=10_000)

    # when the key lists models twice, asks for an unknown model and sends a bad body
    first = _get(live_gateway, "/v1/models", secret)
    second = _get(live_gateway, "/v1/models", secret)
    detail = _get(live_gateway, "/v1/models/small", secret)
    unknown = _chat(live_gateway, secret, model="no-such-model")
    bad = _chat(live_gateway, secret, messages="not a list")

    # then every answer carries the six headers, with the org's limits
    assert [r.status_code for r in (first, second, detail, unknown, bad)] == [
        200, 200, 200, 404, 400]
    for r in (first, second, detail, unknown, bad):
        assert all(h in r.headers for h in RATE_HEADERS), (r.status_code, dict(r.headers))
        assert r.headers["x-ratelimit-limit-requests"] == "50"
        assert r.headers["x-ratelimit-limit-tokens"] == "10000"
    # and reading them consumed nothing
    assert {r.headers["x-ratelimit-remaining-requests"]
            for r in (first, second, detail, unknown, bad)} == {"50"}
    assert {r.headers["x-ratelimit-remaining-tokens"] for r in (first, second)} == {"10000"}

    # when one completion runs
    done = _chat(live_gateway, secret)
    after = _get(live_gateway, "/v1/models", secret)

    # then it took one request (the completion reports what is left after itself)
    assert done.status_code == 200
    assert done.headers["x-ratelimit-remaining-requests"] == "49"
    assert after.headers["x-ratelimit-remaining-requests"] == "49"


def test_an_unauthenticated_401_carries_no_rate_limit_headers(live_gateway):
    r = _get(live_gateway, "/v1/models", None)
    assert r.status_code == 401
    assert not any(h in r.headers for h in RATE_HEADERS)


def test_a_suspended_keys_429_carries_the_headers_too(live_gateway):
    # given a key whose organization's hard budget has suspended it
    from django.utils import timezone

    from plans.models import Budget

    org = OrganizationFactory()
    _key, secret = make_key(project=ProjectFactory(organization=org), scopes=["inference"])
    limits.quota_limit_set(organization=org, rpm=50, tpm=10_000)
    budget = quotas.budget_set(organization=org, amount="5.00", hard=True)
    Budget.objects.filter(pk=budget.pk).update(suspended_at=timezone.now())

    # when it asks for a completion
    refused = _chat(live_gateway, secret)

    # then the refusal says why, and reports the (untouched) rate-limit state
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "organization_spend_limit_exceeded"
    assert refused.headers["x-ratelimit-remaining-requests"] == "50"
    assert all(h in refused.headers for h in RATE_HEADERS)
