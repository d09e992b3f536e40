"""What billing_platform/celery.py declares once holds for every task and every beat entry:
a task added anywhere without the delivery options, or a periodic task without an expiry, or
one scheduled from somewhere else, fails here."""

from __future__ import annotations

import importlib.util

import pytest
from celery import Task
from django.apps import apps

from billing_platform.celery import Queues, app, beat_schedule

# What every task promises (STYLE.md): acked only once done, back on its queue when the worker
# running it dies (so each must be safe to run twice), and no result kept.
DELIVERY = {"acks_late": True, "reject_on_worker_lost": True, "ignore_result": True}


@pytest.fixture(autouse=True)
def _clean_redis() -> None:
    """Nothing here touches Redis."""


def _registered() -> dict[str, Task]:
    """Return the platform's tasks as a worker sees them (every app's tasks module loaded)."""
    app.loader.import_default_modules()
    return {name: task for name, task in app.tasks.items() if not name.startswith("celery.")}


def _defined_in_tasks_modules() -> dict[str, str]:
    """Return each task found in an installed app's ``tasks`` module, with its module."""
    found = {}
    for config in apps.get_app_configs():
        name = f"{config.name}.tasks"
        if importlib.util.find_spec(name) is None:
            continue
        module = importlib.import_module(name)
        for value in vars(module).values():
            if isinstance(value, Task):
                found[value.name] = name
    return found


def test_every_task_of_every_app_carries_the_shared_delivery_options():
    # given every task an app defines, as the worker registers them
    defined = _defined_in_tasks_modules()
    registered = _registered()
    assert {m.split(".")[0] for m in defined.values()} >= {
        "billing_platform", "metering", "plans", "engine_adapter"}
    assert defined.keys() <= registered.keys()

    # then each one is acked late, requeued on worker loss and keeps no result
    differing = {name: {option: getattr(task, option) for option, wanted in DELIVERY.items()
                        if getattr(task, option) != wanted}
                 for name, task in registered.items()}
    assert {name: diff for name, diff in differing.items() if diff} == {}


def test_no_task_retries_every_error():
    # a task may retry its own transient errors, never anything at all (STYLE.md: a task that
    # charges money must not retry blindly)
    blind = {name: task.autoretry_for for name, task in _registered().items()
             if set(getattr(task, "autoretry_for", ()) or ()) & {Exception, BaseException}}
    assert blind == {}


def test_every_task_is_routed_to_a_declared_queue():
    routes = {name: app.amqp.router.route({}, name)["queue"].name for name in _registered()}
    assert {name: queue for name, queue in routes.items() if queue not in set(Queues)} == {}
    assert routes["invoicing.charge"] == Queues.BILLING
    assert routes["fleet.health_check"] == Queues.FLEET


def test_the_beat_schedule_is_declared_once_and_every_entry_expires():
    registered = _registered()
    schedule = app.conf.beat_schedule

    # the worker's schedule is the one declared in billing_platform.celery, nothing added
    assert schedule.keys() == beat_schedule().keys()
    assert len(schedule) >= 10

    for name, entry in schedule.items():
        # each runs a task that exists, and a beat not started in time is dropped, not queued up
        assert entry["task"] in registered, name
        expires = entry.get("options", {}).get("expires")
        assert isinstance(expires, int | float), f"{name} has no expires"
        assert expires > 0, name
