"""Send a request to an engine the router chose, relay the answer, and account for it.

``EngineClient.call()`` returns an ``EngineCall``, an async context manager:

    async with client.call(model=..., path="/v1/chat/completions", body=..., namespace=org,
                           prompt_text=..., allowed_regions=...) as call:
        if call.streaming:
            async for chunk in call.chunks():   # parsed SSE JSON objects
                ...
        else:
            body = call.body
    result = call.result                          # the engine's usage, timings, status

What the client guarantees, whatever the caller asks for:

- usage is always requested from the engine (``stream_options.include_usage`` and
  ``continuous_usage_stats``, so an aborted stream still knows its exact token counts);
- ``cache_salt`` is always set from the tenant namespace, so no tenant reuses another's prefix
  cache (any caller-supplied salt is overwritten);
- retries happen only before the engine's first byte, on another engine when one exists;
- leaving the ``async with`` early (client disconnect) closes the engine connection, which
  aborts the request at the engine, and the result is marked ``client_aborted``;
- however a call ends (answered, failed before or in the middle of its body, cancelled), its
  engine connection slot and the router's in-flight count are given back, once: a
  non-streaming call that fails inside ``async with``'s entry never reaches ``__aexit__``, so
  the entry releases them itself.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any, Self

import orjson

from engine_adapter import http11
from engine_adapter.metrics import parse_engine_load
from engine_adapter.router import Router
from engine_adapter.types import (
    CallResult,
    EngineBadRequest,
    EngineError,
    EngineInfo,
    EngineLoad,
    EngineTimeout,
    NoCapacity,
)

RETRYABLE_STATUS = {500, 502, 503, 504}
DRAIN_S = 0.5  # how long a finished stream's end may take before its connection is dropped


def cache_salt(namespace: str, *, secret: str = "") -> str:
    """Return the engine ``cache_salt`` of a tenant namespace (stable; secret makes it opaque)."""
    return hashlib.blake2b(f"{secret}:{namespace}".encode(), digest_size=16).hexdigest()


class EngineClient:
    """Async HTTP client for the fleet: pooled connections, timeouts, relay, accounting."""

    def __init__(self, router: Router, *, connect_timeout: float = 2.0,
                 first_byte_timeout: float = 120.0, idle_timeout: float = 60.0,
                 max_attempts: int = 2, salt_secret: str = "",
                 max_connections: int = 1000) -> None:
        self.router = router
        self.first_byte_timeout = first_byte_timeout
        self.idle_timeout = idle_timeout
        self.max_attempts = max_attempts
        self.salt_secret = salt_secret
        self._http = http11.Pool(connect_timeout=connect_timeout, write_timeout=10.0,
                                 pool_timeout=10.0, max_connections=max_connections)
        self._max_running: dict[str, int | None] = {}  # engine URL -> its running cap
        # this process's calls in flight per (engine id, priority sent): what runs above a
        # priority is told apart from what runs below it (the gateway's hold-back of
        # reserved capacity counts the requests below the reserved ones' priority)
        self._by_priority: dict[tuple[str, int], int] = {}

    async def aclose(self) -> None:
        await self._http.aclose()

    def inflight_below(self, engine_id: str, priority: int) -> int:
        """Return this process's calls in flight on ``engine_id`` sent below ``priority``."""
        return sum(n for (eid, p), n in self._by_priority.items()
                   if eid == engine_id and p < priority)

    def _count(self, engine_id: str, priority: int, delta: int) -> None:
        key = (engine_id, priority)
        n = self._by_priority.get(key, 0) + delta
        if n > 0:
            self._by_priority[key] = n
        else:
            self._by_priority.pop(key, None)

    async def aloads(self, engines: list[EngineInfo], *, timeout: float = 1.0
                     ) -> dict[str, EngineLoad | None]:
        """Scrape the engines' /metrics now, all at once, on this client's connections.

        For callers that act on load many times a second (the batch runner): the health
        loop's last scrape is seconds old. An engine that does not answer in ``timeout`` is
        None (no room there). The running cap comes from /get_server_info the first time an
        engine's metrics lack it (SGLang's do), and again after a scrape of it failed.
        """
        async def one(engine: EngineInfo) -> EngineLoad | None:
            try:
                async with asyncio.timeout(timeout):
                    raw = parse_engine_load((await self._get(engine.url + "/metrics")).decode())
                    cap = int(raw.get("max_running") or 0) or self._max_running.get(engine.url)
                    if not cap:
                        info = json.loads(await self._get(engine.url + "/get_server_info"))
                        cap = self._max_running[engine.url] = int(
                            info.get("max_running_requests") or 0) or None
            except (TimeoutError, http11.TransportError, ValueError, AttributeError):
                # asked afresh once it answers: it may come back relaunched with another cap
                self._max_running.pop(engine.url, None)
                return None
            return EngineLoad.from_metrics(raw, max_running=cap)

        loads = await asyncio.gather(*(one(engine) for engine in engines))
        return {engine.engine_id: load for engine, load in zip(engines, loads, strict=True)}

    async def _get(self, url: str) -> bytes:
        response = await self._http.get(url)
        try:
            body = await response.aread()
        finally:
            await response.aclose()
        if response.status_code != 200:
            raise http11.TransportError(f"GET {url}: HTTP {response.status_code}")
        return body

    def call(self, *, model: str, path: str, body: dict[str, Any], namespace: str,
             prompt_text: str, allowed_regions: set[str] | None = None,
             priority: int | None = None, request_id: str | None = None) -> EngineCall:
        """Prepare a call; it is sent on ``async with``."""
        body = dict(body)
        body["model"] = model
        body["cache_salt"] = cache_salt(namespace, secret=self.salt_secret)
        if priority is not None:
            body["priority"] = priority
        if request_id:
            body["rid"] = _rid(path, body, request_id)
        if body.get("stream"):
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        return EngineCall(self, model=model, path=path, body=body, namespace=namespace,
                          prompt_text=prompt_text, allowed_regions=allowed_regions)


def _rid(path: str, body: dict[str, Any], request_id: str) -> str | list[str]:
    """Return the engine ``rid`` of a request: SGLang takes an embeddings body with a list of
    inputs only with one rid per input (a single string fails it with a 500)."""
    inputs = body.get("input")
    if path == "/v1/embeddings" and isinstance(inputs, list) and inputs and not isinstance(
            inputs[0], int):
        return [f"{request_id}-{i}" for i in range(len(inputs))]
    return request_id


class EngineCall:
    """One request in flight; see the module docstring."""

    def __init__(self, client: EngineClient, *, model: str, path: str, body: dict[str, Any],
                 namespace: str, prompt_text: str, allowed_regions: set[str] | None) -> None:
        self.client = client
        self.model = model
        self.path = path
        self.request_body = body
        self.namespace = namespace
        self.prompt_text = prompt_text
        self.allowed_regions = allowed_regions
        self.streaming = bool(body.get("stream"))
        self.priority = int(body.get("priority") or 0)
        self.body: dict[str, Any] | None = None
        self.result: CallResult | None = None
        self._response: http11.Response | None = None
        self._lines: AsyncIterator[str] | None = None
        self._engine: EngineInfo | None = None
        self._t0 = 0.0
        self._first_token_at: float | None = None
        self._finished = False
        self._closed = False
        self.tried: list[EngineInfo] = []

    # -- sending, with retries before the first byte -----------------------------------------

    async def __aenter__(self) -> Self:
        router = self.client.router
        failed: list[str] = []
        last_error: Exception | None = None
        self._t0 = time.monotonic()
        for attempt in range(1, self.client.max_attempts + 1):
            try:
                decision = router.choose(model=self.model, namespace=self.namespace,
                                         prompt=self.prompt_text,
                                         allowed_regions=self.allowed_regions, exclude=failed)
            except NoCapacity:
                if last_error is None:
                    raise
                break  # every candidate failed; report the engine's failure below
            engine = decision.engine
            self.tried.append(engine)
            self.client._count(engine.engine_id, self.priority, 1)
            held = True  # the router counts this request on the engine until it is released
            try:
                response = await self._send(engine)
                if response.status_code < 400:
                    self._engine, self._response = engine, response
                    self.result = CallResult(engine=engine, attempts=attempt)
                    if not self.streaming:
                        await self._read_body()
                    held = False  # from here on, ``__aexit__`` releases it
                    return self
                detail, param = await _error_detail(response)
                if response.status_code not in RETRYABLE_STATUS:
                    raise EngineBadRequest(detail, param=param)
                last_error = EngineError(f"engine {engine.engine_id} answered "
                                         f"{response.status_code}: {detail}")
            except (http11.TransportError, EngineTimeout) as exc:  # before its first byte
                last_error = exc
            finally:
                # Whatever happened (an engine error, a body cut off, a cancelled request):
                # the engine's connection slot and in-flight count go back.
                if held and self._response is not None:
                    await self._close()
                elif held:
                    router.release(engine.engine_id)
                    self.client._count(engine.engine_id, self.priority, -1)
            failed.append(engine.engine_id)
        if isinstance(last_error, EngineTimeout):
            raise last_error
        raise EngineError(f"the engine failed before answering: {last_error}")

    async def _send(self, engine: EngineInfo) -> http11.Response:
        try:  # orjson: the same compact UTF-8 text, at a fraction of json's CPU
            body = orjson.dumps(self.request_body)
        except orjson.JSONEncodeError:  # an integer past 64 bits, which json writes
            body = json.dumps(self.request_body, ensure_ascii=False, separators=(",", ":"),
                              allow_nan=False).encode()
        try:
            async with asyncio.timeout(self.client.first_byte_timeout):
                return await self.client._http.post(engine.url + self.path, body)
        except TimeoutError as exc:
            raise EngineTimeout(f"engine {engine.engine_id} sent nothing in "
                                f"{self.client.first_byte_timeout:.0f}s") from exc

    async def _read_body(self) -> None:
        try:
            async with asyncio.timeout(self.client.idle_timeout):
                raw = await self._open().aread()
        except (http11.TransportError, TimeoutError) as exc:
            self._fail(f"engine connection failed while answering: {exc!r}")
            raise EngineError("the engine failed while answering") from exc
        self._first_token_at = time.monotonic()
        try:
            self.body = orjson.loads(raw)
        except ValueError as exc:  # orjson.JSONDecodeError is one
            self._fail(f"the engine answered a body that is not JSON: {raw[:200]!r}")
            raise EngineError("the engine answered a body that is not JSON") from exc
        self._take_usage(self.body.get("usage"))
        choices = self.body.get("choices") or [{}]
        self._res.finish_reason = choices[0].get("finish_reason")
        self._res.response_id = self.body.get("id")
        self._finished = True

    # -- streaming relay ---------------------------------------------------------------------

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """Yield the engine's SSE chunks as dicts (usage chunk included) until ``[DONE]``."""
        # The idle timeout covers each wait for the engine's bytes, never a ``yield`` (the
        # consumer's time is not ours); lines that came in one read share one timer.
        lines = self._lines = self._open().aiter_lines(idle_timeout=self.client.idle_timeout)
        while True:
            try:
                line = await anext(lines)
            except StopAsyncIteration:
                if not self._finished:
                    self._fail("the engine closed the stream before finishing")
                    raise EngineError("the engine closed the stream early") from None
                return
            except TimeoutError as exc:
                self._fail(f"no data from the engine for {self.client.idle_timeout:.0f}s")
                raise EngineTimeout("the engine stalled mid-stream") from exc
            except http11.TransportError as exc:
                self._fail(f"engine connection failed mid-stream: {exc!r}")
                raise EngineError("the engine connection failed mid-stream") from exc
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                self._finished = True
                return
            chunk = orjson.loads(data)  # one per token: orjson's is a third of json's
            if "error" in chunk and "choices" not in chunk:
                self._fail(str(chunk["error"]))
                raise EngineError(f"the engine reported an error mid-stream: {chunk['error']}")
            self._observe(chunk)
            yield chunk

    @property
    def chunk_ready(self) -> bool:
        """Whether the engine's next chunk has arrived already: ``chunks()`` yields it without
        waiting, so a relay may send what it holds together with it. Not its end (``[DONE]``):
        what follows the last chunk (metering, a stored response) must not hold it."""
        response = self._response
        return response is not None and any(
            line.startswith("data:") and line[5:].strip() != "[DONE]"
            for line in response.ready_lines)

    def _observe(self, chunk: dict[str, Any]) -> None:
        self._take_usage(chunk.get("usage"))
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if self._first_token_at is None and (delta.get("content") or choice.get("text")
                                                 or delta.get("reasoning_content")):
                self._first_token_at = time.monotonic()
            if choice.get("finish_reason"):
                self._res.finish_reason = choice["finish_reason"]
        if chunk.get("id"):
            self._res.response_id = chunk["id"]

    def _take_usage(self, usage: dict[str, Any] | None) -> None:
        if not usage:
            return
        result = self._res
        result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        result.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            result.cached_tokens = int(details["cached_tokens"])
        # SGLang reports its reasoning parser's count at the top level (``reasoning_tokens``)
        # and, when there are some, where OpenAI puts it too.
        reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
        if reasoning is None:
            reasoning = usage.get("reasoning_tokens")
        result.reasoning_tokens = min(int(reasoning or 0), result.completion_tokens)

    async def _drain(self) -> None:
        """Read the end of a finished stream (after ``[DONE]``) so its connection is reused.

        Without this, closing the response mid-body closes the connection, and every streamed
        request paid for a new TCP connection to the engine (bench/gateway.py: ~1.5 ms of TTFT).
        The end of the body follows ``[DONE]`` at once; an engine that holds the stream open
        past DRAIN_S just loses its connection, as before.
        """
        lines, self._lines = self._lines, None
        try:
            async with asyncio.timeout(DRAIN_S):
                async for _line in lines:
                    pass
        except (TimeoutError, http11.TransportError):
            pass  # aclose() closes the connection: nothing is reused, nothing is lost

    def _fail(self, message: str) -> None:
        self._res.status = "engine_error"
        self._res.error = message

    @property
    def _res(self) -> CallResult:
        if self.result is None:
            raise RuntimeError("use the engine call inside `async with`")
        return self.result

    def _open(self) -> http11.Response:
        if self._response is None:
            raise RuntimeError("use the engine call inside `async with`")
        return self._response

    # -- completion and accounting -----------------------------------------------------------

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self._close()

    async def _close(self) -> None:
        """Release the engine's connection and in-flight count and account for the call;
        once, however the call ended."""
        if (self._closed or self._response is None or self.result is None
                or self._engine is None):
            return
        self._closed = True
        result = self.result
        if not self._finished and result.status == "ok":
            # The caller stopped early (client disconnect or cancellation).
            result.status = "client_aborted"
        try:
            if self._finished and self._lines is not None:
                await self._drain()
        finally:
            # Closes the connection unless the body was read to its end: the engine aborts
            # the request. A finished, fully read response goes back to the pool instead.
            await self._response.aclose()
            self.client.router.release(self._engine.engine_id)
            self.client._count(self._engine.engine_id, self.priority, -1)
        now = time.monotonic()
        result.total_ms = (now - self._t0) * 1000
        if self._first_token_at is not None:
            result.ttft_ms = (self._first_token_at - self._t0) * 1000
        meta = (self.body or {}).get("meta_info") or {}
        result.queue_ms = float(meta.get("queue_time", 0) or 0) * 1000


async def _error_detail(response: http11.Response) -> tuple[str, str | None]:
    """The message and ``param`` of an engine's error answer, in either shape engines use:
    OpenAI's (and vLLM's) ``{"error": {"message", "param"}}`` or SGLang's top-level
    ``{"object": "error", "message", "param"}``."""
    try:
        raw = await response.aread()
    finally:
        await response.aclose()
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"]:
            param = err.get("param")
            return err["message"], param if isinstance(param, str) else None
        if isinstance(err, str) and err:
            return err, None
    text = raw[:500].decode(errors="replace").strip()
    return text or f"the engine answered {response.status_code} with no detail", None
