"""Console Alerts & webhooks page (issue 19 item 6): an endpoint's signing secret shown once, a
test event and a budget alert delivered to it by a real Celery worker and a real HTTP receiver,
signed; the delivery log with every attempt, a failed delivery sent again; roles, other
organizations' ids, malformed and private URLs, a double submit.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal

import pytest

from billing_platform.accounts.choices import Role
from billing_platform.audit.models import AuditEvent
from billing_platform.redis_conn import get_redis
from plans import admission, quotas, webhooks
from plans.choices import WebhookDeliveryStatus
from plans.models import BudgetAlert, WebhookAttempt, WebhookDelivery, WebhookEndpoint
from tests.conftest import wait_until
from tests.factories import MembershipFactory, OrganizationFactory

WORKER_ENV = {"TOLLGATE_WEBHOOK_ALLOW_PRIVATE_ADDRESSES": "1",
              "TOLLGATE_BUDGET_WEBHOOK_BACKOFF_S": "1",
              "TOLLGATE_BUDGET_WEBHOOK_MAX_RETRIES": "2"}


def _member(org, role=Role.OWNER):
    return MembershipFactory(organization=org, role=role).user


def _signed_in(client, org, role=Role.OWNER):
    user = _member(org, role)
    client.force_login(user)
    return user


def _nonce(page: str) -> str:
    return re.search(r'name="form_nonce" value="([^"]+)"', page).group(1)


def _add_endpoint(client, url: str, description: str = "alerts"):
    page = client.get("/console/alerts/").content.decode()
    return client.post("/console/alerts/", {"action": "create", "url": url,
                                            "description": description,
                                            "form_nonce": _nonce(page)})


def _secret_on(page: str) -> str | None:
    found = re.search(r'<code id="new-secret">([^<]+)</code>', page)
    return found.group(1) if found else None


@pytest.mark.django_db
def test_an_endpoints_secret_is_shown_once_and_signs_its_deliveries(client, settings):
    # given an owner of an organization
    settings.WEBHOOK_ALLOW_PRIVATE_ADDRESSES = False
    org = OrganizationFactory()
    owner = _signed_in(client, org)

    # when they add an endpoint
    r = _add_endpoint(client, "https://hooks.example.com/tollgate")

    # then the page shows its signing secret, once; a reload does not
    assert r.status_code == 200
    secret = _secret_on(r.content.decode())
    endpoint = WebhookEndpoint.objects.get(organization=org)
    assert secret and secret.startswith("whsec_") and endpoint.secret == secret
    again = client.get("/console/alerts/").content.decode()
    assert _secret_on(again) is None and secret not in again
    assert "https://hooks.example.com/tollgate" in again
    # and the change is audited, without the secret
    event = AuditEvent.objects.get(action="webhook_endpoint.create")
    assert (event.organization_id, event.actor_user_id, event.target) == (
        org.id, owner.id, endpoint.public_id)
    assert secret not in json.dumps(event.after)


@pytest.mark.django_db
def test_a_resubmitted_form_makes_one_endpoint(client):
    org = OrganizationFactory()
    _signed_in(client, org)
    page = client.get("/console/alerts/").content.decode()
    form = {"action": "create", "url": "https://hooks.example.com/a", "form_nonce": _nonce(page)}

    first = client.post("/console/alerts/", form)
    second = client.post("/console/alerts/", form, follow=True)

    assert first.status_code == 200 and _secret_on(first.content.decode())
    assert "already submitted" in second.content.decode()
    assert WebhookEndpoint.objects.filter(organization=org).count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize(("url", "says"), [
    ("not a url", "Enter a valid URL"),
    ("ftp://hooks.example.com/x", "must be an http or https URL"),
    ("http://127.0.0.1:9/hook", "non-public address"),
    ("http://169.254.169.254/latest/meta-data/", "non-public address"),
    ("https://localhost/hook", "own host"),
    ("https://hooks.example.com/" + "x" * 2100, "at most 2000 characters"),
])
def test_a_malformed_or_private_url_is_a_form_message_and_makes_nothing(client, settings, url,
                                                                        says):
    settings.WEBHOOK_ALLOW_PRIVATE_ADDRESSES = False
    org = OrganizationFactory()
    _signed_in(client, org)

    r = _add_endpoint(client, url)

    assert r.status_code == 200
    assert says in r.content.decode()
    assert _secret_on(r.content.decode()) is None
    assert not WebhookEndpoint.objects.filter(organization=org).exists()


@pytest.mark.django_db
def test_an_organization_has_at_most_ten_enabled_endpoints(client):
    org = OrganizationFactory()
    _signed_in(client, org)
    for i in range(webhooks.MAX_ENDPOINTS):
        assert _secret_on(_add_endpoint(client, f"https://h{i}.example.com/").content.decode())

    r = _add_endpoint(client, "https://one-more.example.com/")

    assert "at most 10 webhook endpoints" in r.content.decode()
    assert WebhookEndpoint.objects.filter(organization=org).count() == webhooks.MAX_ENDPOINTS


@pytest.mark.django_db
@pytest.mark.parametrize("role", [Role.DEVELOPER, Role.FINANCE, Role.VIEWER])
def test_a_role_without_org_write_sees_the_log_but_changes_nothing(client, role):
    # given an endpoint and a member whose role cannot change the organization
    org = OrganizationFactory()
    endpoint, _secret = webhooks.webhook_endpoint_create(
        organization=org, url="https://hooks.example.com/x", acting_user=None)
    _signed_in(client, org, role)

    # then the page shows the endpoint without the forms, and each action is refused
    page = client.get("/console/alerts/").content.decode()
    assert "https://hooks.example.com/x" in page and 'value="create"' not in page
    for form in ({"action": "create", "url": "https://h.example.com/", "form_nonce": "x"},
                 {"action": "test", "endpoint": endpoint.public_id},
                 {"action": "disable", "endpoint": endpoint.public_id}):
        r = client.post("/console/alerts/", form, follow=True)
        assert "cannot change webhooks" in r.content.decode()
    endpoint.refresh_from_db()
    assert endpoint.disabled_at is None
    assert WebhookEndpoint.objects.filter(organization=org).count() == 1
    assert not WebhookDelivery.objects.exists()


@pytest.mark.django_db
def test_another_organizations_endpoints_and_deliveries_are_404_and_never_shown(client):
    # given another organization's endpoint with a failed delivery
    other = OrganizationFactory()
    theirs, _ = webhooks.webhook_endpoint_create(organization=other,
                                                 url="https://theirs.example.com/hook",
                                                 acting_user=None)
    delivery = WebhookDelivery.objects.create(endpoint=theirs, event_id="evt_theirs",
                                              event_type="webhook.test", payload="{}",
                                              status=WebhookDeliveryStatus.FAILED)
    org = OrganizationFactory()
    _signed_in(client, org)

    # when an owner of this organization names their ids, or forged ones
    answers = [client.post("/console/alerts/", form).status_code for form in (
        {"action": "test", "endpoint": theirs.public_id},
        {"action": "disable", "endpoint": theirs.public_id},
        {"action": "resend", "delivery": delivery.public_id},
        {"action": "test", "endpoint": "we_forged"},
        {"action": "resend", "delivery": "' OR 1=1 --"},
    )]

    # then each is a 404, and nothing of theirs changed or shows
    assert answers == [404] * 5
    theirs.refresh_from_db()
    delivery.refresh_from_db()
    assert theirs.disabled_at is None and delivery.status == WebhookDeliveryStatus.FAILED
    assert WebhookDelivery.objects.count() == 1
    page = client.get("/console/alerts/").content.decode()
    assert "theirs.example.com" not in page and "evt_theirs" not in page


def test_a_test_event_and_a_budget_alert_reach_the_endpoint_signed_and_logged(
        celery_worker_process, receivers, client, settings):
    # given an endpoint that answers 500 once, then 204, and a worker that retries
    settings.WEBHOOK_ALLOW_PRIVATE_ADDRESSES = True  # the receiver is on this host
    receiver = receivers(script=(500,))
    org = OrganizationFactory()
    _signed_in(client, org)
    secret = _secret_on(_add_endpoint(client, receiver.url).content.decode())
    endpoint = WebhookEndpoint.objects.get(organization=org)
    worker = celery_worker_process(queues="quota", env=WORKER_ENV)

    # when the owner sends a test event
    r = client.post("/console/alerts/", {"action": "test", "endpoint": endpoint.public_id},
                    follow=True)
    assert "Test event" in r.content.decode()
    test = WebhookDelivery.objects.get(endpoint=endpoint)

    # then it is delivered on the second attempt, signed with the secret shown once
    def delivered(d: WebhookDelivery) -> bool:
        d.refresh_from_db()
        return d.status == WebhookDeliveryStatus.DELIVERED

    wait_until(lambda: delivered(test), timeout=90, what=f"the test event ({worker.log_path})")
    assert [s for s, _h, _b in receiver.posts] == [500, 204]
    for _status, headers, body in receiver.posts:
        assert headers["Tollgate-Webhook-Id"] == test.event_id
        assert webhooks.verify_webhook(secret=secret, body=body,
                                       header=headers["Tollgate-Signature"])
        assert json.loads(body)["type"] == "webhook.test"
    assert list(WebhookAttempt.objects.filter(delivery=test).order_by("at")
                .values_list("status", flat=True)) == ["500", "204"]

    # when a budget of the organization crosses its 50 % threshold
    budget = quotas.budget_set(organization=org, amount="2.00", hard=False, thresholds=[50])
    key = admission.budget_key(org.id, budget.id, budget.created_at)
    get_redis().hset(key, "spent", admission.to_micro(Decimal("1.25")))
    quotas.budget_reconcile(budget=budget)  # as the sweep does (or the worker's, after the set)
    assert list(BudgetAlert.objects.filter(budget=budget).values_list("threshold",
                                                                      flat=True)) == [50]

    # then the endpoint receives the alert, and the log shows both deliveries and attempts
    alert = WebhookDelivery.objects.get(endpoint=endpoint, event_type="budget.threshold_reached")
    wait_until(lambda: delivered(alert), timeout=90, what=f"the alert ({worker.log_path})")
    body = json.loads(receiver.delivered[-1])
    assert body["type"] == "budget.threshold_reached" and body["organization"] == org.public_id
    assert (body["data"]["threshold"], Decimal(body["data"]["spend"])) == (50, Decimal("1.25"))
    page = client.get("/console/alerts/").content.decode()
    log = page[page.index('id="deliveries"'):]
    assert log.count("Delivered") == 2 and "budget.threshold_reached" in log
    assert ": 500 (" in log and ": 204 (" in log  # each attempt, with its time


def test_a_failed_delivery_can_be_sent_again_once(celery_worker_process, receivers, client,
                                                  settings):
    # given a delivery that failed every attempt (the endpoint was down)
    settings.WEBHOOK_ALLOW_PRIVATE_ADDRESSES = True
    receiver = receivers(script=(503, 503, 503))
    org = OrganizationFactory()
    _signed_in(client, org)
    _add_endpoint(client, receiver.url)
    endpoint = WebhookEndpoint.objects.get(organization=org)
    worker = celery_worker_process(queues="quota", env=WORKER_ENV)
    client.post("/console/alerts/", {"action": "test", "endpoint": endpoint.public_id})
    delivery = WebhookDelivery.objects.get(endpoint=endpoint)

    def status() -> str:
        delivery.refresh_from_db()
        return delivery.status

    wait_until(lambda: status() == WebhookDeliveryStatus.FAILED, timeout=90,
               what=f"the delivery to fail ({worker.log_path})")
    assert delivery.attempts == 3
    assert "Send again" in client.get("/console/alerts/").content.decode()

    # when the owner sends it again, twice (a double click)
    for _ in range(2):
        client.post("/console/alerts/", {"action": "resend", "delivery": delivery.public_id})

    # then it is delivered once, with the same id and body
    wait_until(lambda: status() == WebhookDeliveryStatus.DELIVERED, timeout=90,
               what=f"the second try ({worker.log_path})")
    assert [s for s, _h, _b in receiver.posts] == [503, 503, 503, 204]
    assert len({b for _s, _h, b in receiver.posts}) == 1
    assert AuditEvent.objects.filter(action="webhook_delivery.resend").count() == 1


@pytest.mark.django_db
def test_a_disabled_endpoint_receives_no_event_but_keeps_its_log(client):
    org = OrganizationFactory()
    _signed_in(client, org)
    _add_endpoint(client, "https://hooks.example.com/a")
    endpoint = WebhookEndpoint.objects.get(organization=org)
    WebhookDelivery.objects.create(endpoint=endpoint, event_id="evt_old",
                                   event_type="webhook.test", payload="{}")

    client.post("/console/alerts/", {"action": "disable", "endpoint": endpoint.public_id})
    made = webhooks.webhook_event_emit(organization=org, event_type="webhook.test",
                                       event_id="evt_new", data={})

    endpoint.refresh_from_db()
    assert endpoint.disabled_at is not None and made == []
    page = client.get("/console/alerts/").content.decode()
    assert "disabled" in page and "evt_old" in page


@pytest.mark.django_db
def test_htmx_gets_the_delivery_log_alone_and_a_test_event_answers_with_it(client):
    # given an endpoint of this organization and another organization's delivery
    org = OrganizationFactory()
    _signed_in(client, org)
    _add_endpoint(client, "https://hooks.example.com/a")
    endpoint = WebhookEndpoint.objects.get(organization=org)
    other, _ = webhooks.webhook_endpoint_create(organization=OrganizationFactory(),
                                                url="https://theirs.example.com/",
                                                acting_user=None)
    webhooks.webhook_test_send(endpoint=other, acting_user=None)

    # when htmx posts a test event
    r = client.post("/console/alerts/", {"action": "test", "endpoint": endpoint.public_id},
                    HTTP_HX_REQUEST="true")

    # then the answer is the log alone: the new delivery, pending, polling itself
    body = r.content.decode()
    assert r.status_code == 200 and "<html" not in body
    assert body.startswith('<div class="card" id="delivery-log"')
    assert "Test event evt_test_" in body and 'hx-trigger="every 2s"' in body
    assert "theirs.example.com" not in body
    # and the log fetched alone stops polling once nothing is pending
    WebhookDelivery.objects.filter(endpoint=endpoint).update(
        status=WebhookDeliveryStatus.DELIVERED)
    part = client.get("/console/alerts/?part=deliveries", HTTP_HX_REQUEST="true")
    assert "Delivered" in part.content.decode() and "hx-trigger" not in part.content.decode()


@pytest.mark.django_db
def test_htmx_post_of_a_role_without_org_write_is_refused_in_the_log(client):
    org = OrganizationFactory()
    endpoint, _ = webhooks.webhook_endpoint_create(organization=org,
                                                   url="https://hooks.example.com/a",
                                                   acting_user=None)
    _signed_in(client, org, Role.VIEWER)

    r = client.post("/console/alerts/", {"action": "test", "endpoint": endpoint.public_id},
                    HTTP_HX_REQUEST="true")

    assert "<html" not in r.content.decode() and "cannot change webhooks" in r.content.decode()
    assert not WebhookDelivery.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_an_attempt_meeting_a_held_delivery_is_retried_not_dropped(receivers, settings):
    # given a delivery a resend is being written for (its row held by that transaction)
    import threading

    from django.db import connections, transaction

    settings.WEBHOOK_ALLOW_PRIVATE_ADDRESSES = True
    receiver = receivers()
    org = OrganizationFactory()
    endpoint, _ = webhooks.webhook_endpoint_create(organization=org, url=receiver.url,
                                                   acting_user=None)
    delivery = WebhookDelivery.objects.create(endpoint=endpoint, event_id="evt_held",
                                              event_type="webhook.test", payload="{}")
    holding, release = threading.Event(), threading.Event()

    def resend_in_progress() -> None:
        try:
            with transaction.atomic():
                WebhookDelivery.objects.select_for_update().get(pk=delivery.pk)
                holding.set()
                release.wait(30)
        finally:
            connections.close_all()

    thread = threading.Thread(target=resend_in_progress)
    thread.start()
    assert holding.wait(30)
    try:
        # when the worker's attempt comes meanwhile, it asks to be retried (it used to return,
        # and the delivery stayed pending for ever)
        with pytest.raises(webhooks.WebhookNotDelivered, match="in_progress"):
            webhooks.webhook_delivery_attempt(delivery_id=delivery.id)
    finally:
        release.set()
        thread.join(30)

    # then nothing was posted or logged by it, and the retry delivers it once
    assert receiver.posts == [] and not WebhookAttempt.objects.exists()
    assert webhooks.webhook_delivery_attempt(delivery_id=delivery.id) == "delivered"
    assert webhooks.webhook_delivery_attempt(delivery_id=delivery.id) == "already_delivered"
    assert len(receiver.posts) == 1
