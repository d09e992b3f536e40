"""Plans management API routes, included under /api/v1/."""

from django.urls import path, re_path

from plans import apis

ORG = "organizations/<str:org_id>"

urlpatterns = [
    # POST /api/v1/pricing/quote, with or without the trailing slash (no redirect for a POST)
    re_path(r"^pricing/quote/?$", apis.QuoteApi.as_view(), name="pricing-quote"),
    path("price_books/", apis.PriceBookListApi.as_view(), name="pricebook-list"),
    path("price_books/<slug:code>/", apis.PriceBookDetailApi.as_view(), name="pricebook-detail"),
    path("price_books/<slug:code>/versions/", apis.PriceVersionListApi.as_view(),
         name="priceversion-list"),
    path("price_books/<slug:code>/versions/<int:version_id>/",
         apis.PriceVersionDetailApi.as_view(), name="priceversion-detail"),
    path("plans/", apis.PlanListApi.as_view(), name="plan-list"),
    path("plans/<slug:code>/", apis.PlanDetailApi.as_view(), name="plan-detail"),
    path("plans/<slug:code>/credit_packs/", apis.CreditPackListApi.as_view(),
         name="creditpack-list"),
    path("provisioned_offerings/", apis.OfferingListApi.as_view(), name="offering-list"),
    path(f"{ORG}/subscription/", apis.CurrentSubscriptionApi.as_view(),
         name="subscription-current"),
    path(f"{ORG}/subscription/credit_packs/", apis.PackPurchaseListApi.as_view(),
         name="packpurchase-list"),
    path(f"{ORG}/subscriptions/", apis.SubscriptionListApi.as_view(), name="subscription-list"),
    path(f"{ORG}/subscriptions/<str:sub_id>/cancel/", apis.SubscriptionCancelApi.as_view(),
         name="subscription-cancel"),
    path(f"{ORG}/reservations/", apis.ReservationListApi.as_view(), name="reservation-list"),
    path(f"{ORG}/reservations/<str:reservation_id>/", apis.ReservationDetailApi.as_view(),
         name="reservation-detail"),
    path(f"{ORG}/credit_grants/", apis.CreditGrantListApi.as_view(), name="creditgrant-list"),
    path(f"{ORG}/limits/", apis.OrgLimitsApi.as_view(), name="limits-org"),
    path(f"{ORG}/projects/<str:project_id>/limits/", apis.ProjectLimitsApi.as_view(),
         name="limits-project"),
    path(f"{ORG}/projects/<str:project_id>/api_keys/<str:key_id>/limits/",
         apis.KeyLimitsApi.as_view(), name="limits-key"),
    path(f"{ORG}/budget/", apis.BudgetApi.as_view(), name="budget-org"),
    path(f"{ORG}/projects/<str:project_id>/budget/", apis.BudgetApi.as_view(),
         name="budget-project"),
    path(f"{ORG}/end_user_budgets/", apis.EndUserBudgetListApi.as_view(),
         name="end-user-budget-list"),
    path(f"{ORG}/end_user_budgets/<str:budget_id>/", apis.EndUserBudgetDetailApi.as_view(),
         name="end-user-budget-detail"),
    path(f"{ORG}/quota_audit/", apis.QuotaAuditApi.as_view(), name="quota-audit"),
    path("audit/residency/", apis.ResidencyAuditApi.as_view(), name="audit-residency"),
]
