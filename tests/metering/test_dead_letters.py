"""Dead-lettered usage events, as staff see them: listed and filtered through the API, retried one
at a time, in bulk or from the Django admin, each retry audited; a retry never records an event
twice (the exactly-once key), and the /metrics count follows. Nobody but staff reaches any of it.
"""

from __future__ import annotations

import threading

import pytest
from django.db import connections
from django.db.models import Sum

from billing_platform.audit.models import AuditEvent
from metering import services
from metering.metrics import MeteringCollector
from metering.models import UsageDeadLetter, UsageEvent, UsageRollupHourly
from metering.serializers import MAX_RETRY_IDS
from tests.factories import MembershipFactory, UserFactory, make_price_book

LIST = "/api/v1/usage/dead_letters/"
BULK = "/api/v1/usage/dead_letters/retry"
UNPRICED = "nobody-prices-me"


def _retry_url(letter_id: int | str) -> str:
    return f"/api/v1/usage/dead_letters/{letter_id}/retry"


def _dead_letter(tenant, request_id: str) -> UsageDeadLetter:
    """Dead-letter one event the way ingest does: rating refuses a model without a price."""
    from metering import events

    event = events.normalize(tenant.event(request_id, model=UNPRICED))
    assert services.usage_events_record([event], origin="stream").dead_lettered
    return UsageDeadLetter.objects.get(payload__contains=f'"{request_id}"')


def _gauge() -> float:
    (metric,) = MeteringCollector._dead_letters()
    return metric.samples[0].value


def _price_it() -> None:
    """Fix the cause: the model gets a price."""
    make_price_book(prices=[{"model": UNPRICED, "input": "1", "output": "1"}])


@pytest.fixture
def staff(api_client):
    user = UserFactory(is_staff=True)
    api_client.force_login(user)
    return user


def test_staff_list_filter_and_retry_dead_letters_once_the_cause_is_fixed(
        api_client, tenant, staff):
    # given two events rating refused and one line nobody could read
    first = _dead_letter(tenant, "req-dl-1")
    second = _dead_letter(tenant, "req-dl-2")
    garbage = UsageDeadLetter.objects.create(payload="{not json", error="Unreadable",
                                             origin="spool")
    assert _gauge() == 3

    # when staff list them: newest first, with the organization and request id read out
    page = api_client.get(LIST).json()
    assert [d["id"] for d in page["data"]] == [garbage.id, second.id, first.id]
    assert page["data"][1]["organization"] == tenant.org.public_id
    assert page["data"][1]["request_id"] == "req-dl-2"
    assert page["data"][0]["organization"] is None and page["data"][0]["request_id"] is None
    # filtered by organization and origin, and paged
    by_org = api_client.get(LIST, {"organization": tenant.org.public_id}).json()
    assert [d["id"] for d in by_org["data"]] == [second.id, first.id]
    assert [d["id"] for d in api_client.get(LIST, {"origin": "spool"}).json()["data"]] == [
        garbage.id]
    one = api_client.get(LIST, {"limit": 1}).json()
    assert one["has_more"] is True and one["last_id"] == garbage.id
    rest = api_client.get(LIST, {"limit": 5, "after": one["last_id"]}).json()
    assert [d["id"] for d in rest["data"]] == [second.id, first.id] and not rest["has_more"]

    # when one is retried before its model has a price, it fails again and stays listed
    r = api_client.post(_retry_url(first.id))
    assert r.status_code == 200, r.content
    assert r.json()["outcome"] == "failed" and r.json()["request_id"] == "req-dl-1"
    assert not UsageEvent.objects.filter(request_id="req-dl-1").exists()
    assert _gauge() == 3

    # when the price exists and it is retried (twice), it is recorded once and resolved
    _price_it()
    assert api_client.post(_retry_url(first.id)).json()["outcome"] == "recorded"
    assert api_client.post(_retry_url(first.id)).json()["outcome"] == "already_resolved"
    assert UsageEvent.objects.filter(request_id="req-dl-1").count() == 1
    assert _gauge() == 2

    # when staff retry every unresolved one in bulk
    bulk = api_client.post(BULK, {"all_unresolved": True}, format="json")
    assert bulk.status_code == 200, bulk.content
    outcomes = {d["id"]: d["outcome"] for d in bulk.json()["data"]}
    assert outcomes == {second.id: "recorded", garbage.id: "failed"}
    assert bulk.json()["has_more"] is False

    # then only the unreadable line waits, on the list and on /metrics
    assert [d["id"] for d in api_client.get(LIST).json()["data"]] == [garbage.id]
    assert {d["id"] for d in api_client.get(LIST, {"status": "resolved"}).json()["data"]} == {
        first.id, second.id}
    assert _gauge() == 1

    # and each retry left an audit row naming the staff member
    audits = AuditEvent.objects.filter(action="usage.dead_letter_retry").order_by("id")
    assert [(a.target, a.after["outcome"]) for a in audits] == [
        (f"dead_letter:{first.id}", "failed"), (f"dead_letter:{first.id}", "recorded"),
        (f"dead_letter:{first.id}", "already_resolved"),
        (f"dead_letter:{second.id}", "recorded"), (f"dead_letter:{garbage.id}", "failed")]
    assert {a.actor_user_id for a in audits} == {staff.id}
    assert audits[1].organization_id == tenant.org.id


def test_a_retry_never_records_an_event_twice(api_client, tenant, staff):
    # given the same event dead-lettered twice (from the stream, then from the spool)
    first = _dead_letter(tenant, "req-dl-twice")
    second = UsageDeadLetter.objects.create(payload=first.payload, error=first.error,
                                            origin="spool")
    _price_it()

    # when staff retry both, and then both again
    r = api_client.post(BULK, {"ids": [first.id, second.id, first.id]}, format="json")
    again = api_client.post(BULK, {"ids": [first.id, second.id]}, format="json")

    # then the event is recorded once: the second letter is a duplicate of the first
    assert [d["outcome"] for d in r.json()["data"]] == ["recorded", "duplicate"]
    assert [d["outcome"] for d in again.json()["data"]] == ["already_resolved"] * 2
    assert UsageEvent.objects.filter(request_id="req-dl-twice").count() == 1
    assert UsageRollupHourly.objects.filter(organization=tenant.org).aggregate(
        n=Sum("requests"))["n"] == 1
    assert UsageDeadLetter.objects.filter(resolved_at__isnull=True).count() == 0


def test_concurrent_retries_of_one_letter_record_it_once(transactional_db, tenant):
    # given one dead letter whose cause is fixed, and two staff retrying it at the same moment
    letter = _dead_letter(tenant, "req-dl-race")
    _price_it()
    staff = [UserFactory(is_staff=True), UserFactory(is_staff=True)]
    start, outcomes = threading.Barrier(2), []

    def retry(user) -> None:
        try:
            start.wait(10)
            outcomes.append(services.usage_dead_letter_retry(letter_id=letter.id,
                                                             acting_user=user).outcome)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=retry, args=(u,)) for u in staff]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)

    # then one recorded it; the other found it recorded (or resolved); one event either way
    assert sorted(outcomes)[0] in ("already_resolved", "duplicate")
    assert "recorded" in outcomes and len(outcomes) == 2
    assert UsageEvent.objects.filter(request_id="req-dl-race").count() == 1
    assert AuditEvent.objects.filter(action="usage.dead_letter_retry").count() == 2


def test_nobody_but_staff_reaches_dead_letters(api_client, tenant):
    # given a dead letter of an organization, its owner, and its admin-scoped API key
    letter = _dead_letter(tenant, "req-dl-hostile")
    _price_it()
    owner = UserFactory()
    MembershipFactory(user=owner, organization=tenant.org, role="owner")

    def every_call():
        return [api_client.get(LIST), api_client.post(_retry_url(letter.id)),
                api_client.post(BULK, {"ids": [letter.id]}, format="json"),
                api_client.post(BULK, {"all_unresolved": True}, format="json")]

    # then someone signed out, the org's owner and its admin key each get a DRF error
    answers = [(r, {401, 403}) for r in every_call()]
    api_client.force_login(owner)
    answers += [(r, {403}) for r in every_call()]
    api_client.logout()
    api_client.credentials(HTTP_AUTHORIZATION=f"Bearer {tenant.secret}")
    answers += [(r, {403}) for r in every_call()]
    for r, wanted in answers:
        assert r.status_code in wanted, r.content
        assert "detail" in r.json() and "data" not in r.json()
    letter.refresh_from_db()
    assert letter.resolved_at is None
    assert not UsageEvent.objects.filter(request_id="req-dl-hostile").exists()
    assert not AuditEvent.objects.filter(action="usage.dead_letter_retry").exists()


@pytest.mark.django_db
def test_forged_and_malformed_input_is_refused_in_drf_shape(api_client, staff):
    # a letter that does not exist (or could not) is a 404
    for forged in (999_999_999, 99_999_999_999_999_999_999):
        r = api_client.post(_retry_url(forged))
        assert r.status_code == 404 and r.json()["detail"] == "No such dead letter."
    assert api_client.post(_retry_url("abc")).status_code == 404
    assert api_client.get(LIST, {"organization": "org_nobody"}).status_code == 404

    # filters and bodies out of bounds are 400s naming the field
    for params, field in (({"limit": 1000}, "limit"), ({"limit": 0}, "limit"),
                          ({"status": "bogus"}, "status"), ({"after": -1}, "after"),
                          ({"created_after": "yesterday"}, "created_after"),
                          ({"origin": "x" * 100}, "origin")):
        r = api_client.get(LIST, params)
        assert r.status_code == 400 and field in r.json(), (params, r.content)
    for body, field in (({"ids": list(range(1, MAX_RETRY_IDS + 2))}, "ids"),
                        ({"ids": ["one"]}, "ids"), ({"ids": [{"id": 1}]}, "ids"),
                        ({"ids": [2**70]}, "ids"), ({"ids": []}, "ids"),
                        ({}, "non_field_errors"),
                        ({"ids": [1], "all_unresolved": True}, "non_field_errors"),
                        ({"ids": [1], "origin": "stream"}, "non_field_errors"),
                        ({"all_unresolved": "maybe"}, "all_unresolved")):
        r = api_client.post(BULK, body, format="json")
        assert r.status_code == 400 and field in r.json(), (body, r.content)
    # unknown ids in a bulk retry are skipped
    r = api_client.post(BULK, {"ids": [999_999_999]}, format="json")
    assert r.status_code == 200 and r.json()["data"] == []


def test_the_admin_action_retries_the_selected_letters(client, tenant):
    # given two dead letters whose cause is fixed, and a staff member in the Django admin
    first = _dead_letter(tenant, "req-dl-admin-1")
    second = _dead_letter(tenant, "req-dl-admin-2")
    _price_it()
    admin_user = UserFactory(is_staff=True, is_superuser=True)
    url = "/admin/metering/usagedeadletter/"

    # when someone who is not staff tries the action, nothing happens
    client.force_login(UserFactory())
    r = client.post(url, {"action": "retry_selected", "_selected_action": [first.id]})
    assert r.status_code == 302 and "/admin/login/" in r["Location"]
    assert UsageDeadLetter.objects.filter(resolved_at__isnull=True).count() == 2

    # when staff select one and run the action
    client.force_login(admin_user)
    assert client.get(url).status_code == 200
    r = client.post(url, {"action": "retry_selected", "_selected_action": [first.id]},
                    follow=True)

    # then that one is recorded and resolved, audited, and the page says so
    assert r.status_code == 200
    assert "Retried 1: 1 recorded." in r.content.decode()
    first.refresh_from_db()
    second.refresh_from_db()
    assert first.resolved_at is not None and second.resolved_at is None
    assert UsageEvent.objects.filter(request_id="req-dl-admin-1").count() == 1
    audit = AuditEvent.objects.get(action="usage.dead_letter_retry")
    assert audit.actor_user_id == admin_user.id and audit.after["outcome"] == "recorded"
