"""/v1/files: JSONL files an organization uploads for batches, and the files batches write.

Content lives on disk under ``settings.FILES_DIR/<org>/<file id>`` (object storage can take
its place behind these functions); rows are scoped to the organization, so another org's
file id reads as "not found".

What one tenant may store is bounded: a number of files and their bytes per organization (its
own ``max_stored_*`` fields, else ``ORG_MAX_STORED_*``), counting the files batches wrote for
it; an upload over either is refused (400 ``file_storage_limit_exceeded``), and deleting files
frees the room. Batch output files are never refused (the lines ran and were billed), they
only count. And the disk is shared with PostgreSQL and the usage spool: an upload that would
leave less than ``FILES_DISK_RESERVE_BYTES`` free on the disk of ``FILES_DIR`` is refused
(503 ``insufficient_storage``, checked before and while it is written), so a filling disk
stops taking files before it starves them.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count, QuerySet, Sum

from billing_platform.accounts.selectors import organization_file_limits
from billing_platform.errors import InvalidRequest, NotFound, Unavailable
from billing_platform.gateway.models import FilePurpose, StoredFile

log = logging.getLogger(__name__)
# PostgreSQL advisory lock namespace ("tgfi"): one organization's uploads are counted against
# its quota and saved one at a time, so concurrent uploads cannot pass it together.
QUOTA_LOCK = 0x74676669


def file_path(file: StoredFile) -> Path:
    """Return where a file's content is stored."""
    return Path(settings.FILES_DIR) / file.storage_path


def file_open(file: StoredFile) -> IO[bytes]:
    """Open a file's content for reading; raise InvalidRequest if it is gone from storage."""
    try:
        return open(file_path(file), "rb")  # the caller's response closes it
    except FileNotFoundError:
        raise InvalidRequest(f"The content of file {file.public_id} is no longer available.",
                             param="id") from None


def incoming_dir() -> Path:
    """Return where upload bodies are spooled while they arrive (on the files disk, never in
    memory; the spools are anonymous files, so nothing is left behind)."""
    path = Path(settings.FILES_DIR) / ".incoming"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _new_path(org_public_id: str, file_id: str) -> tuple[str, Path]:
    rel = f"{org_public_id}/{file_id}.jsonl"
    path = Path(settings.FILES_DIR) / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    return rel, path


@dataclass(frozen=True)
class StorageQuota:
    """What one organization may store: files (count) and their bytes."""

    files: int
    bytes: int


def storage_quota(*, org_id: int) -> StorageQuota:
    """Return the organization's quota: its own limits, else the deployment's defaults."""
    files, size = organization_file_limits(org_id=org_id)
    return StorageQuota(files=settings.ORG_MAX_STORED_FILES if files is None else files,
                        bytes=settings.ORG_MAX_STORED_BYTES if size is None else size)


def storage_used(*, org_id: int) -> tuple[int, int]:
    """Return how many files the organization stores, and their bytes."""
    used = StoredFile.objects.filter(organization_id=org_id).aggregate(n=Count("id"),
                                                                       b=Sum("bytes"))
    return used["n"], used["b"] or 0


def _refuse_over_quota(quota: StorageQuota, *, files: int, size: int) -> None:
    """Refuse an upload that would make the organization store ``files`` files of ``size``."""
    if files > quota.files:
        raise InvalidRequest(
            f"Your organization stores {files - 1} files, its limit is {quota.files}; delete "
            "files it no longer needs (DELETE /v1/files/{file_id}) to upload more.",
            param="file", code="file_storage_limit_exceeded")
    if size > quota.bytes:
        raise InvalidRequest(
            f"This file would bring your organization's stored files to at least {size} "
            f"bytes, over its limit of {quota.bytes}; delete files it no longer needs "
            "(DELETE /v1/files/{file_id}) to upload more.",
            param="file", code="file_storage_limit_exceeded")


def disk_room_check(*, incoming: int) -> None:
    """Refuse to write ``incoming`` more bytes when that leaves less than the reserve free."""
    free = shutil.disk_usage(settings.FILES_DIR).free
    if free - incoming < settings.FILES_DISK_RESERVE_BYTES:
        log.warning("refusing a file upload: %d bytes free on the disk of %s, %d more asked, "
                    "%d kept in reserve (TOLLGATE_FILES_DISK_RESERVE_BYTES)", free,
                    settings.FILES_DIR, incoming, settings.FILES_DISK_RESERVE_BYTES)
        raise Unavailable("The platform is short of storage and cannot accept new files right "
                          "now; retry later.", code="insufficient_storage",
                          headers={"retry-after": "60"})


def file_create(*, org_id: int, org_public_id: str, project_id: int | None, purpose: str,
                filename: str, source: IO[bytes]) -> StoredFile:
    """Store an uploaded file; raise InvalidRequest unless it is a JSONL file within limits
    and the organization's quota, Unavailable when the disk is short of space."""
    if purpose != FilePurpose.BATCH:
        raise InvalidRequest(f"Invalid purpose {purpose!r}: only 'batch' files can be "
                             "uploaded here.", param="purpose")
    if not filename.endswith(".jsonl"):
        raise InvalidRequest("Batch files must be JSONL files with the .jsonl extension.",
                             param="file")
    quota = storage_quota(org_id=org_id)
    used_files, used_bytes = storage_used(org_id=org_id)
    announced = getattr(source, "size", None) or 0  # a Django upload knows its size
    _refuse_over_quota(quota, files=used_files + 1, size=used_bytes + announced)
    file = StoredFile(organization_id=org_id, project_id=project_id, purpose=purpose,
                      filename=os.path.basename(filename)[:255], bytes=0, storage_path="")
    rel, path = _new_path(org_public_id, file.public_id)
    disk_room_check(incoming=announced)
    size = lines = 0
    last = b"\n"
    try:
        with open(path, "wb") as out:
            while chunk := source.read(1 << 20):
                size += len(chunk)
                if size > settings.FILES_MAX_BYTES:
                    raise InvalidRequest(f"File is larger than the limit of "
                                         f"{settings.FILES_MAX_BYTES} bytes.", param="file")
                _refuse_over_quota(quota, files=used_files + 1, size=used_bytes + size)
                disk_room_check(incoming=len(chunk))
                lines += chunk.count(b"\n")
                last = chunk[-1:]
                out.write(chunk)
        if last != b"\n":
            lines += 1
        if lines > settings.FILES_MAX_LINES:
            raise InvalidRequest(f"File has {lines} lines; a batch file may have at most "
                                 f"{settings.FILES_MAX_LINES}.", param="file")
        if size == 0:
            raise InvalidRequest("The file is empty.", param="file")
        file.storage_path, file.bytes, file.lines = rel, size, lines
        with transaction.atomic():
            with connection.cursor() as cursor:  # concurrent uploads of one org: one at a time
                cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", [QUOTA_LOCK, org_id])
            used_files, used_bytes = storage_used(org_id=org_id)
            _refuse_over_quota(quota, files=used_files + 1, size=used_bytes + size)
            file.save()
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return file


def file_write_lines(*, org_id: int, org_public_id: str, project_id: int | None,
                     filename: str, rows: Iterable[bytes]) -> StoredFile:
    """Write a batch's output or error file (one JSON document per row)."""
    file = StoredFile(organization_id=org_id, project_id=project_id,
                      purpose=FilePurpose.BATCH_OUTPUT, filename=filename, bytes=0,
                      storage_path="")
    rel, path = _new_path(org_public_id, file.public_id)
    count = 0
    with open(path, "wb") as out:
        for row in rows:
            out.write(row)
            out.write(b"\n")
            count += 1
        out.flush()
        os.fsync(out.fileno())
    file.storage_path, file.bytes, file.lines = rel, path.stat().st_size, count
    file.save()
    return file


def files_for_org(*, org_id: int, purpose: str | None = None) -> QuerySet[StoredFile]:
    """Return the organization's files, newest first."""
    files = StoredFile.objects.filter(organization_id=org_id).order_by("-id")
    return files.filter(purpose=purpose) if purpose else files


def file_get(*, org_id: int, file_id: str) -> StoredFile:
    """Return one of the organization's files, or raise NotFound."""
    file = StoredFile.objects.filter(organization_id=org_id, public_id=file_id).first()
    if file is None:
        raise NotFound(f"No such File object: {file_id}", param="id", code="file_not_found")
    return file


def file_delete(*, file: StoredFile) -> None:
    """Delete a file's row and content (batches keep their lines; they are in PostgreSQL)."""
    path = file_path(file)
    file.delete()
    path.unlink(missing_ok=True)


def file_object(file: StoredFile) -> dict[str, Any]:
    """Return the OpenAI File object."""
    return {"id": file.public_id, "object": "file", "bytes": file.bytes,
            "created_at": int(file.created_at.timestamp()), "filename": file.filename,
            "purpose": file.purpose, "status": "processed", "status_details": None,
            "expires_at": None}


def org_files_remove(*, org_public_id: str) -> None:
    """Remove an organization's stored content (for tests and org deletion)."""
    shutil.rmtree(Path(settings.FILES_DIR) / org_public_id, ignore_errors=True)
