"""Usage retention (TOLLGATE_USAGE_RETENTION_MONTHS): months billing is done with are archived
(a readable CSV.gz and its manifest) and dropped, a month an invoice still needs is kept, the
idempotency keys before the horizon are deleted, and events dated before it are refused on
every way in (the usage API, the stream consumer, spool replay), never silently dropped."""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from django.db import connection
from django.db.models import F, Sum

from billing_platform.invoicing.choices import InvoiceStatus
from billing_platform.invoicing.models import Invoice
from billing_platform.invoicing.retention import usage_months_held
from metering import conf, events, partitions, retention, services, spool
from metering.ingest import Ingestor
from metering.models import (
    UsageDeadLetter,
    UsageEvent,
    UsageEventId,
    UsageLateHour,
    UsageRollupHourly,
)
from tests.factories import ProjectFactory, make_key

MONTHS = 3
URL = "/api/v1/usage/events"
_numbers = iter(range(1, 10_000))


def _month(n: int) -> datetime:
    """Return the start of the UTC month ``n`` months from the current one."""
    m = partitions.add_months(partitions.month_of(datetime.now(UTC)), n)
    return datetime(m.year, m.month, 1, tzinfo=UTC)


def _record(tenant, prefix: str, at: datetime, n: int, *, org=None, project=None) -> None:
    org, project = org or tenant.org, project or tenant.project
    data = [events.normalize(tenant.event(f"{prefix}-{i}", org_id=org.id, project_id=project.id,
                                          api_key_id=None, data_zone=org.data_zone,
                                          event_time=at + timedelta(hours=i)))
            for i in range(n)]
    assert len(services.usage_events_record(data, origin="stream").recorded) == n
    # recorded as they happened back then, not as late usage arriving now
    UsageLateHour.objects.filter(organization_id=org.id).update(
        recorded_at=F("hour") + timedelta(hours=2))


def _invoice(org, start: datetime, status: str = InvoiceStatus.PAID) -> Invoice:
    end = partitions.add_months(start.date(), 1)
    return Invoice.objects.create(
        organization=org, currency="USD", period_start=start,
        period_end=datetime(end.year, end.month, 1, tzinfo=UTC), status=status,
        number=None if status == InvoiceStatus.DRAFT else f"T-{next(_numbers)}")


def _table_exists(month: datetime) -> bool:
    with connection.cursor() as cur:
        cur.execute("SELECT to_regclass(%s)", [partitions.partition_name(month.date())])
        return cur.fetchone()[0] is not None


@pytest.fixture
def retain(settings, tmp_path):
    """Turn retention on (3 months, archives under tmp_path); return the archive directory."""
    def on():
        settings.METERING_USAGE_RETENTION_MONTHS = MONTHS
        settings.METERING_USAGE_ARCHIVE_DIR = str(tmp_path / "archive")
        return tmp_path / "archive"
    settings.METERING_USAGE_RETENTION_MONTHS = 0
    return on


def test_billed_months_are_archived_and_dropped_a_draft_month_is_kept(tenant, retain,
                                                                      api_client):
    # given an organization with usage six and four months ago, invoiced (paid) every month
    # since, and another whose invoice of five months ago is still a draft (a close running)
    old, older_kept, mid, recent = _month(-6), _month(-5), _month(-4), _month(-2)
    _record(tenant, "old", old, 30)
    _record(tenant, "mid", mid, 5)
    _record(tenant, "recent", recent, 4)
    other_project = ProjectFactory()
    other = other_project.organization
    _record(tenant, "other", older_kept, 7, org=other, project=other_project)
    for n in range(-6, 0):
        _invoice(tenant.org, _month(n))
    _invoice(other, older_kept, status=InvoiceStatus.DRAFT)
    archive_dir = retain()
    horizon = _month(-MONTHS)
    assert retention.horizon() == horizon

    # when the retention task runs
    report = services.usage_partitions_retire(held=usage_months_held)

    # then the two billed months are archived and their partitions gone
    assert report.retired == [partitions.partition_name(m.date()) for m in (old, mid)]
    assert not _table_exists(old) and not _table_exists(mid)
    assert _table_exists(older_kept) and _table_exists(recent)
    assert "draft" in report.held[partitions.partition_name(older_kept.date())]
    data = archive_dir / f"{partitions.partition_name(old.date())}.csv.gz"
    manifest = json.loads(data.with_suffix("").with_suffix(".json").read_text())
    with gzip.open(data, "rt", newline="") as f:
        rows = list(csv.DictReader(f))
    assert manifest["rows"] == len(rows) == 30
    assert manifest["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    assert sorted(r["request_id"] for r in rows) == sorted(f"old-{i}" for i in range(30))
    assert {r["organization_id"] for r in rows} == {str(tenant.org.id)}
    # the events are gone; their sums are not (the usage API reads the rollups)
    assert not UsageEvent.objects.filter(event_time__lt=horizon,
                                         organization_id=tenant.org.id).exists()
    assert UsageEvent.objects.filter(organization_id=other.id).count() == 7
    api_client.force_login(_owner(tenant))
    usage = api_client.get("/api/v1/usage", {"organization": tenant.org.public_id,
                                             "start": old.date().isoformat(),
                                             "end": _month(-5).date().isoformat()}).json()
    assert usage["totals"][0]["requests"] == 30
    # idempotency keys before the horizon are deleted, newer ones kept
    assert not UsageEventId.objects.filter(event_time__lt=horizon).exists()
    assert UsageEventId.objects.filter(request_id__startswith="recent-").count() == 4
    assert report.ids_deleted == 30 + 5 + 7

    # when it runs again: nothing more to do, the archive is left as it is
    before = data.read_bytes()
    again = services.usage_partitions_retire(held=usage_months_held)
    assert again.retired == [] and again.ids_deleted == 0
    assert list(again.held) == [partitions.partition_name(older_kept.date())]
    assert data.read_bytes() == before
    assert UsageRollupHourly.objects.filter(organization_id=tenant.org.id).aggregate(
        n=Sum("requests"))["n"] == 39


def _owner(tenant):
    from billing_platform.accounts.choices import Role
    from tests.factories import MembershipFactory, UserFactory

    user = UserFactory()
    MembershipFactory(user=user, organization=tenant.org, role=Role.OWNER)
    return user


def test_a_month_invoicing_may_still_sum_again_is_kept(tenant, retain):
    # given usage four months ago whose invoices stop at it: period close has not run since
    mid = _month(-4)
    _record(tenant, "mid", mid, 3)
    _invoice(tenant.org, mid)
    retain()

    report = services.usage_partitions_retire(held=usage_months_held)

    # then it is kept, saying why, and its keys are deleted all the same (refused anyway)
    reason = report.held[partitions.partition_name(mid.date())]
    assert f"organization {tenant.org.id} is invoiced up to" in reason
    assert report.retired == [] and _table_exists(mid)
    assert UsageEvent.objects.filter(request_id__startswith="mid-").count() == 3
    assert not UsageEventId.objects.filter(request_id__startswith="mid-").exists()


def test_a_second_run_at_the_same_time_does_nothing(tenant, retain):
    _record(tenant, "old", _month(-6), 2)
    for n in range(-6, 0):
        _invoice(tenant.org, _month(n))
    retain()
    dsn = connection.settings_dict
    with psycopg.connect(host=dsn["HOST"], port=dsn["PORT"], user=dsn["USER"],
                         dbname=dsn["NAME"], autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s)", [retention.RETIRE_LOCK])
        busy = services.usage_partitions_retire(held=usage_months_held)
        other.execute("SELECT pg_advisory_unlock(%s)", [retention.RETIRE_LOCK])
    assert busy.busy and busy.retired == [] and _table_exists(_month(-6))

    done = services.usage_partitions_retire(held=usage_months_held)
    assert done.retired == [partitions.partition_name(_month(-6).date())]


def _external(event_id: str, **overrides) -> dict:
    event = {"id": event_id, "model": "test-model", "prompt_tokens": 100,
             "completion_tokens": 10, "event_time": datetime.now(UTC).isoformat()}
    event.update(overrides)
    return event


def test_the_usage_api_refuses_events_before_the_horizon(api_client, tenant, retain):
    retain()
    horizon = _month(-MONTHS)
    type(tenant.org).objects.filter(pk=tenant.org.pk).update(created_at=_month(-12))
    stranger = ProjectFactory()
    _key, stranger_secret = make_key(stranger, scopes=["admin"])
    body = {"events": [
        _external("late", event_time=(horizon - timedelta(seconds=1)).isoformat()),
        _external("edge", event_time=horizon.isoformat()),
        _external("theirs", project=stranger.public_id),
        _external("garbled", event_time="last tuesday"),
        _external("huge", event_time="9" * 5000),
        _external("year-one", event_time="0001-01-01T00:00:00+01:00"),
        _external("numeric", event_time=10**30),
    ]}

    reply = api_client.post(URL, body, format="json",
                            HTTP_AUTHORIZATION=f"Bearer {tenant.secret}")

    assert reply.status_code == 200, reply.content
    out = reply.json()
    assert [(d["id"], d["status"]) for d in out["data"]] == [("edge", "recorded")]
    errors = {e["id"]: e for e in out["errors"]}
    assert set(errors) == {"late", "theirs", "garbled", "huge", "year-one", "numeric"}
    late = errors["late"]
    assert late["code"] == "beyond_retention"
    (message,) = late["errors"]["event_time"]
    assert horizon.isoformat() in message and "billed twice" in message
    assert errors["theirs"]["errors"] == {"project": ["No such project in this organization."]}
    for name in ("garbled", "huge", "numeric"):
        assert errors[name]["code"] == "invalid" and "event_time" in errors[name]["errors"]
    assert errors["year-one"]["code"] == "invalid"  # out of bounds in UTC: no 500
    assert not UsageEvent.objects.filter(request_id="ext:late").exists()
    # the other organization's key sees nothing of ours, and its own call is as refused
    theirs = api_client.post(URL, {"events": [body["events"][0]]}, format="json",
                             HTTP_AUTHORIZATION=f"Bearer {stranger_secret}").json()
    assert theirs["errors"][0]["code"] == "beyond_retention"


def test_streamed_and_spooled_events_before_the_horizon_become_dead_letters(tenant, retain):
    retain()
    old = _month(-MONTHS) - timedelta(days=3)
    # given an old event and a current one on the stream (an engine host's clock, a replay)
    assert services.usage_event_append(tenant.event("req-old", event_time=old)) == "redis"
    assert services.usage_event_append(tenant.event("req-now")) == "redis"

    # when the consumer drains it, it survives and records only the current one
    stats = Ingestor(batch_size=100, block_ms=100, writers=1).run(drain=True)

    assert stats.recorded == 1 and stats.dead_lettered == 1
    assert UsageEvent.objects.filter(request_id="req-now").exists()
    letter = UsageDeadLetter.objects.get(payload__contains='"req-old"')
    assert letter.origin == "stream" and letter.resolved_at is None
    assert "retention horizon" in letter.error and "billed twice" in letter.error

    # a spooled old event, replayed, is kept the same way
    spool.SpoolWriter(conf.spool_dir()).append(
        events.encode(events.normalize(tenant.event("req-spooled", event_time=old))))
    assert services.usage_spool_replay().lines == 1
    spooled = UsageDeadLetter.objects.get(payload__contains='"req-spooled"')
    assert spooled.origin == "spool" and "retention horizon" in spooled.error

    # and a retry of it fails again with the same reason, adding no letter
    from tests.factories import UserFactory

    retry = services.usage_dead_letter_retry(letter_id=letter.id,
                                             acting_user=UserFactory(is_staff=True))
    assert retry.outcome == "failed" and "retention horizon" in retry.error
    assert UsageDeadLetter.objects.count() == 2
    assert not UsageEvent.objects.filter(request_id__in=["req-old", "req-spooled"]).exists()
