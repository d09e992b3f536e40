"""Real HTTP endpoints for webhook tests: each answers a scripted status per POST and keeps
what it was sent."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


@dataclass
class Receiver:
    """A real HTTP endpoint: answers the next status of ``script`` (then ``then``) per POST."""

    url: str
    script: list[int] = field(default_factory=list)
    then: int = 204
    location: str = ""
    posts: list[tuple[int, dict[str, str], bytes]] = field(default_factory=list)

    @property
    def delivered(self) -> list[bytes]:
        return [body for status, _h, body in self.posts if 200 <= status < 300]


@pytest.fixture
def receivers() -> Iterator[Callable[..., Receiver]]:
    servers: list[ThreadingHTTPServer] = []

    def start(*, script: tuple[int, ...] = (), then: int = 204, location: str = "") -> Receiver:
        receiver = Receiver(url="", script=list(script), then=then, location=location)
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with lock:
                    status = receiver.script.pop(0) if receiver.script else receiver.then
                    receiver.posts.append((status, dict(self.headers), body))
                self.send_response(status)
                if receiver.location:
                    self.send_header("Location", receiver.location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                return

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        receiver.url = f"http://127.0.0.1:{server.server_address[1]}/hooks/budget"
        return receiver

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()
