"""ASGI entry point served by uvicorn (the web process).

``/v1/*`` (the OpenAI-compatible gateway) is served by a lean ASGI route beside Django
(``billing_platform.gateway.asgi``): Django's ASGIHandler spends threads on every request (a
thread-sensitive context, sync signal receivers, sync middleware via ``MiddlewareMixin``),
which bench/gateway.py measured as most of the gateway's added latency, while the gateway
needs none of it (bearer keys, no sessions, cookies, CSRF or templates). It still uses
Django's request objects, URL map and views. Everything else (/api, /console, /admin,
/metrics) goes through Django's full stack.
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "billing_platform.settings")
django_application = get_asgi_application()

from billing_platform.gateway.asgi import GatewayASGI  # noqa: E402

gateway_application = GatewayASGI()


async def application(scope, receive, send):
    if scope["type"] == "http" and scope["path"].startswith("/v1/"):
        return await gateway_application(scope, receive, send)
    return await django_application(scope, receive, send)
