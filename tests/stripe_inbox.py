"""Receive the Stripe stand-in's signed webhook deliveries, as ``stripe listen`` does.

The stand-in (``tests/stripe_standin.py``) posts each event it emits, signed with Stripe's
scheme, to the URLs registered at ``/_config/webhooks/<id>``. ``StripeInbox`` listens on a
local port for them and keeps each delivery's exact bytes and ``Stripe-Signature`` header; a
test takes the one it waits for and posts it to the platform's webhook endpoint unchanged
(through Django's test client, so it runs in the test's transaction).
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Delivery:
    """One webhook as the stand-in sent it."""

    body: bytes
    signature: str
    event: dict[str, Any] = field(default_factory=dict)

    @property
    def object(self) -> dict[str, Any]:
        return dict(self.event["data"]["object"])


class StripeInbox:
    """An HTTP endpoint on 127.0.0.1 the stand-in delivers its webhooks to."""

    def __init__(self) -> None:
        self._deliveries: list[Delivery] = []
        self._taken: set[int] = set()
        self._changed = threading.Condition()
        inbox = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                delivery = Delivery(body=body, signature=self.headers.get("Stripe-Signature", ""),
                                    event=json.loads(body))
                with inbox._changed:
                    inbox._deliveries.append(delivery)
                    inbox._changed.notify_all()
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/"

    def register(self, stripe_base: str, *, secret: str) -> None:
        """Ask the stand-in to deliver every event here, signed with ``secret``."""
        httpx.post(f"{stripe_base}/_config/webhooks/tollgate_tests",
                   json={"url": self.url, "secret": secret}, timeout=10).raise_for_status()

    def take(self, kind: str, *, object_id: str, timeout: float = 30) -> Delivery:
        """Wait for the next delivery of event ``kind`` about ``object_id`` not taken yet."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for i, delivery in enumerate(self._deliveries):
                    if (i not in self._taken and delivery.event.get("type") == kind
                            and delivery.object.get("id") == object_id):
                        self._taken.add(i)
                        return delivery
                left = deadline - time.monotonic()
                if left <= 0:
                    seen = [(d.event.get("type"), d.object.get("id")) for d in self._deliveries]
                    raise AssertionError(f"no {kind} webhook for {object_id} within {timeout}s; "
                                         f"delivered: {seen[-20:]}")
                self._changed.wait(left)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
