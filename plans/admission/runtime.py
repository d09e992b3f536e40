"""The admission the gateway calls: cached policies, batched script calls, the async API.

Why a module of its own: this is the only part of admission that holds state and does IO. It
keeps each (key, model) policy for ``POLICY_TTL_S`` and reloads it off the request path
(``_Reloading``), sends the admissions and settlements of one event-loop tick to Redis as ONE
script call (``_Batcher``: the script runs them one after the other, each as if alone), and
offers the four calls the gateway and the batch runner make: ``apolicy``, ``aadmit``,
``asettle``, ``apeek_headers``. What is decided and how it is worded is ``decision``'s.

Time is Redis's own clock (``TIME``), so gateway hosts with skewed clocks agree.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

from asgiref.sync import sync_to_async
from django.conf import settings
from redis.commands.core import AsyncScript
from redis.crc import key_slot
from redis.exceptions import NoScriptError

from billing_platform.redis_conn import (
    ClusterPipelinedConnection,
    Pipelined,
    get_aredis,
    get_pipelined,
)
from plans.admission import lease, loading, scripts
from plans.admission.decision import (
    Ticket,
    admit_op,
    budget_amounts,
    explain,
    rate_headers,
    spend_limit_error,
)
from plans.admission.policy import (
    BudgetRule,
    QuotaExceeded,
    QuotaPolicy,
    month_tag,
    rate_key,
    rule_key,
)
from plans.admission.wire import Op, evalsha
from plans.metrics import POLICY_RELOAD_FAILURES, admission_observed, timed_admission

log = logging.getLogger(__name__)

Limits = tuple[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]]
POLICY_TTL_S = settings.QUOTA_POLICY_TTL_S
# How long past its TTL a policy may still be served while its reload runs; older than that,
# a request waits for the reload (a key idle for a while gets no stale limits).
POLICY_STALE_S = 30.0
# How old a policy may still be served while its reloads fail (PostgreSQL down); past that the
# reload's error reaches the request (the gateway answers 503), as it does with nothing cached.
POLICY_OUTAGE_STALE_S = settings.QUOTA_POLICY_MAX_STALE_S  # TOLLGATE_QUOTA_POLICY_MAX_STALE_S

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Reloading(Generic[K, V]):
    """Values read from PostgreSQL, fresh for ``POLICY_TTL_S``, reloaded off the request path.

    Past its TTL a value is still served while ONE task per key reloads it, so no request
    waits for the reload (a few ms of queries) and concurrent requests do not each start one;
    a change (limits, budgets, suspension) takes effect within the TTL plus one reload. Past
    ``POLICY_STALE_S`` more, or when nothing is cached, the request waits for the reload.
    A reload that fails leaves the old value in place and is tried again by the next request.

    While reloads fail (PostgreSQL down), a value up to ``POLICY_OUTAGE_STALE_S`` old
    (``TOLLGATE_QUOTA_POLICY_MAX_STALE_S``, 300 s) is served without waiting, one reload per
    key at a time retrying; the outage is logged when it starts and when it ends, and each
    failed reload counts in ``tollgate_quota_policy_reload_failures``.
    """

    def __init__(self, load: Callable[..., V],
                 carry: Callable[[V, V], None] | None = None) -> None:
        self.load = load
        self.carry = carry  # told (old, new) when a reload replaces a value
        self.items: dict[K, tuple[float, V]] = {}
        self.loading: dict[K, asyncio.Task[V]] = {}
        self.failing_since: float | None = None

    async def get(self, key: K, **kwargs: Any) -> V:
        now = time.monotonic()
        hit = self.items.get(key)
        if hit is not None and now - hit[0] < POLICY_TTL_S:
            return hit[1]
        loop = asyncio.get_running_loop()
        task = self.loading.get(key)
        if task is None or task.get_loop() is not loop:
            task = self.loading[key] = loop.create_task(self._reload(key, kwargs))
            task.add_done_callback(self._done)
        if hit is not None and now - hit[0] < POLICY_TTL_S + (
                POLICY_STALE_S if self.failing_since is None else POLICY_OUTAGE_STALE_S):
            return hit[1]
        try:
            return await asyncio.shield(task)
        except Exception:
            if hit is not None and time.monotonic() - hit[0] < (
                    POLICY_TTL_S + POLICY_OUTAGE_STALE_S):
                return hit[1]
            raise

    async def _reload(self, key: K, kwargs: dict[str, Any]) -> V:
        started = time.monotonic()
        try:
            value = await sync_to_async(self.load, thread_sensitive=False)(**kwargs)
        finally:
            if self.loading.get(key) is asyncio.current_task():
                del self.loading[key]
        if len(self.items) > 50_000:  # keys x models seen by this process
            self.items.clear()
        old = self.items.get(key)
        self.items[key] = (started, value)
        if old is not None and self.carry is not None:
            self.carry(old[1], value)
        return value

    def _done(self, task: asyncio.Task[V]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            if self.failing_since is not None:
                log.warning("quota policy reloads succeed again after %.1f s of failures",
                            time.monotonic() - self.failing_since)
                self.failing_since = None
            return
        POLICY_RELOAD_FAILURES.inc()
        if self.failing_since is None:
            self.failing_since = time.monotonic()
            log.warning("quota policy reload failed (%r): serving cached policies up to "
                        "%.0f s old until reloads succeed", exc, POLICY_OUTAGE_STALE_S)


def _load_limits(**kwargs: int) -> Limits:
    rpm, tpm, _regions = loading.limits_of(**kwargs)
    return rpm, tpm


def _carry_lease(old: QuotaPolicy, new: QuotaPolicy) -> None:
    lease.carry(old, new, _send)


_policies: _Reloading[tuple[int, str], QuotaPolicy] = _Reloading(loading.quota_policy_load,
                                                                 _carry_lease)
_limits: _Reloading[int, Limits] = _Reloading(_load_limits)


async def apolicy(*, org_id: int, project_id: int, key_id: int, model: str) -> QuotaPolicy:
    """Return the (key, model) policy, re-read from PostgreSQL about every POLICY_TTL_S."""
    return await _policies.get((key_id, model), organization_id=org_id,
                               project_id=project_id, key_id=key_id, model=model)


class _Batcher:
    """Send the admissions and settlements of one event-loop tick as ONE script call.

    The script runs them one after the other, each exactly as it would run alone (a batch
    only shares the round trip, the command parsing and the script's start-up, which is what
    bounds decisions per second from one process); an operation that fails answers its own
    error. A request waits at most one loop iteration longer than it would alone. Operations
    come packed (``wire.Op``): a batch is their bytes joined under one ``EVALSHA`` header.
    All keys of one organization share a hash tag; a batch mixes organizations, so this
    batcher serves one Redis server; on a Redis Cluster ``_SlotBatcher`` keeps one per slot.
    """

    def __init__(self, connection: Pipelined, source: str = scripts.STEP_LUA) -> None:
        self.connection = connection
        self.source = source  # the script's Lua (bench/admission.py's floor runs a no-op)
        self.pending: list[Op] = []
        self.futures: list[asyncio.Future[Any] | None] = []  # None: nobody waits
        self.scheduled = False
        self.flushing: set[asyncio.Task[None]] = set()
        self.sha: str | None = None

    async def call(self, op: Op) -> Any:
        return await self.submit(op)

    def submit(self, op: Op) -> asyncio.Future[Any]:
        """Queue an operation; return the future of its answer."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue(loop, op, future)
        return future

    def send(self, op: Op) -> None:
        """Queue an operation nobody waits for: it runs in this process's next script call,
        before every operation queued after it; an error it meets is logged."""
        self._queue(asyncio.get_running_loop(), op, None)

    def _queue(self, loop: asyncio.AbstractEventLoop, op: Op,
               future: asyncio.Future[Any] | None) -> None:
        self.pending.append(op)
        self.futures.append(future)
        if len(self.pending) >= MAX_BATCH:
            # A full batch goes now: Redis runs it while this process prepares the next one.
            self._spawn(loop, self.pending, self.futures)
            self.pending, self.futures = [], []
        elif not self.scheduled:
            # The flush's first step runs at the next loop iteration, after every other
            # call() made in this one has joined the batch.
            self.scheduled = True
            self._spawn(loop, None, None)

    def _spawn(self, loop: asyncio.AbstractEventLoop, batch: list[Op] | None,
               futures: list[asyncio.Future[Any] | None] | None) -> None:
        task = loop.create_task(self._flush(batch, futures))
        self.flushing.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self.flushing.discard)

    async def _load(self) -> str:
        sha: str = await self.connection.execute("SCRIPT", "LOAD", self.source)
        self.sha = sha
        return sha

    async def _run(self, batch: list[Op]) -> list[Any]:
        sha = self.sha or await self._load()
        route = batch[0][0]
        results: list[Any]
        try:
            results = await self.connection.execute_packed(
                evalsha(sha.encode(), batch), "EVALSHA", route)
        except NoScriptError:
            # Redis lost its script cache (a restart): nothing ran; load it and run again.
            sha = await self._load()
            results = await self.connection.execute_packed(
                evalsha(sha.encode(), batch), "EVALSHA", route)
        return results

    async def _flush(self, batch: list[Op] | None,
                     futures: list[asyncio.Future[Any] | None] | None) -> None:
        if batch is None or futures is None:
            self.scheduled = False
            batch, futures = self.pending, self.futures
            if not batch:
                return
            self.pending, self.futures = [], []
        try:
            results = await self._run(batch)
        except Exception as exc:
            for future in futures:
                if future is not None and not future.done():
                    future.set_exception(exc)
            if None in futures:  # the reservation expires on its own; the sweep fixes spend
                log.warning("%d settlements not waited for failed: %r", futures.count(None), exc)
            return
        for future, result in zip(futures, results, strict=True):
            if future is None:
                if isinstance(result, Exception):
                    log.warning("a settlement not waited for failed: %r", result)
                continue
            if future.done():
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)


class _SlotBatcher:
    """The batcher of a Redis Cluster: one ``_Batcher`` per hash slot, so that every script
    call's KEYS lie in one slot (an operation's keys are all of one organization, which share
    its hash tag) and go to that slot's master; the batches of one tick go out together."""

    def __init__(self, connection: Pipelined, source: str = scripts.STEP_LUA) -> None:
        self.connection = connection
        self.source = source
        self.slots: dict[int, _Batcher] = {}

    def _of(self, op: Op) -> _Batcher:
        slot = key_slot(op[0].encode())
        batcher = self.slots.get(slot)
        if batcher is None:
            batcher = self.slots[slot] = _Batcher(self.connection, self.source)
            # the script is loaded on every master: a slot's first batch need not load it
            batcher.sha = next((b.sha for b in self.slots.values() if b.sha), None)
        return batcher

    async def call(self, op: Op) -> Any:
        return await self._of(op).call(op)

    def submit(self, op: Op) -> asyncio.Future[Any]:
        return self._of(op).submit(op)

    def send(self, op: Op) -> None:
        self._of(op).send(op)


# Operations per script call: big enough to share the round trip, small enough that two
# batches overlap (Redis runs one while this process answers the other).
MAX_BATCH = 32
_batchers: weakref.WeakKeyDictionary[Pipelined, _Batcher | _SlotBatcher] | None = None
_last: tuple[asyncio.AbstractEventLoop, _Batcher | _SlotBatcher] | None = None


def batcher_for(connection: Pipelined, source: str = scripts.STEP_LUA
                ) -> _Batcher | _SlotBatcher:
    """Return a new batcher of ``source`` (a script that frames its operations as STEP_LUA
    does) on ``connection``: one per slot on a cluster."""
    if isinstance(connection, ClusterPipelinedConnection):
        return _SlotBatcher(connection, source)
    return _Batcher(connection, source)


def _batcher() -> _Batcher | _SlotBatcher:
    """Return the batcher of the running loop's pipelined Redis connection (one per loop)."""
    global _batchers, _last
    loop = asyncio.get_running_loop()
    if _last is not None and _last[0] is loop:
        return _last[1]
    if _batchers is None:
        _batchers = weakref.WeakKeyDictionary()
    connection = get_pipelined()
    batcher = _batchers.get(connection)
    if batcher is None:
        batcher = _batchers[connection] = batcher_for(connection)
    _last = (loop, batcher)
    return batcher


def _send(op: Op) -> None:
    """Queue an operation nobody waits for on the running loop's batcher (a lease's
    giveback), looked up only when one is sent."""
    _batcher().send(op)


def _submit(op: Op) -> asyncio.Future[Any]:
    """Queue an operation on the running loop's batcher; return the future of its answer (a
    lease taken ahead, which no request waits for unless it needs it)."""
    return _batcher().submit(op)


async def _end_user_rule(policy: QuotaPolicy, rule: BudgetRule) -> BudgetRule:
    """Return an end user's rule with its seed: read from PostgreSQL only when Redis holds
    no spend for that end user this month (one EXISTS per request that names an end user of
    an organization with end-user budgets; the spend is then Redis's, as a budget's is)."""
    if await get_aredis().exists(rule_key(policy.org_id, rule, month_tag())):
        return rule
    return await sync_to_async(loading.end_user_seed, thread_sensitive=False)(
        organization_id=policy.org_id, rule=rule)


async def aadmit(policy: QuotaPolicy, *, request_id: str, tier: str, zone: str,
                 prompt_tokens: int, max_output: int, end_user: str | None = None) -> Ticket:
    """Admit one request or raise ``QuotaExceeded``; the returned ticket must be settled.

    ``end_user`` is the request's ``user``: an organization's per-end-user budget limits it
    as one more hard budget, in the same atomic step. A busy policy's requests are admitted
    from its lease in the process (``lease``) while it covers them."""
    worst = None  # per budget rule, when the request may come from a lease
    if lease.leasable(policy) and policy.end_user_limit(end_user) is None:
        started = time.perf_counter()
        worst = budget_amounts(policy, tier=tier, zone=zone, prompt_tokens=prompt_tokens,
                               cached_tokens=0, completion_tokens=max_output, worst=True)
        ticket = lease.take(policy, request_id, tier, zone, prompt_tokens + max_output, worst,
                            _submit, _send)
        if ticket is not None:
            admission_observed("leased", time.perf_counter() - started)
            return ticket
    return await _admit(policy, request_id=request_id, tier=tier, zone=zone,
                        prompt_tokens=prompt_tokens, max_output=max_output, end_user=end_user,
                        worst=worst)


@timed_admission
async def _admit(policy: QuotaPolicy, *, request_id: str, tier: str, zone: str,
                 prompt_tokens: int, max_output: int, end_user: str | None,
                 worst: list[int] | None) -> Ticket:
    """Admit a request its policy's lease did not: from a new lease (``worst`` given: the
    policy may lease), or in Redis alone."""
    own_rule = policy.end_user_limit(end_user)
    if own_rule is not None:
        policy = policy.with_rule(await _end_user_rule(policy, own_rule))
    for rule in policy.budgets:
        if rule.suspended:
            raise spend_limit_error(rule, {"retry-after": "60"})
    if policy.plan_exhausted:
        raise QuotaExceeded(f"Your token plan's credits are exhausted: "
                            f"{policy.plan_exhausted}. Buy a credit pack or wait.",
                            code="plan_quota_exhausted", headers={"retry-after": "60"})
    batcher = _batcher()
    if worst is not None:
        ticket = await lease.acquire(policy, request_id, tier, zone, prompt_tokens + max_output,
                                     worst, batcher.submit, _send)
        if ticket is not None:
            return ticket
    op, month, norm = admit_op(policy, request_id=request_id, tier=tier, zone=zone,
                               prompt_tokens=prompt_tokens, max_output=max_output)
    raw = await batcher.call(op)
    if raw[0] != 1:
        raise explain(policy, raw[1], raw[4:10], int(raw[2]),
                      estimate=prompt_tokens + max_output)
    return Ticket(policy, request_id, tier, zone, prompt_tokens + max_output, norm, raw[3],
                  raw[4:10], month, raw[10], raw[11])


async def asettle(ticket: Ticket, *, prompt_tokens: int = 0, cached_tokens: int = 0,
                  completion_tokens: int = 0, wait: bool = True) -> None:
    """Replace the ticket's reservation with the actual tokens and cost (once).

    With ``wait=False`` it returns at once, without a round trip of its own: the settlement
    runs in this process's next script call (with the next admissions), before any admission
    made after it; an error is logged, not raised (what the gateway does with one anyway)."""
    if ticket.settled:
        return
    ticket.settled = True
    if ticket.lease is not None:  # settled in the process (``lease``)
        ticket.lease.settle(ticket, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                            completion_tokens=completion_tokens, send=_send)
        return
    op = ticket.settle_op(prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                          completion_tokens=completion_tokens)
    if wait:
        await _batcher().call(op)
    else:
        _batcher().send(op)


async def aclose_leases() -> int:
    """Give back every quota lease this process holds (the web process's shutdown)."""
    return await lease.aclose(_batcher().submit)


# --- read-only state for answers that were not admitted ------------------------------------

_peek_script: AsyncScript | None = None


async def alimits(*, org_id: int, project_id: int, key_id: int) -> Limits:
    """Return the key's (rpm, tpm) limits per scope, from a cached policy or PostgreSQL."""
    return await _limits.get(key_id, organization_id=org_id, project_id=project_id,
                             key_id=key_id)


async def apeek_headers(*, org_id: int, project_id: int, key_id: int) -> dict[str, str]:
    """Return the key's ``x-ratelimit-*`` headers now, consuming nothing."""
    global _peek_script
    rpm, tpm = await alimits(org_id=org_id, project_id=project_id, key_id=key_id)
    client = get_aredis()
    if _peek_script is None:
        _peek_script = client.register_script(scripts.PEEK_LUA)
    rpm_of, tpm_of = dict(rpm), dict(tpm)
    scopes = list(rpm_of) + [s for s in tpm_of if s not in rpm_of]
    keys = [rate_key(org_id, s) for s in scopes]
    argv = [v for s in scopes for v in (rpm_of.get(s, -1), tpm_of.get(s, -1))]
    raw = await _peek_script(keys=keys, args=argv, client=client)
    return rate_headers(raw)
