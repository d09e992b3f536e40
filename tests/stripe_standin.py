"""localstripe, plus Stripe's idempotent requests: the Stripe stand-in the tests start.

localstripe speaks Stripe's API over HTTP but ignores the ``Idempotency-Key`` header, and the
platform's "never a double charge" rests on that header: a charge whose answer was lost (a
network error, a worker killed before it recorded the result) is sent again with the same
key, and Stripe answers with the first result instead of charging again. This wrapper adds
that behaviour as Stripe documents it: per key (and API key), the first result of a request
that ran (2xx, or 402 for a declined card) is saved and replayed with
``Idempotent-Replayed: true``; the same key with other parameters is a 400
``idempotency_error``; requests with one key run one at a time. It also gives PaymentIntents
Stripe's ``amount_received`` (the amount once succeeded, else 0), which localstripe leaves
out and the platform pays by. Nothing else changes.

    python tests/stripe_standin.py --port 8420 --from-scratch
"""

from __future__ import annotations

import asyncio
import hashlib

from aiohttp import web
from localstripe import resources, server

_saved: dict[tuple[str, str], tuple[str, int, bytes, str]] = {}
_locks: dict[tuple[str, str], asyncio.Lock] = {}


@web.middleware
async def idempotency_middleware(request: web.Request, handler) -> web.StreamResponse:
    key = request.headers.get("Idempotency-Key")
    if request.method != "POST" or not key:
        return await handler(request)
    scope = (request.headers.get("Authorization", ""), key)
    body = await request.read()  # aiohttp keeps it for the handler
    fingerprint = hashlib.sha256(request.path.encode() + b"\0" + body).hexdigest()
    async with _locks.setdefault(scope, asyncio.Lock()):
        saved = _saved.get(scope)
        if saved is not None:
            if saved[0] != fingerprint:
                return web.json_response({"error": {
                    "type": "idempotency_error",
                    "message": "Keys for idempotent requests can only be used with the same "
                               "parameters they were first used with."}}, status=400)
            _, status, payload, content_type = saved
            return web.Response(status=status, body=payload, content_type=content_type,
                                headers={"Idempotent-Replayed": "true", "Idempotency-Key": key})
        response = await handler(request)
        if isinstance(getattr(response, "body", None), bytes) and (
                200 <= response.status < 300 or response.status == 402):
            _saved[scope] = (fingerprint, response.status, response.body,
                             response.content_type)
        return response


def _amount_received(intent: resources.PaymentIntent) -> int:
    return intent.amount if intent.status == "succeeded" else 0


if __name__ == "__main__":
    resources.PaymentIntent.amount_received = property(_amount_received)
    server.app.middlewares.insert(0, idempotency_middleware)
    server.start()
