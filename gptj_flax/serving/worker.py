"""Requests as the engine (:mod:`gptj_flax.serving.engine`) takes them: a :class:`Job` is one
request's prompts, each a :class:`Prompt` with its own settings, answered on the request's event
loop — through ``result`` once (plain), or through ``pieces`` as text is produced (streaming).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence

from gptj_flax.sampling.samplers import Sampling

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
    sampling: Sampling
    seed: int
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0  # alternatives reported per generated token (with the job's logprobs)
    adapter: int = 0  # the row of the server's adapter bank it applies (0: none, the base)


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

    def __init__(self, rows: Sequence[Prompt], *, stream: bool = False, logprobs: bool = False, model: str = ""):
        self.rows = list(rows)
        self.model = model  # the model the request named (the base's or an adapter's name), for its answer
        self.stream, self.logprobs = stream, logprobs
        self.loop = asyncio.get_running_loop()
        self.result: asyncio.Future = self.loop.create_future()
        self.pieces: asyncio.Queue | None = asyncio.Queue() if stream else None
        self.cancelled = False
        self.submitted_at = time.monotonic()
        self.outputs: list = [None] * len(self.rows)  # each row's Completion, filled in by the engine
        self.answered = False  # the engine has sent its completions (or its stream's end)

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
