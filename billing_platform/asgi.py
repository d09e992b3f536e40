"""ASGI entry point served by uvicorn (the web process)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "billing_platform.settings")
application = get_asgi_application()
