"""Budget-alert webhooks: delivered by a real Celery worker with retries and backoff, at most
once per alert however often the task runs, never to a private, loopback, link-local or
metadata address (unless the setting allows it), never through a redirect; and budgets take a
bounded number of thresholds.

The receivers are real HTTP servers the tests start; a test that needs its receiver on
127.0.0.1 turns on ``WEBHOOK_ALLOW_PRIVATE_ADDRESSES`` (the worker by its environment).
"""

from __future__ import annotations

import json
import threading
from decimal import Decimal

import pytest
from django.db import connections, transaction

from billing_platform.accounts.choices import Role
from billing_platform.redis_conn import get_redis
from plans import admission, quotas, webhooks
from plans.metrics import BUDGET_WEBHOOKS
from plans.models import Budget, BudgetAlert
from tests.conftest import wait_until
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory


def _budget(*, url: str, thresholds=(100,)) -> Budget:
    org = OrganizationFactory()
    return quotas.budget_set(organization=org, amount="1.00", hard=False,
                             thresholds=list(thresholds), webhook_url=url)


def _overspend(budget: Budget) -> None:
    """Put this month's live spend past every threshold (Redis is ahead of PostgreSQL)."""
    key = admission.budget_key(budget.organization_id, budget.id, budget.created_at)
    get_redis().hset(key, "spent", admission.to_micro(Decimal("50")))


def _count(outcome: str) -> float:
    return BUDGET_WEBHOOKS.labels(outcome)._value.get()


# --- with a real worker ---------------------------------------------------------------------

WORKER_ENV = {"TOLLGATE_WEBHOOK_ALLOW_PRIVATE_ADDRESSES": "1",
              "TOLLGATE_BUDGET_WEBHOOK_BACKOFF_S": "1",
              "TOLLGATE_BUDGET_WEBHOOK_MAX_RETRIES": "5"}


def test_a_receiver_failing_twice_gets_exactly_one_delivery_from_the_worker(
        celery_worker_process, receivers, settings):
    # given a receiver that answers 500 twice, then 204, and a worker retrying with backoff
    settings.WEBHOOK_ALLOW_PRIVATE_ADDRESSES = True  # the budget's URL is this host's
    receiver = receivers(script=(500, 503))
    budget = _budget(url=receiver.url)
    worker = celery_worker_process(queues="quota", env=WORKER_ENV)
    _overspend(budget)

    # when the sweep finds the threshold crossed (the webhook goes out from the worker)
    assert quotas.budget_reconcile(budget=budget)["fired"] == [100]

    # then the third attempt delivers it, and the alert row says so
    alert = BudgetAlert.objects.get(budget=budget)

    def delivered() -> bool:
        alert.refresh_from_db()
        return alert.webhook_delivered_at is not None

    wait_until(delivered, timeout=120, what=f"the delivery (worker log: {worker.log_path})")
    assert [status for status, _h, _b in receiver.posts] == [500, 503, 204]
    assert len(receiver.delivered) == 1
    assert alert.webhook_attempts == 3 and alert.webhook_status == "204"
    # every attempt is the same signed event, with one id to deduplicate on
    ids = {headers["Tollgate-Webhook-Id"] for _s, headers, _b in receiver.posts}
    assert ids == {f"balert_{alert.id}"}
    for _status, headers, body in receiver.posts:
        assert webhooks.verify_webhook(secret=budget.webhook_secret, body=body,
                                       header=headers["Tollgate-Signature"])
        assert json.loads(body)["threshold"] == 100

    # when the task runs again (a duplicate) and the sweep runs again
    from plans.tasks import budget_alert_webhook

    budget_alert_webhook.delay(alert.id)
    assert quotas.budget_reconcile(budget=budget)["fired"] == []
    wait_until(lambda: "'already_delivered'" in worker.log_path.read_text(), timeout=60,
               what=f"the duplicate task to run (worker log: {worker.log_path})")

    # then nothing more was posted
    assert len(receiver.posts) == 3 and len(receiver.delivered) == 1


def test_the_worker_gives_up_after_its_retries_and_records_the_last_failure(
        celery_worker_process, receivers, settings):
    # given a receiver that always answers 500 and a worker allowed two retries
    settings.WEBHOOK_ALLOW_PRIVATE_ADDRESSES = True
    receiver = receivers(then=500)
    budget = _budget(url=receiver.url)
    worker = celery_worker_process(queues="quota", env={
        **WORKER_ENV, "TOLLGATE_BUDGET_WEBHOOK_MAX_RETRIES": "2"})
    _overspend(budget)

    # when the threshold fires
    quotas.budget_reconcile(budget=budget)

    # then three attempts were made, and the alert keeps the failure, undelivered
    alert = BudgetAlert.objects.get(budget=budget)

    def gave_up() -> bool:
        return "raised unexpected: WebhookNotDelivered('500')" in worker.log_path.read_text()

    wait_until(gave_up, timeout=120, what=f"the worker to give up (log: {worker.log_path})")
    alert.refresh_from_db()
    assert alert.webhook_delivered_at is None
    assert (alert.webhook_attempts, alert.webhook_status) == (3, "500")
    assert len(receiver.posts) == 3


# --- in this process ------------------------------------------------------------------------

def _alert(budget: Budget) -> BudgetAlert:
    _overspend(budget)
    quotas.budget_reconcile(budget=budget)  # no worker: on_commit never fires in a test txn
    return BudgetAlert.objects.get(budget=budget)


PRIVATE_URLS = [
    "http://127.0.0.1:9/hook", "http://10.0.0.7/hook", "http://169.254.169.254/latest/meta-data/",
    "http://192.168.1.1/", "http://[::1]:8080/", "http://[::ffff:127.0.0.1]/",
    "https://localhost/hook", "http://100.64.0.1/", "http://[fd00:ec2::254]/",
]


@pytest.mark.django_db
@pytest.mark.parametrize("url", PRIVATE_URLS)
def test_a_webhook_url_to_a_private_address_is_refused_with_a_400(api_client, url):
    # given an admin of an organization
    org = OrganizationFactory()
    user = UserFactory()
    MembershipFactory(user=user, organization=org, role=Role.ADMIN)
    api_client.force_login(user)

    # when they set a budget whose webhook points inside the platform's network
    r = api_client.put(f"/api/v1/organizations/{org.public_id}/budget/",
                       {"amount": "10", "webhook_url": url}, format="json")

    # then it is refused in DRF's shape, and no budget was stored
    assert r.status_code == 400, r.content
    assert r.json()["code"] == "webhook_address_refused"
    assert r.json()["param"] == "webhook_url"
    assert not Budget.objects.filter(organization=org).exists()


@pytest.mark.django_db
@pytest.mark.parametrize("url", [*PRIVATE_URLS, "http://2130706433/", "http://127.1/",
                                 "http://0x7f000001/"])
def test_every_writer_of_budgets_is_refused_a_private_webhook(url):
    # (the API's URL field already refuses the numeric forms of the last three; the console's
    # form and any other caller of the service meet the same check)
    with pytest.raises(webhooks.WebhookAddressRefused):
        quotas.budget_set(organization=OrganizationFactory(), amount="10", webhook_url=url)


@pytest.mark.django_db
def test_the_setting_allows_private_addresses(api_client, settings, receivers):
    # given the setting that allows private webhook addresses
    settings.WEBHOOK_ALLOW_PRIVATE_ADDRESSES = True
    receiver = receivers()
    org = OrganizationFactory()
    user = UserFactory()
    MembershipFactory(user=user, organization=org, role=Role.OWNER)
    api_client.force_login(user)

    # when a budget's webhook is on this host, it is accepted and delivered to
    r = api_client.put(f"/api/v1/organizations/{org.public_id}/budget/",
                       {"amount": "1", "hard": False, "thresholds": [100],
                        "webhook_url": receiver.url}, format="json")
    assert r.status_code == 200, r.content
    alert = _alert(Budget.objects.get(public_id=r.json()["id"]))
    assert webhooks.budget_alert_webhook_deliver(alert_id=alert.id) == "delivered"
    assert len(receiver.delivered) == 1


@pytest.mark.django_db
def test_a_name_that_resolves_to_a_private_address_is_refused_at_delivery(receivers,
                                                                         settings):
    # given a budget whose webhook host resolved to a public address when it was saved, and
    # now resolves to loopback (here: "localhost", saved around the write-time check)
    receiver = receivers()
    settings.WEBHOOK_ALLOW_PRIVATE_ADDRESSES = True
    budget = _budget(url=receiver.url)
    alert = _alert(budget)
    port = receiver.url.split(":")[2].split("/")[0]
    Budget.objects.filter(pk=budget.pk).update(webhook_url=f"http://localhost:{port}/hooks")
    settings.WEBHOOK_ALLOW_PRIVATE_ADDRESSES = False
    refused = _count("refused")

    # when the worker would deliver it
    outcome = webhooks.budget_alert_webhook_deliver(alert_id=alert.id)

    # then nothing is sent, it is not retried (no exception), and it is recorded and counted
    assert outcome == "refused"
    assert receiver.posts == []
    alert.refresh_from_db()
    assert alert.webhook_status.startswith("refused") and alert.webhook_delivered_at is None
    assert _count("refused") == refused + 1


@pytest.mark.django_db
@pytest.mark.parametrize("target", ["http://169.254.169.254/latest/meta-data/", "inner"])
def test_a_redirect_is_never_followed(receivers, settings, target):
    # given a receiver that redirects to the metadata address, or to another local receiver
    settings.WEBHOOK_ALLOW_PRIVATE_ADDRESSES = True  # to reach the redirecting receiver
    inner = receivers()
    outer = receivers(then=307, location=inner.url if target == "inner" else target)
    alert = _alert(_budget(url=outer.url))
    failed = _count("failed")

    # when the webhook is delivered, the redirect is a failed attempt (retried), not followed
    with pytest.raises(webhooks.WebhookNotDelivered):
        webhooks.budget_alert_webhook_deliver(alert_id=alert.id)

    # then nothing reached the redirect's target
    assert len(outer.posts) == 1 and inner.posts == []
    alert.refresh_from_db()
    assert (alert.webhook_status, alert.webhook_attempts) == ("307", 1)
    assert alert.webhook_delivered_at is None
    assert _count("failed") == failed + 1


@pytest.mark.django_db(transaction=True)
def test_a_duplicate_task_does_not_post_while_another_holds_the_alert(receivers, settings):
    # given one worker in the middle of delivering an alert (it holds the alert's row)
    settings.WEBHOOK_ALLOW_PRIVATE_ADDRESSES = True
    receiver = receivers()
    budget = _budget(url=receiver.url)
    # the alert the sweep would record (made here: the sweep's would go to a worker)
    alert = BudgetAlert.objects.create(budget=budget, period_start=budget.created_at,
                                       threshold=100, spend=Decimal("1.5"))
    holding, release = threading.Event(), threading.Event()

    def other_worker() -> None:
        try:
            with transaction.atomic():
                BudgetAlert.objects.select_for_update().get(pk=alert.pk)
                holding.set()
                release.wait(30)
        finally:
            connections.close_all()

    thread = threading.Thread(target=other_worker)
    thread.start()
    assert holding.wait(30)
    try:
        # when a duplicate of the task runs meanwhile, it leaves the alert alone
        assert webhooks.budget_alert_webhook_deliver(alert_id=alert.id) == "in_progress"
    finally:
        release.set()
        thread.join(30)

    # then nothing was posted by it; once free, one delivery, and then never again
    assert receiver.posts == []
    assert webhooks.budget_alert_webhook_deliver(alert_id=alert.id) == "delivered"
    assert webhooks.budget_alert_webhook_deliver(alert_id=alert.id) == "already_delivered"
    assert len(receiver.posts) == 1


# --- thresholds and the other inputs of a budget --------------------------------------------

@pytest.mark.django_db
def test_budget_inputs_are_bounded_and_errors_are_in_drf_shape(api_client):
    # given an admin of an organization, and a stranger's organization
    org = OrganizationFactory()
    user = UserFactory()
    MembershipFactory(user=user, organization=org, role=Role.ADMIN)
    api_client.force_login(user)
    url = f"/api/v1/organizations/{org.public_id}/budget/"
    too_many = list(range(1, quotas.MAX_THRESHOLDS + 2))

    # then thresholds over the bound, malformed ones, too many emails and an oversized URL are
    # each a 400 naming the field
    cases = {
        "thresholds": [{"thresholds": too_many}, {"thresholds": []},
                       {"thresholds": ["fifty"]}, {"thresholds": [[50]]},
                       {"thresholds": [0]}, {"thresholds": [1001]}],
        "alert_emails": [{"alert_emails": [f"a{i}@example.com" for i in range(11)]},
                         {"alert_emails": ["not-an-email"]},
                         {"alert_emails": [f"{'a' * 250}@example.com"]}],
        "webhook_url": [{"webhook_url": "https://h.example/" + "x" * 300},
                        {"webhook_url": "ftp://h.example/x"}],
    }
    for name, bodies in cases.items():
        for body in bodies:
            r = api_client.put(url, {"amount": "10", **body}, format="json")
            assert r.status_code == 400, (body, r.content)
            # the field's errors (DRF validation) or the service's domain error naming it
            assert name in r.json() or r.json()["param"] == name, (body, r.json())
    assert not Budget.objects.filter(organization=org).exists()

    # and the bound itself is accepted
    r = api_client.put(url, {"amount": "10", "thresholds": too_many[:-1]}, format="json")
    assert r.status_code == 200, r.content
    assert r.json()["thresholds"] == too_many[:-1]

    # and the service refuses the same for every other caller (the console's form)
    from billing_platform.errors import InvalidRequest

    with pytest.raises(InvalidRequest) as refused:
        quotas.budget_set(organization=org, amount="10", thresholds=too_many)
    assert refused.value.param == "thresholds"

    # and another organization's budget is not found, whatever the body
    stranger = OrganizationFactory()
    r = api_client.put(f"/api/v1/organizations/{stranger.public_id}/budget/",
                       {"amount": "10", "thresholds": too_many}, format="json")
    assert r.status_code == 404
    assert not Budget.objects.filter(organization=stranger).exists()
