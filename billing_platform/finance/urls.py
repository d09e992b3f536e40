"""Routes of ``/api/v1/finance/`` (included before the other ``api/v1/`` includes): the
reports (``apis``) and finance's operations (``operations_apis``)."""

from django.urls import URLPattern, URLResolver

urlpatterns: list[URLPattern | URLResolver] = []
