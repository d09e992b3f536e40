"""Fuzz the management API from its own OpenAPI schema (issue 15, item 7).

schemathesis reads ``/api/v1/schema/`` and generates requests for every operation: valid ones
(what a generated client sends) and invalid ones (wrong types, missing fields, odd unicode).
They go through Django's whole stack (WSGI: middleware, sessions, CSRF, DRF) on the test
database, signed in as each role of an organization, as platform staff and anonymously, with
the path's ids pointing at real objects of that organization. Every answer must be a non-5xx
that the schema documents: its status code, content type, body shape and headers.

Each operation runs in a savepoint rolled back afterwards, so an operation that deletes or
changes the shared objects does not starve the next one. Hypothesis is derandomized and its
example count bounded, so the suite is deterministic and stays inside CI's time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.db import close_old_connections, transaction
from django.test import Client
from django.utils import timezone
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from billing_platform.accounts.choices import Role
from billing_platform.accounts.models import User
from tests.factories import (
    MembershipFactory,
    OrganizationFactory,
    make_key,
    make_offering,
    make_price_book,
    make_token_plan,
)

pytestmark = pytest.mark.django_db

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, response_headers_conformance]
CSRF = "fuzzfuzzfuzzfuzzfuzzfuzzfuzzfuzz"  # 32 letters: a CSRF secret Django accepts


@contextlib.contextmanager
def _test_connection_kept() -> Iterator[None]:
    """As Django's test client does, keep the test's database connection across requests (in
    production each request closes an old one), so the app sees the test's objects."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


@pytest.fixture(scope="module")
def api_schema() -> schemathesis.BaseSchema:
    """The schema, served by the WSGI app that then answers the fuzzed requests in-process.

    Loaded before any test's database is open (a module fixture): with the request signals
    connected, an earlier test's connection would be health-checked here, outside any test."""
    from billing_platform.wsgi import application

    with _test_connection_kept():
        return schemathesis.openapi.from_wsgi("/api/v1/schema/?format=json", application)


@pytest.fixture(autouse=True)
def _keep_the_test_connection() -> Iterator[None]:
    with _test_connection_kept():
        yield


class _Rollback(Exception):
    pass


def _world() -> dict[str, Any]:
    """An organization with a member of every role, a target member, keys, a subscription, a
    reservation, an invoice; the catalogue (price book, token plan, credit pack, offering)."""
    from billing_platform.invoicing import services as invoicing
    from plans import quotas
    from plans import services as plans

    created = timezone.now() - timedelta(days=70)
    org = OrganizationFactory(created_at=created)
    project = org.projects.create(name="fuzzed")
    users = {role: MembershipFactory(organization=org, role=role).user for role in Role.values}
    target = MembershipFactory(organization=org, role=Role.VIEWER)
    key, _secret = make_key(project, scopes=["inference", "admin"],
                            acting_user=users[Role.OWNER])
    book = make_price_book()
    plan = make_token_plan()
    plans.credit_pack_create(plan=plan, code="fuzz-pack", name="Fuzz pack", credits="100",
                             price="5.00")
    offering = make_offering(model="test-model")
    subscription = plans.subscription_create(organization=org, plan=plan,
                                             starts_at=created)
    reservation = plans.reservation_create(organization=org, offering=offering, units=1,
                                           term="monthly", starts_at=created)
    end_user_budget = quotas.end_user_budget_set(organization=org, end_user="fuzz-user",
                                                 amount="5", acting_user=users[Role.OWNER])
    invoicing.period_close_run(org_ids=[org.id], enqueue_payments=False)
    invoice = org.invoices.order_by("id").first()
    staff = User.objects.create_user(email="staff@tollgate.example", password="x" * 12,
                                     is_staff=True)
    return {
        "users": {**users, "staff": staff},
        "ids": {
            "org_id": org.public_id, "project_id": project.public_id,
            "key_id": key.public_id, "member_id": target.pk,
            "invoice_id": invoice.public_id if invoice else "inv_missing",
            "sub_id": subscription.public_id, "reservation_id": reservation.public_id,
            "version_id": book.versions.first().pk, "budget_id": end_user_budget.public_id,
        },
        "codes": {"/api/v1/price_books/": book.code, "/api/v1/plans/": plan.code},
    }


def _signed_in(user: User | None) -> dict[str, dict[str, str]]:
    """What a signed-in browser sends (session cookie, CSRF cookie and header), or nothing."""
    if user is None:
        return {"headers": {}, "cookies": {}}
    client = Client()
    client.force_login(user)
    return {"headers": {"X-CSRFToken": CSRF},
            "cookies": {"sessionid": client.cookies["sessionid"].value, "csrftoken": CSRF}}


def _path_parameters(operation: Any, world: dict[str, Any]) -> dict[str, Any]:
    names = {p.name for p in operation.path_parameters}
    known = {name: value for name, value in world["ids"].items() if name in names}
    if "code" in names:
        known["code"] = next(code for prefix, code in world["codes"].items()
                             if operation.path.startswith(prefix))
    return known


def _fuzz(operation: Any, mode: GenerationMode, examples: int,
          auth: dict[str, dict[str, str]], path_parameters: dict[str, Any]) -> None:
    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck), phases=(Phase.explicit, Phase.generate))
    @given(case=operation.as_strategy(generation_mode=mode, path_parameters=path_parameters))
    def run(case: schemathesis.Case) -> None:
        case.call_and_validate(checks=CHECKS, **auth)

    run()


def _fuzz_all(schema: schemathesis.BaseSchema, auth: dict[str, dict[str, str]],
              world: dict[str, Any], examples: dict[GenerationMode, int], *,
              forged_ids: bool = False) -> list[str]:
    """Fuzz every operation; return the failures (each operation rolled back after)."""
    # a signed-in browser sends no Authorization header (a generated one would be a wrong key)
    schema.config.generation.update(with_security_parameters=not auth["cookies"])
    failures = []
    for result in schema.get_all_operations():
        operation = result.ok()
        path_parameters = _path_parameters(operation, world)
        if forged_ids:  # only the organization is real; every other id is generated
            if set(path_parameters) <= {"org_id"}:
                continue
            path_parameters = {k: v for k, v in path_parameters.items() if k == "org_id"}
        for mode, count in examples.items():
            if mode is GenerationMode.NEGATIVE and not (len(operation.body)
                                                        or len(operation.query)):
                continue  # nothing to make invalid but the (real) path
            try:
                with transaction.atomic():
                    _fuzz(operation, mode, count, auth, path_parameters)
                    raise _Rollback
            except _Rollback:
                pass
            except (Exception, BaseExceptionGroup) as exc:  # every operation's failures
                failures.append(f"{operation.label} ({mode.value}): {exc}")
    return failures


# Examples per operation (valid, invalid), bounded so the file runs in about two minutes on a
# loaded 2-core machine: the owner and staff, who reach every write and so every validation,
# get invalid bodies too; the other roles and the anonymous caller meet their refusals first
# (the permission check comes before the body is read), which one valid request per operation
# shows.
PRINCIPALS = {
    Role.OWNER: {GenerationMode.POSITIVE: 2, GenerationMode.NEGATIVE: 2},
    "staff": {GenerationMode.POSITIVE: 2, GenerationMode.NEGATIVE: 1},
    **{role: {GenerationMode.POSITIVE: 1} for role in (Role.ADMIN, Role.DEVELOPER,
                                                          Role.FINANCE, Role.VIEWER)},
    "anonymous": {GenerationMode.POSITIVE: 1},
}


@pytest.mark.parametrize("principal", list(PRINCIPALS))
def test_every_operation_answers_what_its_schema_says(api_schema, principal):
    # given an organization with every kind of object, and a principal signed in to it
    world = _world()
    auth = _signed_in(world["users"].get(principal))
    # when every operation is fuzzed with valid and invalid requests
    t0 = time.monotonic()
    failures = _fuzz_all(api_schema, auth, world, PRINCIPALS[principal])
    # then no answer is a 5xx and every answer matches the schema
    print(f"{principal}: {time.monotonic() - t0:.1f}s")  # noqa: T201
    assert failures == [], "\n\n".join(failures)


def test_forged_ids_answer_what_the_schema_says(api_schema):
    # given the organization's owner
    world = _world()
    auth = _signed_in(world["users"][Role.OWNER])
    # when every operation is fuzzed with generated ids of projects, keys, members, invoices
    failures = _fuzz_all(api_schema, auth, world, {GenerationMode.POSITIVE: 1},
                         forged_ids=True)
    # then no answer is a 5xx (e.g. an id past PostgreSQL's integer) and all match the schema
    assert failures == [], "\n\n".join(failures)


# --- what the fuzz found, named ----------------------------------------------------------------

def test_a_plan_window_past_its_column_is_a_400_not_a_500(api_client):
    # given platform staff and a token plan
    plan = make_token_plan()
    staff = User.objects.create_user(email="ops@tollgate.example", password="x" * 12,
                                     is_staff=True)
    api_client.force_login(staff)
    # when staff set a rolling window longer than the column holds
    r = api_client.patch(f"/api/v1/plans/{plan.code}/", {"window_hours": 672_668},
                         format="json")
    # then it is refused field by field, and the plan keeps its window
    assert r.status_code == 400, r.content
    assert "window_hours" in r.json()
    plan.refresh_from_db()
    assert plan.window_hours == 5


@pytest.mark.parametrize("depth", [65, 900, 100_000])
def test_deeply_nested_json_is_a_400_in_drfs_shape(api_client, depth):
    # given an owner signed in
    member = MembershipFactory(role=Role.OWNER)
    api_client.force_login(member.user)
    # when a body nests deeper than the platform accepts (100,000: past Python's parser)
    body = b'{"name": ' + b"[" * depth + b"]" * depth + b"}"
    r = api_client.post(f"/api/v1/organizations/{member.organization.public_id}/projects/",
                        data=body, content_type="application/json")
    # then it is a parse error, and no project is made
    assert r.status_code == 400, r.content
    assert "nested deeper than 64 levels" in r.json()["detail"]
    assert not member.organization.projects.exists()
