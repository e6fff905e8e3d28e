"""The batch path of consumption: a pulled batch handled in one transaction (inbox rows claimed together, a
savepoint per message or none at first, outbox and job trace rows written once at its end), then settled message
by message after its commit; a batch that fails as a whole is bisected. Batch handlers (`ServiceSpec.batch_handlers`)
take their batch whole."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import asyncpg
from nats.aio.msg import Msg

from shared.clock import Clock
from shared.plumbing.deadletters import DeadLetterSink
from shared.plumbing.outbox import OutboxRelay
from shared.plumbing.spec import Counters, ServiceSpec
from shared.plumbing.units import (
    BatchHandler,
    JobTraces,
    Tx,
    _BatchResult,
    _BatchWork,
    _DeadLetter,
    _Optimism,
    _Prepared,
    insert_outbox_rows,
)

log = logging.getLogger("gpuq.service")

# The savepoint each message of a consumed batch is handled in (`Batches.process`).
_MESSAGE_SAVEPOINT = "gpuq_message"
# A service with optimistic batches (ServiceSpec.optimistic_batches) handles this many batches with a savepoint per
# message after one of its batches had to be handled again (failures come in runs: a dependency not there yet).
SAVEPOINT_BATCHES_AFTER_FAILURE = 8
# A consumed batch that fails as a whole is bisected (`_bisect`) down to parts of this many messages, then handled
# one by one: halving a part of all-bad messages further would cost more transactions than it saves.
BISECT_PART = 8



class BatchesHost(Protocol):
    """What the batch path needs of its runtime (shared/service.py ServiceRuntime): its unit of work for one
    message, how it settles one message on its own, and what they share."""

    stale: bool  # memory may be ahead of the tables: rebuilt before the next unit of work

    @property
    def spec(self) -> ServiceSpec: ...
    @property
    def pool(self) -> asyncpg.Pool: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def source(self) -> str: ...
    @property
    def counters(self) -> Counters: ...
    @property
    def job_traces(self) -> JobTraces: ...
    @property
    def outbox(self) -> OutboxRelay: ...
    @property
    def dead_letters(self) -> DeadLetterSink: ...
    @property
    def handle_lock(self) -> AbstractAsyncContextManager[Any]: ...

    def routed(self, subject: str) -> bool: ...
    def count(self, outcome: str) -> None: ...
    def prepare_or_verdict(self, m: Msg) -> _Prepared | _DeadLetter | None: ...
    async def reload_if_stale(self, conn: asyncpg.Connection) -> None: ...
    async def _unit(self, conn: asyncpg.Connection, raw: bytes, subject: str,
                    deferred: dict[str, Callable[[Tx], Awaitable[None]]] | None,
                    traces: list[tuple[str, str]], batch: _BatchWork | None = ...,
                    prepared: _Prepared | _DeadLetter | None = ...,
                    scratch: dict[str, Any] | None = ..., own_savepoint: bool = ...) -> tuple[str, bool]: ...
    async def retry_or_give_up(self, raw: Msg, exc: BaseException) -> None: ...
    async def settle_message(self, raw: Msg) -> None: ...


class Batches:
    """How one runtime handles a pulled batch. Each message goes through the runtime's unit of work
    (`ServiceRuntime._unit`) and is settled by it; this class decides the transactions around them."""

    def __init__(self, runtime: BatchesHost):
        self.rt = runtime
        self._savepoint_batches = 0  # batches left to handle with savepoints after an optimistic one failed

    async def process(self, msgs: Sequence[Msg]) -> None:
        """Handle a pulled batch in stream order in one transaction, each message with its inbox row; then settle
        each: ack (handled, duplicate, ignored, dead-lettered) or nak with delay (failed). A message that fails or
        is poison costs only itself: it is handled in a savepoint of its own, which its failure rolls back. A
        service with `optimistic_batches` handles a batch without savepoints first; if one of its handlers fails
        (or refuses), or the batch fails as a whole, the whole transaction rolls back, memory is rebuilt, and the
        batch is handled again with a savepoint per message (and so are the next few batches). If the batch fails as
        a whole even so (the commit, or the work deferred to its end), it is bisected (`_bisect`)."""
        work = []
        for m in msgs:
            if self.rt.routed(m.subject):
                work.append(m)
            else:
                self.rt.counters.ignored += 1
                await m.ack()
        if not work:
            return
        # Parse and check every message first (no Postgres), so that the batch's inbox rows are claimed in one
        # statement; a service that claims events per message (sharding) writes its inbox rows one by one.
        await self._handle(work, [self.rt.prepare_or_verdict(m) for m in work])

    async def _handle(self, work: Sequence[Msg], prepared: Sequence[_Prepared | _DeadLetter | None], *,
                      part: bool = False) -> None:
        """One batch (or, `part`, a part of one being bisected: always with savepoints) handled and settled."""
        savepoints = part or not self.rt.spec.optimistic_batches or self._savepoint_batches > 0
        if self._savepoint_batches > 0 and not part:
            self._savepoint_batches -= 1
        result: _BatchResult | None = None
        async with self.rt.handle_lock:
            for attempt_savepoints in ((True,) if savepoints else (False, True)):
                try:
                    async with self.rt.pool.acquire() as conn, conn.transaction():
                        await self.rt.reload_if_stale(conn)
                        result = await self._run(conn, work, prepared, savepoints=attempt_savepoints)
                except Exception as exc:
                    # Rolled back as a whole: memory may be ahead of the tables (rebuilt by the next attempt).
                    self.rt.stale = True
                    result = None
                    if not attempt_savepoints:
                        # A handler failed, or the batch's end did (the rows held for it: one that Postgres refuses
                        # fails them all). With a savepoint per message each writes its own rows and fails alone.
                        self.rt.counters.batch_retries += 1
                        self._savepoint_batches = SAVEPOINT_BATCHES_AFTER_FAILURE
                        log.info("%s: a batch of %d failed (%s: %s); handling it again with a savepoint per message",
                                 self.rt.spec.name, len(work), type(exc).__name__, exc)
                        continue
                    log.warning("%s: a batch of %d failed as a whole, bisecting it: %s: %s",
                                self.rt.spec.name, len(work), type(exc).__name__, exc)
                break
        if result is None:
            await self._bisect(work, prepared)
            return
        self.rt.counters.batches += 1
        self.rt.job_traces.committed(result.traces)
        if result.emitted:
            self.rt.outbox.wake()
        for m, why in result.dead:
            await self.rt.dead_letters.notify(m.data, m.subject, m.metadata.sequence.stream,
                                              m.metadata.num_delivered, why.reason, why.message)
            await m.ack()
        for m, outcome, error in result.outcomes:
            if error is None:
                self.rt.count(outcome)
                await m.ack()
            else:
                await self.rt.retry_or_give_up(m, error)

    async def _bisect(self, work: Sequence[Msg], prepared: Sequence[_Prepared | _DeadLetter | None]) -> None:
        """A batch that failed as a whole although each message had its own savepoint: the failure is the batch's
        (its commit, or the work deferred to its end), caused by one or a few of its messages. Each half is handled as
        a batch of its own, a half that fails again is halved again, and the messages of a part of BISECT_PART or
        fewer take the per-message path one by one (nak with backoff, dead-lettered at MAX_DELIVER, or at once for
        data Postgres refuses). One bad message among n costs about 2·log2(n/BISECT_PART) + BISECT_PART transactions,
        and the good messages of each half are committed together; handling all n one by one cost n units of work,
        each with its own cycle (admission's), on every delivery of the bad one (issue 43)."""
        if len(work) <= BISECT_PART:
            for m in work:
                await self.rt.settle_message(m)
            return
        middle = len(work) // 2
        await self._handle(work[:middle], prepared[:middle], part=True)
        await self._handle(work[middle:], prepared[middle:], part=True)

    async def _run(self, conn: asyncpg.Connection, work: Sequence[Msg],
                   prepared: Sequence[_Prepared | _DeadLetter | None], *, savepoints: bool) -> _BatchResult:
        """One attempt at a batch inside the caller's transaction. With `savepoints`, each handled message runs in a
        savepoint of its own and a failure rolls back only that message; without, the first failing handler
        raises _Optimism (the caller rolls the transaction back and tries again with savepoints)."""
        result = _BatchResult()
        batch = _BatchWork(claimed=await self._claim_inbox(conn, prepared))
        if self.rt.spec.prefetch is not None:
            await self.rt.spec.prefetch(conn, [
                (p.event, p.payload, p.subject) for p in prepared if isinstance(p, _Prepared)
                and (batch.claimed is None or p.inbox_id in batch.claimed)], result.scratch)
        deferred: dict[str, Callable[[Tx], Awaitable[None]]] = {}
        for m, p in zip(work, prepared, strict=True):
            if p is None or (isinstance(p, _Prepared) and batch.claimed is not None
                             and p.inbox_id not in batch.claimed):
                # ignored, or a duplicate: nothing to do, no savepoint needed
                result.outcomes.append((m, "ignored" if p is None else "duplicate", None))
                continue
            if isinstance(p, _DeadLetter):  # poison, known before any handler ran: nothing of it to roll back
                result.dead.append((m, p))
                await self.rt.dead_letters.record(conn, m.data, m.subject, m.metadata.sequence.stream,
                                                  m.metadata.num_delivered, p.reason, p.message)
                continue
            if not savepoints:
                try:
                    outcome, wrote = await self.rt._unit(conn, m.data, m.subject, deferred, [], batch, p,
                                                         scratch=result.scratch)
                except Exception as exc:
                    raise _Optimism(f"{type(exc).__name__}: {exc}") from exc
                result.emitted = result.emitted or wrote
                result.outcomes.append((m, outcome, None))
                continue
            # A savepoint: this message's work alone. Savepoints of the same name nest and are not released (the
            # commit ends them all): one round trip to Postgres per message instead of two; a rollback goes back to
            # the newest one, the start of this message.
            await conn.execute(f"SAVEPOINT {_MESSAGE_SAVEPOINT}")
            unit_traces: list[tuple[str, str]] = []
            try:
                outcome, wrote = await self.rt._unit(conn, m.data, m.subject, deferred, unit_traces, batch, p,
                                                     scratch=result.scratch, own_savepoint=True)
                result.emitted = result.emitted or wrote
                result.outcomes.append((m, outcome, None))
            except _DeadLetter as verdict:
                await self._roll_back_message(conn, batch, p, unit_traces)
                if verdict.handler_ran:
                    await self._reload_in(conn)
                result.dead.append((m, verdict))
                await self.rt.dead_letters.record(conn, m.data, m.subject, m.metadata.sequence.stream,
                                                  m.metadata.num_delivered, verdict.reason, verdict.message)
            except Exception as exc:
                await self._roll_back_message(conn, batch, p, unit_traces)
                await self._reload_in(conn)
                result.outcomes.append((m, "failed", exc))
        # The messages' rows, in handling order, before the rows of the work deferred to the batch's end.
        if batch.rows:
            await insert_outbox_rows(conn, self.rt.spec.schema, batch.rows)
        result.traces = await self.rt.job_traces.write_staged(conn, self.rt.spec.schema, batch.traces)
        if deferred:
            tx = Tx(conn=conn, now=self.rt.clock.now(), source=self.rt.source, schema=self.rt.spec.schema,
                    job_traces=self.rt.job_traces, buffered=True, scratch=result.scratch,
                    written_traces=dict(result.traces))
            for key in sorted(deferred):
                await deferred[key](tx)
            await tx.flush()
            result.emitted = result.emitted or bool(tx.emitted)
        return result

    async def _reload_in(self, conn: asyncpg.Connection) -> None:
        """After one message's savepoint rolled back: its handler may have changed memory, which must match the
        transaction again (the batch's earlier messages included) before the next message."""
        if self.rt.spec.reload is not None:
            await self.rt.spec.reload(conn)

    async def _claim_inbox(self, conn: asyncpg.Connection,
                           prepared: Sequence[_Prepared | _DeadLetter | None]) -> set[str] | None:
        """Insert the inbox rows of a batch's messages in one statement; returns the ids this batch inserted (the
        others were handled before: duplicates). None where the service claims events per message (`claim`)."""
        if self.rt.spec.claim is not None:
            return None
        rows: dict[str, str] = {}
        for p in prepared:
            if isinstance(p, _Prepared):
                rows.setdefault(p.inbox_id, p.event.type)
        if not rows:
            return set()
        ids = list(rows)
        inserted = await conn.fetch(
            f"INSERT INTO {self.rt.spec.schema}.inbox(event_id, type) SELECT * FROM unnest($1::text[], $2::text[]) "
            "ON CONFLICT DO NOTHING RETURNING event_id", ids, [rows[i] for i in ids])
        return {r["event_id"] for r in inserted}

    async def _roll_back_message(self, conn: asyncpg.Connection, batch: _BatchWork,
                                 p: _Prepared | _DeadLetter | None, unit_traces: list[tuple[str, str]]) -> None:
        """Undo one message of a batch: its savepoint, its staged trace rows, and the inbox row the batch claimed
        for it before the savepoint (so that its redelivery, or its replay from the dead letters, is handled)."""
        await conn.execute(f"ROLLBACK TO SAVEPOINT {_MESSAGE_SAVEPOINT}")
        for job, _ in unit_traces:
            batch.traces.pop(job, None)
        if isinstance(p, _Prepared) and batch.claimed is not None:
            await conn.execute(f"DELETE FROM {self.rt.spec.schema}.inbox WHERE event_id = $1", p.inbox_id)

    async def hand_over(self, batch_fn: BatchHandler, raws: Sequence[Msg]) -> None:
        try:
            async with self.rt.handle_lock, self.rt.pool.acquire() as conn:
                outcome = await batch_fn(conn, [m.data for m in raws])
        except Exception as exc:
            # The batch rolled back as a whole: settle each message on its own path instead.
            log.warning("%s: batch of %d failed, falling back to one by one: %s", self.rt.spec.name, len(raws), exc)
            for m in raws:
                await self.rt.settle_message(m)
            return
        self.rt.counters.handled += outcome.handled
        self.rt.counters.duplicates += outcome.duplicates
        rest = list(outcome.rest)
        for m in raws:
            if m.data in rest:
                rest.remove(m.data)
                await self.rt.settle_message(m)  # not the batch handler's: dead letter or another handler
            else:
                await m.ack()
