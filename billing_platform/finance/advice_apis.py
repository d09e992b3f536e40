"""``GET /api/v1/finance/organizations/{org}/plan_advice``: platform finance reads the plan
advice of any organization (``finance.view_reports``; anyone else gets 404, as on every
finance endpoint). The answer is the customer's (``invoicing.advice_apis``)."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from billing_platform.accounts.models import Organization
from billing_platform.errors import NotFound
from billing_platform.finance.permissions import FinanceReader
from billing_platform.invoicing.advice_apis import PlanAdviceAnswer
from plans.serializers import PlanAdviceQuerySerializer, PlanAdviceSerializer


class FinancePlanAdviceApi(PlanAdviceAnswer, APIView):
    permission_classes = [FinanceReader]

    @extend_schema(parameters=[PlanAdviceQuerySerializer], responses=PlanAdviceSerializer)
    def get(self, request: Request, org_id: str) -> Response:
        organization = Organization.objects.filter(public_id=org_id).first()
        if organization is None:
            raise NotFound("No such organization.")
        return self.advice(request, organization)
