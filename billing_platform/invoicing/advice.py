"""Plan advice for a billing period: plans' advisor over the periods invoicing closes.

``plans.advisor`` prices a past period's usage under every plan kind; which periods have
closed and how an amount is rounded to money are invoicing's (the period's invoice,
``money.quantize_money``), so both surfaces that show advice, the customer's
``/api/v1/organizations/{org}/plan_advice`` and finance's, come through here.
"""

from __future__ import annotations

from datetime import datetime

from billing_platform.accounts.models import Organization
from billing_platform.errors import InvalidRequest
from billing_platform.invoicing.choices import InvoiceKind, InvoiceStatus
from billing_platform.invoicing.models import Invoice
from billing_platform.invoicing.money import quantize_money
from plans.advisor import PlanAdvice, plan_advice


def last_closed_period(*, organization: Organization) -> tuple[datetime, datetime] | None:
    """Return [start, end) of the organization's latest billing period that has an invoice
    (issued: not a draft), or None before its first period closes."""
    return (Invoice.objects.filter(organization=organization, kind=InvoiceKind.INVOICE)
            .exclude(status=InvoiceStatus.DRAFT).order_by("-period_end")
            .values_list("period_start", "period_end").first())


def plan_advice_for(*, organization: Organization, start: datetime | None = None,
                    end: datetime | None = None) -> PlanAdvice:
    """Return the plan advice of [start, end), by default of the last closed period.

    ``start`` and ``end`` come validated (``plans.serializers.PlanAdviceQuerySerializer``: a
    past period of at most a month). Raises ``InvalidRequest`` when neither is given and no
    period of the organization has closed yet.
    """
    if start is None or end is None:
        period = last_closed_period(organization=organization)
        if period is None:
            raise InvalidRequest("No billing period of this organization has closed yet; give "
                                 "start and end of a past period.", param="start")
        start, end = period
    return plan_advice(organization=organization, period_start=start, period_end=end,
                       round_money=quantize_money)
