"""The console's plan advice page: what the organization's last closed period (or a past
period it picks) would have cost on every plan kind, for its billing readers.

The same advice the API answers (``invoicing.advice.plan_advice_for``) and the same period
rules (``plans.serializers.PlanAdviceQuerySerializer``); a malformed period is a form message.
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from billing_platform.accounts.selectors import OrgAccess
from billing_platform.console.views import org_page
from billing_platform.errors import InvalidRequest
from billing_platform.invoicing.advice import plan_advice_for
from plans.serializers import PlanAdviceQuerySerializer


@org_page("billing.read")
def plan_advice(request: HttpRequest, access: OrgAccess) -> HttpResponse:
    query = PlanAdviceQuerySerializer(data=request.GET)
    advice, errors = None, []
    if query.is_valid():
        try:
            advice = plan_advice_for(organization=access.organization, **query.validated_data)
        except InvalidRequest as exc:
            errors = [exc.message]
    else:
        errors = [f"{field}: {' '.join(str(m) for m in messages)}"
                  for field, messages in query.errors.items()]
    return render(request, "console/plan_advice.html", {
        "advice": advice, "errors": errors,
        "start": request.GET.get("start", "")[:40], "end": request.GET.get("end", "")[:40]})
