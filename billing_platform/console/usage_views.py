"""Console usage explorer: an organization's usage over any range (past periods too), filtered
by project, key, model, tier, region and status, grouped by hour, day, model, project, key,
tier or region (and split by a second dimension), as a chart, a table and a streamed CSV.

One source: the filters are ``GET /api/v1/usage``'s parameters, parsed, bounded and refused by
the API's own ``metering.apis.usage_query`` (the same names, defaults, 366-day and 10,000-group
bounds, and messages), and the sums are the API's ``usage_buckets`` (``usage_summary`` over the
hourly rollups). So the chart, the table, the CSV and the API link on the page all answer the
same query. The one console-only input is ``through``, the inclusive last day a person picks
(the API's ``end`` is exclusive); it becomes ``end`` = the day after.

Status: the rollups keep, per hour and dimension, how many requests ended in ``engine_error``
(``error_requests``) and ``client_aborted`` (``aborted_requests``), not tokens or amounts per
status. So the explorer shows requests by outcome (columns, and chart metrics) from the
rollups, and a status filter (tokens and amounts of the requests that ended so) is the API's
``status`` filter, which reads the events themselves and so sums at most 31 days.

Amounts: the CSV has them exact (the rated sums, trailing zeros dropped, at least cents); the
page shows them with the places they need (``usage_money``: ``$0.0031``, ``$1.95``), never
``0.00`` for a few cheap requests, each cell carrying its exact CSV value (``data-exact``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from decimal import Decimal
from typing import Any
from urllib.parse import urlencode

from django.http import HttpRequest, QueryDict, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

from billing_platform.accounts.models import ApiKey, Project
from billing_platform.accounts.selectors import OrgAccess
from billing_platform.console.templatetags.money import usage_money
from billing_platform.console.views import org_page
from billing_platform.csv_export import csv_writer
from billing_platform.db import replica_report
from billing_platform.errors import DomainError, InvalidRequest
from metering import apis as usage_api
from metering import serializers as usage_serializers
from metering.selectors import UsageBucket

# the API's filter parameters the explorer offers (comma-separated lists, as the API takes)
FILTERS = ("project", "key", "model", "service_tier", "region", "status")
GROUPS = {"day": "Day", "hour": "Hour", "model": "Model", "project": "Project",
          "key": "API key", "service_tier": "Tier", "region": "Region"}
SPLITS = {"": "nothing", "model": "Model", "project": "Project", "key": "API key",
          "service_tier": "Tier", "region": "Region"}
METRICS = {"total_tokens": "Total tokens", "prompt_tokens": "Input tokens",
           "cached_tokens": "Cached input tokens", "completion_tokens": "Output tokens",
           "requests": "Requests", "error_requests": "Requests failed (engine_error)",
           "aborted_requests": "Requests aborted by the client", "amount": "Amount"}
TIERS = ("default", "priority", "flex", "batch")
STATUSES = (("ok", "OK"), ("engine_error", "Engine error"), ("client_aborted", "Client aborted"))
COLUMNS = ("currency", "requests", "error_requests", "aborted_requests", "prompt_tokens",
           "cached_tokens", "completion_tokens", "total_tokens", "amount")


def amount_text(amount: Decimal) -> str:
    """Return an exact amount as text: every digit it has, at least cents (``0.0031``)."""
    exact = amount.normalize()
    exponent = exact.as_tuple().exponent
    if isinstance(exponent, int) and exponent > -2:  # finite (a rated sum): pad to cents
        exact = exact.quantize(Decimal("0.01"))
    return f"{exact:f}"


@dataclass(frozen=True)
class Explorer:
    """One explorer query answered: its table (the CSV's rows as text), chart and totals."""

    query: usage_api.UsageQuery
    group: str
    split: str
    metric: str
    header: list[str]
    rows: list[list[str]]  # the CSV's rows as text (amounts exact)
    buckets: list[UsageBucket]  # the rows' sums (the page shows amounts with usage_money)
    totals: list[UsageBucket]
    chart: dict[str, Any]
    api_url: str

    def table_body(self) -> SafeString:
        """Return the table's rows as HTML: the CSV's cells, the amount shown with the places
        it needs and its exact value (the CSV's) in ``data-exact``. Built here, not in the
        template: a year by hour is 8,784 rows, which Django's template loop took seconds to
        render (measured 5.6 s under a profiler on this machine), this a small part of that."""
        return mark_safe("".join(  # noqa: S308 (every cell is escaped)
            "<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row[:-1])
            + f'<td data-exact="{escape(row[-1])}" title="exact: {escape(row[-1])}">'
            + f"{escape(usage_money(b.amount, b.currency))}</td></tr>"
            for row, b in zip(self.rows, self.buckets, strict=True)))

    @property
    def metric_label(self) -> str:
        return METRICS[self.metric]

    @property
    def group_label(self) -> str:
        return GROUPS[self.group].lower()

    @property
    def split_label(self) -> str:
        return SPLITS[self.split].lower()


class _Names:
    """Display names of the organization's projects and keys, by public id."""

    def __init__(self, access: OrgAccess) -> None:
        org = access.organization
        self.projects = dict(Project.objects.filter(organization=org)
                             .values_list("public_id", "name"))
        self.keys = dict(ApiKey.objects.filter(organization=org)
                         .values_list("public_id", "name"))

    def label(self, dimension: str, value: object) -> str:
        if value is None:
            return "(no key)" if dimension == "key" else ""
        if dimension == "hour" and isinstance(value, datetime):
            return f"{value:%Y-%m-%d %H:00}"
        if dimension == "day" and isinstance(value, date):
            return value.isoformat()
        if dimension == "project":
            return f"{self.projects.get(str(value), '?')} ({value})"
        if dimension == "key":
            return f"{self.keys.get(str(value), '?')} ({value})"
        return str(value)


def _api_params(get: QueryDict) -> tuple[dict[str, str], str, str, str]:
    """Return the API parameters a filter form sent, and its group, split and metric.

    Multiple values of a filter (a multi-select) are joined with commas, as the API takes them.
    ``InvalidRequest`` for a ``through`` that is no date, or a group, split or metric not
    offered.
    """
    params = {name: ",".join(v.strip() for v in get.getlist(name) if v.strip())
              for name in ("start", "end", *FILTERS)}
    through = get.get("through", "").strip()
    if through:
        try:
            params["end"] = (date.fromisoformat(through) + timedelta(days=1)).isoformat()
        except (ValueError, OverflowError):  # not a date, or the last one there is
            raise InvalidRequest("through must be a date (YYYY-MM-DD), the last day of the "
                                 "range.", param="through") from None
    group = get.get("group") or "day"
    split = get.get("split", "model") if "group" not in get else get.get("split", "")
    metric = get.get("metric") or "total_tokens"
    for name, value, offered in (("group", group, GROUPS), ("split", split, SPLITS),
                                 ("metric", metric, METRICS)):
        if value not in offered:
            choices = ", ".join(o for o in offered if o)
            raise InvalidRequest(f"{name} must be one of {choices}.", param=name)
    if split == group:
        split = ""
    params["group_by"] = ",".join(g for g in (group, split) if g)
    return {k: v for k, v in params.items() if v}, group, split, metric


def explore(get: QueryDict, access: OrgAccess, *, chart: bool = True) -> Explorer:
    """Answer an explorer query of the organization (``DomainError`` for one the API refuses);
    ``chart``: with its chart (the CSV needs none)."""
    org = access.organization
    params, group, split, metric = _api_params(get)
    validated = usage_serializers.UsageQuerySerializer(data=params)
    if not validated.is_valid():
        raise InvalidRequest(f"The filters do not validate: {validated.errors}.")
    query = usage_api.usage_query(validated.validated_data, organization=org,
                                  only_project_id=None, now=timezone.now())
    buckets = usage_api.usage_buckets(query)
    names = _Names(access)
    header = [*query.group_by, *COLUMNS]
    rows = [[*(names.label(g, b.group[g]) for g in query.group_by), *_cells(b)]
            for b in buckets]
    api_params = {"organization": org.public_id, "start": query.start.isoformat(),
                  "end": query.end.isoformat(),
                  **{k: v for k, v in params.items() if k in (*FILTERS, "group_by")}}
    totals = usage_api.usage_totals(buckets)
    for t in totals:
        t.extra["amount_text"] = amount_text(t.amount)
    return Explorer(
        query=query, group=group, split=split, metric=metric, header=header, rows=rows,
        buckets=buckets, totals=totals,
        chart=_chart(query, buckets, names, group, split, metric) if chart else {},
        api_url=reverse("usage") + "?" + urlencode(api_params))


def _cells(b: UsageBucket) -> list[str]:
    values: dict[str, object] = {"currency": b.currency, "total_tokens": b.total_tokens,
                                 "amount": amount_text(b.amount)}
    return [str(values[c] if c in values else getattr(b, c)) for c in COLUMNS]


def _time_labels(query: usage_api.UsageQuery, group: str, names: _Names) -> list[str]:
    """Every hour or day of the range, so the chart shows the quiet ones as zero."""
    step = timedelta(hours=1) if group == "hour" else timedelta(days=1)
    at = query.start if group == "hour" else query.start.replace(hour=0)
    labels = []
    while at < query.end:
        labels.append(names.label(group, at if group == "hour" else at.date()))
        at += step
    return labels


def _chart(query: usage_api.UsageQuery, buckets: list[UsageBucket], names: _Names, group: str,
           split: str, metric: str) -> dict[str, Any]:
    """The chart of the table's numbers: ``metric`` per ``group`` value, a series per ``split``
    value (amounts: per currency too, never added across currencies)."""
    points: dict[tuple[str, str], Decimal] = {}
    # dicts as ordered sets: a year by hour is 8,784 labels
    labels = dict.fromkeys(_time_labels(query, group, names) if group in ("hour", "day")
                           else ())
    series: dict[str, None] = {}
    for b in buckets:
        label = names.label(group, b.group[group])
        name = names.label(split, b.group[split]) if split else METRICS[metric]
        if metric == "amount":
            name = f"{name} ({b.currency})"
        value = b.total_tokens if metric == "total_tokens" else getattr(b, metric)
        points[(label, name)] = points.get((label, name), Decimal(0)) + Decimal(value)
        labels.setdefault(label)
        series.setdefault(name)
    return {
        "type": "bar", "stacked": bool(split), "metric": metric, "labels": list(labels),
        "datasets": [{"label": name, "data": [str(points.get((label, name), 0))
                                               for label in labels]}
                     for name in sorted(series)],
    }


class _Echo:
    """A file whose ``write`` hands the line back, so the CSV writer feeds a generator."""

    def write(self, value: str) -> str:
        return value


def _csv_lines(explorer: Explorer) -> Iterator[str]:
    writer = csv_writer(_Echo())
    yield writer.writerow(explorer.header)
    for row in explorer.rows:
        yield writer.writerow(row)


def _form(get: QueryDict, access: OrgAccess) -> dict[str, Any]:
    """What the filter form shows: the choices, and the values sent (or the defaults)."""
    org = access.organization
    today = timezone.now().date()
    return {
        "start": get.get("start") or today.replace(day=1).isoformat(),
        "through": get.get("through") or ("" if get.get("end") else today.isoformat()),
        "projects": Project.objects.filter(organization=org).order_by("name"),
        "keys": ApiKey.objects.filter(organization=org).select_related("project")
                               .order_by("project__name", "name"),
        "chosen": {name: set(",".join(get.getlist(name)).split(",")) for name in FILTERS},
        "model": get.get("model", ""), "region": get.get("region", ""),
        "tiers": TIERS, "statuses": STATUSES, "groups": GROUPS, "splits": SPLITS,
        "metrics": METRICS,
        "group": get.get("group") or "day",
        "split": get.get("split", "model") if "group" not in get else get.get("split", ""),
        "metric": get.get("metric") or "total_tokens",
        "presets": _presets(today),
    }


def _presets(today: date) -> list[tuple[str, str]]:
    first = today.replace(day=1)
    last_month = (first - timedelta(days=1)).replace(day=1)
    return [
        ("This month", urlencode({"start": first, "through": today})),
        ("Last month", urlencode({"start": last_month, "through": first - timedelta(days=1)})),
        ("Last 7 days", urlencode({"start": today - timedelta(days=6), "through": today})),
        ("Today by hour", urlencode({"start": today, "through": today, "group": "hour",
                                     "split": "model"})),
        # 366 days: the longest range one read sums
        ("Last 12 months by model", urlencode({"start": today - timedelta(days=365),
                                               "through": today, "group": "model",
                                               "split": ""})),
    ]


@org_page()
@replica_report  # may lag the primary by DATABASE_REPLICA_MAX_LAG_S (billing_platform/db.py)
def usage(request: HttpRequest, access: OrgAccess) -> HttpResponseBase:
    """The explorer: filters, chart, table; ``?format=csv`` streams the table as CSV."""
    context: dict[str, Any] = {"form": _form(request.GET, access)}
    try:
        explorer = explore(request.GET, access,
                           chart=request.GET.get("format") != "csv")
    except DomainError as exc:
        context["errors"] = [exc.message]
        return render(request, "console/usage.html", context, status=400)
    if request.GET.get("format") == "csv":
        response = StreamingHttpResponse(_csv_lines(explorer), content_type="text/csv")
        name = f"usage-{explorer.query.start:%Y%m%d}-{explorer.query.end:%Y%m%d}.csv"
        response["Content-Disposition"] = f'attachment; filename="{name}"'
        return response
    params = [(k, v) for k, v in request.GET.lists() if k != "format"]
    context.update(
        explorer=explorer, csv_url="?" + urlencode([*((k, v) for k, vs in params for v in vs),
                                                    ("format", "csv")]),
        range_end=explorer.query.end - timedelta(seconds=1))
    return render(request, "console/usage.html", context)

