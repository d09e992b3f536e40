"""API keys: shown once, stored hashed, revoked and expired keys refused at once."""

from __future__ import annotations

import time
from dataclasses import asdict
from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.db import connection
from django.utils import timezone

from billing_platform.accounts import keycache, selectors, services
from billing_platform.accounts.models import ApiKey
from billing_platform.accounts.selectors import _load_principal, api_key_authenticate
from tests.factories import ProjectFactory, make_key

pytestmark = pytest.mark.django_db(transaction=True)


def _rows_containing(text: str) -> list[str]:
    """Return ``table`` names of every row in the database whose JSON contains ``text``."""
    hits = []
    with connection.cursor() as cur:
        cur.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        for (table,) in cur.fetchall():
            cur.execute(
                f'SELECT count(*) FROM "{table}" t WHERE row_to_json(t)::text LIKE %s',  # noqa: S608
                [f"%{text}%"],
            )
            if cur.fetchone()[0]:
                hits.append(table)
    return hits


def test_secret_is_not_stored_anywhere_in_the_database(api_client):
    # given a key created through the management API
    key, secret = make_key(scopes=["inference", "admin"])
    # when it has been used (cache filled, last-used noted and flushed)
    assert api_key_authenticate(secret) is not None
    services.api_key_last_used_flush()
    # then neither the whole key nor its secret half appears in any table
    secret_half = secret.split("_", 1)[1]
    assert _rows_containing(secret_half) == []
    assert _rows_containing(secret) == []
    # and the stored row holds only the prefix and a digest
    stored = ApiKey.objects.get(pk=key.pk)
    assert secret.startswith(f"tg-{stored.prefix}_")
    assert stored.secret_hash != secret_half
    assert len(stored.secret_hash) == 64


def test_wrong_secret_with_a_real_prefix_is_refused():
    _key, secret = make_key()
    tampered = secret[:-1] + ("A" if secret[-1] != "A" else "B")
    assert api_key_authenticate(tampered) is None
    assert api_key_authenticate("tg-nosuchprefix1_" + "x" * 43) is None
    assert api_key_authenticate("sk-not-ours") is None


def test_revoked_key_gets_401_at_once_even_when_cached(api_client):
    key, secret = make_key(scopes=["admin"])
    api_client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert api_client.get("/api/v1/organizations/").status_code == 200  # now cached in Redis
    services.api_key_revoke(api_key=key)
    response = api_client.get("/api/v1/organizations/")
    assert response.status_code == 401
    assert "revoked" in response.json()["detail"]


def test_a_lookup_racing_a_revocation_cannot_write_back_a_stale_entry():
    # given a reader that missed the cache and read the key from the database...
    key, secret = make_key()
    cached, marker = keycache.read(key.prefix)
    stale = _load_principal(key.prefix)
    assert cached is None
    assert stale is not None
    assert not stale.revoked
    # ...when the revocation commits before the reader writes its copy back
    services.api_key_revoke(api_key=key)
    keycache.fill(key.prefix, asdict(stale), marker=marker)
    # then the stale copy was not stored and the key is refused
    assert api_key_authenticate(secret) is None


def test_expired_key_gets_401(api_client, monkeypatch):
    # given a key that expires in an hour, used (so its principal is in the key cache)
    expires_at = timezone.now() + timedelta(hours=1)
    _key, secret = make_key(scopes=["admin"], expires_at=expires_at)
    api_client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert api_client.get("/api/v1/organizations/").status_code == 200

    # when the clock authentication reads passes its expiry (nothing else changes)
    past = expires_at.timestamp() + 1
    monkeypatch.setattr(selectors, "time", SimpleNamespace(time=lambda: past))

    # then the cached key is refused
    assert api_client.get("/api/v1/organizations/").status_code == 401


def test_key_works_when_redis_is_unreachable(settings):
    _key, secret = make_key()
    from billing_platform.redis_conn import get_redis

    get_redis.cache_clear()
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    try:
        principal = api_key_authenticate(secret)
    finally:
        get_redis.cache_clear()
    assert principal is not None
    assert principal.scopes == ("inference",)


def test_key_creation_rejects_bad_input():
    project = ProjectFactory()
    from billing_platform.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="Unknown scopes"):
        services.api_key_create(project=project, name="k", scopes=["root"])
    with pytest.raises(InvalidRequest, match="future"):
        services.api_key_create(project=project, name="k", scopes=["inference"],
                                expires_at=timezone.now() - timedelta(days=1))
    assert not ApiKey.objects.exists()


def test_last_used_is_flushed_by_the_periodic_task_in_a_real_worker(celery_worker_process):
    # given a worker with beat flushing every second, and a key that gets used
    from tests.conftest import wait_until

    key, secret = make_key()
    worker = celery_worker_process(beat=True, env={"TOLLGATE_LAST_USED_FLUSH_S": "1"})
    before = time.time()
    assert api_key_authenticate(secret) is not None
    # then the worker writes the last-used time to PostgreSQL on its own
    wait_until(lambda: ApiKey.objects.get(pk=key.pk).last_used_at, timeout=60,
               what=f"last_used_at to be flushed (worker log: {worker.log_path})")
    used = ApiKey.objects.get(pk=key.pk).last_used_at
    assert abs(used.timestamp() - before) < 30
    assert "accounts.flush_api_key_last_used" in worker.log_path.read_text()


def test_gateway_notes_last_used_in_one_write_off_the_requests_path():
    # given a key used twice by the gateway's async path
    import asyncio

    from billing_platform.accounts.selectors import aapi_key_authenticate
    from billing_platform.redis_conn import get_redis

    key, secret = make_key()
    before = time.time()

    def noted_now() -> str | bytes | None:
        return get_redis().hget(keycache.LAST_USED_HASH, str(key.pk))

    async def scenario():
        first = await aapi_key_authenticate(secret)
        second = await aapi_key_authenticate(secret)
        # then nothing was written yet: the request did not pay for it
        noted_at_once = noted_now()
        # the batched write runs on this loop, TOUCH_BATCH_S later: wait for it to land
        for _ in range(600):
            if noted_now() is not None:
                break
            await asyncio.sleep(0.05)
        return first, second, noted_at_once

    first, second, noted_at_once = asyncio.run(scenario())
    assert first is not None and second is not None
    assert noted_at_once is None
    # and then the later use is in Redis, for the periodic flush to PostgreSQL
    noted = float(noted_now())
    assert before <= noted <= time.time()
    assert services.api_key_last_used_flush() == 1
    assert ApiKey.objects.get(pk=key.pk).last_used_at.timestamp() == pytest.approx(noted)


def test_requests_that_miss_the_cache_together_share_one_database_lookup():
    # given a key whose cache entry is gone (expired, or Redis lost it)
    import asyncio

    from billing_platform.accounts.metrics import KEY_LOOKUPS
    from billing_platform.accounts.selectors import aapi_key_authenticate

    key, secret = make_key()
    keycache.invalidate([key.prefix])
    database = KEY_LOOKUPS.labels("database")
    start = database._value.get()

    # when 20 requests with it arrive together, and one more once they are answered
    async def scenario():
        together = await asyncio.gather(*(aapi_key_authenticate(secret) for _ in range(20)))
        return together, await aapi_key_authenticate(secret)

    together, after = asyncio.run(scenario())

    # then all were let in on one lookup of PostgreSQL, which filled the cache for the next
    assert [p.key_id for p in together] == [key.pk] * 20
    assert after.key_id == key.pk
    assert database._value.get() == start + 1


def test_a_request_shares_only_a_lookup_begun_after_its_cache_read():
    # given a key whose cache entry is gone, and one lookup of it in flight
    import asyncio

    from billing_platform.accounts.metrics import KEY_LOOKUPS
    from billing_platform.accounts.selectors import _alookup

    key, _secret = make_key()
    database = KEY_LOOKUPS.labels("database")
    start = database._value.get()

    async def scenario():
        read_before = time.monotonic()
        first = asyncio.ensure_future(_alookup(key.prefix, read_before))
        await asyncio.sleep(0)  # its lookup has started (a database thread takes longer)
        # when one request read the cache before that lookup began and one after
        return await asyncio.gather(first, _alookup(key.prefix, read_before),
                                    _alookup(key.prefix, time.monotonic()))

    (_, first), (_, earlier), (_, later) = asyncio.run(scenario())

    # then the earlier one shares it; the later one looks up on its own (a key revoked in
    # between must not be let in on the older answer)
    assert (first, earlier, later) == (True, False, True)
    assert database._value.get() == start + 2
