"""``GET /api/v1/finance/margin/``: revenue against cost-to-serve (issue 18 item 2).

The sibling reports' view (``apis.FinanceReportView``): filters validated by a query
serializer (DRF's 400), one call to ``finance.reports.margin_report``, the rows as ``data``
and the other tables beside them, or with ``?format=csv`` the table ``table`` names as CSV.
Finance readers only (``FinanceReader``: 404 for everyone else). Never routed anywhere a
customer reaches.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.http import HttpResponse
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request

from billing_platform.finance import reports
from billing_platform.finance.apis import (
    FinanceReportView,
    RangeQuery,
    _params,
    _report_schema,
    _responses,
    row_serializer,
)
from plans.choices import ServiceTier

MARGIN_TABLES: dict[str, type[reports.Row]] = {
    "groups": reports.MarginRow, "pools": reports.PoolEconomicsRow,
    "requests": reports.RequestMarginRow}


class MarginQuery(RangeQuery):
    by = serializers.ChoiceField(choices=reports.MARGIN_BY, default="organization",
                                 help_text="what the groups (data) are")
    model = serializers.CharField(required=False, max_length=200)
    service_tier = serializers.ChoiceField(choices=ServiceTier.values, required=False)
    limit = serializers.IntegerField(required=False, min_value=1, max_value=1000, default=25,
                                     help_text="how many of the costliest requests to list")
    table = serializers.ChoiceField(
        choices=list(MARGIN_TABLES), default="groups",
        help_text="which table is data (and the CSV): groups, pools or requests")
    default_months: ClassVar[int] = 1


class MarginReportApi(FinanceReportView):
    """Revenue vs cost-to-serve and gross margin per organization, model, plan kind, tier or
    pool; each pool's idle cost, cost per 1M tokens and break-even utilization; the costliest
    requests. Costs are USD; a margin is given only for revenue in USD."""

    query = MarginQuery
    name = "margin"
    row_type = reports.MarginRow

    def table_type(self, q: dict[str, Any]) -> type[reports.Row]:
        return MARGIN_TABLES[q["table"]]

    def build(self, q: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        table = q.pop("table")
        report = reports.margin_report(report_filter=reports.MarginFilter(**q))
        tables: dict[str, Any] = {"groups": report.rows, "pools": report.pools,
                                  "requests": report.requests}
        data = tables.pop(table)
        return data, {"totals": report.totals, "cost_currency": reports.COST_CURRENCY,
                      **tables}

    @extend_schema(parameters=_params(MarginQuery), responses=_responses(_report_schema(
        "margin", reports.MarginRow, totals=row_serializer(reports.MarginRow),
        pools=row_serializer(reports.PoolEconomicsRow),
        requests=row_serializer(reports.RequestMarginRow))))
    def get(self, request: Request) -> HttpResponse:
        return super().get(request)
