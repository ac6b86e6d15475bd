"""Runs batch lines through the router's own request path, on spare capacity.

Each tick (``batch.poll_s``, or at once when a job is created or cancelled) the runner:
moves jobs along (validating -> in_progress; expired or done -> finalizing; cancelling or
finalizing -> their end, files written), preempts its newest batch line when an online request
has waited past ``batch.preempt_after_s``, claims as many lines as the replicas have spare
capacity for (pacing.spare_slots) plus the lines a job behind its pace needs (promoted to the
standard class), and renews the leases of the lines it holds.

A line runs as an internal request (``RequestPipeline.serve_internal``): the same admission
(class sheddable, or standard when promoted), routing, retries and forwarding as a client's.
Cancelling its task closes its upstream connection: the replica sees the disconnect and
aborts, as for a client that went away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from multidict import CIMultiDict

from kvroute.kvcore.batch_pacing import behind, should_preempt, spare_slots
from kvroute.kvcore.fair_queue import Priority
from kvroute.policies import FleetView

from .. import errors
from ..admission import Admission
from ..agent_request import parse_messages
from ..config import BatchConfig
from ..openai_request import ParsedRequest, parse_chat, parse_completion
from ..pipeline import InternalRequest, RequestPipeline
from ..proxy import retryable_status
from .messages_model import MESSAGES_ENDPOINT, render_results
from .metrics import BatchMetrics
from .model import Job, Result, Status, error_of, final_status, render_files
from .store import BatchStore, Claim

log = logging.getLogger(__name__)

# A line that found no replica (or a 5xx) waits this long before it is claimed again.
RETRY_BACKOFF_S = 1.0
JOB_GAUGE_EVERY_S = 1.0


@dataclass(eq=False, slots=True)
class _Run:
    claim: Claim
    promoted: bool
    started: float
    task: asyncio.Task[None] | None = None
    # Why it is being aborted: preempted (re-queued), or the job is ending.
    aborted: str | None = None


@dataclass(slots=True)
class _Outcome:
    result: Result | None = None  # to store
    retry_after_s: float | None = None  # or: give the line back, to run again after this
    failed_try: bool = field(default=False)  # counted against batch.max_attempts


class BatchRunner:
    def __init__(
        self,
        config: BatchConfig,
        store: BatchStore,
        pipeline: RequestPipeline,
        admission: Admission,
        fleet: FleetView,
        metrics: BatchMetrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.store = store
        self.pipeline = pipeline
        self.admission = admission
        self.fleet = fleet
        self.metrics = metrics
        self.clock = clock
        # Unique per process and start: a restarted router never takes its old leases for its own.
        self.owner = f"{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"
        self._runs: dict[tuple[str, int], _Run] = {}
        self._jobs: dict[str, Job] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._renewed = 0.0
        self._gauged = 0.0

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="kvroute-batch-runner")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        runs = list(self._runs.values())
        for run in runs:
            self._abort(run, "shutdown")
        # Each gives its line back to the queue: another router (or this one, restarted)
        # runs it without waiting for the lease to lapse.
        await asyncio.gather(*(r.task for r in runs if r.task is not None), return_exceptions=True)

    def wake(self) -> None:
        self._wake.set()

    def cancel(self, batch_id: str) -> int:
        """Abort this router's in-flight lines of a job being cancelled, now."""
        runs = [r for r in self._runs.values() if r.claim.batch_id == batch_id]
        for run in runs:
            self._abort(run, "cancelled")
        self.wake()
        return len(runs)

    @property
    def in_flight(self) -> int:
        return len(self._runs)

    async def _loop(self) -> None:
        while True:
            try:
                await self._tick()
            except Exception:  # the store is down, say: log it and keep trying
                log.exception("batch runner tick failed")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.poll_s):
                    await self._wake.wait()

    # -- one tick ----------------------------------------------------------------------

    async def _tick(self) -> None:
        now = self.clock()
        jobs = await self.store.unfinished(now)
        self._jobs = {job.id: job for job in jobs}
        for job in jobs:
            await self._advance(job, now)
        self._preempt()
        await self._fill(jobs, now)
        if now - self._renewed >= self.config.lease_s / 3:
            await self.store.renew(self.owner, now, self.config.lease_s)
            self._renewed = now
        if now - self._gauged >= JOB_GAUGE_EVERY_S:
            counts = await self.store.counts_by_status()
            self.metrics.jobs = {s.value: counts.get(s.value, 0) for s in Status}
            self._gauged = now

    async def _advance(self, job: Job, now: float) -> None:
        """One step of a job's life, where one is due."""
        store = self.store
        if job.status == Status.VALIDATING:
            await store.move(job.id, [Status.VALIDATING], Status.IN_PROGRESS, now)
        elif job.status == Status.IN_PROGRESS:
            if now >= job.expires_at:
                log.info("batch %s expired with %d lines not run", job.id, job.pending)
                await store.move(job.id, [Status.IN_PROGRESS], Status.FINALIZING, now, "expired")
                self._abort_job(job.id, "expired")
            elif job.pending == 0 and job.running == 0:
                await store.move(
                    job.id, [Status.IN_PROGRESS], Status.FINALIZING, now, Status.COMPLETED
                )
        else:
            final = final_status(job.status, job.ending)
            if final is None:
                return
            self._abort_job(job.id, final.value)
            if not any(r.claim.batch_id == job.id for r in self._runs.values()):

                def render(
                    rows: list[tuple[int, str, Result | None]],
                ) -> tuple[bytes | None, bytes | None]:
                    if job.endpoint == MESSAGES_ENDPOINT:  # a Message Batch: its results file
                        return render_results(final, rows)
                    return render_files(job.id, final, rows)

                if await store.finish(job, final, now, render):
                    log.info("batch %s %s", job.id, final.value)
                    self._gauged = 0.0  # the jobs gauge shows it on the next tick

    def _abort_job(self, batch_id: str, why: str) -> None:
        for run in list(self._runs.values()):
            if run.claim.batch_id == batch_id:
                self._abort(run, why)

    def _abort(self, run: _Run, why: str) -> None:
        if run.aborted is None and run.task is not None:
            run.aborted = why
            run.task.cancel()

    def _preempt(self) -> None:
        """Abort the newest batch lines (not promoted ones) while online requests wait past
        the bound: their slots go to the online requests, the lines back to the queue."""
        oldest = self.admission.fair.oldest_arrival(Priority.SHEDDABLE)
        wait = time.monotonic() - oldest if oldest is not None else None
        candidates = [r for r in self._runs.values() if not r.promoted and r.aborted is None]
        if not should_preempt(wait, self.config.preempt_after_s, len(candidates)):
            return
        candidates.sort(key=lambda r: r.started, reverse=True)
        for run in candidates[: max(1, self.admission.queued)]:
            log.info("batch line %s#%d preempted", run.claim.batch_id, run.claim.line_no)
            self.metrics.preemptions += 1
            self._abort(run, "preempted")

    async def _fill(self, jobs: list[Job], now: float) -> None:
        runnable = [j for j in jobs if j.status == Status.IN_PROGRESS and j.pending > 0]
        if not runnable:
            return
        cfg = self.config
        serving = [
            r
            for r in self.fleet.replicas
            if r.healthy and not r.ejected and not r.quarantined and not r.draining
        ]
        admission = self.admission
        free = admission.limit - admission.active if admission.limit else None
        online_waiting = admission.fair.oldest_arrival(Priority.SHEDDABLE) is not None
        plain = sum(1 for r in self._runs.values() if not r.promoted)
        slots = spare_slots(
            (r.in_flight for r in serving), cfg.max_in_flight_per_replica, online_waiting, plain,
            free,
        )  # fmt: skip
        if slots:
            for claim in await self.store.claim(self.owner, slots, now, cfg.lease_s):
                self._launch(claim, promoted=False)
        # Pacing: a job behind its line gets the lines it lacks in the standard class, up to
        # what the fleet could hold of batch work, whatever the spare capacity.
        cap = cfg.max_in_flight_per_replica * len(serving)
        promoted = sum(1 for r in self._runs.values() if r.promoted)
        for job in runnable:
            started = job.times.get("in_progress_at", job.created_at)
            finished = job.completed + job.failed
            lag = behind(
                job.total, finished, job.running, started, job.expires_at, now, cfg.pace_fraction
            )
            n = min(lag, cap - promoted)
            if n <= 0:
                continue
            claims = await self.store.claim(self.owner, n, now, cfg.lease_s, batch_id=job.id)
            for claim in claims:
                self._launch(claim, promoted=True)
            promoted += len(claims)

    # -- one line ----------------------------------------------------------------------

    def _launch(self, claim: Claim, promoted: bool) -> None:
        run = _Run(claim, promoted, time.monotonic())
        self._runs[(claim.batch_id, claim.line_no)] = run
        run.task = asyncio.create_task(self._run_line(run))

    async def _run_line(self, run: _Run) -> None:
        claim = run.claim
        try:
            try:
                outcome = await self._execute(run)
            except asyncio.CancelledError:
                if run.aborted is None:
                    raise  # not ours: the router is going down
                outcome = _Outcome(retry_after_s=0.0)
            await self._settle(run, outcome)
        except Exception:
            log.exception("batch line %s#%d failed to settle", claim.batch_id, claim.line_no)
        finally:
            self._runs.pop((claim.batch_id, claim.line_no), None)
            if run.aborted is None:
                self.wake()  # a slot freed: look for the next line now

    async def _settle(self, run: _Run, outcome: _Outcome) -> None:
        claim, store, now = run.claim, self.store, self.clock()
        result = outcome.result
        if result is None and outcome.failed_try and claim.attempts + 1 >= self.config.max_attempts:
            result = Result(None, b"", _request_id(claim), "no_replica", "No replica could run it.")
        if result is not None:
            if await store.complete(self.owner, claim, result):
                self.metrics.line("completed" if result.ok else "failed")
            return
        await store.release(
            self.owner, claim, now + (outcome.retry_after_s or 0.0), outcome.failed_try
        )
        self.metrics.line("requeued")

    async def _execute(self, run: _Run) -> _Outcome:
        """Send the line through the router's path; what to do with what came back."""
        claim = run.claim
        job = self._jobs.get(claim.batch_id)
        tenant = job.tenant if job is not None else "default"
        request_id = _request_id(claim)
        headers = CIMultiDict({"Content-Type": "application/json", "X-Request-Id": request_id})
        request = InternalRequest(claim.url, headers, claim.body)
        priority = Priority.STANDARD if run.promoted else Priority.SHEDDABLE
        try:
            response = await self.pipeline.serve_internal(
                request, _parser(claim.url), tenant, priority
            )
        except errors.ApiError as exc:
            if exc.status == 429:  # admission or the tenant's budget: wait, then try again
                after = float((exc.headers or {}).get("Retry-After", RETRY_BACKOFF_S))
                return _Outcome(retry_after_s=after)
            if exc.status >= 500:  # no replica could take it now
                return _Outcome(retry_after_s=RETRY_BACKOFF_S, failed_try=True)
            code = exc.code or exc.error_type
            return _Outcome(Result(exc.status, exc.body(), request_id, code, exc.message))
        status = response.status
        body = getattr(response, "body", b"")
        body = body if isinstance(body, bytes) else b""
        if retryable_status(status):
            code, message = error_of(status, body)
            outcome = _Outcome(retry_after_s=RETRY_BACKOFF_S, failed_try=True)
            if run.claim.attempts + 1 >= self.config.max_attempts:
                outcome.result = Result(status, body, request_id, code, message)
            return outcome
        if status >= 400:
            code, message = error_of(status, body)
            return _Outcome(Result(status, body, request_id, code, message))
        return _Outcome(Result(status, body, request_id))


def _request_id(claim: Claim) -> str:
    return f"{claim.batch_id}-{claim.line_no}"


def _parser(url: str) -> Callable[[bytes], ParsedRequest]:
    if url == MESSAGES_ENDPOINT:
        return parse_messages
    return parse_chat if url.endswith("/chat/completions") else parse_completion
