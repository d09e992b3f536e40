"""An optional read replica for the read-heavy report pages (``DATABASE_REPLICA_URL``).

With ``DATABASE_REPLICA_URL`` set, ``settings.DATABASES`` holds a second alias, ``replica``,
configured like ``default``. Nothing reads it unless a view opts in with ``reports_read``
(the finance reports, ``GET /api/v1/usage``, the console's dashboard and usage explorer); every
other read, and every write, stays on ``default``. Inside ``reports_read`` the ORM reads through
``ReplicaRouter`` and the raw SQL of the selectors they call (``metering.selectors``,
``plans.selectors``, ``invoicing.reports``, ``invoicing.selectors``, the late-usage reads of
``invoicing.builder``) through ``reading_connection()``, so one report reads one database.

What a report on the replica may show, and when it reads the primary instead:

- It may lag the primary by up to ``DATABASE_REPLICA_MAX_LAG_S`` seconds (5 by default).
  Each ``reports_read`` asks the replica how far behind it is (``replica_lag_s``); past the
  bound, or when the replica does not answer, the request reads the primary. A replica that
  failed is not asked again for ``REPLICA_RETRY_S``, so a dead one costs one refused connect
  per few seconds, not one per request.
- Read-your-writes: after a user or an API key sends a write (any unsafe method) through the
  web process, ``ReadYourWritesMiddleware`` pins that principal to the primary for the lag
  bound, so the page showing an admin action's result never shows the state before it.
- A read inside a transaction that writes (``default`` in an atomic block) always reads the
  primary, and writes always go there (``ReplicaRouter.db_for_write``): objects loaded from
  the replica are saved to the primary.
- A report whose replica query fails (the connection broke, or the replica cancelled the
  query for a conflict with recovery) is run again on the primary (the views that opt in only
  read, so running one twice is safe).

Unset, there is no ``replica`` alias and everything reads ``default``, as before.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from functools import wraps
from typing import Any, TypeVar

from django.conf import settings
from django.core.cache import cache
from django.db import DEFAULT_DB_ALIAS, DatabaseError, InterfaceError, OperationalError, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.http import HttpRequest, HttpResponseBase
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

REPLICA = "replica"
# Seconds a replica that did not answer (or lagged past the bound) is left alone.
REPLICA_RETRY_S = 5.0
_PIN_KEY = "tg:db:primary-pin:{}"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})

# The alias the current report reads (None: not inside reports_read, reads go to default).
_reading: ContextVar[str | None] = ContextVar("tollgate_reading_db", default=None)
# Monotonic time until which this process does not try the replica.
_replica_down_until = 0.0

F = TypeVar("F", bound=Callable[..., Any])

# Lag in seconds: 0 while the replica streams from the primary and has replayed all it
# received; otherwise how old the last transaction it replayed is (unknown: NULL, no
# transaction replayed yet). A primary (not in recovery) has no lag.
LAG_SQL = """
SELECT CASE
    WHEN NOT pg_is_in_recovery() THEN 0
    WHEN EXISTS (SELECT 1 FROM pg_stat_wal_receiver WHERE status = 'streaming')
         AND pg_last_wal_receive_lsn() = pg_last_wal_replay_lsn() THEN 0
    ELSE EXTRACT(EPOCH FROM clock_timestamp() - pg_last_xact_replay_timestamp())
END
"""


def replica_configured() -> bool:
    """Return True when DATABASES has a replica alias (DATABASE_REPLICA_URL is set)."""
    return REPLICA in connections.settings


def replica_lag_s() -> float | None:
    """Return how many seconds the replica lags the primary, or None if it does not answer."""
    conn = connections[REPLICA]
    try:
        with conn.cursor() as cur:
            cur.execute(LAG_SQL)
            row = cur.fetchone()
    except DatabaseError as exc:
        log.warning("read replica unreachable, reports read the primary: %s", exc)
        with contextlib.suppress(DatabaseError):
            conn.close()
        return None
    if row is None or row[0] is None:
        return float("inf")
    return float(row[0])


def reporting_db() -> str:
    """Return the alias reports should read now: the replica if it answers within the lag bound."""
    if not replica_configured() or time.monotonic() < _replica_down_until:
        return DEFAULT_DB_ALIAS
    lag = replica_lag_s()
    if lag is None or lag > settings.DATABASE_REPLICA_MAX_LAG_S:
        if lag is not None:
            log.warning("read replica lags %.1fs (bound %ss), reports read the primary", lag,
                        settings.DATABASE_REPLICA_MAX_LAG_S)
        _mark_replica_down()
        return DEFAULT_DB_ALIAS
    return REPLICA


def _mark_replica_down() -> None:
    global _replica_down_until
    _replica_down_until = time.monotonic() + REPLICA_RETRY_S


def reset_replica_state() -> None:
    """Forget a replica failure, so the next report asks the replica again (tests, operators)."""
    global _replica_down_until
    _replica_down_until = 0.0


def reading_db() -> str:
    """Return the alias a read should use here: the report's, or default in a writing
    transaction and outside reports."""
    alias = _reading.get()
    if alias is None or alias == DEFAULT_DB_ALIAS or connections[DEFAULT_DB_ALIAS].in_atomic_block:
        return DEFAULT_DB_ALIAS
    return alias


def reading_connection() -> BaseDatabaseWrapper:
    """Return the connection a selector's raw SQL reads through (see ``reading_db``)."""
    return connections[reading_db()]


def _principal(request: Any) -> str | None:
    user = getattr(request, "user", None)
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    pk = getattr(user, "pk", None)
    return f"user:{pk}" if pk is not None else str(user)  # a key: "api-key:<id>"


def _pinned_to_primary(request: Any) -> bool:
    principal = _principal(request)
    if principal is None:
        return False
    try:
        return bool(cache.get(_PIN_KEY.format(principal)))
    except RedisError as exc:  # the pin cannot be read: read the primary, to be safe
        log.warning("read-your-writes pin unreadable, reading the primary: %s", exc)
        return True


@contextlib.contextmanager
def reports_read(request: Any = None) -> Iterator[str]:
    """Read the ORM and ``reading_connection()`` from the reporting database in this block;
    yield its alias. ``request``: its principal's recent writes keep it on the primary."""
    if not replica_configured() or (request is not None and _pinned_to_primary(request)):
        alias = DEFAULT_DB_ALIAS
    else:
        alias = reporting_db()
    token = _reading.set(alias)
    try:
        yield alias
    finally:
        _reading.reset(token)


def replica_report(view: F) -> F:
    """Serve a read-only view from the reporting database (``reports_read``); if the replica
    breaks mid-way, serve it again from the primary. The first argument whose ``user`` is set
    (the request; DRF's, after authentication, for an API view's method) is the principal."""

    @wraps(view)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        request = next((a for a in args if hasattr(a, "user") and hasattr(a, "method")), None)
        with reports_read(request) as alias:
            if alias == DEFAULT_DB_ALIAS:
                return view(*args, **kwargs)
            try:
                return view(*args, **kwargs)
            except (OperationalError, InterfaceError) as exc:
                # a replica gone, or a query it cancelled (a conflict with recovery): the
                # primary has the same rows; an error of the view's own comes back again there
                log.warning("report failed on the read replica, serving it from the primary: %s",
                            exc)
                conn = connections[REPLICA]
                if conn.connection is None or not conn.is_usable():
                    with contextlib.suppress(DatabaseError):
                        conn.close()
                    _mark_replica_down()
        token = _reading.set(DEFAULT_DB_ALIAS)
        try:
            return view(*args, **kwargs)
        finally:
            _reading.reset(token)

    return wrapper  # type: ignore[return-value]


class ReplicaRouter:
    """Reads inside ``reports_read`` go to its alias; every write goes to the primary; only the
    primary is migrated (the replica replays it)."""

    def db_for_read(self, model: type[Any], **hints: Any) -> str | None:
        return reading_db() if _reading.get() is not None else None

    def db_for_write(self, model: type[Any], **hints: Any) -> str:
        return DEFAULT_DB_ALIAS

    def allow_relation(self, obj1: Any, obj2: Any, **hints: Any) -> bool:
        return True  # the replica holds the primary's rows

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        return None if db == DEFAULT_DB_ALIAS else False


class ReadYourWritesMiddleware:
    """After a write request (an unsafe method) of a signed-in user or an API key, keep that
    principal's reports on the primary for ``DATABASE_REPLICA_MAX_LAG_S``: within the bound the
    replica may not have the write yet."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        response = self.get_response(request)
        if request.method not in SAFE_METHODS and replica_configured():
            principal = _principal(request)
            if principal is not None:
                # the lag is measured in fractions of a second: round the bound up, plus one
                pin_s = math.ceil(settings.DATABASE_REPLICA_MAX_LAG_S) + 1
                try:
                    cache.set(_PIN_KEY.format(principal), 1, timeout=pin_s)
                except RedisError as exc:  # then the read side cannot read it either: primary
                    log.warning("read-your-writes pin not recorded: %s", exc)
        return response
