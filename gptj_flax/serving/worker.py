"""The batching worker: one thread owns the model and turns queued requests into batched generate calls.

Generation is blocking device work, so it runs in a dedicated thread fed by a bounded queue.
Request handlers (on the event loop) ``submit`` a :class:`Job` — one request's prompts, each with
its own settings — and await its future; the worker takes the oldest job, waits a short window
for more, and runs up to ``max_batch`` prompts of compatible jobs as one ``generate`` call with
per-prompt settings, then hands each job its own completions back on the event loop. A job is
answered exactly once (its future is set once; a cancelled one is skipped). A job whose client
went away is dropped if it is still waiting, and its slot is free at once.

Streaming jobs are batched with each other (never with plain ones) and run through
``LanguageModel.stream``; their text goes to each job's asyncio queue as it is produced.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Sequence

from gptj_flax.serving.metrics import Metrics

logger = logging.getLogger(__name__)

WARMING_UP, READY, FAILED, STOPPED = "warming_up", "ready", "failed", "stopped"


class QueueFull(Exception):
    """The queue has no room for the request's prompts."""

    def __init__(self, retry_after: int):
        super().__init__(f"the request queue is full; retry in {retry_after} s")
        self.retry_after = retry_after


class NotAccepting(Exception):
    """The worker is not taking requests: warming up, failed, or stopped."""


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt (token ids) and its generation settings: one row of a batch."""

    tokens: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    typical_p: float
    seed: int
    stop: tuple[str, ...] = ()
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    top_logprobs: int = 0  # alternatives reported per generated token (with the job's logprobs)


@dataclasses.dataclass(frozen=True)
class StreamEnd:
    """Last item of a streaming job's queue; ``error`` when generation failed, else each row's
    finish reason ("eos", "stop", "length"; ``None`` where the batch was cut short)."""

    error: BaseException | None = None
    finish_reasons: tuple[str | None, ...] = ()


class Job:
    """One request's rows; answered through ``result`` (plain) or ``pieces`` (streaming) on ``loop``.

    ``result`` gets the request's completions (one per row, in order); ``pieces`` gets a list of
    new text per row each time some row's text grows, then a :class:`StreamEnd`.
    """

    def __init__(self, rows: Sequence[Prompt], *, stream: bool = False, logprobs: bool = False):
        self.rows = list(rows)
        self.stream, self.logprobs = stream, logprobs
        self.loop = asyncio.get_running_loop()
        self.result: asyncio.Future = self.loop.create_future()
        self.pieces: asyncio.Queue | None = asyncio.Queue() if stream else None
        self.cancelled = False
        self.submitted_at = time.monotonic()

    def _call(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop has closed: nobody is waiting any more
            pass

    def resolve(self, value=None, error: BaseException | None = None) -> None:
        def settle():
            if self.result.done():
                return
            if error is not None:
                self.result.set_exception(error)
            else:
                self.result.set_result(value)

        self._call(settle)

    def send(self, item) -> None:
        self._call(self.pieces.put_nowait, item)


class BatchWorker:
    """Owns the model: warms it up, then serves queued jobs in batches until stopped."""

    def __init__(
        self, model, *, max_batch: int, queue_size: int, batch_window_s: float, warmup_tokens: int, metrics: Metrics
    ):
        self.model, self.metrics = model, metrics
        self.max_batch, self.queue_size, self.batch_window_s = max_batch, queue_size, batch_window_s
        self.warmup_tokens = warmup_tokens
        self.state = WARMING_UP
        self.error: str | None = None
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._waiting_rows = 0
        self._stopping = False
        self._batch_seconds = 1.0  # running mean of one batch's duration, for Retry-After
        self._last_rows = max_batch  # rows of the last batch, whose clients may be back soon (_next_batch)
        self._thread = threading.Thread(target=self._run, name="gptj-batch-worker", daemon=True)

    # -- event-loop side -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Finish the jobs already queued, then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)

    @property
    def queued_rows(self) -> int:
        return self._waiting_rows

    def submit(self, job: Job) -> None:
        """Queue ``job``; raises :class:`QueueFull` or :class:`NotAccepting` instead of queuing it."""
        with self._cond:
            if self._stopping or self.state != READY:
                raise NotAccepting(self.error or f"the model is {self.state.replace('_', ' ')}")
            if self._waiting_rows + len(job.rows) > self.queue_size:
                batches_ahead = self._waiting_rows / self.max_batch + 1
                raise QueueFull(max(1, math.ceil(batches_ahead * self._batch_seconds)))
            self._waiting.append(job)
            self._waiting_rows += len(job.rows)
            self.metrics.queue_depth.set(self._waiting_rows)
            self._cond.notify_all()

    def cancel(self, job: Job) -> None:
        """The client went away: drop ``job`` if it still waits; a running one's output is discarded."""
        with self._cond:
            job.cancelled = True
            if job in self._waiting:
                self._waiting.remove(job)
                self._waiting_rows -= len(job.rows)
                self.metrics.queue_depth.set(self._waiting_rows)

    # -- worker thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._warm_up()
        except Exception as e:  # a model that cannot generate cannot serve: report it on /health
            logger.exception("warm-up failed")
            self.error, self.state = f"warm-up failed: {e}", FAILED
            return
        self.state = READY
        while (jobs := self._next_batch()) is not None:
            if jobs:
                self._execute(jobs)
        self.state = STOPPED

    def _warm_up(self) -> None:
        """Compile the programs for every batch size up to ``max_batch`` at the warm-up length."""
        start = time.monotonic()
        prompt = [0 if self.model.eos_token_id is None else int(self.model.eos_token_id)]
        new_tokens = max(1, min(self.warmup_tokens, self.model.config.max_len - 1))
        sizes = sorted({min(1 << i, self.max_batch) for i in range(self.max_batch.bit_length() + 1)})
        for size in sizes:
            self.model.generate([prompt] * size, new_tokens, temperature=0.0, ignore_eos=True)
        logger.info("warm-up: batch sizes %s, %d new tokens, in %.1f s", sizes, new_tokens, time.monotonic() - start)

    def _next_batch(self) -> list[Job] | None:
        """Wait for work, then gather compatible jobs; None: stop.

        The worker expects the rows waiting now plus the rows of the batch it just answered (those
        clients usually send their next request at once), and spends the batch window only while
        fewer have arrived: a busy server keeps its batches full, a lone client never waits.
        """
        with self._cond:
            expected = min(self.max_batch, self._waiting_rows + self._last_rows)
            while not self._waiting:
                if self._stopping:
                    return None
                self._cond.wait()
            deadline = time.monotonic() + self.batch_window_s
            while (
                self._compatible_rows() < expected
                and not self._stopping
                and (remaining := deadline - time.monotonic()) > 0
            ):
                self._cond.wait(remaining)
            return self._take()

    def _compatible_rows(self) -> int:
        if not self._waiting:
            return self.max_batch  # nothing left to wait for (the head was cancelled)
        kind = self._waiting[0].stream
        return sum(len(job.rows) for job in self._waiting if job.stream == kind)

    def _take(self) -> list[Job]:
        """The oldest job and the next ones of its kind, in order, while they fit in ``max_batch``."""
        if not self._waiting:
            return []
        kind = self._waiting[0].stream
        taken, rows = [], 0
        for job in list(self._waiting):
            if job.stream != kind:
                continue
            if rows + len(job.rows) > self.max_batch:
                break
            taken.append(job)
            rows += len(job.rows)
            self._waiting.remove(job)
        self._waiting_rows -= rows
        self.metrics.queue_depth.set(self._waiting_rows)
        return taken

    def _execute(self, jobs: list[Job]) -> None:
        rows = [row for job in jobs for row in job.rows]
        self._last_rows = len(rows)
        start = time.monotonic()
        for job in jobs:
            self.metrics.queue_wait.observe(start - job.submitted_at)
        self.metrics.batch_size.observe(len(rows))
        try:
            if jobs[0].stream:
                self._stream(jobs, rows)
                tokens = None
            else:
                tokens = self._generate(jobs, rows)
        except Exception as e:
            logger.exception("a batch of %d prompt(s) failed", len(rows))
            for job in jobs:
                if job.stream:
                    job.send(StreamEnd(e))
                else:
                    job.resolve(error=e)
            return
        seconds = time.monotonic() - start
        self._batch_seconds = 0.8 * self._batch_seconds + 0.2 * seconds
        self.metrics.batch_latency.observe(seconds)
        if tokens is not None:
            self.metrics.generated_tokens.inc(tokens)
            self.metrics.tokens_per_second.set(tokens / max(seconds, 1e-9))

    @staticmethod
    def _settings(rows: list[Prompt]) -> dict:
        return dict(
            max_new_tokens=[r.max_new_tokens for r in rows],
            temperature=[r.temperature for r in rows],
            top_p=[r.top_p for r in rows],
            typical_p=[r.typical_p for r in rows],
            seed=[r.seed for r in rows],
            stop=[list(r.stop) for r in rows],
            top_k=[r.top_k for r in rows],
            min_p=[r.min_p for r in rows],
            repetition_penalty=[r.repetition_penalty for r in rows],
        )

    def _generate(self, jobs: list[Job], rows: list[Prompt]) -> int:
        completions = self.model.generate(
            [r.tokens for r in rows],
            return_tokens=True,
            return_logprobs=any(job.logprobs for job in jobs),
            return_top_logprobs=[r.top_logprobs for r in rows],
            **self._settings(rows),
        )
        offset = 0
        for job in jobs:
            job.resolve(completions[offset : offset + len(job.rows)])
            offset += len(job.rows)
        return sum(c.completion_tokens for c in completions)

    def _stream(self, jobs: list[Job], rows: list[Prompt]) -> None:
        pieces_iter = self.model.stream(
            [r.tokens for r in rows],
            return_logprobs=any(job.logprobs for job in jobs),
            return_top_logprobs=[r.top_logprobs for r in rows],
            **self._settings(rows),
        )
        try:
            for pieces in pieces_iter:
                offset, listening = 0, False
                for job in jobs:
                    own = pieces[offset : offset + len(job.rows)]
                    offset += len(job.rows)
                    if not job.cancelled:
                        listening = True
                        if any(own):
                            job.send(own)
                if not listening:  # every client of this batch went away: stop generating for them
                    break
        finally:
            pieces_iter.close()
        completions = pieces_iter.completions  # None when every client left before the end
        offset = 0
        for job in jobs:
            reasons = (
                (None,) * len(job.rows)
                if completions is None
                else tuple(c.finish_reason for c in completions[offset : offset + len(job.rows)])
            )
            offset += len(job.rows)
            job.send(StreamEnd(finish_reasons=reasons))
