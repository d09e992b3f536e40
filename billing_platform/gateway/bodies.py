"""Bodies on /v1 that never sit whole in memory, whatever a client sends or stops reading.

A request's body is read only when its view's decorator asks (``GatewayRequest.aread_body``,
after the bearer key, scope and in-flight slot were checked on the headers alone), so an
unknown caller's body is never read at all. It is read under the route's limit, enforced as
it arrives (413 as soon as a promised ``Content-Length`` or the bytes received pass it): into
memory for JSON routes (``GATEWAY_MAX_BODY_BYTES``), or, for ``POST /v1/files``, spooled to an
anonymous file on the files disk (``files.incoming_dir``; nothing is left behind, even if the
process dies) that Django's multipart parser then reads, writing the uploaded file beside it.
A client that sends nothing for ``GATEWAY_BODY_READ_TIMEOUT_S`` between two reads is answered
408 (as nginx's ``client_body_timeout``); one that goes away raises ``ClientGone``.

A request collects what must happen when it ends, however it ends (``on_close``: the engine
call of a stream, the organization's in-flight slot, an open download); ``gateway/asgi.py``
runs them once the response was sent, or the client went, or the send timed out.

``file_response`` streams a file's content in ``CHUNK_BYTES`` pieces read off the event loop:
Django's ``FileResponse`` served asynchronously reads the whole file into a list first.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import IO, Any

from django.conf import settings
from django.core.files.uploadedfile import UploadedFile
from django.core.files.uploadhandler import FileUploadHandler
from django.core.handlers.asgi import ASGIRequest
from django.http import StreamingHttpResponse

from billing_platform.errors import PayloadTooLarge, Unavailable
from billing_platform.gateway.batch import files
from billing_platform.gateway.errors import RequestTimeout

log = logging.getLogger(__name__)
CHUNK_BYTES = 64 * 1024  # a download is read and sent in pieces of this size
# File reads and writes of request and response bodies: off the event loop, and off the
# default executor, whose jobs are wrapped in database connection checks they do not need.
_FILE_IO = ThreadPoolExecutor(max_workers=4, thread_name_prefix="gateway-file-io")


class ClientGone(Exception):
    """The client disconnected before its request body was read to its end."""


async def _in_file_thread(fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(_FILE_IO, fn, *args)


def _new_spool(incoming: int = 0) -> IO[bytes]:
    # Anonymous (O_TMPFILE where the filesystem has it): gone when closed or the process dies.
    directory = files.incoming_dir()
    files.disk_room_check(incoming=incoming)
    return tempfile.TemporaryFile(prefix="upload-", dir=directory)


def _spool_write(spool: IO[bytes], chunk: bytes) -> None:
    files.disk_room_check(incoming=len(chunk))
    try:
        spool.write(chunk)
    except OSError as exc:  # the disk filled up under us
        log.warning("spooling an upload failed: %r", exc)
        raise Unavailable("The platform is short of storage and cannot accept new files "
                          "right now; retry later.", code="insufficient_storage",
                          headers={"retry-after": "60"}) from exc


class _DiskUploadHandler(FileUploadHandler):
    """Write every file of a multipart body to an anonymous file on the files disk (Django's
    default handlers keep files under 2.5 MB in memory and put larger ones in /tmp)."""

    def new_file(self, *args: Any, **kwargs: Any) -> None:
        super().new_file(*args, **kwargs)
        self.file = UploadedFile(_new_spool(),
                                 name=self.file_name, content_type=self.content_type, size=0,
                                 charset=self.charset,
                                 content_type_extra=self.content_type_extra)

    def receive_data_chunk(self, raw_data: bytes, start: int) -> None:
        self.file.write(raw_data)

    def file_complete(self, file_size: int) -> UploadedFile:
        self.file.seek(0)
        self.file.size = file_size
        return self.file


class GatewayRequest(ASGIRequest):
    """A /v1 request whose body is read only when ``aread_body`` is awaited."""

    def __init__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict]]) -> None:
        super().__init__(scope, io.BytesIO())
        self._receive = receive
        self._closers: list[Callable[[], Awaitable[None]]] = []
        self.body_limit = settings.GATEWAY_MAX_BODY_BYTES
        self.body_spooled = False
        # True once the body is read to its end (or none was promised): only then may the
        # connection serve another request, and may the response watch ``receive``.
        self.body_complete = not (int(self.META.get("CONTENT_LENGTH") or 0) > 0
                                  or "chunked" in self.META.get("HTTP_TRANSFER_ENCODING", ""))

    def spool_body(self, *, limit: int) -> None:
        """Spool this request's body to the files disk, up to ``limit`` bytes."""
        self.body_limit, self.body_spooled = limit, True
        self.upload_handlers = [_DiskUploadHandler(self)]

    def on_close(self, closer: Callable[[], Awaitable[None]]) -> None:
        """Run ``closer`` when the request ends, however it ends (last registered, first run)."""
        self._closers.append(closer)

    async def aclose(self) -> None:
        """Run the closers, then close the body's files (spool and parsed uploads)."""
        while self._closers:
            closer = self._closers.pop()
            try:
                await closer()
            except Exception:
                log.exception("closing %s %s", self.method, self.path)
        self.close()  # Django's: the files of a parsed multipart body
        self._stream.close()

    def _too_large(self, size: int | str) -> PayloadTooLarge:
        return PayloadTooLarge(f"Request body of {size} bytes exceeds the limit of "
                               f"{self.body_limit} bytes.")

    async def aread_body(self) -> None:
        """Read the body under the limit; raise PayloadTooLarge, RequestTimeout, ClientGone."""
        if self.body_complete:
            return
        announced = int(self.META.get("CONTENT_LENGTH") or 0)
        if announced > self.body_limit:
            raise self._too_large(announced)  # said up front: not a byte read
        if self.body_spooled:
            sink: IO[bytes] = await _in_file_thread(_new_spool, announced)
        else:
            sink = io.BytesIO()
        self._stream = sink  # closed by aclose, whatever happens next
        size = 0
        timeout = settings.GATEWAY_BODY_READ_TIMEOUT_S
        while True:
            try:
                async with asyncio.timeout(timeout):
                    message = await self._receive()
            except TimeoutError:
                raise RequestTimeout(f"The request body was not received in time: nothing "
                                     f"arrived for {timeout:g} s after {size} bytes.") from None
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.body_limit:
                raise self._too_large(f"more than {size}")
            if chunk and self.body_spooled:
                await _in_file_thread(_spool_write, sink, chunk)
            elif chunk:
                sink.write(chunk)
            if not message.get("more_body"):
                break
        sink.seek(0)
        self.META["CONTENT_LENGTH"] = str(size)  # also a chunked body's, for the parsers
        self.body_complete = True


async def _file_chunks(content: IO[bytes]) -> AsyncIterator[bytes]:
    while chunk := await _in_file_thread(content.read, CHUNK_BYTES):
        yield chunk


async def file_response(request: GatewayRequest, open_file: Callable[[], IO[bytes]], *,
                        content_type: str) -> StreamingHttpResponse:
    """Return a response streaming the file ``open_file`` opens, in CHUNK_BYTES pieces read
    off the event loop (closed when the request ends, however it ends)."""
    content = await _in_file_thread(open_file)
    request.on_close(partial(_in_file_thread, content.close))
    response = StreamingHttpResponse(_file_chunks(content), content_type=content_type)
    response["Content-Length"] = str(os.fstat(content.fileno()).st_size)
    return response
