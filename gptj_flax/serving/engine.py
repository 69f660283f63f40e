"""The serving engine: continuous batching over decode slots.

One thread owns the model. Request handlers (on the event loop) ``submit`` a :class:`Job` — one
request's prompts, each with its own settings — to a bounded queue and await its future (or read
its stream). Between decode steps the engine thread

- frees the slot of every row that finished, met a stop string, or whose client went away;
- moves waiting rows into free slots: short prompts are prefilled together in one call, a long one
  chunk by chunk (one chunk per step), so no prefill holds decoding up for longer than one chunk;
- advances every occupied slot, each row with its own sampling settings, seed and length: by up to
  ``decode_steps`` steps in one device call while no prompt waits for a slot, else by one, so a
  prompt that arrives waits for at most the call in flight (see "Multi-step decoding" below);
- hands each job its new text (streaming) or, once all its rows are done, its completions.

Given a prefill mesh (devices beside the decode slots'), a second thread prefills there instead:
it takes waiting rows as slots come free, prefills them while the decode step runs, and sends
their first tokens at once; the engine thread then only places the prefilled rows into free slots
between two steps. A request's first token then waits for its own prefill, not for the step in
flight and the admissions queued before it.

The host's share of a step (detokenising, stop strings, streaming) runs while the device computes
the next one: the engine waits for the step in flight to end, admits waiting rows (sending their
first tokens), queues the next step, and only then works through the tokens of the step that ended. So a row's end (or its stop
string) is seen one step later than the device knows it, and its slot is reused one step later.

Multi-step decoding: a device call of K steps costs the host one dispatch and one read instead
of K, so the device idles less between steps. A row still ends where it would with one step a call:
the program stops a row at EOS or its token limit itself, and the host cuts a row's tokens at its
first stop string, so the tokens a row made past its stop in the same call are never sent, counted
or logged (nor counted as busy in /metrics). Such a row, or a cancelled one, runs on for the rest
of the call and through the call queued behind it, its tokens dropped, as with one step a call it
runs one step more. K steps are only run while nothing waits to be admitted, so a new prompt is
admitted before the call after the one in flight.

Every program is compiled during the warm-up, for every prompt bucket, prefill batch and attention
window, so requests coming and going never compile anything.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time

from jax.sharding import Mesh

from gptj_flax.errors import GptjFlaxError
from gptj_flax.sampling.adapter_bank import AdapterBank
from gptj_flax.sampling.api import Completion, LanguageModel, Piece
from gptj_flax.sampling.decoding import EOS, FINISH_REASON_OF_CODE, RUNNING
from gptj_flax.sampling.prefix_cache import PromptCounts
from gptj_flax.sampling.samplers import SamplingParams
from gptj_flax.sampling.slots import MAX_PREFILL_ROWS, Pending, Prefill, Prefilled, Request, Slots, Tokens
from gptj_flax.sampling.stopping import TextTracker
from gptj_flax.serving.metrics import Metrics
from gptj_flax.serving.worker import FAILED, READY, STOPPED, WARMING_UP, Job, NotAccepting, Prompt, QueueFull, StreamEnd

logger = logging.getLogger(__name__)

ENGINE_STACK_BYTES = 256 * 2**20

__all__ = ["Engine", "FAILED", "READY", "STOPPED", "WARMING_UP"]


@dataclasses.dataclass(eq=False)
class _Row:
    """One prompt of a job, from the queue to its completion."""

    job: Job
    index: int  # its place in the job's rows
    prompt: Prompt
    tracker: TextTracker
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top: list[dict[int, float]] = dataclasses.field(default_factory=list)  # where asked: alternatives per token
    sent: int = 0  # tokens already streamed
    slot: int | None = None
    finish: str | None = None  # "eos", "length", "stop"; None while running
    last_token_at: float | None = None

    @property
    def wants_text(self) -> bool:
        """Whether its text is needed at every step: to stream it, or to look for stop strings."""
        return self.job.stream or bool(self.prompt.stop)

    @property
    def wants_top(self) -> bool:
        return self.job.logprobs and self.prompt.top_logprobs > 0

    @property
    def length(self) -> int:
        return len(self.prompt.tokens) + len(self.tokens)


@dataclasses.dataclass
class _Step:
    """A decode step queued on the device: its tokens, and the rows that were running when it was."""

    pending: Pending
    rows: list[_Row]
    queued_at: float
    ended_at: float | None = None


class Engine:
    """Owns the model: warms it up, then runs queued jobs' rows in decode slots until stopped.

    Args:
      slots: decode slots (rows generated together); also the most prompts one request may have.
      queue_size: prompts that may wait for a slot; beyond it :meth:`submit` raises QueueFull.
      length: the longest prompt + completion of one row (each slot's cache columns).
      chunk: prompts longer than this many tokens are prefilled in chunks of it.
      top_logprobs: the most alternatives a row may ask for at each token.
      prefill_mesh: devices to prefill new prompts on, beside the decode steps (see the module's
        docstring); default: prefill between steps, on the model's own devices.
      prefix_cache: reuse the cached full pages of earlier prompts (:mod:`gptj_flax.sampling.prefix_cache`);
        only where prompts are prefilled between steps, so off with a ``prefill_mesh``.
      decode_steps: the most decode steps one device call runs, while no prompt waits (see the
        module's docstring); 1: a call per step.
      adapters: the LoRA adapters served beside the base, each prompt applying the one it names
        (:class:`~gptj_flax.sampling.adapter_bank.AdapterBank`; not with a ``prefill_mesh``).
    """

    def __init__(
        self,
        model: LanguageModel,
        *,
        slots: int,
        queue_size: int,
        length: int,
        chunk: int,
        metrics: Metrics,
        top_logprobs: int = 5,
        prefill_mesh: Mesh | None = None,
        prefix_cache: bool = True,
        decode_steps: int = 1,
        adapters: AdapterBank | None = None,
    ):
        if decode_steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
        self.model, self.metrics, self.prefill_mesh = model, metrics, prefill_mesh
        self.max_batch, self.queue_size, self.length = slots, queue_size, length
        if prefix_cache and prefill_mesh is not None:
            logger.info("the prefix cache is off: it serves prompts prefilled between decode steps only")
        self.decode_steps = decode_steps
        self._slot_args = dict(
            slots=slots,
            length=length,
            chunk=chunk,
            steps=decode_steps,
            top_logprobs=top_logprobs,
            prefill_mesh=prefill_mesh,
            prefix_cache=prefix_cache and prefill_mesh is None,
            adapters=adapters,
        )
        self._counted = PromptCounts()  # the slots' prompt counts already added to the metrics
        self.slots: Slots | None = None
        self.state = WARMING_UP
        self.error: str | None = None
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Row] = collections.deque()
        self._stopping = False
        self._occupied: dict[int, _Row] = {}  # slot → row
        self._release: set[int] = set()  # slots to stop at the next decode call
        self._prefill: tuple[Prefill, _Row, int] | None = None  # a long prompt and its reserved slot
        self._in_flight: _Step | None = None  # the decode step queued last, its tokens not yet read
        self._first: list[tuple[list[_Row], Pending]] = []  # admitted rows whose first tokens are not yet read
        self._step_seconds = 0.05  # running mean of one decode step, for Retry-After
        self._thread = threading.Thread(target=self._run, name="gptj-engine", daemon=True)
        # with a prefill mesh: the thread that prefills there, the rows it holds, and those it has
        # prefilled (their first tokens sent) that wait for a slot
        self._prefiller: threading.Thread | None = None
        if prefill_mesh is not None:
            self._prefiller = threading.Thread(target=self._run_prefill, name="gptj-prefill", daemon=True)
        self._prefilling = 0
        self._ready: list[tuple[list[_Row], Prefilled]] = []
        metrics.busy_slots.set_function(self._held_slots)

    # -- event-loop side -----------------------------------------------------------------------
    def start(self) -> None:
        # XLA compiles the engine's programs on this thread and its compiler's recursion grows with
        # the program; a stack costs only address space until it is touched, so the thread gets a
        # generous one rather than the process default (often 8 MiB).
        previous = threading.stack_size(ENGINE_STACK_BYTES)
        try:
            self._thread.start()
            if self._prefiller is not None:
                self._prefiller.start()
        finally:
            threading.stack_size(previous)

    def stop(self, timeout: float | None = None) -> None:
        """Finish the rows queued and running, then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._prefiller is not None:
            self._prefiller.join(timeout)

    @property
    def queued_rows(self) -> int:
        return len(self._waiting)

    def submit(self, job: Job) -> None:
        """Queue ``job``'s rows; raises :class:`QueueFull` or :class:`NotAccepting` instead of queuing it."""
        with self._cond:
            if self._stopping or self.state != READY:
                raise NotAccepting(self.error or f"the model is {self.state.replace('_', ' ')}")
            if len(self._waiting) + len(job.rows) > self.queue_size:
                mean_tokens = sum(r.prompt.max_new_tokens for r in self._waiting) / max(1, len(self._waiting))
                rounds = (len(self._waiting) + len(job.rows)) / self.max_batch
                raise QueueFull(max(1, math.ceil(rounds * mean_tokens * self._step_seconds)))
            for i, prompt in enumerate(job.rows):
                self._waiting.append(_Row(job, i, prompt, TextTracker(self.model.tokenizer, prompt.stop)))
            self.metrics.queue_depth.set(len(self._waiting))
            self._cond.notify_all()

    def cancel(self, job: Job) -> None:
        """The client went away: its waiting rows are dropped now, its running ones at the next step."""
        with self._cond:
            job.cancelled = True
            kept = [row for row in self._waiting if row.job is not job]
            if len(kept) != len(self._waiting):
                self._waiting = collections.deque(kept)
                self.metrics.queue_depth.set(len(self._waiting))
            self._cond.notify_all()

    # -- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            start = time.monotonic()
            self.slots = self.model.slots(**self._slot_args)
            if not self.slots.warm_up(stop=lambda: self._stopping):
                logger.info("warm-up stopped after %.1f s: the server is shutting down", time.monotonic() - start)
                self._set_state(STOPPED)
                return
            logger.info(
                "warm-up: %d decode slots of %d tokens, %d programs compiled in %.1f s",
                self.slots.slots,
                self.length,
                self.slots.compilations(),
                time.monotonic() - start,
            )
        except Exception as e:  # a model that cannot generate cannot serve: report it on /health
            if isinstance(e, GptjFlaxError):  # its message says what is wrong and what to do: no traceback
                logger.error("warm-up failed: %s", e)
            else:
                logger.exception("warm-up failed")
            self.error = f"warm-up failed: {e}"
            self._set_state(FAILED)
            return
        self.metrics.slots.set(self.slots.slots)
        self.metrics.kv_pages.set(self.slots.table.pages)
        # read on the server's thread while the engine's changes it: a count that may be a step old
        self.metrics.kv_pages_used.set_function(lambda: self.slots.table.in_use if self.slots else 0)
        self.metrics.prefix_cache_pages.set_function(
            lambda: self.slots.prefix.pages if self.slots and self.slots.prefix else 0
        )
        self.metrics.prefix_cache_hit_rate.set_function(lambda: self.slots.counts.hit_rate if self.slots else 0.0)
        self._set_state(READY)
        while self._wait_for_work():
            try:
                self._iterate()
            except Exception as e:
                logger.exception("generation failed")
                self._fail_all(e)
        self._set_state(STOPPED)

    def _set_state(self, state: str) -> None:
        with self._cond:  # the prefill thread waits for the engine to be ready, or to end
            self.state = state
            self._cond.notify_all()

    def _wait_for_work(self) -> bool:
        with self._cond:
            while not self._has_work():
                if self._stopping and not (self._waiting or self._prefilling or self._ready):
                    return False
                self._cond.wait()
            return True

    def _has_work(self) -> bool:
        """Whether the engine thread has something to do now (waiting rows are the prefill thread's, if any)."""
        running = self._occupied or self._in_flight or self._ready
        if self._prefiller is not None:
            return bool(running)
        return bool(running or self._waiting or self._prefill or self._first)

    def _iterate(self) -> None:
        slots = self.slots
        assert slots is not None
        step, self._in_flight = self._in_flight, None
        if step is not None:
            slots.wait()  # the step has ended: what comes next can be queued behind it at once
            step.ended_at = time.monotonic()
        for slot, row in list(self._occupied.items()):  # clients that went away free their slots now
            if row.job.cancelled:
                self._free(slot)
        if self._prefiller is not None:
            self._place_ready()
        if self._prefill is not None:
            self._advance_prefill()
        self._admit()
        self._count_prompts()
        # New rows' first tokens go out before the next step is queued: their clients wait for
        # nothing else, and the step's dispatch would only delay them.
        first, self._first = self._first, []
        for rows, pending in first:
            self._read_first(rows, pending)
        if any(row.finish is None for row in self._occupied.values()):
            self._dispatch_decode()
        if step is not None:
            self._read_step(step)
        if self._prefiller is not None:
            with self._cond:  # slots may have come free: the prefill thread may take more rows
                self._cond.notify_all()

    def _free_slots(self) -> list[int]:
        assert self.slots is not None
        reserved = {self._prefill[2]} if self._prefill else set()
        return [s for s in range(self.slots.slots) if s not in self._occupied and s not in reserved]

    def _take(self, limit: int) -> list[_Row]:
        """Up to ``limit`` waiting rows from the head of the queue that are short enough to admit together."""
        assert self.slots is not None
        taken: list[_Row] = []
        with self._cond:
            while self._waiting and len(taken) < limit:
                head = self._waiting[0]
                if head.job.cancelled:
                    self._waiting.popleft()
                    continue
                if self.slots.prompt_columns(len(head.prompt.tokens)) > self.slots.chunk:
                    # a long prompt is prefilled alone, and only once the prefill in progress is done
                    if not taken and self._prefill is None:
                        taken.append(self._waiting.popleft())
                    break
                taken.append(self._waiting.popleft())
            self.metrics.queue_depth.set(len(self._waiting))
        return taken

    def _request(self, row: _Row) -> Request:
        p = row.prompt
        eos = self.model.eos_token_id
        return Request(
            tokens=p.tokens,
            max_new_tokens=p.max_new_tokens,
            eos_id=-1 if eos is None else int(eos),
            seed=p.seed,
            sampling=SamplingParams.of([p.sampling]),
            want_top=row.wants_top,
            adapter=p.adapter,
        )

    def _admit(self) -> None:
        slots = self.slots
        assert slots is not None
        free = self._free_slots()
        if not free or not self._waiting or self._prefiller is not None:
            return
        rows = self._take(min(len(free), MAX_PREFILL_ROWS))
        if not rows:
            return
        now = time.monotonic()
        for row in rows:
            self.metrics.queue_wait.observe(now - row.job.submitted_at)
        if len(rows) == 1 and slots.prompt_columns(len(rows[0].prompt.tokens)) > slots.chunk:
            try:
                prefill = slots.start_prefill(self._request(rows[0]))
            except Exception as e:
                self._answer_error([rows[0].job], e)
                raise
            self._prefill = (prefill, rows[0], free[0])
            self._advance_prefill()
            return
        try:
            pending = slots.dispatch_admit([self._request(r) for r in rows], free[: len(rows)])
        except Exception as e:
            self._answer_error({id(r.job): r.job for r in rows}.values(), e)
            raise
        for row, slot in zip(rows, free, strict=False):
            self._occupy(row, slot)
        self._first.append((rows, pending))

    # -- prefill thread (with a prefill mesh) ---------------------------------------------------
    def _count_prompts(self) -> None:
        """Add the prompt tokens admitted since the last call to the metrics."""
        assert self.slots is not None
        with self._cond:  # admitted on the engine thread, or on the prefill thread
            counts, counted = self.slots.counts, self._counted
            self.metrics.prompt_tokens.inc(counts.prompt - counted.prompt)
            self.metrics.prefilled_tokens.inc(counts.prefilled - counted.prefilled)
            self._counted = PromptCounts(counts.prompt, counts.prefilled)

    def _run_prefill(self) -> None:
        while True:
            with self._cond:
                while not (self.state == READY and self._waiting and self._room() > 0):
                    if self.state in (FAILED, STOPPED) or (self._stopping and not self._waiting):
                        self._cond.notify_all()  # the engine thread may be waiting for this one to end
                        return
                    self._cond.wait()
                rows = self._take(min(self._room(), MAX_PREFILL_ROWS))
                self._prefilling = len(rows)
            if rows:
                self._prefill_rows(rows)

    def _held_slots(self) -> int:
        """Slots that a row holds, is being prefilled for (beside), or has been prefilled for and waits for."""
        with self._cond:
            ready = sum(1 for rows, _ in self._ready for row in rows if row.finish is None and not row.job.cancelled)
            return len(self._occupied) + self._prefilling + ready

    def _room(self) -> int:
        """Slots that no row holds, is being prefilled for, or waits for."""
        assert self.slots is not None
        return self.slots.slots - self._held_slots()

    def _prefill_rows(self, rows: list[_Row]) -> None:
        """Prefill ``rows`` on the prefill mesh, send their first tokens, and queue them for slots."""
        slots = self.slots
        assert slots is not None
        now = time.monotonic()
        for row in rows:
            self.metrics.queue_wait.observe(now - row.job.submitted_at)
        try:
            if len(rows) == 1 and slots.prompt_columns(len(rows[0].prompt.tokens)) > slots.chunk:
                prefill = slots.start_prefill(self._request(rows[0]))
                while not prefill.done:
                    slots.prefill_chunk(prefill)
                prefilled = slots.dispatch_first(prefill)
            else:
                prefilled = slots.dispatch_prefill([self._request(r) for r in rows])
            first = prefilled.pending.result()
            self._count_prompts()
        except Exception as e:
            logger.exception("prefill failed")
            self._answer_error({id(r.job): r.job for r in rows}.values(), e)
            with self._cond:
                self._prefilling = 0
                self._cond.notify_all()
            return
        now = time.monotonic()
        for i, row in enumerate(rows):
            if row.job.cancelled:
                row.finish = "length"  # never placed; nobody reads it
                continue
            self.metrics.time_to_first_token.observe(now - row.job.submitted_at)
            row.last_token_at = now
            self._extend(row, first, i, 1)
        with self._cond:
            self._ready.append((rows, prefilled))
            self._prefilling = 0
            self._cond.notify_all()

    def _place_ready(self) -> None:
        """Place prefilled rows that are still running into free slots (engine thread)."""
        assert self.slots is not None
        placed: list[tuple[Prefilled, list[int | None]]] = []
        with self._cond:  # a row is always counted as held: waiting for a slot, or in one
            free, kept = self._free_slots(), []
            for rows, prefilled in self._ready:
                live = [row for row in rows if row.finish is None and not row.job.cancelled]
                if len(live) > len(free):
                    kept.append((rows, prefilled))
                    continue
                targets: list[int | None] = []
                for row in rows:
                    slot = free.pop(0) if row in live else None
                    if slot is not None:
                        self._occupy(row, slot)
                    targets.append(slot)
                if live:
                    placed.append((prefilled, targets))
            self._ready = kept
        for prefilled, targets in placed:
            self.slots.place(prefilled, targets)

    def _advance_prefill(self) -> None:
        assert self.slots is not None and self._prefill is not None
        prefill, row, slot = self._prefill
        if row.job.cancelled:
            self._prefill = None
            return
        self.slots.prefill_chunk(prefill)
        if prefill.done:
            self._prefill = None
            pending = self.slots.dispatch_insert(prefill, slot)
            self._occupy(row, slot)
            self._first.append(([row], pending))

    def _occupy(self, row: _Row, slot: int) -> None:
        """``row``'s sequence is being inserted into ``slot``; its first token comes with the insert."""
        row.slot = slot
        self._occupied[slot] = row
        self._release.discard(slot)  # the slot holds a new sequence: a pending stop is for the old one

    def _read_first(self, rows: list[_Row], pending: Pending) -> None:
        """The first tokens of admitted rows (``rows[i]`` is the call's row ``i``)."""
        first = pending.result()
        now = time.monotonic()
        for i, row in enumerate(rows):
            if row.finish is not None or self._occupied.get(row.slot) is not row:
                continue  # its client went away in the meantime
            self.metrics.time_to_first_token.observe(now - row.job.submitted_at)
            row.last_token_at = now
            self._extend(row, first, i, 1)

    def _dispatch_decode(self) -> None:
        slots = self.slots
        assert slots is not None
        running = [row for row in self._occupied.values() if row.finish is None]
        release, self._release = sorted(self._release), set()
        steps = 1 if self._prompt_waiting() else self.decode_steps
        pending = slots.dispatch_decode(release, steps, max(self._occupied))
        self._in_flight = _Step(pending, running, time.monotonic())

    def _prompt_waiting(self) -> bool:
        """Whether a prompt waits to be admitted: queued, being prefilled, or prefilled for a slot."""
        with self._cond:
            return bool(self._waiting or self._prefill or self._prefilling or self._ready)

    def _read_step(self, step: _Step) -> None:
        """The tokens of a decode step that has ended, for the rows that were running in it."""
        slots = self.slots
        assert slots is not None and step.ended_at is not None
        out = step.pending.result()
        done = int(max((out.num_generated[row.slot] - len(row.tokens) for row in step.rows), default=0))
        self._step_seconds = 0.9 * self._step_seconds + 0.1 * (step.ended_at - step.queued_at) / max(done, 1)
        self.metrics.decode_steps.inc(done)
        self.metrics.slot_steps.inc(done * slots.slots)
        now = time.monotonic()
        for row in step.rows:
            if row.finish is not None or self._occupied.get(row.slot) is not row:
                continue  # ended (or its client left) after the step was queued: its token is dropped
            slot = row.slot
            assert slot is not None
            n = int(out.num_generated[slot]) - len(row.tokens)
            if n:
                self.metrics.inter_token_latency.observe((now - (row.last_token_at or step.queued_at)) / n)
                row.last_token_at = now
            self.metrics.busy_slot_steps.inc(self._extend(row, out, slot, n))

    def _extend(self, row: _Row, out: Tokens, i: int, n: int) -> int:
        """Add the ``n`` tokens of ``out``'s row ``i`` to ``row``; stream its new text; finish it at
        EOS, its length, or a stop string. Returns how many of them are its output: those up to its
        stop string, if they hold one."""
        before = len(row.tokens)
        row.tokens += [int(t) for t in out.tokens[i, :n]]
        row.logprobs += [float(x) for x in out.logprobs[i, :n]]
        if row.wants_top:
            k = row.prompt.top_logprobs
            row.top += [
                {int(t): float(x) for t, x in zip(ids[:k], values[:k], strict=True)}
                for ids, values in zip(out.top_ids[i, :n], out.top_logprobs[i, :n], strict=True)
            ]
        finish = int(out.finish[i])
        ended = finish != RUNNING
        if row.wants_text or ended:
            text_tokens = row.tokens[:-1] if finish == EOS else row.tokens
            text = row.tracker.update(text_tokens, final=ended)
            if row.job.stream and not row.job.cancelled:
                self._stream(row, text)
            if row.tracker.stopped:
                row.finish = "stop"
                if row.slot is not None:
                    self._release.add(row.slot)
        if ended and row.finish is None:
            row.finish = FINISH_REASON_OF_CODE[finish]
        kept = max(0, row.tracker.num_tokens - before) if row.tracker.stopped else n
        self.metrics.generated_tokens.inc(kept)
        if row.finish is not None:
            self._finish(row)
        return kept

    def _stream(self, row: _Row, text: str) -> None:
        """Send the row's new text (and, if the job asks, the tokens since its last piece)."""
        piece: str = text
        if row.job.logprobs:
            end = row.tracker.num_tokens if row.tracker.stopped else len(row.tokens)
            start, row.sent = row.sent, max(row.sent, end)
            top = row.top[start:end] if row.wants_top else None
            piece = Piece(text, row.tokens[start:end], row.logprobs[start:end], top)
        if piece:
            pieces: list[str] = [""] * len(row.job.rows)
            pieces[row.index] = piece
            row.job.send(pieces)

    def _finish(self, row: _Row) -> None:
        if row.slot is not None and self._occupied.get(row.slot) is row:  # else: it never had a slot
            self._occupied.pop(row.slot)
            assert self.slots is not None
            self.slots.free([row.slot])  # a stop string's row is released too (see _extend)
        n = row.tracker.num_tokens if row.finish == "stop" else len(row.tokens)
        job = row.job
        job.outputs[row.index] = Completion(
            text=row.tracker.text,
            finish_reason=row.finish or "length",
            prompt_tokens=len(row.prompt.tokens),
            completion_tokens=n,
            tokens=row.tokens[:n],
            logprobs=row.logprobs[:n],
            top_logprobs=row.top[:n] if row.wants_top else None,
        )
        with self._cond:  # a job's rows may end on the engine and the prefill thread at once
            answered, job.answered = job.answered, all(c is not None for c in job.outputs)
        if job.answered and not answered:
            if job.stream:
                job.send(StreamEnd(finish_reasons=tuple(c.finish_reason for c in job.outputs)))
            else:
                job.resolve(list(job.outputs))

    def _free(self, slot: int) -> None:
        """A client left: its row stops at the next decode call, and its pages are free now."""
        assert self.slots is not None
        self._occupied.pop(slot, None)
        self._release.add(slot)
        self.slots.free([slot])

    def _fail_all(self, error: BaseException) -> None:
        """A device call failed: every job in the slots or the prefill gets the error; the queue goes on."""
        rows = list(self._occupied.values()) + ([self._prefill[1]] if self._prefill else [])
        with self._cond:
            rows += [row for ready, _ in self._ready for row in ready if row.finish is None]
            self._ready = []
        self._occupied.clear()
        self._prefill = None
        self._release = set()
        self._in_flight, self._first = None, []
        assert self.slots is not None
        self.slots.reset()  # the failed call may have consumed the state it was given
        self._answer_error({id(r.job): r.job for r in rows}.values(), error)

    @staticmethod
    def _answer_error(jobs, error: BaseException) -> None:
        for job in jobs:
            if job.stream:
                job.send(StreamEnd(error))
            else:
                job.resolve(error=error)
