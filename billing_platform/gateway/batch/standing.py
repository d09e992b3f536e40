"""Whether a running batch may still run, and under what: re-read at every slice and heartbeat.

A batch runs for hours after its key authenticated. A /v1 request is refused the moment its
key is revoked or expires, its organization is suspended (dunning, staff) or closed, or its
model leaves what the organization's data zone and the key's and project's residency narrowing
allow; a batch is held to the same rules, read afresh from PostgreSQL (never the principal
stored at creation) at the start of each slice and once per heartbeat while it runs. When any
of them no longer allows it the runner stops: lines in flight finish and are kept (they were
sent while it was allowed), the rest are not run, and the batch ends ``failed`` with the reason
in its ``errors`` (``services.batch_fail``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async

from billing_platform.accounts.choices import OrgStatus
from billing_platform.accounts.selectors import KeyPrincipal, api_key_principal
from billing_platform.errors import NotFound
from billing_platform.gateway import pipeline
from billing_platform.gateway.batch.validation import ENDPOINTS
from billing_platform.gateway.models import Batch
from plans import admission as quota

ORG_STATUS_CODES = {OrgStatus.SUSPENDED: "organization_suspended",
                    OrgStatus.CLOSED: "organization_closed"}


@dataclass(frozen=True)
class Standing:
    """What a batch's lines run under now: its key as it stands, the regions its model may
    run in (None: any), and the policy lines are admitted under (None: nothing to admit)."""

    principal: KeyPrincipal
    regions: set[str] | None
    policy: quota.QuotaPolicy | None


def _stop(code: str, message: str) -> dict[str, Any]:
    """Return a batch-level error entry in OpenAI's shape (no line: the batch as a whole)."""
    return {"code": code, "message": f"The batch was stopped: {message} Lines not yet run "
            "were not run and are not billed.", "param": None, "line": None}


async def batch_standing(batch: Batch) -> Standing | dict[str, Any]:
    """Return what ``batch``'s lines may run under now, or the error entry that stops it."""
    key_id = KeyPrincipal.from_json(batch.principal).key_id
    principal = await sync_to_async(api_key_principal)(key_id=key_id)
    if principal is None or principal.revoked:
        return _stop("api_key_revoked", "the API key that created it was revoked.")
    if principal.expires_at is not None and principal.expires_at <= time.time():
        return _stop("api_key_expired", "the API key that created it expired.")
    if principal.org_status != OrgStatus.ACTIVE:
        return _stop(ORG_STATUS_CODES.get(principal.org_status, "organization_inactive"),
                     f"the organization is {principal.org_status}.")
    try:
        placement = await pipeline.placement_resolve(principal=principal, model=batch.model,
                                                     kind=ENDPOINTS[batch.endpoint].kind)
    except NotFound as exc:  # the data zone, a residency narrowing, the key's models, a price
        return _stop(exc.code, exc.message)
    return Standing(principal=principal, regions=placement.regions,
                    policy=pipeline.admission_policy(placement.policy, tier="batch",
                                                     regions=placement.regions))
