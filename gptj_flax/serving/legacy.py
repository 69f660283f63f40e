"""What lets the original mesh-transformer-jax servers' clients talk to this server.

``device_serve.py`` took ``{"context", "top_p", "temp"}`` on ``POST /complete``, the path where
GPT-4chan's ``{"prompt", …}`` body also arrives: :class:`CompleteBodyDispatch` reads the body's field
names before routing and marks the request, and :class:`DeviceServeRoute` takes only marked
requests, so the GPT-4chan route sees exactly the requests it always did.

The ``docker/`` API answered ``POST /model/predict`` with a ``qid`` and ``POST
/model/get_prediction`` later with the result: :class:`PredictionStore` holds those jobs, and keeps
finished results only up to a bound, the oldest going first, so that results nobody fetches cannot
fill the memory.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import secrets
import time

from fastapi.routing import APIRoute
from starlette.datastructures import Headers
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from gptj_flax.serving.request_body import BodyTooLarge, answer_too_large, is_json, read_body, replaying
from gptj_flax.serving.schemas import QID_LIMIT

# device_serve.py always generated 256 tokens; GPT-J's context (2048) leaves room for them.
DEVICE_SERVE_LENGTH = 256
# The fields only a device_serve.py body has (top_p and api_key are in both kinds of body).
DEVICE_SERVE_FIELDS = frozenset({"context", "temp"})
BODY_KIND = "gptj_flax.complete_body"
DEVICE_SERVE = "device_serve"


def is_device_serve_body(body: bytes) -> bool:
    """A JSON object with ``context`` or ``temp``; anything else (not JSON at all, too) is left to
    the GPT-4chan route, whose errors it always answered with."""
    try:
        fields = json.loads(body)
    except (ValueError, RecursionError):
        return False
    return isinstance(fields, dict) and not DEVICE_SERVE_FIELDS.isdisjoint(fields)


class CompleteBodyDispatch:
    """Marks ``POST /complete`` requests whose JSON body is device_serve.py's, for
    :class:`DeviceServeRoute`; the body is read once here and handed on unchanged."""

    def __init__(self, app: ASGIApp, path: str = "/complete"):
        self.app, self.path = app, path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != self.path:
            return await self.app(scope, receive, send)
        if not is_json(Headers(scope=scope)):
            return await self.app(scope, receive, send)
        try:
            messages, body = await read_body(receive)
        except BodyTooLarge as refused:
            return await answer_too_large(scope, receive, send, refused)
        if is_device_serve_body(body):
            scope = {**scope, BODY_KIND: DEVICE_SERVE}
        await self.app(scope, replaying(messages, receive), send)


class DeviceServeRoute(APIRoute):
    """A route that matches only requests :class:`CompleteBodyDispatch` marked as device_serve.py's;
    registered before GPT-4chan's ``/complete``, which then takes every other request."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope.get(BODY_KIND) != DEVICE_SERVE:
            return Match.NONE, {}
        return super().matches(scope)


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
