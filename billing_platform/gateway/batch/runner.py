"""Run a batch's lines through the fleet in the troughs.

One run is a time slice of one Celery task: it asks the engine adapter how much spare room the
model's engines have (scraped live) and the guard (``guard.py``) how much of it batch may take
now (most of it on an idle fleet, a floor while interactive TTFT says batch costs it), sends
that many lines at the lowest SGLang priority, and asks again as they finish; outcomes are
recorded in groups. With no spare room it sends nothing and waits; interactive traffic always
has the engines first.

Each line passes the same request pipeline as a /v1 request (``gateway/pipeline.py``: placement,
output bound, admission at the batch tier, the engine call, settlement, the Redis-down rule);
only what becomes of the answer (a line outcome, not a response) is the runner's own. What the
lines run under (the key, its organization, the placement) is read afresh once per heartbeat
(``standing.py``): when it no longer allows the batch, no further line starts and the batch
ends ``failed``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection
from redis.exceptions import RedisError

from billing_platform.accounts.selectors import KeyPrincipal
from billing_platform.errors import InvalidRequest, Unavailable
from billing_platform.gateway import capacity, pipeline, ttft_signal
from billing_platform.gateway.batch import services as batch_services
from billing_platform.gateway.batch.guard import HostCpu, Scavenger, batch_share, scavenger_for
from billing_platform.gateway.batch.services import MAX_ATTEMPTS, LineOutcome
from billing_platform.gateway.batch.standing import Standing, batch_standing
from billing_platform.gateway.batch.validation import ENDPOINTS, LineRequest
from billing_platform.gateway.models import Batch, BatchLine, BatchStatus, LineState
from billing_platform.gateway.services import usage_event
from engine_adapter.registry import Fleet
from engine_adapter.types import EngineBadRequest, EngineError, EngineInfo, NoCapacity
from plans import admission as quota

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.2
HEARTBEAT_S = 1.0  # how often a runner reads the batch's status (cancel) and says it is alive
RECORD_EVERY = 64  # outcomes written per transaction, at most
WRITE_AFTER_S = 1.0  # ...or once the oldest unwritten outcome is this old
PROBE_EVERY_S = 0.2  # how often the engines' load is scraped while a batch runs
SEND_GRACE_S = 0.01  # probe no sooner than this after starting lines (they must reach engines)
# Admission answers that end the batch: the remaining lines go to the error file unbilled.
STOP_CODES = {"organization_spend_limit_exceeded", "project_spend_limit_exceeded",
              "plan_quota_exhausted"}
# ...and those that fail only their line (its end user's budget is spent; others' are not).
LINE_CODES = {"end_user_spend_limit_exceeded"}


async def _admit(policy: quota.QuotaPolicy, principal: KeyPrincipal, req, line: BatchLine
                 ) -> tuple[quota.Ticket | None, LineOutcome | None]:
    """Reserve the line's worst case through the pipeline; say what a refusal does to it.

    The bounds are the validated body's, as on /v1: the output bound is the one the engine is
    sent (``req.engine_body``), so a line cannot generate past what it reserved.
    """
    try:
        ticket = await pipeline.request_admit(policy, principal=principal, req=req,
                                              tier="batch", request_id=line.request_id)
    except quota.QuotaExceeded as exc:
        if exc.code not in STOP_CODES and exc.code not in LINE_CODES:
            return None, LineOutcome(line.id, retry=True)  # rate limits: later
        error = {"message": exc.message, "type": "rate_limit_error", "param": None,
                 "code": exc.code}
        return None, LineOutcome(line.id, state=LineState.FAILED, status_code=429,
                                 response={"error": error}, stop=exc.code in STOP_CODES,
                                 error={"code": exc.code, "message": exc.message})
    except Unavailable:
        return None, LineOutcome(line.id, retry=True)  # never run past a hard budget
    return ticket, None


def _refused(line: BatchLine, message: str, *, param: str | None, code: str) -> LineOutcome:
    """A line the engine cannot run as written: failed with a 400, nothing billed."""
    error = {"message": message, "type": "invalid_request_error", "param": param,
             "code": code}
    return LineOutcome(line.id, state=LineState.FAILED, status_code=400,
                       response={"error": error}, error={"code": code, "message": message})


async def _run_line(line: BatchLine, *, fleet: Fleet, batch: Batch, principal: KeyPrincipal,
                    regions: set[str] | None, policy: quota.QuotaPolicy | None = None
                    ) -> LineOutcome:
    line_req = ENDPOINTS[batch.endpoint].parse(line.body)
    req = line_req.req
    try:
        pipeline.request_check(req, fleet.router)
    except InvalidRequest as exc:
        return _refused(line, exc.message, param=exc.param, code=exc.code)
    ticket = None
    if policy is not None:
        ticket, refused = await _admit(policy, principal, req, line)
        if refused is not None:
            return refused
    try:
        return await _send(line, line_req=line_req, fleet=fleet, batch=batch,
                           principal=principal, regions=regions, ticket=ticket)
    finally:
        await pipeline.request_settle(ticket, None)  # no-op once _send settled


async def _send(line: BatchLine, *, line_req: LineRequest, fleet: Fleet, batch: Batch,
                principal: KeyPrincipal, regions: set[str] | None, ticket: quota.Ticket | None
                ) -> LineOutcome:
    req = line_req.req
    started = datetime.now(tz=UTC)
    call = pipeline.engine_call(fleet.client, principal=principal, req=req, regions=regions,
                                tier="batch", request_id=line.request_id)
    try:
        async with call:
            pass
    except NoCapacity:
        return LineOutcome(line.id, retry=True)
    except EngineBadRequest as exc:
        message, param = pipeline.refusal(exc, req)
        return _refused(line, message, param=param, code=exc.code)
    except EngineError as exc:
        if line.attempts < MAX_ATTEMPTS:
            return LineOutcome(line.id, retry=True)
        return LineOutcome(line.id, state=LineState.FAILED, status_code=exc.status,
                           response={"error": {"message": str(exc), "type": "server_error",
                                               "param": None, "code": exc.code}},
                           error={"code": exc.code, "message": str(exc)})
    result = call.result
    await pipeline.request_settle(ticket, result)
    if result is None or result.status != "ok":
        if line.attempts < MAX_ATTEMPTS:
            return LineOutcome(line.id, retry=True)
        message = (result.error if result else None) or "the engine failed"
        return LineOutcome(line.id, state=LineState.FAILED, status_code=502,
                           error={"code": "engine_error", "message": message})
    surface = line_req.surface(principal=principal, request_id=line.request_id)
    # ids as /v1 words them; the service tier as OpenAI's batch output says it ("default":
    # batch is how the line is run and billed, not a tier a request names, and the SDKs'
    # types know no other)
    body = surface.body(call, req, line.request_id[4:], "default")
    await surface.persist()  # a Response line with ``store`` (the default): retrievable
    event = usage_event(principal=principal, request_id=line.request_id, model=req.model,
                        tier="batch", engine=call.tried[-1], result=result, started=started,
                        user=req.user)
    event["batch_id"] = batch.public_id
    return LineOutcome(line.id, status_code=200, response=body, usage=event)


def _close_db() -> None:
    connection.close()


async def _run(batch_id: int, *, slice_s: float) -> str:
    """Run lines until the slice ends or nothing is left; return why it stopped."""
    batch = await Batch.objects.filter(pk=batch_id).afirst()
    if batch is None or batch.status != BatchStatus.IN_PROGRESS:
        return "inactive"
    # A fleet view of this slice's own: its HTTP pool belongs to this event loop.
    fleet = Fleet(salt_secret=settings.SECRET_KEY)
    await sync_to_async(fleet.refresh)()
    try:
        return await _slice(batch, fleet=fleet, deadline=time.monotonic() + slice_s)
    finally:
        await fleet.client.aclose()
        # The DB work of this slice ran in asgiref's sync thread; do not leave its
        # connection open between slices (or past a test database's teardown).
        await sync_to_async(_close_db)()


class _Pipeline:
    """The lines one slice holds: claimed and waiting, in flight, and finished but unwritten.

    Lines start one by one as the engines have room, not in lockstep chunks: a chunk started
    all its lines at once and waited for the slowest before probing again, which put bursts
    on the engines (and left room unused while the last line of a chunk ran).

    The database is kept off the dispatch path: the next chunk of lines is claimed while fewer
    than BATCH_CHUNK wait, and finished outcomes are written by a task of their own while
    lines go on starting. Awaited in the dispatch loop, the writes and claims took about
    half of a slice on the 2-core bench host (bench/batch_interference.py's idle fleet: 1.0 s
    of writes and 0.4 s of claims per 3 s slice), and every line that finished meanwhile left
    its slot empty until they returned; the engines ran in waves, emptied at every write.
    """

    def __init__(self, batch: Batch, *, fleet: Fleet) -> None:
        self.batch = batch
        self.fleet = fleet
        self.standing: Standing | None = None  # what lines run under, as of the last heartbeat
        self.halt: dict[str, Any] | None = None  # why the batch may no longer run
        self.claim_sync = sync_to_async(batch_services.batch_lines_claim)
        self.record_sync = sync_to_async(batch_services.batch_lines_record)
        # claimed, not sent, each with its lease token
        self.waiting: collections.deque[tuple[BatchLine, str]] = collections.deque()
        self.claiming: asyncio.Task[tuple[str, list[BatchLine]]] | None = None
        self.drained = False  # a claim found nothing left to run
        self.flying: dict[asyncio.Task[LineOutcome], str] = {}  # task -> its lease token
        self.unwritten: dict[str, list[LineOutcome]] = {}  # lease token -> outcomes
        self.unwritten_since = 0.0
        self.writing: asyncio.Task[None] | None = None  # outcomes being written
        self.stop: LineOutcome | None = None  # a hard limit refused a line
        self.started_at = 0.0  # when lines were last started

    @property
    def regions(self) -> set[str] | None:
        """Where lines may run now (none before the first heartbeat said)."""
        return self.standing.regions if self.standing is not None else set()

    @property
    def unwritten_count(self) -> int:
        return sum(map(len, self.unwritten.values()))

    def _claim(self) -> None:
        """Lease the next BATCH_CHUNK lines in the background (one claim at a time)."""
        if self.claiming is None and not self.drained:
            self.claiming = asyncio.create_task(
                self.claim_sync(batch_id=self.batch.pk, limit=settings.BATCH_CHUNK))

    async def _claimed(self, *, wait: bool) -> None:
        """Take the lines of a finished claim (of the one under way: ``wait``) into waiting."""
        task = self.claiming
        if task is None or not (wait or task.done()):
            return
        self.claiming = None
        token, lines = await task
        self.waiting.extend((line, token) for line in lines)
        self.drained = not lines

    async def start(self, n: int) -> None:
        """Send up to ``n`` lines under the last heartbeat's standing, waiting for a claim only
        when none is waiting; then claim the next chunk ahead while fewer than BATCH_CHUNK
        wait."""
        st = self.standing
        if st is None:
            return
        await self._claimed(wait=False)
        if n > 0 and not self.waiting and not self.drained:
            self._claim()
            await self._claimed(wait=True)
        started = 0
        while started < n and self.waiting:
            line, token = self.waiting.popleft()
            run = _run_line(line, fleet=self.fleet, batch=self.batch, principal=st.principal,
                            regions=st.regions, policy=st.policy)
            self.flying[asyncio.create_task(run)] = token
            started += 1
        if started:
            self.started_at = time.monotonic()
            if len(self.waiting) < settings.BATCH_CHUNK:
                self._claim()

    async def wait(self, timeout: float) -> bool:
        """Wait until a line finishes or ``timeout``; keep the outcomes; True if any retry."""
        if not self.flying:
            await asyncio.sleep(timeout)
            return False
        finished, _ = await asyncio.wait(self.flying, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        retry = False
        for task in finished:
            outcome = task.result()
            if not self.unwritten:
                self.unwritten_since = time.monotonic()
            self.unwritten.setdefault(self.flying.pop(task), []).append(outcome)
            retry |= outcome.retry
            if outcome.stop and self.stop is None:
                self.stop = outcome
        return retry

    async def _record(self, unwritten: dict[str, list[LineOutcome]]) -> None:
        for token, outcomes in unwritten.items():
            await self.record_sync(batch_id=self.batch.pk, token=token, outcomes=outcomes)

    async def write(self, *, force: bool = False) -> None:
        """Record finished outcomes: RECORD_EVERY at a time, or once they are WRITE_AFTER_S
        old (so the caller sees progress), in a task while lines go on starting (one write
        at a time); or now, after the one under way (``force``). A write that failed raises
        here, at the next call."""
        if self.writing is not None:
            if not (force or self.writing.done()):
                return
            task, self.writing = self.writing, None
            await task
        if not self.unwritten or not (
                force or self.unwritten_count >= RECORD_EVERY
                or time.monotonic() - self.unwritten_since >= WRITE_AFTER_S):
            return
        unwritten, self.unwritten = self.unwritten, {}
        if force:
            await self._record(unwritten)
        else:
            self.writing = asyncio.create_task(self._record(unwritten))

    async def close(self) -> None:
        """Let the lines in flight finish, hand back the unsent ones, write everything."""
        while self.flying:
            await self.wait(IDLE_WAIT_S)
        await self._claimed(wait=True)
        for line, token in self.waiting:
            self.unwritten.setdefault(token, []).append(
                LineOutcome(line.id, retry=True, started=False))
        self.waiting.clear()
        await self.write(force=True)


async def _slice(batch: Batch, *, fleet: Fleet, deadline: float) -> str:
    """Keep the engines' spare room filled with lines until the deadline or the end.

    A probe every PROBE_EVERY_S (``_probe``: the interactive TTFT signal, a live scrape of
    the engines, the host's CPU) says how many lines may be in flight (``guard.batch_share``:
    the share of the engines' slots the guard allows, less what interactive traffic uses),
    and none at all while interactive requests run on a host whose CPUs were busier than
    BATCH_HOST_CPU_CEILING since the last probe (``HostCpu``); in between, a finished line
    is replaced at once while that share allows, so engines are neither scraped per line
    (their /metrics is not cheap) nor left idle until the next scrape. Outcomes are written
    RECORD_EVERY lines at a time, and the batch's status and standing (its key, organization
    and placement: ``standing.batch_standing``) are read once per HEARTBEAT_S, the first time
    before any line starts: the database round trips per line were most of what a running
    batch cost the machine it shares with interactive traffic.
    A runner that dies loses only unwritten outcomes: those lines are still leased and run
    again once the lease ends, each recorded once.
    """
    batch_id = batch.pk
    heartbeat = sync_to_async(batch_services.batch_heartbeat)
    lines = _Pipeline(batch, fleet=fleet)
    why = "slice"
    next_beat = next_probe = 0.0
    share = peak = 0  # how many lines may be in flight, as of the last probe; the most seen
    host, guard = HostCpu(settings.BATCH_HOST_STAT), scavenger_for(batch.model)
    counts_before = dict(guard.counts)
    try:
        while time.monotonic() < deadline and lines.stop is None:
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + HEARTBEAT_S
                if await heartbeat(batch_id=batch_id) != BatchStatus.IN_PROGRESS:
                    why = "stopped"  # finished lines are kept, also when cancelled
                    break
                standing = await batch_standing(batch)
                if isinstance(standing, dict):
                    lines.halt, why = standing, "halted"  # lines in flight finish, kept
                    break
                lines.standing = standing
            if time.monotonic() >= next_probe:
                # lines just started may not have reached their engine: let them be counted
                await asyncio.sleep(lines.started_at + SEND_GRACE_S - time.monotonic())
                share = await _probe(guard, host, fleet=fleet, model=batch.model,
                                     regions=lines.regions, ours=len(lines.flying))
                peak = max(peak, share)
                next_probe = time.monotonic() + PROBE_EVERY_S
            await lines.start(share - len(lines.flying))
            if lines.drained and not lines.waiting and not lines.flying:
                why = "drained"
                break
            if await lines.wait(max(0.0, next_probe - time.monotonic())):
                # rate-limited or engine trouble: start nothing until the next probe
                share = 0
                next_probe = time.monotonic() + IDLE_WAIT_S
            await lines.write()
    finally:
        await lines.close()
        probes = {k: n - counts_before.get(k, 0) for k, n in guard.counts.items()
                  if n > counts_before.get(k, 0)}
        log.info("batch %s: slice ended (%s); at most %d lines in flight; probes by what the "
                 "guard decided: %s", batch.public_id, why, peak, probes)
    if lines.halt is not None:
        await sync_to_async(batch_services.batch_fail)(batch_id=batch_id, error=lines.halt)
        return why
    if lines.stop is not None:
        await sync_to_async(batch_services.batch_lines_stop)(batch_id=batch_id,
                                                             error=lines.stop.error)
        return "drained"
    return why


async def _probe(guard: Scavenger, host: HostCpu, *, fleet: Fleet, model: str,
                 regions: set[str] | None, ours: int) -> int:
    """Return how many of this runner's lines may be in flight now (``ours`` are).

    One read of the interactive TTFT signal, the host's CPU while interactive traffic runs,
    one live scrape of the model's engines; the guard (``guard.Scavenger``) turns them into a
    share of the engines' slots, and a host whose CPUs are busy gets no line at all.
    """
    now = time.time()
    try:
        slots = await ttft_signal.aslots(model, seconds=guard.lookback_s, now=now)
    except (RedisError, OSError):
        slots = None  # the guard holds batch at its floor
    busy = None
    if slots is not None and guard.cpu_ceiling < 1.0 and guard.traffic(slots, now):
        busy = await host.abusy()
    await fleet.arefresh_if_stale()
    loads = await fleet.client.aloads(_healthy(fleet, model, regions))
    fraction = guard.decide(slots, queued=any(load is not None and load.queued > 0
                                              for load in loads.values()),
                            host_busy=busy, now=now)
    if guard.reason == "host_cpu":
        return 0  # the host's CPU has no trough to fill
    share = batch_share(loads.values(), fraction=fraction, floor=guard.floor,
                        free_slots=settings.BATCH_FREE_SLOTS, ours=ours)
    return max(0, share - await _reserved_slots(fleet, model, regions))


async def _reserved_slots(fleet: Fleet, model: str, regions: set[str] | None) -> int:
    """Return the slots of these pools held for reservations (``gateway.capacity``).

    Batch lines are on-demand work: like interactive on-demand requests they leave a pool's
    reserved share free, or a reserved request would wait behind them for a slot (engines do
    not preempt a running request). Counted whole, though reserved requests running there
    also count in what the engines run: batch leaves a reserved pool more room, never less.
    """
    reserved = await capacity.areserved()
    return sum(pool.held for pool in capacity.pool_shares(fleet, model, reserved)
               if regions is None or pool.region in regions)


def _healthy(fleet: Fleet, model: str, regions: set[str] | None) -> list[EngineInfo]:
    """The healthy engines of ``model`` in ``regions`` in this runner's fleet view."""
    try:
        return fleet.router.candidates(model, regions)
    except EngineError:
        return []


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop where installed, as the gateway runs under uvicorn: every line is a few
    network round trips, and asyncio's own loop spends more CPU on each."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def batch_run(*, batch_id: int, slice_s: float | None = None) -> str:
    """Run one slice of a batch; finalize it when done. Return why the slice ended: ``slice``
    (time is up, lines remain), ``drained``, ``stopped`` (no longer in progress), ``halted``
    (its standing stopped it: failed) or ``inactive``."""
    with asyncio.Runner(loop_factory=_loop_factory()) as loop:
        why = loop.run(_run(batch_id, slice_s=slice_s or settings.BATCH_SLICE_S))
    if why in ("drained", "stopped"):
        batch_services.batch_finalize_if_done(batch_id=batch_id)
    return why
