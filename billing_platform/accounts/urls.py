"""Management API routes for organizations, projects, API keys and members."""

from django.urls import path

from billing_platform.accounts import apis

ORG = "organizations/<str:org_id>"
KEYS = f"{ORG}/projects/<str:project_id>/api_keys"

urlpatterns = [
    path("organizations/", apis.OrganizationListApi.as_view(), name="org-list"),
    path(f"{ORG}/", apis.OrganizationDetailApi.as_view(), name="org-detail"),
    path(f"{ORG}/billing-profile/", apis.OrganizationBillingProfileApi.as_view(),
         name="org-billing-profile"),
    path(f"{ORG}/projects/", apis.ProjectListApi.as_view(), name="project-list"),
    path(f"{ORG}/projects/<str:project_id>/", apis.ProjectDetailApi.as_view(),
         name="project-detail"),
    path(f"{KEYS}/", apis.ApiKeyListApi.as_view(), name="apikey-list"),
    path(f"{KEYS}/<str:key_id>/", apis.ApiKeyDetailApi.as_view(), name="apikey-detail"),
    path(f"{KEYS}/<str:key_id>/revoke/", apis.ApiKeyRevokeApi.as_view(), name="apikey-revoke"),
    path(f"{ORG}/members/", apis.MemberListApi.as_view(), name="member-list"),
    path(f"{ORG}/members/<int:member_id>/", apis.MemberDetailApi.as_view(),
         name="member-detail"),
]
