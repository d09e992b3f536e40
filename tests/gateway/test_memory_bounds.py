"""Memory stays bounded whatever /v1 clients send or stop reading (issue 15, item 2).

Against a live gateway (uvicorn, the real ASGI app) in front of simulated engines, with raw
sockets where a client must misbehave the way no HTTP library lets it: promise a 200 MB body
and send nothing (or a few MB, then nothing), download a 200 MB file sixteen times at once,
stop reading a stream. The web process's memory is read from ``/proc/<pid>/status``: its peak
(``VmHWM``, reset once the paths were warmed up) against the stated bound. Every wait is for a
state (a response, a spool on disk, a metered event, a released slot), never for a time.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from billing_platform.gateway.batch import files
from billing_platform.gateway.models import StoredFile
from billing_platform.redis_conn import get_redis
from engine_adapter.sim.testing import FAST_RATES, start_sim
from metering.models import UsageEvent
from plans import admission, quotas
from plans.admission.policy import inflight_key
from tests.conftest import wait_until
from tests.factories import OrganizationFactory, ProjectFactory, make_key, make_price_book
from tests.gateway.conftest import (
    LiveGateway,
    drain_usage,
    register_engine,
    start_gateway,
    stop_gateway,
)

PROMISED = 200 * 1024 * 1024  # what each hostile connection says it will send
SENT = 4 * 1024 * 1024  # what each authenticated upload does send before it stops
CONNECTIONS = 40
DOWNLOADS = 16
# Growth of the web process's peak RSS allowed over its warmed-up RSS. The hostile uploads
# send 20 x 4 MB (80 MB) and promise 8 GB; buffered in memory as before, either would pass
# it; the downloads move 16 x 200 MB. What a bounded gateway holds per connection is tens of
# KB (uvicorn reads at most 64 KB ahead, a download chunk is 64 KB), so 40 MB is room for the
# interpreter's own arenas and threads under 80 concurrent requests, and nothing more
# (measured on the 2-core box: 4 MB for the connections, 9 MB for the downloads).
RSS_GROWTH_BOUND_KB = 40 * 1024
# Generous deadlines: a loaded 2-core machine can be slow, never wrong.
SOCKET_TIMEOUT_S = 120
BOUNDARY = "tollgate-memory-bounds"


@dataclass
class Gateway:
    live: LiveGateway
    files_dir: Path

    @property
    def pid(self) -> int:
        return self.live.process.pid


@pytest.fixture
def make_gateway(transactional_db, tmp_path, settings, metering_stream) -> Iterator:
    """Start live gateways (with extra settings) storing files under this test's directory."""
    settings.FILES_DIR = str(tmp_path / "files")
    started: list[LiveGateway] = []

    def start(**env: str) -> Gateway:
        live = start_gateway(tmp_path, env={**metering_stream,
                                            "TOLLGATE_FILES_DIR": settings.FILES_DIR,
                                            "TOLLGATE_AUTH_FAILURE_LIMIT": "1000", **env})
        started.append(live)
        return Gateway(live, Path(settings.FILES_DIR))

    yield start
    for live in started:
        stop_gateway(live)


def _tenant(**org_fields) -> tuple[object, str]:
    org = OrganizationFactory(**org_fields)
    _key, secret = make_key(project=ProjectFactory(organization=org),
                            scopes=["inference", "batch"])
    return org, secret


# --- raw HTTP/1.1, for clients no library lets misbehave -----------------------------------

def _connect(gateway: Gateway, *, small_buffers: bool = False) -> socket.socket:
    url = urlsplit(gateway.live.url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if small_buffers:
        # A small window and segment size, set before connecting: on loopback (64 KB segments)
        # the server's send buffer autotunes to 4 MB, so a client that stops reading would be
        # noticed only after megabytes; with these the kernel holds about 130 KB.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.settimeout(SOCKET_TIMEOUT_S)
    sock.connect((url.hostname, url.port))
    return sock


def _head(method: str, path: str, headers: dict[str, object]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1",
             *(f"{name}: {value}" for name, value in headers.items()), "", ""]
    return "\r\n".join(lines).encode()


def _read_all(sock: socket.socket) -> bytes:
    """Read until the server closes the connection (a timeout fails: it was kept open)."""
    data = bytearray()
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass  # closed with our unread bytes in its buffer: what came before still counts
    return bytes(data)


def _answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Return the status, headers and body of the one answer before the connection closed."""
    raw = _read_all(sock)
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in header_lines)
    return int(status_line.split()[1]), {k.lower(): v for k, v in headers.items()}, body


def _openai_error(body: bytes) -> dict:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# --- the web process ------------------------------------------------------------------------

def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _reset_peak(pid: int) -> int:
    """Reset the process's peak RSS to its current RSS (Linux clear_refs); return that."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _status_kb(pid, "VmRSS")


def _spools(gateway: Gateway) -> list[int]:
    """Return the sizes of the upload spools the web process has open (anonymous files)."""
    incoming = str(gateway.files_dir / ".incoming")
    sizes = []
    for fd in os.listdir(f"/proc/{gateway.pid}/fd"):
        link = f"/proc/{gateway.pid}/fd/{fd}"
        try:
            if os.readlink(link).startswith(incoming):
                sizes.append(os.stat(link).st_size)
        except FileNotFoundError:  # closed meanwhile
            continue
    return sizes


def _held(org) -> int:
    return get_redis().zcard(inflight_key(org.id))


def _multipart_preamble() -> bytes:
    return (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"big.jsonl\"\r\nContent-Type: application/jsonl\r\n\r\n").encode()


def _warm_up(gateway: Gateway, secret: str) -> None:
    """Take every path the test takes once, so its code and caches are in memory."""
    auth = {"Authorization": f"Bearer {secret}"}
    uploaded = httpx.post(f"{gateway.live.url}/v1/files", headers=auth, timeout=60,
                          data={"purpose": "batch"},
                          files={"file": ("warm.jsonl", b'{"custom_id": "w"}\n')})
    assert uploaded.status_code == 200, uploaded.text
    content = httpx.get(f"{gateway.live.url}/v1/files/{uploaded.json()['id']}/content",
                        headers=auth, timeout=60)
    assert content.content == b'{"custom_id": "w"}\n'
    for headers in ({}, {"Authorization": "Bearer sk-warm-up"}, auth):
        sock = _connect(gateway)
        sock.sendall(_head("POST", "/v1/chat/completions",
                           {"Content-Length": PROMISED, **headers}))
        assert _answer(sock)[0] in (401, 413)
        sock.close()


def test_forty_connections_promising_200_mb_leave_the_web_process_memory_bounded(
        make_gateway):
    # given a gateway that waits long for slow bodies, and a tenant allowed 100 requests at once
    # (no in-flight slots taken ahead: its set then holds exactly the requests in flight)
    gateway = make_gateway(TOLLGATE_BODY_READ_TIMEOUT_S="600",
                           TOLLGATE_ORG_CONCURRENCY_POOL_MAX="0")
    org, secret = _tenant(max_concurrent_requests=100)
    _warm_up(gateway, secret)
    baseline = _reset_peak(gateway.pid)

    # when 40 unauthenticated connections (no key, a made-up key) promise 200 MB each to a JSON
    # route, to the upload route and to no route at all, and send nothing
    paths = ["/v1/chat/completions", "/v1/files", "/v1/no-such-endpoint"]
    unknown = []
    for i in range(CONNECTIONS):
        auth = {"Authorization": f"Bearer sk-made-up-{i}"} if i % 2 else {}
        sock = _connect(gateway)
        sock.sendall(_head("POST", paths[i % 3], {"Content-Length": PROMISED,
                                                  "Content-Type": "application/json", **auth}))
        unknown.append((paths[i % 3], sock))

    # then each is answered 401 (404 for no route) in OpenAI's shape without its body being
    # read, and its connection closed
    for path, sock in unknown:
        status, headers, body = _answer(sock)
        assert headers["connection"] == "close"
        if path == "/v1/no-such-endpoint":
            assert (status, _openai_error(body)["code"]) == (404, "unknown_url")
        else:
            assert status == 401
            assert _openai_error(body)["code"] in {"missing_api_key", "invalid_api_key"}
        sock.close()

    # when 40 authenticated connections promise 200 MB: 20 to a JSON route, sending nothing,
    # and 20 uploads that send 4 MB of their multipart body, then nothing more
    refused, uploads = [], []
    for _ in range(CONNECTIONS // 2):
        sock = _connect(gateway)
        sock.sendall(_head("POST", "/v1/chat/completions", {
            "Content-Length": PROMISED, "Content-Type": "application/json",
            "Authorization": f"Bearer {secret}"}))
        refused.append(sock)
    preamble = _multipart_preamble()
    for _ in range(CONNECTIONS // 2):
        sock = _connect(gateway)
        sock.sendall(_head("POST", "/v1/files", {
            "Content-Length": PROMISED, "Authorization": f"Bearer {secret}",
            "Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}))
        sock.sendall(preamble + b"x" * (SENT - len(preamble)))
        uploads.append(sock)

    # then the JSON route answers 413 at once, unread, and closes
    for sock in refused:
        status, headers, body = _answer(sock)
        assert status == 413 and headers["connection"] == "close"
        assert _openai_error(body)["code"] == "request_too_large"
        sock.close()
    # and the uploads were spooled to disk as they came, each holding an in-flight slot
    wait_until(lambda: sorted(_spools(gateway)) == [SENT] * len(uploads), timeout=120,
               what="every upload's 4 MB on disk")
    assert _held(org) == len(uploads)
    # and the web process's memory stayed within the bound the whole time
    grown = _status_kb(gateway.pid, "VmHWM") - baseline
    assert grown <= RSS_GROWTH_BOUND_KB, f"peak RSS grew by {grown} kB"

    # when the uploaders go away
    for sock in uploads:
        sock.close()

    # then their spools are gone, their slots free, and no file was stored
    wait_until(lambda: not _spools(gateway) and _held(org) == 0, timeout=60,
               what="the abandoned uploads to be cleaned up")
    assert StoredFile.objects.filter(organization=org).count() == 1  # the warm-up's


class _Lines:
    """A readable stream of ``count`` distinct JSONL lines of ``width`` bytes each."""

    def __init__(self, count: int, width: int) -> None:
        self.count, self.width, self.next = count, width, 0

    def line(self, i: int) -> bytes:
        head = json.dumps({"custom_id": f"r{i:06d}", "pad": ""})[:-2].encode()
        return head + b"x" * (self.width - len(head) - 3) + b'"}\n'

    def read(self, size: int) -> bytes:
        lines = []
        while self.next < self.count and len(lines) * self.width < size:
            lines.append(self.line(self.next))
            self.next += 1
        return b"".join(lines)


def test_sixteen_concurrent_downloads_of_a_200_mb_file_leave_memory_bounded(make_gateway):
    # given a 200 MB batch file of a tenant, stored through the files service
    gateway = make_gateway()
    org, secret = _tenant()
    lines = _Lines(count=47_000, width=4_400)
    stored = files.file_create(org_id=org.id, org_public_id=org.public_id, project_id=None,
                               purpose="batch", filename="big.jsonl", source=lines)
    expected = hashlib.sha256(files.file_path(stored).read_bytes()).hexdigest()
    assert 200 * 1000 * 1000 < stored.bytes <= 200 * 1024 * 1024
    _warm_up(gateway, secret)
    baseline = _reset_peak(gateway.pid)

    # when 16 clients download it at once
    def download(_: int) -> tuple[int, str, str]:
        digest, size = hashlib.sha256(), 0
        with httpx.stream("GET", f"{gateway.live.url}/v1/files/{stored.public_id}/content",
                          headers={"Authorization": f"Bearer {secret}"},
                          timeout=SOCKET_TIMEOUT_S) as response:
            assert response.status_code == 200
            for chunk in response.iter_raw(1 << 20):
                digest.update(chunk)
                size += len(chunk)
            return size, digest.hexdigest(), response.headers["content-length"]

    with ThreadPoolExecutor(DOWNLOADS) as pool:
        results = list(pool.map(download, range(DOWNLOADS)))

    # then each got the whole file, byte for byte, and the web process's memory stayed bounded
    assert results == [(stored.bytes, expected, str(stored.bytes))] * DOWNLOADS
    grown = _status_kb(gateway.pid, "VmHWM") - baseline
    assert grown <= RSS_GROWTH_BOUND_KB, f"peak RSS grew by {grown} kB"
    wait_until(lambda: _held(org) == 0, timeout=30, what="the downloads' slots")


# --- slow clients --------------------------------------------------------------------------

@pytest.fixture
def slow_clients(make_gateway) -> Iterator[tuple[Gateway, object]]:
    """A gateway that gives slow clients one second, in front of a simulated engine that
    decodes slowly enough to be mid-generation when its client is cut."""
    make_price_book(prices=[{"model": m, "input": "0.50", "output": "1.50"}
                            for m in ("small", "fast")])
    sim = start_sim(served_model_name="small", prefill_tokens_per_s=10_000_000,
                    decode_tokens_per_s=400)
    fast = start_sim(served_model_name="fast", **FAST_RATES)
    register_engine(sim, pool="small-us", region="us-east", zone="us")
    register_engine(fast, pool="fast-us", region="us-east", zone="us")
    gateway = make_gateway(TOLLGATE_BODY_READ_TIMEOUT_S="1", TOLLGATE_SEND_TIMEOUT_S="1")
    yield gateway, sim
    sim.stop()
    fast.stop()


def _sim_stats(sim) -> dict:
    return httpx.get(f"{sim.base_url}/sim/stats", timeout=10).json()


def _chat(secret: str, model: str = "small", **fields) -> tuple[bytes, bytes]:
    """Return the head and body of a chat request that generates exactly its max_tokens."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "story"}],
                       "ignore_eos": True, **fields}).encode()
    return _head("POST", "/v1/chat/completions", {
        "Content-Length": len(body), "Content-Type": "application/json",
        "Authorization": f"Bearer {secret}"}), body


def _metered(org) -> list[UsageEvent]:
    drain_usage()
    return list(UsageEvent.objects.filter(organization=org).order_by("event_time"))


def test_a_stream_reader_that_stops_reading_is_cut_and_metered_client_aborted(slow_clients):
    # given a tenant with a hard budget (so its request holds a reservation)
    gateway, sim = slow_clients
    org, secret = _tenant()
    quotas.budget_set(organization=org, amount="1000", hard=True)

    # when a client starts a long stream, reads its headers, and then reads nothing more
    sock = _connect(gateway, small_buffers=True)
    head, body = _chat(secret, stream=True, max_tokens=12_000)
    sock.sendall(head + body)
    received = bytearray()
    while b"\r\n\r\n" not in received:
        received += sock.recv(1)
    assert received.startswith(b"HTTP/1.1 200")
    request_id = next(line.split(b": ", 1)[1].decode() for line in received.split(b"\r\n")
                      if line.lower().startswith(b"x-request-id:"))

    # then once its buffers are full it is cut: the engine request aborted, metered as
    # client_aborted with what was relayed, the reservation settled and the slot free
    event = wait_until(lambda: next((e for e in _metered(org) if e.request_id == request_id),
                                    None), timeout=120, what="the stalled stream's event")
    assert event.status == "client_aborted"
    assert 0 < event.completion_tokens < 12_000
    wait_until(lambda: _sim_stats(sim)["running"] == 0, timeout=30, what="the engine slot")
    assert _sim_stats(sim)["aborted"] == 1
    wait_until(lambda: _held(org) == 0, timeout=30, what="the in-flight slot")
    assert get_redis().zcard(admission.reservations_key(org.id)) == 0
    # and what the client reads now ends without [DONE]: the connection was dropped
    assert b"data: [DONE]" not in _read_all(sock)
    sock.close()
    assert "connection dropped" in gateway.live.log()


def test_a_stream_whose_client_stopped_reading_before_it_began_is_closed_and_metered(
        slow_clients):
    # given a tenant with a hard budget
    gateway, sim = slow_clients
    org, secret = _tenant()
    quotas.budget_set(organization=org, amount="1000", hard=True)

    # when a client that reads nothing pipelines, on one connection, a request answered with
    # 2 MB (a refusal that quotes back a 1 MB unknown parameter) and then a stream: the answer
    # fills the connection's buffers, so the stream's first send blocks, before its
    # generator ever runs
    sock = _connect(gateway, small_buffers=True)
    refused = b"".join(_chat(secret, **{"x" * 1_000_000: 1}))
    stream = b"".join(_chat(secret, stream=True, max_tokens=6_000))
    sock.sendall(refused + stream)

    # then the stream is cut all the same: its engine request aborted and metered
    # client_aborted (nothing else closes a stream that never started), its reservation and
    # its slot released
    event = wait_until(lambda: next(iter(_metered(org)), None), timeout=120,
                       what="the stream's event")
    assert event.status == "client_aborted"
    wait_until(lambda: _sim_stats(sim)["running"] == 0, timeout=30, what="the engine slot")
    assert _sim_stats(sim)["aborted"] == 1
    wait_until(lambda: _held(org) == 0, timeout=30, what="the in-flight slots")
    assert get_redis().zcard(admission.reservations_key(org.id)) == 0
    # and the client got the refusal, never the stream
    received = _read_all(sock)
    assert received.startswith(b"HTTP/1.1 400") and b"text/event-stream" not in received
    sock.close()


@pytest.mark.parametrize(("path", "content_type"), [
    ("/v1/chat/completions", "application/json"),
    ("/v1/files", f"multipart/form-data; boundary={BOUNDARY}"),
])
def test_a_body_that_stops_midway_is_answered_408_and_cleaned_up(slow_clients, path,
                                                                  content_type):
    # given a tenant
    gateway, _sim = slow_clients
    org, secret = _tenant()

    # when a client promises 64 KB and sends 1 KB of it, then nothing
    sock = _connect(gateway)
    sock.sendall(_head("POST", path, {"Content-Length": 64 * 1024, "Content-Type": content_type,
                                      "Authorization": f"Bearer {secret}"}))
    sock.sendall(_multipart_preamble().ljust(1024, b"x"))

    # then it is answered 408 in OpenAI's shape and its connection closed, after the read
    # timeout; nothing of it is left: no spool, no slot, no file
    status, headers, body = _answer(sock)
    assert status == 408 and headers["connection"] == "close"
    assert _openai_error(body)["code"] == "request_timeout"
    sock.close()
    wait_until(lambda: not _spools(gateway) and _held(org) == 0, timeout=30,
               what="the abandoned request to be cleaned up")
    assert not StoredFile.objects.filter(organization=org).exists()
