"""/v1/files: JSONL files an organization uploads for batches, and the files batches write.

Content lives on disk under ``settings.FILES_DIR/<org>/<file id>`` (object storage can take
its place behind these functions); rows are scoped to the organization, so another org's
file id reads as "not found".
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from django.conf import settings
from django.db.models import QuerySet

from billing_platform.gateway.errors import GatewayError, invalid
from billing_platform.gateway.models import FilePurpose, StoredFile


def file_path(file: StoredFile) -> Path:
    """Return where a file's content is stored."""
    return Path(settings.FILES_DIR) / file.storage_path


def file_open(file: StoredFile) -> IO[bytes]:
    """Open a file's content for reading; a 400 GatewayError if it is gone from storage."""
    try:
        return open(file_path(file), "rb")  # the caller's response closes it
    except FileNotFoundError:
        raise invalid(f"The content of file {file.public_id} is no longer available.",
                      param="id") from None


def _new_path(org_public_id: str, file_id: str) -> tuple[str, Path]:
    rel = f"{org_public_id}/{file_id}.jsonl"
    path = Path(settings.FILES_DIR) / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    return rel, path


def file_create(*, org_id: int, org_public_id: str, project_id: int | None, purpose: str,
                filename: str, source: IO[bytes]) -> StoredFile:
    """Store an uploaded file; raise GatewayError if it is not a JSONL file within the limits."""
    if purpose != FilePurpose.BATCH:
        raise invalid(f"Invalid purpose {purpose!r}: only 'batch' files can be uploaded here.",
                      param="purpose")
    if not filename.endswith(".jsonl"):
        raise invalid("Batch files must be JSONL files with the .jsonl extension.",
                      param="file")
    file = StoredFile(organization_id=org_id, project_id=project_id, purpose=purpose,
                      filename=os.path.basename(filename)[:255], bytes=0, storage_path="")
    rel, path = _new_path(org_public_id, file.public_id)
    size = lines = 0
    last = b"\n"
    try:
        with open(path, "wb") as out:
            while chunk := source.read(1 << 20):
                size += len(chunk)
                if size > settings.FILES_MAX_BYTES:
                    raise invalid(f"File is larger than the limit of "
                                  f"{settings.FILES_MAX_BYTES} bytes.", param="file")
                lines += chunk.count(b"\n")
                last = chunk[-1:]
                out.write(chunk)
        if last != b"\n":
            lines += 1
        if lines > settings.FILES_MAX_LINES:
            raise invalid(f"File has {lines} lines; a batch file may have at most "
                          f"{settings.FILES_MAX_LINES}.", param="file")
        if size == 0:
            raise invalid("The file is empty.", param="file")
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    file.storage_path, file.bytes, file.lines = rel, size, lines
    file.save()
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
    """Return one of the organization's files, or raise a 404 GatewayError."""
    file = StoredFile.objects.filter(organization_id=org_id, public_id=file_id).first()
    if file is None:
        raise GatewayError(404, f"No such File object: {file_id}", param="id",
                           code="file_not_found")
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
