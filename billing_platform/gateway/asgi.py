"""A lean ASGI route for /v1, mounted beside Django (see billing_platform/asgi.py for why).

It does what Django's ASGIHandler does for our views, minus the parts that cost a thread per
request (a thread-sensitive context, sync signal receivers, sync ``response.close``) and the
sync-style middleware: read the body (413 above the limit), build Django's ``ASGIRequest``,
resolve the URL, await the async view, send the response, and cancel the response task when the
client disconnects (so a stream is aborted at the engine and metered as ``client_aborted``).
Requests and latencies are counted here (``gateway/metrics.py``), since no middleware sees them.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import time
from typing import Any

from django.conf import settings
from django.core.handlers.asgi import ASGIRequest
from django.db import DatabaseError
from django.http import HttpResponseBase
from django.urls import Resolver404, get_resolver

from billing_platform.errors import NotFound, PayloadTooLarge
from billing_platform.gateway import db_connections
from billing_platform.gateway.errors import openai_error, server_error
from billing_platform.gateway.metrics import request_observed
from plans import concurrency

log = logging.getLogger(__name__)


class _Disconnected(Exception):
    pass


async def _read_body(receive: Any, limit: int) -> bytes | None:
    """Return the body, or None if it exceeds ``limit``; raise _Disconnected."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def _send_response(response: HttpResponseBase, send: Any) -> None:
    headers = [(k.encode("ascii"), v.encode("latin1")) for k, v in response.items()]
    await send({"type": "http.response.start", "status": response.status_code,
                "headers": headers})
    if response.streaming:
        async with contextlib.aclosing(aiter(response)) as content:
            async for part in content:
                await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body"})
    else:
        await send({"type": "http.response.body", "body": response.content})


async def _wait_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class GatewayASGI:
    """ASGI app serving Django's /v1 views directly."""

    def __init__(self) -> None:
        self.resolver = get_resolver()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        t0 = time.perf_counter()
        db_connections.install()  # no request signals here: its executor checks connections
        limit = settings.GATEWAY_MAX_BODY_BYTES
        if scope["path"] == "/v1/files":  # batch file uploads (multipart): up to 200 MB
            limit = settings.FILES_MAX_BYTES + 1024 * 1024
        try:
            body = await _read_body(receive, limit)
        except _Disconnected:
            return
        if body is None:
            error = PayloadTooLarge(f"Request body exceeds the limit of {limit} bytes.")
            await _send_response(openai_error(error), send)
            return
        request = ASGIRequest(scope, io.BytesIO(body))
        try:
            match = self.resolver.resolve(request.path_info)
        except Resolver404:
            response = openai_error(NotFound(f"Unknown endpoint {request.path_info}.",
                                             code="unknown_url"))
            endpoint = "unknown"
        else:
            endpoint = match.url_name or "unknown"
            try:
                response = await match.func(request, *match.args, **match.kwargs)
            except DatabaseError as exc:  # PostgreSQL away and nothing cached would do: 503
                response = openai_error(db_connections.unavailable(exc))
            except Exception:
                log.exception("unhandled error in %s", request.path_info)
                response = server_error()
        request_observed(endpoint, response, time.perf_counter() - t0)
        try:
            sender = asyncio.create_task(_send_response(response, send))
            watcher = asyncio.create_task(_wait_disconnect(receive))
            await asyncio.wait({sender, watcher}, return_when=asyncio.FIRST_COMPLETED)
            for task in (watcher, sender):
                if not task.done():
                    task.cancel()  # a disconnect cancels the stream: the engine call is aborted
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await task
        finally:
            # sent, or the client went: the organization's in-flight slot is free again
            await concurrency.arelease(getattr(request, "in_flight", None))
