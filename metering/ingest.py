"""The stream consumer: usage events from the Redis stream into PostgreSQL, exactly once.

It runs as its own long-lived process (``manage.py ingest_usage``), not as Celery tasks. The
work is one endless loop whose unit is a batch of thousands of events: a Celery task per batch
would put a broker round trip, a task message and a prefork hand-off in front of every batch,
and acknowledging stream entries after the commit needs a consumer identity that survives
between batches (the consumer-group member), which a pool of task workers does not have. Two
threads overlap the work: a reader fetches and decodes the next batch (``XREADGROUP``,
``XAUTOCLAIM``) while the writer records the current one (``metering.recording``: COPY,
dedup, rating, rollups, one transaction) and then ``XACK``s it. Entries are acknowledged only
after their transaction committed, so a consumer killed at any instant leaves them pending; a
live consumer reclaims entries idle longer than ``claim_idle_ms`` and records them again, and
the request ids turn anything already committed into duplicates.

Housekeeping rides along: the stream is trimmed below the oldest entry any group still needs,
consumers that died with nothing pending are removed from the group, the local spool is
replayed at start-up and periodically, and next months' partitions are created ahead.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import orjson
import redis
from django.db import connection
from redis.exceptions import ClusterDownError, MasterDownError, TryAgainError

from metering import conf, events, recording, services, stream
from metering.models import UsageDeadLetter
from metering.recording import RecordResult

# a stream entry as redis-py returns it: (entry id, fields), fields None once deleted
Entry: TypeAlias = tuple[Any, Any]

log = logging.getLogger(__name__)

DEAD_CONSUMER_IDLE_MS = 3_600_000


# One round trip and one reply string per batch instead of five RESP values per entry: parsing
# replies entry by entry in Python cost more than everything else the consumer does.
READ_LUA = """
local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[3],
                         'STREAMS', KEYS[1], '>')
if not reply then return {'', ''} end
local ids, payloads = {}, {}
for i, entry in ipairs(reply[1][2]) do
  ids[i] = entry[1]
  local fields = entry[2]
  local payload = 'null'
  for j = 1, #fields, 2 do
    if fields[j] == 'e' then payload = fields[j + 1] end
  end
  payloads[i] = payload
end
return {table.concat(ids, ' '), table.concat(payloads, ',')}
"""
ACK_LUA = """
local ids, acked = {}, 0
for id in string.gmatch(ARGV[2], '[^ ]+') do
  ids[#ids + 1] = id
  if #ids == 1000 then
    acked = acked + redis.call('XACK', KEYS[1], ARGV[1], unpack(ids))
    ids = {}
  end
end
if #ids > 0 then acked = acked + redis.call('XACK', KEYS[1], ARGV[1], unpack(ids)) end
return acked
"""


def _outage(exc: redis.RedisError) -> bool:
    """Return whether an error means a shard's Redis is unreachable for now (read it again
    later), not a bug: a connection error, or a cluster that lost the shard's master."""
    return not isinstance(exc, redis.ResponseError) or isinstance(
        exc, ClusterDownError | TryAgainError | MasterDownError)


@dataclass
class Batch:
    """Stream entries read together, decoded."""

    ids: list[bytes]
    rows: list[events.Row]
    bad: list[tuple[bytes, str]] = field(default_factory=list)  # (payload, error)
    claimed: bool = False
    trusted_text: bool = False  # no JSON escape anywhere: no tab, newline or backslash
    key: str = ""  # the stream (shard) the entries came from, where they are acknowledged


@dataclass
class IngestStats:
    """Counters of one consumer's run."""

    batches: int = 0
    events: int = 0
    recorded: int = 0
    duplicates: int = 0
    dead_lettered: int = 0
    claimed: int = 0


Observer = Callable[[Batch, RecordResult, float], None]
FULL_GC_EVERY = 200  # batches


@contextlib.contextmanager
def _collect_between_batches() -> Iterator[None]:
    """Run the cyclic garbage collector between batches only.

    A batch allocates tens of thousands of short-lived tuples while it is alive; the automatic
    collector, triggered every 700 allocations, kept re-scanning that live set and cost about
    a fifth of the consumer's time. Reference counting frees a batch's objects when it is
    done, so a young-generation pass after each batch (and a full one now and then) is enough.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    gc.freeze()  # what start-up loaded is permanent: never scan it again
    try:
        yield
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()


def _framed(value: object) -> bool:
    """Return whether a decoded entry looks like a version-1 usage event row (one written
    before the last added fields gets their defaults, as ``events.decode_row`` does)."""
    events.pad_entry(value)
    return (type(value) is list and len(value) == events.ROW_LEN + 1
            and value[0] == events.WIRE_VERSION and type(value[1 + events.I_ORG]) is int
            and type(value[1 + events.I_REQUEST]) is str
            and type(value[1 + events.I_TIME]) is str
            and value[1 + events.I_TIME].endswith("+00:00"))


class Ingestor:
    """One member of the consumer group of each of its streams; ``run()`` until ``stop()``
    (or until drained).

    With the stream sharded (``conf.stream_shards()``), it consumes every shard, or the ones
    named by ``shards`` (indexes into ``conf.stream_keys()``), so N processes can share K
    shards; each shard has its own consumer group (same name), reclaim and trim.
    """

    def __init__(self, *, name: str | None = None, batch_size: int | None = None,
                 block_ms: int = 500, claim_idle_ms: int | None = None,
                 writers: int = 2, observer: Observer | None = None,
                 shards: Sequence[int] | None = None) -> None:
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.batch_size = batch_size or conf.batch_size()
        self.block_ms = block_ms
        self.claim_idle_ms = claim_idle_ms if claim_idle_ms is not None else conf.claim_idle_ms()
        self.claim_every_s = max(0.2, self.claim_idle_ms / 2000)
        self.observer = observer
        every = conf.stream_keys()
        self.keys = every if shards is None else [every[i] for i in shards]
        if not self.keys:
            raise ValueError("an ingest consumer needs at least one stream shard")
        self.key = self.keys[0]
        self.group = conf.consumer_group()
        self.redis = stream.client(socket_timeout=block_ms / 1000 + 5)
        self.stats = IngestStats()
        self._stop = threading.Event()
        self.writers = max(1, writers)
        self._queue: queue.Queue[Batch | None] = queue.Queue(maxsize=self.writers + 1)
        # A slot is held from before a read until a writer takes the batch: read late, a batch
        # holds all that came while the writers were busy (not many small ones queued early).
        self._slots = threading.BoundedSemaphore(self.writers)
        self._stats_lock = threading.Lock()
        self._writer_error: BaseException | None = None
        self._reader_idle = threading.Event()
        self._reader_error: BaseException | None = None
        self._read_script = self.redis.register_script(READ_LUA)
        self._ack_script = self.redis.register_script(ACK_LUA)

    def stop(self) -> None:
        """Ask the loop to finish the batches it holds and return."""
        self._stop.set()

    # -- reader thread ------------------------------------------------------------------

    def _decode(self, entries: list[Entry], *, claimed: bool, key: str) -> Batch:
        batch = Batch(ids=[], rows=[], claimed=claimed, trusted_text=True, key=key)
        decode_row = events.decode_row
        for entry_id, fields in entries:
            batch.ids.append(entry_id)
            payload = (fields or {}).get(stream.FIELD)
            if payload is None:
                continue  # trimmed under us, or not a usage event: nothing to record
            try:
                batch.rows.append(decode_row(payload))
            except Exception as exc:
                batch.bad.append((payload, str(exc)))
            else:
                batch.trusted_text = batch.trusted_text and b"\\" not in payload
        return batch

    def _decode_blob(self, ids_blob: bytes, payload_blob: bytes, key: str) -> Batch:
        ids = ids_blob.split(b" ")
        try:
            values = orjson.loads(b"[" + payload_blob + b"]")  # as events.decode_row does
            if len(values) != len(ids) or not all(map(_framed, values)):
                raise ValueError("malformed entries")
        except ValueError:
            # some entry is not a usage event: fetch and decode them one by one
            entries = []
            for entry_id in ids:
                found = self.redis.xrange(key, min=entry_id, max=entry_id)
                entries.append(found[0] if found else (entry_id, None))
            return self._decode(entries, claimed=False, key=key)
        return Batch(ids=ids, rows=[v[1:] for v in values],
                     trusted_text=b"\\" not in payload_blob, key=key)

    def _claim(self, key: str) -> list[Entry]:
        """Take over entries other (dead) consumers left unacknowledged for too long."""
        claimed: list[Entry] = []
        start = "0-0"
        while len(claimed) < self.batch_size:
            reply = self.redis.xautoclaim(
                key, self.group, self.name, min_idle_time=self.claim_idle_ms,
                start_id=start, count=self.batch_size - len(claimed),
            )
            start, entries = reply[0], reply[1]
            claimed += entries
            if start in (b"0-0", "0-0"):
                break
        return claimed

    def _forget_dead_consumers(self, key: str) -> None:
        for info in self.redis.xinfo_consumers(key, self.group):
            name = info["name"].decode() if isinstance(info["name"], bytes) else info["name"]
            if (name != self.name and not info["pending"]
                    and info["idle"] > DEAD_CONSUMER_IDLE_MS):
                self.redis.xgroup_delconsumer(key, self.group, name)

    def _slot(self) -> bool:
        """Wait for a free read slot (see ``__init__``); False when stopping instead."""
        return any(self._slots.acquire(timeout=0.5) for _ in iter(self._stop.is_set, True))

    def _put(self, batch: Batch) -> None:
        """Queue a batch read under a slot; the writer that takes it frees the slot."""
        while not self._stop.is_set():
            with contextlib.suppress(queue.Full):
                self._queue.put(batch, timeout=0.5)
                return
        self._slots.release()

    def _take(self, timeout: float | None = None) -> Batch | None:
        """Return the next batch (or an end mark), freeing its read slot."""
        if (batch := self._queue.get(timeout=timeout)) is not None:
            self._slots.release()
        return batch

    def _read_shard(self, key: str, *, claim: bool) -> bool:
        """Queue the next batch of one shard (reclaimed entries first when ``claim``); return
        whether there was one."""
        if not self._slot():
            return False
        batch = None
        try:
            if claim and (entries := self._claim(key)):
                self.stats.claimed += len(entries)
                log.info("reclaimed %d pending usage entries of %s", len(entries), key)
                batch = self._decode(entries, claimed=True, key=key)
            else:
                if claim:
                    self._forget_dead_consumers(key)
                ids_blob, payload_blob = self._read_script(
                    keys=[key], args=[self.group, self.name, self.batch_size])
                batch = self._decode_blob(ids_blob, payload_blob, key) if ids_blob else None
        finally:
            if batch is None:
                self._slots.release()
        if batch is None:
            return False
        self._reader_idle.clear()
        self._put(batch)
        return True

    def _read_loop(self) -> None:
        next_claim = 0.0
        backoff = 0.1
        turn = 0
        try:
            while not self._stop.is_set():
                claim = time.monotonic() >= next_claim
                if claim:
                    next_claim = time.monotonic() + self.claim_every_s
                found, failed = False, 0
                for key in self.keys:  # one shard's outage leaves the others read
                    try:
                        found = self._read_shard(key, claim=claim) or found
                    except redis.RedisError as exc:
                        if "NOGROUP" in str(exc):
                            stream.ensure_group(self.redis, key)
                            found = True  # read it again at once
                        elif _outage(exc):
                            failed += 1
                            log.warning("usage stream %s unavailable (%s)", key, exc)
                        else:
                            raise
                if failed == len(self.keys):
                    log.warning("usage stream unavailable; retrying in %.1fs", backoff)
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                if found:
                    continue
                # nothing waiting: block on one shard at a time until something arrives
                key = self.keys[turn % len(self.keys)]
                turn += 1
                if not self._slot():
                    break
                try:
                    # redis-py types this reply as a union of its RESP2 and RESP3 shapes
                    reply: Any = self.redis.xreadgroup(
                        self.group, self.name, {key: ">"}, count=self.batch_size,
                        block=max(1, self.block_ms // len(self.keys)),
                    )
                    backoff = 0.1
                except redis.RedisError as exc:
                    self._slots.release()
                    if "NOGROUP" in str(exc):
                        stream.ensure_group(self.redis, key)
                    elif _outage(exc):
                        log.warning("usage stream %s unavailable (%s)", key, exc)
                    else:
                        raise
                    continue
                entries = reply[0][1] if reply else []
                if entries:
                    self._reader_idle.clear()
                    self._put(self._decode(entries, claimed=False, key=key))
                else:
                    self._slots.release()
                    self._reader_idle.set()
        except BaseException as exc:  # surfaced by the writer, which stops the process
            self._reader_error = exc
            log.exception("usage stream reader crashed")
        finally:
            for _ in range(self.writers):  # one end mark per writer
                self._queue.put(None)

    # -- writer (calling thread) ----------------------------------------------------------

    def _record(self, batch: Batch) -> RecordResult:
        backoff = 0.1
        while True:
            try:
                if batch.bad:
                    UsageDeadLetter.objects.bulk_create(
                        UsageDeadLetter(payload=p.decode(errors="replace"), error=e,
                                        origin="stream") for p, e in batch.bad
                    )
                    batch.bad = []
                return recording.record_rows(batch.rows, origin="stream",
                                             trusted_text=batch.trusted_text)
            except Exception as exc:
                recording.close_broken_connection(exc)
                if self._stop.is_set():
                    raise
                log.warning("recording a usage batch failed (%s: %s); retrying in %.1fs",
                            type(exc).__name__, exc, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def _ack(self, batch: Batch) -> None:
        for attempt in range(5):
            try:
                self._ack_script(keys=[batch.key], args=[self.group, b" ".join(batch.ids)])
            except redis.RedisError as exc:
                log.warning("XACK failed (%s); attempt %d", exc, attempt + 1)
                time.sleep(0.2 * (attempt + 1))
            else:
                return
        # still pending: reclaimed and recorded again (as duplicates) after claim_idle_ms
        log.error("could not acknowledge %d usage entries; they will be reclaimed",
                  len(batch.ids))

    def _housekeeping(self, now: float, due: dict[str, float]) -> None:
        jobs: dict[str, tuple[float, Callable[[], object]]] = {
            "trim": (5.0, self._trim),
            "spool": (conf.spool_replay_s(), services.usage_spool_replay),
            "partitions": (3600.0, services.usage_partitions_ensure),
        }
        for name, (every, job) in jobs.items():
            if now < due.get(name, 0.0):
                continue
            due[name] = now + every
            try:
                job()
            except Exception as exc:
                recording.close_broken_connection(exc)
                log.warning("ingest housekeeping %s failed: %s", name, exc)

    def _trim(self) -> None:
        for key in self.keys:
            stream.trim_acknowledged(self.redis, key)

    def _drained(self) -> bool:
        if not self._reader_idle.is_set() or not self._queue.empty():
            return False
        try:
            return all(self.redis.xpending(key, self.group)["pending"] == 0
                       for key in self.keys)
        except redis.RedisError:
            return False

    def run(self, *, drain: bool = False) -> IngestStats:
        """Consume until ``stop()``; with ``drain``, also return once nothing is left to do."""
        with _collect_between_batches():
            return self._run(drain=drain)

    def _process(self, batch: Batch) -> None:
        result = self._record(batch)
        committed = time.time()
        self._ack(batch)
        with self._stats_lock:
            self.stats.batches += 1
            self.stats.events += len(batch.ids)
            self.stats.recorded += len(result.recorded)
            self.stats.duplicates += len(result.duplicates)
            self.stats.dead_lettered += len(result.dead_lettered)
            full = self.stats.batches % FULL_GC_EVERY == 0
            if self.observer is not None:
                self.observer(batch, result, committed)
        gc.collect(2 if full else 0)

    def _write_loop(self) -> None:
        """An extra writer: its own database connection, so two batches' SQL overlap."""
        try:
            while (batch := self._take()) is not None:
                self._process(batch)
        except BaseException as exc:
            self._writer_error = exc
            log.exception("usage writer crashed")
            self.stop()
        finally:
            connection.close()

    def _run(self, *, drain: bool) -> IngestStats:
        for key in self.keys:
            try:
                stream.ensure_group(self.redis, key)
            except redis.RedisError as exc:
                if not _outage(exc):
                    raise
                # the reader creates it once the shard answers (NOGROUP)
                log.warning("usage stream %s unavailable at start-up (%s)", key, exc)
        due: dict[str, float] = {}
        self._housekeeping(time.monotonic(), due)
        reader = threading.Thread(target=self._read_loop, name="usage-reader", daemon=True)
        reader.start()
        extra = [threading.Thread(target=self._write_loop, name=f"usage-writer-{i}",
                                  daemon=True) for i in range(1, self.writers)]
        for thread in extra:
            thread.start()
        try:
            while True:
                try:
                    batch = self._take(timeout=0.5)
                except queue.Empty:
                    self._housekeeping(time.monotonic(), due)
                    if drain and self._drained():
                        self.stop()
                    if self._stop.is_set() and not reader.is_alive():
                        break
                    continue
                if batch is None:
                    break
                self._process(batch)
                self._housekeeping(time.monotonic(), due)
        finally:
            self.stop()
            reader.join(timeout=self.block_ms / 1000 + 10)
            for thread in extra:
                thread.join(timeout=120)
        if self._writer_error is not None:
            raise RuntimeError("a usage writer crashed") from self._writer_error
        try:
            self._trim()
        except redis.RedisError as exc:
            log.warning("final stream trim failed: %s", exc)
        if self._reader_error is not None:
            raise RuntimeError("usage stream reader crashed") from self._reader_error
        return self.stats
