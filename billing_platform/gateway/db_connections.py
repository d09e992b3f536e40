"""Database connections of the lean /v1 route, which fires no Django request signals.

Django health-checks and recycles a thread's connection when a request starts and ends
(``close_old_connections`` on ``request_started``/``request_finished``, with
``CONN_HEALTH_CHECKS``). The lean route (``gateway/asgi.py``) sends no signals, and its database
work runs in the event loop's default executor (``sync_to_async(..., thread_sensitive=False)``:
the fleet view's refresh, admission policy reloads, key lookups that miss the cache). So a
connection that a PostgreSQL restart had broken stayed in its thread for good, and /v1 failed
until the process restarted. ``install`` gives the loop a default executor that runs every job
between two ``close_old_connections()`` calls, as Django runs a request between its signals:
a broken connection is dropped and the next job connects afresh, and ``CONN_MAX_AGE`` means
what it means for any Django request. ``in_thread`` is how a /v1
view runs its database work there: asgiref's thread-sensitive ``sync_to_async`` (its default)
runs it in one shared thread that nothing checks, so after a PostgreSQL restart /v1/files and
/v1/batches answered 503 until the process restarted.

The executor's threads keep their connection between jobs for
``TOLLGATE_GATEWAY_DB_CONN_MAX_AGE_S`` (60 s; Django's ``CONN_MAX_AGE``, given to these
threads only): with the project's ``CONN_MAX_AGE`` of 0 each job opened a new connection, a
PostgreSQL backend forked and authenticated for every policy reload, fleet refresh and
key-cache miss (bench/gateway.py: about a tenth of the gateway's CPU per request, besides
the server's fork). Before each job, a connection the server has ended (a restart tells each
backend's client, then closes) is dropped and the job connects afresh: a poll of its socket
(``_drop_closed_by_server``) where Django's ``CONN_HEALTH_CHECKS`` sent a ``SELECT 1``, a
round trip for every policy reload and key-cache miss. After a job that failed, Django still
checks the connection (``close_old_connections``) and drops it if broken. The threads are
the executor's, at most ``max_workers`` per process, so the connections are bounded too.

``unavailable`` is the /v1 error when PostgreSQL is needed and nothing cached would do (a key
not in the Redis key cache, a fleet view past ``TOLLGATE_FLEET_MAX_STALE_S``): a retryable 503
in OpenAI's shape, never a 500, logged at most once every ``LOG_EVERY_S``, not per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import select
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import DatabaseError, close_old_connections, connections

from billing_platform.errors import Unavailable

log = logging.getLogger(__name__)
T = TypeVar("T")
P = ParamSpec("P")
LOG_EVERY_S = 60.0


def _drop_closed_by_server() -> None:
    """Close this thread's connections on which the server spoke unasked.

    An idle connection receives nothing unless the server ends it (a restart's "terminating
    connection due to administrator command", then end of file), so a socket with something
    to read is one to drop: a poll, no round trip. Django's health check (``SELECT 1`` before
    each job's first query) cost as much as the policy reload it preceded.
    """
    for conn in connections.all(initialized_only=True):
        raw = conn.connection
        if raw is None:
            continue
        try:
            poll = select.poll()
            poll.register(raw.fileno(), select.POLLIN)
            spoke = bool(poll.poll(0))
        except Exception:  # closed under us: psycopg's or the OS's error
            spoke = True
        if spoke:
            with contextlib.suppress(DatabaseError):
                conn.close()


def _between_checks(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    close_old_connections()
    _drop_closed_by_server()
    try:
        return fn(*args, **kwargs)
    finally:
        close_old_connections()


def _keep_connections() -> None:
    """Give this thread's connections ``GATEWAY_DB_CONN_MAX_AGE_S`` as their CONN_MAX_AGE, and
    ``_drop_closed_by_server`` instead of Django's health check.

    Each thread has connection objects of its own; their settings are the project's dict,
    shared, so each gets a copy (other threads keep theirs)."""
    age = settings.GATEWAY_DB_CONN_MAX_AGE_S
    for alias in connections:
        conn = connections[alias]
        conn.settings_dict = {**conn.settings_dict, "CONN_MAX_AGE": age,
                              "CONN_HEALTH_CHECKS": False}


class ConnectionCheckingExecutor(ThreadPoolExecutor):
    """A thread pool whose every job runs between two ``close_old_connections()`` calls, and
    whose threads keep a connection for ``GATEWAY_DB_CONN_MAX_AGE_S`` between jobs."""

    def __init__(self, *, thread_name_prefix: str = "") -> None:
        super().__init__(thread_name_prefix=thread_name_prefix, initializer=_keep_connections)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        return super().submit(_between_checks, fn, *args, **kwargs)


_loop: asyncio.AbstractEventLoop | None = None


def install() -> None:
    """Make the running loop's default executor a ``ConnectionCheckingExecutor`` (once)."""
    global _loop
    loop = asyncio.get_running_loop()
    if loop is _loop:
        return
    loop.set_default_executor(ConnectionCheckingExecutor(thread_name_prefix="gateway-db"))
    _loop = loop


def in_thread(fn: Callable[P, T]) -> Callable[P, Awaitable[T]]:
    """Return ``fn`` as a coroutine function that runs in the loop's default executor, between
    two connection checks (``install``'s executor does them; here they are made explicit, so
    a view called outside the lean route gets them too).

    For the database work of /v1 views. Each call is one job: run its whole unit of work
    (a transaction included) in one ``fn``.
    """
    return sync_to_async(functools.partial(_between_checks, fn), thread_sensitive=False)


_logged_at = float("-inf")


def unavailable(exc: DatabaseError) -> Unavailable:
    """Return the /v1 error for a request that needed PostgreSQL while it is unavailable."""
    global _logged_at
    now = time.monotonic()
    if now - _logged_at > LOG_EVERY_S:
        _logged_at = now
        log.warning("PostgreSQL unavailable (%r): /v1 requests that need it answer 503 (said "
                    "at most once every %.0f s)", exc, LOG_EVERY_S)
    return Unavailable("The service is temporarily unavailable; retry shortly.",
                       code="service_unavailable", headers={"retry-after": "1"})
