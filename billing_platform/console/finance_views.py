"""The platform finance workspace's pages at ``/finance/``: the four reports, each with its
filters, a chart, a table and a CSV export that equals the table.

Who: ``finance.view_reports`` reads every page (``can_read_finance``); anyone else, signed in
or not, gets 404, as on ``/api/v1/finance/``. The operations (``finance_operations``) also
need ``finance.operate``.

One source for each report: the filters are the REST API's query serializers
(``finance.apis``: the same names, defaults, choices, range limits and messages), the report
is built by the same ``build`` the API calls (``finance.reports``), and the table is
``reports.csv_rows``: the CSV link sends exactly the rows and columns the page shows (the
table's cells are the CSV's values as text). A filter that does not validate is a form message
on the page (400), never a 500. Charts are drawn by ``static/console/finance_charts.js`` from
``json_script`` data (the CSP allows no inline script).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from functools import wraps
from typing import Any
from urllib.parse import urlencode

from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from rest_framework import serializers

from billing_platform.console.views import domain_error_page
from billing_platform.csv_export import csv_writer
from billing_platform.db import replica_report
from billing_platform.errors import DomainError
from billing_platform.finance import apis, reports
from billing_platform.finance.margin_apis import MarginReportApi
from billing_platform.finance.permissions import can_operate_finance, can_read_finance

NAV = (("revenue", "Revenue"), ("receivables", "Receivables"), ("credits", "Credits"),
       ("customers", "Customers"), ("margin", "Margin"), ("invoices", "Invoices"),
       ("close", "Close period"))


def finance_page(*, operate: bool = False) -> Callable[..., Callable[..., HttpResponse]]:
    """Serve the view to finance readers (``operate``: to finance operators) only; 404 to
    everyone else, so the workspace does not confirm it exists. A domain error the view did
    not turn into a form message goes through the console's one error path."""

    def decorator(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
        @wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            allowed = (can_operate_finance if operate else can_read_finance)(request.user)
            if not allowed:
                raise Http404("No such page.")
            try:
                return view(request, *args, **kwargs)
            except DomainError as exc:
                return domain_error_page(request, exc)

        return wrapper

    return decorator


def finance_context(request: HttpRequest, section: str, **extra: Any) -> dict[str, Any]:
    """Return what every finance page's template needs (its navigation, who may operate)."""
    return {"nav": NAV, "section": section, "can_operate": can_operate_finance(request.user),
            **extra}


# --- cells, tables, charts -------------------------------------------------------------------

def cell(value: Any) -> str:
    """Return a value as the CSV writes it (the table shows exactly the CSV's text)."""
    return "" if value is None else str(value)


def table_of(rows: list[Any], row_type: type[reports.Row]) -> dict[str, Any]:
    """Return a table (header, rows of text cells) of report rows: the CSV, as shown."""
    header, *body = reports.csv_rows(rows, row_type)
    return {"header": list(header), "rows": [[cell(v) for v in r] for r in body]}


def _number(value: Decimal | int | None) -> str | None:
    return None if value is None else str(value)


def _series(points: dict[tuple[str, str], Decimal], labels: list[str],
            names: list[str]) -> list[dict[str, Any]]:
    return [{"label": name, "data": [_number(points.get((label, name))) for label in labels]}
            for name in names]


def revenue_chart(rows: list[Any], parts: dict[str, Any]) -> dict[str, Any]:
    """Billed and accrued revenue per period, one bar per currency and kind (never summed)."""
    totals: list[reports.RevenueTotal] = parts["totals"]
    labels = sorted({cell(t.period) for t in totals})
    points: dict[tuple[str, str], Decimal] = {}
    names = []
    for t in totals:
        for kind in ("billed", "accrued"):
            name = f"{t.currency} {kind}"
            points[(cell(t.period), name)] = getattr(t, kind)
            if name not in names:
                names.append(name)
    return {"type": "bar", "labels": labels, "datasets": _series(points, labels, sorted(names))}


AGING = (("current", "current"), ("days_0_30", "0-30"), ("days_31_60", "31-60"),
         ("days_61_90", "61-90"), ("days_90_plus", "90+"))


def receivables_chart(rows: list[Any], parts: dict[str, Any]) -> dict[str, Any]:
    """Open receivables by aging bucket, one series per currency."""
    summaries: list[reports.ReceivablesSummary] = parts["summaries"]
    return {"type": "bar", "labels": [label for _, label in AGING], "datasets": [
        {"label": s.currency, "data": [_number(getattr(s, name)) for name, _ in AGING]}
        for s in summaries]}


@dataclass(frozen=True)
class AfterPaymentRow(reports.Row):
    """The receivables summary's figures of what Stripe moved back after payment, one
    currency: its own small table on the page (the summary's fields, as the API answers them;
    ``reports.ReceivablesSummary`` says what each counts)."""

    currency: str
    refunded: Decimal
    refunds_pending: Decimal
    disputed: Decimal
    charged_back: Decimal


def after_payment_rows(summaries: list[reports.ReceivablesSummary]) -> list[AfterPaymentRow]:
    return [AfterPaymentRow(currency=s.currency, refunded=s.refunded,
                            refunds_pending=s.refunds_pending, disputed=s.disputed,
                            charged_back=s.charged_back) for s in summaries]


CREDIT_FLOWS = ("opening", "granted", "consumed", "expired", "closing")


def credits_chart(rows: list[Any], parts: dict[str, Any]) -> dict[str, Any]:
    """Credit balances rolled forward (breakage is ``expired``), one series per currency."""
    totals: list[reports.CreditRow] = parts["totals"]
    return {"type": "bar", "labels": list(CREDIT_FLOWS), "datasets": [
        {"label": t.currency, "data": [_number(getattr(t, name)) for name in CREDIT_FLOWS]}
        for t in totals]}


def customers_chart(rows: list[Any], parts: dict[str, Any]) -> dict[str, Any]:
    """Top customers' revenue in the range, one series per currency (bars never mixed)."""
    # the top customers are the rows, unless another table was asked for (then a part)
    top: list[reports.TopCustomerRow] = parts.get("top", rows)
    labels = [f"{r.organization_name} ({r.currency})" for r in top]
    points = {(f"{r.organization_name} ({r.currency})", r.currency): r.revenue for r in top}
    return {"type": "hbar", "labels": labels,
            "datasets": _series(points, labels, sorted({r.currency for r in top}))}


def margin_chart(rows: list[Any], parts: dict[str, Any]) -> dict[str, Any]:
    """Each pool's measured utilization against its break-even utilization (where its cost
    per 1M tokens meets the list price): the break-even view."""
    # the pools are a part, unless they were asked for as the table
    pools: list[reports.PoolEconomicsRow] = parts.get("pools", rows)
    return {"type": "bar", "labels": [p.pool for p in pools], "datasets": [
        {"label": label, "data": [_number(getattr(p, name)) for p in pools]}
        for name, label in (("utilization", "measured utilization"),
                            ("break_even_utilization", "break-even utilization"))]}


@dataclass(frozen=True)
class ReportPage:
    """One report page: the API view whose filters and build it shares, its chart, and the
    report's other parts shown as tables above the main one (name, title, row type), those
    that ``build`` answers beside its rows."""

    title: str
    api: type[apis.FinanceReportView]
    chart: Callable[[list[Any], dict[str, Any]], dict[str, Any]]
    chart_title: str
    parts: tuple[tuple[str, str, type[reports.Row]], ...] = ()


REPORTS: dict[str, ReportPage] = {
    "revenue": ReportPage(
        "Revenue", apis.RevenueReportApi, revenue_chart, "Billed and accrued by period",
        (("currency_totals", "Totals per currency", reports.RevenueTotal),
         ("totals", "Totals per period", reports.RevenueTotal))),
    "receivables": ReportPage(
        "Receivables", apis.ReceivablesReportApi, receivables_chart, "Open, by days past due",
        (("summaries", "Per currency", reports.ReceivablesSummary),
         ("after_payment", "Refunds and disputes (as Stripe reported them)", AfterPaymentRow))),
    "credits": ReportPage(
        "Credits", apis.CreditsReportApi, credits_chart, "Credit balances over the range",
        (("totals", "Totals per currency", reports.CreditRow),)),
    "customers": ReportPage(
        "Customers", apis.CustomersReportApi, customers_chart, "Top customers by revenue",
        (("top", "Top customers", reports.TopCustomerRow),
         ("months", "Customers, new and churned per month", reports.CustomerMonthRow),
         ("movements", "New and churned customers", reports.CustomerMovementRow))),
    "margin": ReportPage(
        "Margin (internal: cost-to-serve, never shown to customers)", MarginReportApi,
        margin_chart, "Pools: measured against break-even utilization",
        (("totals", "Totals per currency (cost in USD; a margin only for USD revenue)",
          reports.MarginRow),
         ("pools", "Pools: idle cost, cost per 1M tokens, break-even", reports.PoolEconomicsRow),
         ("groups", "Revenue, cost and margin per group", reports.MarginRow),
         ("requests", "Costliest requests", reports.RequestMarginRow))),
}


# --- filters ---------------------------------------------------------------------------------

def filter_fields(query: serializers.Serializer[Any], params: Any) -> list[dict[str, Any]]:
    """Return the filter form's inputs, one per query parameter, with the values sent."""
    out = []
    for name, field in query.fields.items():
        if name == "offset":
            continue  # paging is a link, not an input
        spec: dict[str, Any] = {"name": name, "label": name.replace("_", " "),
                                "help": field.help_text or "", "value": params.get(name, "")}
        if isinstance(field, serializers.ChoiceField):
            spec["input"], spec["choices"] = "select", [str(c) for c in field.choices]
        elif isinstance(field, serializers.DateField):
            spec["input"] = "date"
        elif isinstance(field, serializers.IntegerField):
            spec["input"] = "number"
        else:
            spec["input"] = "text"
        out.append(spec)
    return out


def _messages(errors: Any, prefix: str = "") -> list[str]:
    """Flatten a serializer's errors into sentences naming the filter."""
    if isinstance(errors, dict):
        return [m for name, value in errors.items()
                for m in _messages(value, "" if name == "non_field_errors" else f"{name}: ")]
    if isinstance(errors, list):
        return [m for value in errors for m in _messages(value, prefix)]
    return [f"{prefix}{errors}"]


def _shown(value: Any) -> Any:
    return value.date() if isinstance(value, datetime) else value


# --- pages -----------------------------------------------------------------------------------

@finance_page()
def home(request: HttpRequest) -> HttpResponse:
    return redirect("finance:report", name="revenue")


@finance_page()
@replica_report  # may lag the primary by DATABASE_REPLICA_MAX_LAG_S (billing_platform/db.py)
def report(request: HttpRequest, name: str) -> HttpResponse:
    """One report: filters, chart, table, CSV (``?format=csv``: the table's rows)."""
    page = REPORTS.get(name)
    if page is None:
        raise Http404("No such report.")
    query = page.api.query(data=request.GET)
    context = finance_context(request, name, page=page, name=name,
                              fields=filter_fields(query, request.GET))
    if not query.is_valid():
        context["errors"] = _messages(query.errors)
        return render(request, "finance/report.html", context, status=400)
    q = dict(query.validated_data)
    organization = q.pop("organization", None)
    q["org_id"] = organization.id if organization is not None else None
    api = page.api()
    row_type = api.table_type(q)  # the rows ``build`` answers (customers: the table asked)
    rows, parts = api.build(dict(q))
    if name == "receivables":
        parts["after_payment"] = after_payment_rows(parts["summaries"])
    if request.GET.get("format") == "csv":
        response = HttpResponse(content_type="text/csv")
        start = _shown(q.get("start")) or "all"
        response["Content-Disposition"] = f'attachment; filename="{name}-{start}.csv"'
        csv_writer(response).writerows(reports.csv_rows(rows, row_type))
        return response
    params = {k: str(v) for k, v in request.GET.items() if k != "format" and v != ""}
    context.update(
        table=table_of(rows, row_type),
        parts=[(key, title, table_of(parts[key], part_type))
               for key, title, part_type in page.parts if key in parts],
        chart=page.chart(rows, parts), csv_url="?" + urlencode({**params, "format": "csv"}),
        shown={k: _shown(v) for k, v in q.items() if v is not None and k != "org_id"},
        organization=organization)
    if name == "receivables":
        context["paging"] = _paging(params, q, parts)
    return render(request, "finance/report.html", context)


def _paging(params: dict[str, str], q: dict[str, Any], parts: dict[str, Any]
            ) -> dict[str, Any]:
    """Return the receivables page's position and the links to the pages around it."""
    limit, offset, count = q["limit"], q["offset"], parts["count"]
    links = {}
    if offset > 0:
        links["previous"] = "?" + urlencode({**params, "offset": max(0, offset - limit)})
    if parts["has_more"]:
        links["next"] = "?" + urlencode({**params, "offset": offset + limit})
    return {"first": offset + 1 if count else 0, "last": min(offset + limit, count),
            "count": count, **links}

