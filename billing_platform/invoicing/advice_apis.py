"""``GET /api/v1/organizations/{org}/plan_advice``: what a past period would have cost on
every plan kind (``plans.advisor``), for the organization's billing readers (``billing.read``:
owner, admin, finance; an API key with the ``admin`` scope). Another organization is a 404, a
role without ``billing.read`` a 403, as for invoices. Finance's view of any organization
(``billing_platform.finance.advice_apis``) answers through the same ``PlanAdviceAnswer``.
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.response import Response

from billing_platform.accounts.models import Organization
from billing_platform.invoicing.advice import plan_advice_for
from billing_platform.invoicing.apis import BillingView
from plans.serializers import PlanAdviceQuerySerializer, PlanAdviceSerializer


class PlanAdviceAnswer:
    """Validate ``start``/``end`` (DRF's 400), compute the advice, serialize it."""

    def advice(self, request: Request, organization: Organization) -> Response:
        query = PlanAdviceQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        advice = plan_advice_for(organization=organization, **query.validated_data)
        return Response(PlanAdviceSerializer(advice).data)


class PlanAdviceApi(PlanAdviceAnswer, BillingView):
    @extend_schema(parameters=[PlanAdviceQuerySerializer], responses=PlanAdviceSerializer)
    def get(self, request: Request, org_id: str) -> Response:
        return self.advice(request, self.org)
