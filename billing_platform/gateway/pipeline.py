"""The one request pipeline: the rules every inference request passes, interactive or batch.

Whatever wire shape a request came in (chat, completions, embeddings; Responses and Messages
ride on chat) and whoever sends it (``services.serve`` for /v1, the batch runner for
a batch line), the same rules decide where it runs, how much it may generate and what it may
spend, and they are written only here:

- placement: the model exists, the key may use it, it is offered in the caller's data zone and
  has a price in force, and the key's and project's residency narrowing leaves a region that
  serves it; otherwise ``model_not_found``, in the same words whatever the reason; and it is
  the kind the endpoint needs (an embedding model for embeddings, a generating one otherwise:
  ``unsupported_model``, said only once the caller may see the model at all);
- the output bound: ONE number per request, what the client asked or
  ``TOLLGATE_DEFAULT_MAX_TOKENS``; the engine is sent it and admission reserves it;
- admission: one atomic reservation under the caller's quota policy, narrowed per tier;
- the engine call: the tier's scheduling priority, the organization's own cache namespace,
  only the placement's regions;
- settlement: the engine's counts charged, the rest of the reservation returned;
- Redis down: with a hard budget nothing runs (``quota_unavailable``, retry shortly), without
  one the request runs unadmitted (logged), since budgets are raised from PostgreSQL later.

The gateway and the runner had a copy each, and the copies drifted: the runner hard-coded a
4096-token output bound where the gateway read the setting, and a narrowing with nothing left
was a 404 on /v1 but an empty region set in the runner (a batch that could never run, found
out only at its expiry). Errors here are domain errors (``billing_platform.errors``); each
surface maps them.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from django.conf import settings
from redis.exceptions import RedisError

from billing_platform.accounts.selectors import KeyPrincipal
from billing_platform.errors import (
    DomainError,
    InvalidRequest,
    NotFound,
    Unavailable,
    UpstreamFailed,
)
from engine_adapter.client import EngineCall, EngineClient
from engine_adapter.registry import get_fleet
from engine_adapter.router import Router
from engine_adapter.types import (
    CallResult,
    EngineBadRequest,
    EngineError,
    ModelNotServed,
    NoCapacity,
)
from plans import admission as quota

if TYPE_CHECKING:
    from billing_platform.gateway.validation import InferenceRequest

log = logging.getLogger(__name__)

# SGLang with --enable-priority-scheduling runs larger priority values first; batch lines sit
# below flex, the lowest of all, so interactive traffic always has the engines first. A
# request admitted on its organization's reservation ("provisioned", whatever its tier) runs
# above the priority tier: a reservation is capacity bought ahead, the priority tier a premium
# on shared capacity (downgraded when the pool is saturated), as Azure's PTU traffic runs
# ahead of pay-as-you-go; its spillover runs at its tier's priority (``engine_priority``).
ENGINE_PRIORITY = {"provisioned": 20, "priority": 10, "default": 0, "flex": -10, "batch": -20}
# The engine endpoint of each request kind.
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions",
         "embedding": "/v1/embeddings"}
TOKENIZE_PATH = "/v1/tokenize"  # SGLang's: a prompt or chat messages, counted by the model


@dataclass(frozen=True)
class Placement:
    """Where a caller's request for one model may run, and the quota policy it falls under.

    ``regions`` None means any region (a global zone with no narrowing); it is never empty.
    """

    regions: set[str] | None
    policy: quota.QuotaPolicy


def model_not_found(model: str) -> NotFound:
    """Return the one answer for a model this caller cannot use, whatever the reason.

    A model that does not exist, one the key may not use and one that is offered only in
    other data zones or regions get the same words: the answer says nothing about where else
    a model runs.
    """
    return NotFound(f"The model '{model}' does not exist or you do not have access to it.",
                    code="model_not_found", param="model")


async def placement_resolve(*, principal: KeyPrincipal, model: str, kind: str) -> Placement:
    """Return where the caller's request for ``model`` may run and its policy, or raise NotFound.

    NotFound for a model that does not exist, that the key may not use, that is offered only
    in other zones or outside the key's and project's regions (all in the same words), or that
    has no price in force. A model offered there whose engines are all down is not refused
    here: the engine call answers a retryable 503, and nothing runs outside the placement.

    ``kind`` is the request's (``PATHS``): an embedding model serves only embeddings.

    Nothing is served that cannot be billed: rating needs a price for every event (on demand,
    token plan and provisioned alike), so an unpriced model's events would be dead-lettered
    and its worst case would reserve nothing. A price of zero is a price. The policy is the
    cached one (``quota.apolicy``): this adds no query to a request.
    """
    fleet = get_fleet()
    await fleet.arefresh_if_stale()
    served = fleet.router.regions_of(model)
    if not served or not principal.may_use_model(model):
        raise model_not_found(model)
    regions = fleet.regions_in_zone(principal.data_zone)
    if regions is not None and not served & regions:
        raise model_not_found(model)
    policy = await quota.apolicy(org_id=principal.org_id, project_id=principal.project_id,
                                 key_id=principal.key_id, model=model)
    if policy.pricing is None:
        raise NotFound(f"The model '{model}' has no price in force for your organization, so "
                       "it cannot be served.", code="model_not_found", param="model")
    if policy.allowed_regions is not None:  # the key's/project's residency narrowing
        regions = set(policy.allowed_regions) if regions is None else (
            regions & policy.allowed_regions)
        if not served & regions:
            raise model_not_found(model)
    embedding = fleet.router.traits(model).embedding
    if embedding != (kind == "embedding"):
        raise NotFound(
            f"The model '{model}' is an embedding model: call POST /v1/embeddings with it."
            if embedding else
            f"The model '{model}' does not create embeddings; use an embedding model (GET "
            "/v1/models lists each model's endpoints).", code="unsupported_model",
            param="model")
    return Placement(regions=regions, policy=policy)


def request_check(req: InferenceRequest, router: Router) -> None:
    """Refuse, once the request is placed, what the model's engines cannot read: token-id
    input, when the fleet does not know the model's vocabulary (SGLang does not check ids,
    and one past the vocabulary fails the engine), else ids at or past it. Every surface
    calls it (``services.serve``, the batch runner's lines)."""
    arrays = req.engine_body.get("input") if req.kind == "embedding" else None
    if not arrays or isinstance(arrays[0], str):
        return
    vocab_size = router.traits(req.model).vocab_size
    if vocab_size is None:
        raise InvalidRequest(f"The model '{req.model}' takes text input only here: send "
                             "'input' as strings.", param="input")
    for i, ids in enumerate(arrays):
        if max(ids) >= vocab_size:
            raise InvalidRequest(f"'input[{i}]' has token id {max(ids)}; the model's "
                                 f"vocabulary has {vocab_size} (ids 0 to {vocab_size - 1}).",
                                 param=f"input[{i}]")


def output_bound(asked: int | None) -> int:
    """Return a request's output bound: what the client asked, else the deployment's default.

    The engine is sent exactly this number and admission reserves it, so no request (a batch
    line included) can generate past what it reserved.
    """
    return settings.GATEWAY_DEFAULT_MAX_TOKENS if asked is None else asked


def admission_policy(policy: quota.QuotaPolicy, *, tier: str, regions: set[str] | None
                     ) -> quota.QuotaPolicy | None:
    """Return the policy a request at ``tier`` is admitted under; None: nothing to admit.

    A provisioned reservation serves only requests that may run in its region. Batch runs on
    spare shared capacity: never on a reservation, and outside the organization's RPM/TPM,
    which are for interactive traffic (as OpenAI's batch limits are separate); budgets and
    token plans still apply, and a batch held back by neither skips admission altogether.
    """
    if tier == "batch":
        policy = replace(policy, provisioned=None, rpm=(), tpm=())
        if not (policy.budgets or policy.window or policy.plan_exhausted
                or policy.end_users):
            return None
        return policy
    if policy.provisioned is not None and regions is not None and (
            policy.provisioned.region not in regions):
        return replace(policy, provisioned=None)
    return policy


async def request_admit(policy: quota.QuotaPolicy | None, *, principal: KeyPrincipal,
                        req: InferenceRequest, tier: str, request_id: str
                        ) -> quota.Ticket | None:
    """Reserve the request's worst case (its prompt and output bounds) in one atomic step.

    Return the ticket to settle, or None when nothing was admitted: no policy, or Redis down
    and no hard budget. Raise ``QuotaExceeded`` (a 429 with OpenAI's code and the rate-limit
    headers), or ``Unavailable`` when Redis is down and a hard budget could be overrun.
    """
    if policy is None:
        return None
    try:
        return await quota.aadmit(policy, request_id=request_id, tier=tier,
                                  zone=principal.data_zone, prompt_tokens=req.prompt_bound,
                                  max_output=req.max_output, end_user=req.user)
    except RedisError as exc:
        if any(b.hard for b in policy.budgets) or policy.end_user_limit(req.user):
            raise Unavailable("Quota enforcement is unavailable, and this organization has a "
                              "hard budget; retry shortly.", code="quota_unavailable",
                              headers={"retry-after": "1"}) from exc
        log.warning("admission skipped for %s: Redis unavailable (%r)", request_id, exc)
        return None


def engine_regions(placement: Placement, ticket: quota.Ticket | None) -> set[str] | None:
    """Return the regions the engine call may use: a provisioned admission runs on its
    reservation's region, anything else anywhere in the placement."""
    provisioned = placement.policy.provisioned
    if ticket is not None and ticket.capacity == "provisioned" and provisioned is not None:
        return {provisioned.region}
    return placement.regions


def engine_priority(tier: str, ticket: quota.Ticket | None) -> int:
    """Return the engine priority of a request: its reservation's when admitted on one."""
    provisioned = ticket is not None and ticket.capacity == "provisioned"
    return ENGINE_PRIORITY["provisioned" if provisioned else tier]


def engine_call(client: EngineClient, *, principal: KeyPrincipal, req: InferenceRequest,
                regions: set[str] | None, tier: str, request_id: str,
                ticket: quota.Ticket | None = None) -> EngineCall:
    """Return the (not yet started) engine call of a request.

    The organization's own cache namespace keeps prefix reuse inside one tenant; ``regions``
    bound where it may run (the router fails closed outside them).
    """
    return client.call(model=req.model, path=PATHS[req.kind], body=req.engine_body,
                       namespace=principal.org_public_id, prompt_text=req.prompt_text,
                       allowed_regions=regions, priority=engine_priority(tier, ticket),
                       request_id=request_id)


async def request_settle(ticket: quota.Ticket | None, result: CallResult | None) -> None:
    """Charge the engine's counts to the admission and return the rest (all of it when
    ``result`` is None: nothing was generated). Safe to call twice; never cancelled halfway."""
    if ticket is None or ticket.settled:
        return
    try:
        await asyncio.shield(quota.asettle(
            ticket, prompt_tokens=result.prompt_tokens if result else 0,
            cached_tokens=result.cached_tokens if result else 0,
            completion_tokens=result.completion_tokens if result else 0))
    except RedisError as exc:
        # The reservation expires on its own; the sweep raises spend to PostgreSQL's.
        log.warning("settlement of %s failed: %r", ticket.request_id, exc)


def refusal(exc: EngineBadRequest, req: InferenceRequest) -> tuple[str, str | None]:
    """Return the message and param of an engine's refusal of ``req`` for its caller.

    The engine's own words, except where they name what is the deployment's business: SGLang
    refuses ``dimensions`` naming the model's path on disk.
    """
    if req.kind == "embedding" and "dimensions" in req.engine_body and (
            "dimension" in str(exc) or "matryoshka" in str(exc)):
        return (f"The model '{req.model}' cannot return embeddings of "
                f"{req.engine_body['dimensions']} dimensions (it does not shorten its vectors, "
                "or not to that length); leave out 'dimensions' or ask for fewer.",
                "dimensions")
    return str(exc), exc.param


def engine_failure(exc: EngineError, *, req: InferenceRequest,
                   headers: dict[str, str] | None = None) -> DomainError:
    """Return the domain error of an engine call for ``req`` that failed before any output."""
    message = str(exc)
    if isinstance(exc, EngineBadRequest):
        message, param = refusal(exc, req)
        return InvalidRequest(message, code=exc.code, param=param, headers=headers)
    if isinstance(exc, ModelNotServed):
        return NotFound(message, code=exc.code, headers=headers)
    if isinstance(exc, NoCapacity):
        return Unavailable(message, code=exc.code, headers=headers)
    return UpstreamFailed(message, status=exc.status, code=exc.code,
                          param=getattr(exc, "param", None), headers=headers)
