"""A lean ASGI route for /v1, mounted beside Django (see billing_platform/asgi.py for why).

It does what Django's ASGIHandler does for our views, minus the parts that cost a thread per
request (a thread-sensitive context, sync signal receivers, sync ``response.close``) and the
sync-style middleware: build Django's request, resolve the URL, await the async view, send the
response, and cancel the response task when the client disconnects (so a stream is aborted at
the engine and metered as ``client_aborted``). Requests and latencies are counted here
(``gateway/metrics.py``), since no middleware sees them.

Memory stays bounded whatever a client sends or stops reading:

- the body is NOT read here: the view's decorator reads it after the bearer key, scope and
  in-flight slot were checked on the headers (``gateway/bodies.py``: a small in-memory limit
  for JSON, ``POST /v1/files`` spooled to disk under the file limit, a read timeout). An
  unknown URL (404), an unknown caller (401) or any refusal before the body was read is
  answered without reading it, and the connection closed (``Connection: close``), since
  what the client still sends could not be told from a next request;
- every ``send`` must go through within ``GATEWAY_SEND_TIMEOUT_S``: a client that stops
  reading (its socket's buffers full, ``send`` blocked) is cut, its connection dropped, and
  what it held is given back as for a disconnect (the engine request aborted, metered as
  ``client_aborted``, the reservation settled, the in-flight slot freed), not after minutes;
- whatever the request registered to run at its end (``GatewayRequest.on_close``: the engine
  call of a stream, the in-flight slot, an open download) runs in the ``finally``, also when
  the client went after the view returned but before the stream was sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import Any

from django.conf import settings
from django.db import DatabaseError
from django.http import HttpResponseBase
from django.urls import Resolver404, get_resolver

from billing_platform.accounts import keycache
from billing_platform.errors import NotFound
from billing_platform.gateway import db_connections
from billing_platform.gateway.bodies import ClientGone, GatewayRequest
from billing_platform.gateway.errors import openai_error, server_error
from billing_platform.gateway.metrics import request_observed
from plans import admission, concurrency

log = logging.getLogger(__name__)
# Routes whose POST body is spooled to disk under the file limit, not read into memory; the
# allowance on top of the file is for the multipart framing and the other form fields.
SPOOLED_ROUTES = {"v1-files"}
MULTIPART_ALLOWANCE = 1024 * 1024


class _Stalled(Exception):
    """A ``send`` did not go through within GATEWAY_SEND_TIMEOUT_S: the client stopped reading."""


class _SendWatch:
    """Cut a response one of whose sends waits longer than ``timeout`` (``_Stalled``).

    One timer per response, re-armed only when it fires, where an ``asyncio.timeout`` per
    send cost two timer operations per chunk, as much as uvicorn's send itself (a stream
    sends one per token). A send that waits marks when it began; the timer fires at that
    moment plus ``timeout`` and cancels the response's task if the same send still waits.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.since: float | None = None  # when the send now waiting began
        self.stalled = False
        self.handle = self.loop.call_later(timeout, self._check)

    def _check(self) -> None:
        since, now = self.since, self.loop.time()
        if since is not None and now - since >= self.timeout and self.task is not None:
            self.stalled = True
            self.task.cancel()  # the task waits in that send: it is thrown there
            return
        self.handle = self.loop.call_at((now if since is None else since) + self.timeout,
                                        self._check)

    async def send(self, send: Any, message: dict[str, Any]) -> None:
        self.since = self.loop.time()
        try:
            await send(message)
        except asyncio.CancelledError:
            if self.stalled and self.task is not None and self.task.uncancel() == 0:
                raise _Stalled from None
            raise
        finally:
            self.since = None

    def close(self) -> None:
        self.handle.cancel()


async def _send_response(response: HttpResponseBase, send: Any) -> None:
    watch = _SendWatch(settings.GATEWAY_SEND_TIMEOUT_S)
    emit = functools.partial(watch.send, send)
    try:
        if not response.streaming and not response.has_header("Content-Length"):
            response["Content-Length"] = str(len(response.content))  # else uvicorn chunks it
        headers = [(k.encode("ascii"), v.encode("latin1")) for k, v in response.items()]
        await emit({"type": "http.response.start", "status": response.status_code,
                    "headers": headers})
        if response.streaming:
            async with contextlib.aclosing(aiter(response)) as content:
                async for part in content:
                    await emit({"type": "http.response.body", "body": part,
                                "more_body": True})
            await emit({"type": "http.response.body"})
        else:
            await emit({"type": "http.response.body", "body": response.content})
    finally:
        watch.close()


async def _wait_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _drop_connection(send: Any) -> None:
    """Drop the connection of a client that stopped reading, now.

    ASGI has no message for it, and uvicorn's close after an unfinished response would wait
    for the client to read what is buffered, which it does not; so the transport of uvicorn's
    connection (``send`` is its cycle's) is aborted. Elsewhere the server closes as it does.
    """
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is not None:
        transport.abort()


class GatewayASGI:
    """ASGI app serving Django's /v1 views directly."""

    def __init__(self) -> None:
        # A path resolves the same way every time: the last paths' matches are kept (Django's
        # resolver walks its patterns per call, ~2 % of a gateway's CPU a request). A path
        # that matches nothing raises each time, as before: nothing is kept for it.
        self.resolve = functools.lru_cache(maxsize=1024)(get_resolver().resolve)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        t0 = time.perf_counter()
        db_connections.install()  # no request signals here: its executor checks connections
        request = GatewayRequest(scope, receive)
        try:
            try:
                match = self.resolve(request.path_info)
            except Resolver404:
                response = openai_error(NotFound(f"Unknown endpoint {request.path_info}.",
                                                 code="unknown_url"))
                endpoint = "unknown"
            else:
                endpoint = match.url_name or "unknown"
                if endpoint in SPOOLED_ROUTES and request.method == "POST":
                    request.spool_body(limit=settings.FILES_MAX_BYTES + MULTIPART_ALLOWANCE)
                try:
                    response = await match.func(request, *match.args, **match.kwargs)
                except ClientGone:
                    return
                except DatabaseError as exc:  # PostgreSQL away and nothing cached would do
                    response = openai_error(db_connections.unavailable(exc))
                except Exception:
                    log.exception("unhandled error in %s", request.path_info)
                    response = server_error()
            request_observed(endpoint, response, time.perf_counter() - t0)
            await self._respond(request, response, receive, send)
        finally:
            # sent, or the client went: the stream's engine call is closed and metered, the
            # organization's in-flight slot is free again, open files are closed
            await request.aclose()

    async def _respond(self, request: GatewayRequest, response: HttpResponseBase,
                       receive: Any, send: Any) -> None:
        if not request.body_complete:
            # Refused before its body was read: what the client still sends is no next
            # request, so the connection closes after the answer (and nothing reads it).
            response["Connection"] = "close"
        tasks = [asyncio.create_task(_send_response(response, send))]
        if request.body_complete:
            tasks.append(asyncio.create_task(_wait_disconnect(receive)))
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in reversed(tasks):
            if not task.done():
                task.cancel()  # a disconnect cancels the stream: the engine call is aborted
            with contextlib.suppress(asyncio.CancelledError, OSError):
                try:
                    await task
                except _Stalled:
                    log.info("%s %s: the client read nothing for %g s; connection dropped",
                             request.method, request.path, settings.GATEWAY_SEND_TIMEOUT_S)
                    _drop_connection(send)
                    await asyncio.sleep(0)  # uvicorn sees the connection lost before we return


async def lifespan(receive: Any, send: Any) -> None:
    """Serve the ASGI lifespan protocol: at shutdown (after uvicorn has let the requests in
    flight finish), give back the quota leases and in-flight slot pools this process holds, so
    that what they hold unused is counted and reserved no more (a process that dies without it
    leaves them to expire, as a crashed request's reservation and slots do), and close the
    API-key near cache's tracking connection."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            for what, give_back in (("quota leases", admission.aclose_leases),
                                    ("in-flight slot pools", concurrency.aclose),
                                    ("API key near cache", keycache.aclose_near)):
                try:
                    given_back = await give_back()
                    if given_back:
                        log.info("gave back %d %s at shutdown", given_back, what)
                except Exception as exc:  # Redis down: they expire on their own
                    log.warning("%s not given back at shutdown: %r", what, exc)
            await send({"type": "lifespan.shutdown.complete"})
            return
