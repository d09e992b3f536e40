"""``/api/v1/finance/`` reports: revenue, receivables, credits, customers (platform finance).

Thin views: a query serializer validates the filters (DRF's 400 for a malformed date, an
unknown choice, a range past ``MAX_RANGE_DAYS``), one call to ``finance.reports`` builds the
report, and the answer is its rows (``data``) and sums, or with ``?format=csv`` the rows table
as CSV (``csv_export``: the same columns and values as ``data``). Only users with
``finance.view_reports`` get anything; everyone else, anonymous included, a 404
(``FinanceReader``). Dates are ISO dates (UTC midnight); ``start`` is inclusive, ``end``
exclusive.
"""

from __future__ import annotations

import dataclasses
import io
import types
from collections.abc import Mapping
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any, ClassVar, Union, get_args, get_origin, get_type_hints

from django.http import HttpResponse
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import renderers, serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from billing_platform.accounts.models import Organization
from billing_platform.csv_export import csv_writer
from billing_platform.db import replica_report
from billing_platform.finance import reports
from billing_platform.finance.permissions import FinanceReader
from plans.choices import CreditGrantKind, ServiceTier

MAX_RANGE_DAYS = 5 * 366  # a report reads at most five years at once
EARLIEST, LATEST = date(2000, 1, 1), date(2100, 1, 1)
TOKEN_CLASSES = ("input", "cached_input", "output")


class CsvRenderer(renderers.BaseRenderer):
    """Lets ``?format=csv`` through content negotiation; the views write the CSV body."""

    media_type = "text/csv"
    format = "csv"

    def render(self, data: Any, accepted_media_type: str | None = None,
               renderer_context: Mapping[str, Any] | None = None) -> bytes:
        return b""


# --- query parameters ------------------------------------------------------------------------

def _month_start(day: date) -> date:
    return day.replace(day=1)


def _months_before(day: date, months: int) -> date:
    index = day.year * 12 + day.month - 1 - months
    return date(index // 12, index % 12 + 1, 1)


class RangeQuery(serializers.Serializer[Any]):
    """``start`` (inclusive) and ``end`` (exclusive) ISO dates, at most ``MAX_RANGE_DAYS``."""

    start = serializers.DateField(required=False, help_text="ISO date, inclusive (UTC)")
    end = serializers.DateField(required=False, help_text="ISO date, exclusive (UTC)")
    currency = serializers.RegexField(r"^[A-Za-z]{3}$", required=False,
                                      help_text="ISO 4217 code, e.g. USD")
    organization = serializers.CharField(required=False, max_length=40,
                                         help_text="an organization's public id")
    default_months: ClassVar[int] = 12

    def validate_currency(self, value: str) -> str:
        return value.upper()

    def validate_organization(self, value: str) -> Organization:
        org = Organization.objects.filter(public_id=value).first()
        if org is None:
            raise serializers.ValidationError("No such organization.")
        return org

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        today = timezone.now().astimezone(UTC).date()
        end = attrs.get("end") or _months_before(_month_start(today), -1)
        start = attrs.get("start") or _months_before(end, self.default_months)
        for name, value in (("start", start), ("end", end)):
            if not EARLIEST <= value <= LATEST:
                raise serializers.ValidationError(
                    {name: [f"Must be between {EARLIEST} and {LATEST}."]})
        if start >= end:
            raise serializers.ValidationError({"end": ["Must be after start."]})
        if (end - start).days > MAX_RANGE_DAYS:
            raise serializers.ValidationError(
                {"end": [f"The range may span at most {MAX_RANGE_DAYS} days."]})
        attrs["start"] = datetime.combine(start, datetime.min.time(), tzinfo=UTC)
        attrs["end"] = datetime.combine(end, datetime.min.time(), tzinfo=UTC)
        return attrs


class RevenueQuery(RangeQuery):
    unit = serializers.ChoiceField(choices=reports.UNITS, default="month")
    plan_kind = serializers.ChoiceField(choices=reports.PLAN_KINDS, required=False)
    kind = serializers.ChoiceField(choices=reports.LINE_KINDS, required=False,
                                   help_text="line kind (credit_note: a credit note's lines)")
    model = serializers.CharField(required=False, max_length=200)
    region = serializers.CharField(required=False, max_length=64)
    service_tier = serializers.ChoiceField(choices=ServiceTier.values, required=False)
    token_class = serializers.ChoiceField(choices=TOKEN_CLASSES, required=False)


class ReceivablesQuery(RangeQuery):
    start = serializers.DateField(required=False, help_text="issued on or after (ISO date)")
    end = serializers.DateField(required=False, help_text="issued before (ISO date)")
    bucket = serializers.ChoiceField(choices=reports.AGING_BUCKETS, required=False)
    stage = serializers.ChoiceField(choices=reports.DUNNING_STAGES, required=False)
    limit = serializers.IntegerField(required=False, min_value=1, max_value=1000, default=100)
    offset = serializers.IntegerField(required=False, min_value=0, max_value=1_000_000,
                                      default=0)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        # no range given: every unpaid invoice, whenever it was issued
        bounded = "start" in attrs or "end" in attrs
        attrs = super().validate(attrs)
        if not bounded:
            attrs["start"] = attrs["end"] = None
        return attrs


class CreditsQuery(RangeQuery):
    kind = serializers.ChoiceField(choices=CreditGrantKind.values, required=False)
    default_months = 1


CUSTOMER_TABLES = {"top": reports.TopCustomerRow, "months": reports.CustomerMonthRow,
                   "movements": reports.CustomerMovementRow}


class CustomersQuery(RangeQuery):
    limit = serializers.IntegerField(required=False, min_value=1, max_value=500, default=25)
    table = serializers.ChoiceField(
        choices=list(CUSTOMER_TABLES), default="top",
        help_text="which table is data (and the CSV): top customers, months or movements")

    def validate_organization(self, value: str) -> Organization:
        raise serializers.ValidationError("The customers report covers every organization.")


# --- response schemas, derived from the report rows ------------------------------------------

def _field_for(hint: Any) -> serializers.Field:
    args = get_args(hint)
    nullable = (get_origin(hint) in (Union, types.UnionType)) and type(None) in args
    if nullable:
        (hint,) = [a for a in args if a is not type(None)]
    kwargs: dict[str, Any] = {"allow_null": nullable}
    if hint is Decimal:
        return serializers.DecimalField(max_digits=30, decimal_places=10, **kwargs)
    if hint is int:
        return serializers.IntegerField(**kwargs)
    if hint is datetime:
        return serializers.DateTimeField(**kwargs)
    if hint is date:
        return serializers.DateField(**kwargs)
    if get_origin(hint) is dict:
        return serializers.DictField(child=serializers.IntegerField(), **kwargs)
    return serializers.CharField(**kwargs)


def row_serializer(row_type: type) -> type[serializers.Serializer[Any]]:
    """Return a serializer describing ``row_type``'s fields (for the OpenAPI schema)."""
    hints = get_type_hints(row_type)
    attrs = {f.name: _field_for(hints[f.name]) for f in dataclasses.fields(row_type)}
    return type(row_type.__name__, (serializers.Serializer,), attrs)


def _report_schema(name: str, rows: type, **extra: Any) -> type[serializers.Serializer[Any]]:
    attrs: dict[str, Any] = {
        "object": serializers.CharField(default="finance_report"),
        "report": serializers.CharField(default=name),
        "filter": serializers.DictField(),
        "data": row_serializer(rows)(many=True),
    }
    attrs.update({k: v(many=True) for k, v in extra.items()})
    return type(f"{name.title()}Report", (serializers.Serializer,), attrs)


# --- views -----------------------------------------------------------------------------------

class FinanceReportView(APIView):
    """A report: ``query`` validates the parameters, ``build`` makes the report,
    ``tables`` names its row lists (the first is ``data`` and the CSV)."""

    permission_classes = [FinanceReader]
    renderer_classes = [renderers.JSONRenderer, CsvRenderer]
    query: ClassVar[type[RangeQuery]]
    name: ClassVar[str]
    row_type: ClassVar[type[reports.Row]]

    def build(self, q: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        """Return the report's rows (``row_type``'s) and its other parts (sums)."""
        raise NotImplementedError

    def table_type(self, q: dict[str, Any]) -> type[reports.Row]:
        """Return the type of the rows ``build`` answers (the CSV's columns)."""
        return self.row_type

    @replica_report  # may lag the primary by DATABASE_REPLICA_MAX_LAG_S (billing_platform/db.py)
    def get(self, request: Request) -> HttpResponse:
        query = self.query(data=request.query_params)
        query.is_valid(raise_exception=True)
        q = dict(query.validated_data)
        shown = {k: (v.date().isoformat() if isinstance(v, datetime) else v)
                 for k, v in q.items()}
        org = q.pop("organization", None)
        q["org_id"] = org.id if org is not None else None
        if org is not None:
            shown["organization"] = org.public_id
        row_type = self.table_type(q)
        rows, parts = self.build(q)
        if request.accepted_renderer.format == "csv":
            buffer = io.StringIO()
            csv_writer(buffer).writerows(reports.csv_rows(rows, row_type))
            response = HttpResponse(buffer.getvalue(), content_type="text/csv")
            name = "-".join(str(p) for p in (self.name, shown.get("table"), shown["start"],
                                              shown["end"]) if p)
            response["Content-Disposition"] = f'attachment; filename="{name}.csv"'
            return response
        return Response({"object": "finance_report", "report": self.name, "filter": shown,
                         "data": [_json(r) for r in rows],
                         **{k: [_json(v) for v in vs] if isinstance(vs, list) else vs
                            for k, vs in parts.items()}})

    def finalize_response(self, request: Request, response: Any, *args: Any,
                          **kwargs: Any) -> Any:
        # an error is DRF's JSON shape even when the CSV was asked for
        if getattr(response, "status_code", 200) >= 400 and isinstance(response, Response):
            request.accepted_renderer = renderers.JSONRenderer()
            request.accepted_media_type = "application/json"
        return super().finalize_response(request, response, *args, **kwargs)


def _json(row: Any) -> dict[str, Any]:
    """Return a row as JSON values: money as decimal strings (never floats), as elsewhere."""
    return {k: str(v) if isinstance(v, Decimal) else v
            for k, v in dataclasses.asdict(row).items()}


def _params(query: type[serializers.Serializer[Any]]) -> list[OpenApiParameter]:
    return [OpenApiParameter("format", str, enum=["json", "csv"],
                             description="csv: the data rows as CSV (the same table)")] + [
        OpenApiParameter(name, OpenApiTypes.STR, description=field.help_text or "",
                         enum=list(field.choices) if isinstance(
                             field, serializers.ChoiceField) else None)
        for name, field in query().fields.items()]


def _responses(schema: Any) -> dict[Any, Any]:
    return {200: schema, (200, "text/csv"): OpenApiResponse(OpenApiTypes.STR),
            404: OpenApiResponse(description="Not a finance user (no finance.view_reports).")}


class RevenueReportApi(FinanceReportView):
    """Revenue per period x currency x plan kind x line kind x model x region x tier x token
    class: billed (finalized invoices and credit notes) and accrued (rated, not invoiced)."""

    query = RevenueQuery
    name = "revenue"
    row_type = reports.RevenueRow

    def build(self, q: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        report = reports.revenue_report(report_filter=reports.RevenueFilter(**q))
        return report.rows, {"totals": report.totals,
                             "currency_totals": report.currency_totals}

    @extend_schema(parameters=_params(RevenueQuery), responses=_responses(_report_schema(
        "revenue", reports.RevenueRow, totals=row_serializer(reports.RevenueTotal),
        currency_totals=row_serializer(reports.RevenueTotal))))
    def get(self, request: Request) -> HttpResponse:
        return super().get(request)


class ReceivablesReportApi(FinanceReportView):
    """Unpaid invoices with aging bucket and dunning stage (one page), and per currency: open,
    overdue, aging buckets, uncollectible, written off, DSO, and what Stripe moved back after
    payment: refunded, refunds pending, disputed, charged back."""

    query = ReceivablesQuery
    name = "receivables"
    row_type = reports.ReceivableRow

    def build(self, q: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        limit, offset = q.pop("limit"), q.pop("offset")
        report = reports.receivables_report(
            report_filter=reports.ReceivablesFilter(
                as_of=timezone.now(), issued_from=q.pop("start"), issued_to=q.pop("end"), **q),
            limit=limit, offset=offset)
        return report.rows, {"count": report.count, "has_more": offset + limit < report.count,
                             "summaries": report.summaries}

    @extend_schema(parameters=_params(ReceivablesQuery), responses=_responses(_report_schema(
        "receivables", reports.ReceivableRow,
        summaries=row_serializer(reports.ReceivablesSummary))))
    def get(self, request: Request) -> HttpResponse:
        return super().get(request)


class CreditsReportApi(FinanceReportView):
    """Credit grants rolled forward per currency x kind x expiry month: opening, granted,
    consumed, expired unused (breakage), closing (the liability)."""

    query = CreditsQuery
    name = "credits"
    row_type = reports.CreditRow

    def build(self, q: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        report = reports.credits_report(report_filter=reports.CreditsFilter(**q))
        return report.rows, {"totals": report.totals}

    @extend_schema(parameters=_params(CreditsQuery), responses=_responses(_report_schema(
        "credits", reports.CreditRow, totals=row_serializer(reports.CreditRow))))
    def get(self, request: Request) -> HttpResponse:
        return super().get(request)


class CustomersReportApi(FinanceReportView):
    """Top customers by billed revenue with month-over-month change; customers, new and
    churned per month (``months``) and who they are (``movements``)."""

    query = CustomersQuery
    name = "customers"
    row_type = reports.TopCustomerRow

    def table_type(self, q: dict[str, Any]) -> type[reports.Row]:
        return CUSTOMER_TABLES[q["table"]]

    def build(self, q: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        q.pop("org_id")
        table = q.pop("table")
        report = reports.customers_report(report_filter=reports.CustomersFilter(**q))
        tables: dict[str, list[Any]] = {"top": report.top, "months": report.months,
                                        "movements": report.movements}
        return tables.pop(table), tables

    @extend_schema(parameters=_params(CustomersQuery), responses=_responses(_report_schema(
        "customers", reports.TopCustomerRow, months=row_serializer(reports.CustomerMonthRow),
        movements=row_serializer(reports.CustomerMovementRow))))
    def get(self, request: Request) -> HttpResponse:
        return super().get(request)

