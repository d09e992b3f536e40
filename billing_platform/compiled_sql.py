"""ORM queries compiled once and run on a plain cursor: the reads that run all the time.

Why a module of its own: building a queryset and compiling it to SQL costs this machine about
0.5-1 ms of CPU a query, several times what PostgreSQL spends answering a read by primary key,
and the reads that gateway processes repeat every second or two (each key's quota policy)
did that again on every read. (The fleet read does the same with SQL of its own,
``engine_adapter.selectors``: engine_adapter imports nothing of the other apps.)
``CompiledQuery`` keeps the ORM as the one definition of
the query (the queryset, built by the selector that owns it) and compiles it once per process;
each run sends the same SQL with the new values and reads plain rows (no model instances).

A query with values that change (an organization, an instant) is compiled twice, from two
sets of placeholder values: the parameters that differ between the two are the placeholders'
(a constant of the query equal to a placeholder's value stays a constant), and each run puts
its own values there. A placeholder the ORM did not pass through unchanged (a lookup that wraps
it, as ``__contains`` does) is refused when the query is compiled, never silently dropped.

``rows_of(q1, q2, ...)`` sends several as one statement string, one round trip (a policy's
seven reads: ~0.48 ms of this process's CPU instead of ~1.55 as seven executes). The project's
cursors bind values client-side (Django's default), which is what lets one execute carry
several statements with their values.

``CompiledQuery.built_each_time()`` runs every compiled query as the ORM would (built and
compiled again, read through the queryset): the baseline ``bench/policy_reload.py`` measures
against in the same run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import date, datetime, timedelta
from decimal import Decimal
from typing import Any, ClassVar

from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.db.models import QuerySet


def _other(value: Any) -> Any:
    """A second value of ``value``'s type, different from it (the second compile's)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | Decimal | float):
        return value - 1
    if isinstance(value, str):
        return value + "~"
    if isinstance(value, datetime | date):  # a datetime is a date
        return value + timedelta(days=1)
    raise ImproperlyConfigured(f"no second placeholder value for a {type(value).__name__}")


class CompiledQuery:
    """``build(**placeholders)``'s SQL, compiled on first use; ``rows(**values)`` runs it."""

    _orm: ClassVar[bool] = False  # the benchmark's baseline: build and compile every time

    def __init__(self, build: Callable[..., QuerySet[Any]], **placeholders: Any) -> None:
        self._build = build
        self._placeholders = placeholders
        self._compiled: tuple[str, tuple[tuple[str | None, Any], ...]] | None = None

    def _compile(self) -> tuple[str, tuple[tuple[str | None, Any], ...]]:
        others = {name: _other(value) for name, value in self._placeholders.items()}
        sql, params = self._build(**self._placeholders).query.sql_with_params()
        sql_b, params_b = self._build(**others).query.sql_with_params()
        if sql_b != sql or len(params_b) != len(params):
            raise ImproperlyConfigured("the query's SQL depends on its values: not compilable")
        slots: list[tuple[str | None, Any]] = []
        for a, b in zip(params, params_b, strict=True):
            name = None
            if a != b:
                name = next((n for n, v in self._placeholders.items()
                             if type(v) is type(a) and v == a and others[n] == b), None)
                if name is None:
                    raise ImproperlyConfigured(
                        f"parameter {a!r} follows a placeholder but is not its value (the "
                        f"lookup changed it): give values the ORM passes through unchanged")
            slots.append((name, a))
        missing = set(self._placeholders) - {name for name, _ in slots}
        if missing:
            raise ImproperlyConfigured(
                f"placeholders {sorted(missing)} are not among the query's parameters")
        return sql, tuple(slots)

    def rows(self, **values: Any) -> list[tuple[Any, ...]]:
        """Run the query with ``values`` in place of the placeholders; its rows as tuples.

        Values are as a plain cursor reads them: a JSON column is text, for instance.
        """
        return rows_of(self, **values)[0]

    def _bound(self, values: dict[str, Any]) -> tuple[str, list[Any]]:
        if self._compiled is None:
            self._compiled = self._compile()
        sql, slots = self._compiled
        return sql, [values[name] if name is not None else constant for name, constant in slots]

    def _orm_rows(self, values: dict[str, Any]) -> list[tuple[Any, ...]]:
        return list(self._build(**{name: values[name] for name in self._placeholders}))

    @staticmethod
    @contextlib.contextmanager
    def built_each_time() -> Iterator[None]:
        """Within, every compiled query is built and compiled by the ORM at each run."""
        CompiledQuery._orm = True
        try:
            yield
        finally:
            CompiledQuery._orm = False


def rows_of(*queries: CompiledQuery, **values: Any) -> list[list[tuple[Any, ...]]]:
    """Run ``queries`` as ONE statement string (one round trip), each with the ``values`` its
    placeholders name; each query's rows, in order.

    The statements run one after the other in the connection's transaction, as separate
    executes would; what saves is the per-execute cost on both sides (the send, the wait, the
    result's framing): 7 reads of a quota policy took ~0.2 ms of this process's CPU each.
    """
    if CompiledQuery._orm:
        return [query._orm_rows(values) for query in queries]
    bound = [query._bound(values) for query in queries]
    with connection.cursor() as cursor:
        cursor.execute(";\n".join(sql for sql, _ in bound),
                       [param for _, params in bound for param in params])
        out = [cursor.fetchall()]
        while cursor.nextset():
            out.append(cursor.fetchall())
    if len(out) != len(queries):
        raise ImproperlyConfigured(f"{len(queries)} queries answered {len(out)} results")
    return out
