"""The docker API's jobs: ``POST /model/predict`` answers a ``qid`` at once, and ``POST
/model/get_prediction`` the result later. :class:`PredictionStore` holds those jobs, and keeps
finished results only up to a bound, the oldest going first, so that results nobody fetches cannot
fill the memory.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import secrets
import time

from gptj_flax.serving.schemas import QID_LIMIT


@dataclasses.dataclass
class Prediction:
    """One ``/model/predict`` job: whose it is, its context, and (once done) its completion or error,
    and whether anyone has collected it."""

    key: str | None
    context: str
    submitted: float
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    completion: str | None = None
    seconds: float = 0.0
    failed: bool = False
    collected: bool = False


class PredictionStore:
    """The docker API's jobs by qid: every unfinished one, and the last ``keep`` finished ones."""

    def __init__(self, keep: int):
        self.keep = keep
        self._jobs: dict[int, Prediction] = {}
        self._finished: collections.deque[int] = collections.deque()
        self.running = 0  # jobs not finished yet

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, key: str | None, context: str) -> tuple[int, Prediction]:
        while (qid := secrets.randbelow(QID_LIMIT - 1) + 1) in self._jobs:
            pass
        prediction = self._jobs[qid] = Prediction(key, context, time.monotonic())
        self.running += 1
        return qid, prediction

    def finish(self, qid: int, completion: str | None) -> None:
        """Record the job's completion (``None``: it failed); the oldest finished ones beyond ``keep`` go."""
        prediction = self._jobs[qid]
        prediction.completion, prediction.failed = completion, completion is None
        prediction.seconds = time.monotonic() - prediction.submitted
        prediction.done.set()
        self.running -= 1
        self._finished.append(qid)
        while len(self._finished) > self.keep:
            del self._jobs[self._finished.popleft()]

    def get(self, qid: int, key: str | None) -> Prediction | None:
        """The job, if it is known and was asked for with the same key (else, as if unknown)."""
        prediction = self._jobs.get(qid)
        return prediction if prediction is not None and prediction.key == key else None

    def settled(self, grace_s: float, now: float | None = None) -> bool:
        """Whether every job has finished and each result nobody has collected finished at least
        ``grace_s`` seconds ago: what a drain waits for before the server exits."""
        now = time.monotonic() if now is None else now
        return self.running == 0 and all(
            p.collected or now - (p.submitted + p.seconds) >= grace_s for p in self._jobs.values()
        )
