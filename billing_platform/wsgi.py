"""WSGI entry point, for tools that need one; the platform is served over ASGI."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "billing_platform.settings")
application = get_wsgi_application()
