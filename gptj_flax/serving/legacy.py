"""The original mesh-transformer-jax servers' APIs, and what lets their clients talk to this server.

``device_serve.py`` took ``{"context", "top_p", "temp"}`` on ``POST /complete``, the path where
GPT-4chan's ``{"prompt", …}`` body also arrives: :class:`CompleteBodyDispatch` reads the body's field
names before routing and marks the request, and :class:`DeviceServeRoute` takes only marked
requests, so the GPT-4chan route sees exactly the requests it always did.

The ``docker/`` API answered ``POST /model/predict`` with a ``qid`` and ``POST
/model/get_prediction`` later with the result (the jobs wait in the service's
:class:`~gptj_flax.serving.predictions.PredictionStore`).

Undocumented in /openapi.json (their clients were written against the originals, not a schema),
these routes share the engine, authentication, queue limits and request log with the others.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, HTTPException, Request
from fastapi.routing import APIRoute
from starlette.datastructures import Headers
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from gptj_flax.sampling import Sampling
from gptj_flax.serving import schemas
from gptj_flax.serving.request_body import BodyTooLarge, answer_too_large, is_json, read_body, replaying
from gptj_flax.serving.service import Service, caller, client_gone, draw_seed
from gptj_flax.serving.worker import Job, Prompt

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


def prompt_row(service: Service, context: str, length: int, sampling: Sampling) -> Prompt:
    """A row continuing ``context``'s last tokens that fit with ``length`` new ones, with a fresh seed."""
    return Prompt(service.last_tokens(context, length), length, sampling, draw_seed(None))


async def device_serve_completion(service: Service, body: schemas.DeviceServeRequest, request: Request) -> dict:
    started = time.monotonic()
    key = caller(request)
    length = min(DEVICE_SERVE_LENGTH, service.context - 1)
    row = prompt_row(service, body.context, length, body.sampling)
    (completion,) = await service.run(request, Job([row]))
    service.log(
        key=key,
        endpoint="/complete",
        prompt=body.context,
        pre_prompt="",
        settings=dict(length=row.max_new_tokens, top_p=body.top_p, temp=body.temp, seed=row.seed),
        response=completion.text,
        started=started,
    )
    return {"completion": completion.text}


def queue_prediction(service: Service, body: schemas.PredictRequest, request: Request) -> dict:
    key = caller(request)
    if body.length + 1 > service.context:
        raise HTTPException(
            413,
            f"length {body.length} with at least one context token exceeds the model's context of "
            f"{service.context} tokens",
        )
    job = Job([prompt_row(service, body.context, body.length, body.sampling)])
    service.submit(job)
    qid, prediction = service.predictions.add(key, body.context)

    def finished(result: asyncio.Future) -> None:
        if result.cancelled() or result.exception() is not None:  # the worker has logged the error
            service.predictions.finish(qid, None)
            return
        (completion,) = result.result()
        service.predictions.finish(qid, completion.text)
        service.log(
            key=key,
            endpoint="/model/predict",
            prompt=body.context,
            pre_prompt="",
            settings=dict(
                length=body.length, top_p=body.top_p, top_k=body.top_k, temp=body.temp, seed=job.rows[0].seed
            ),
            response=completion.text,
            started=prediction.submitted,
        )

    job.result.add_done_callback(finished)
    return {"qid": qid}


async def collect_prediction(service: Service, body: schemas.PredictionRequest, request: Request) -> dict:
    prediction = service.predictions.get(body.qid, caller(request))
    if prediction is None:  # another key's qid reads as unknown: a qid says nothing to its non-owner
        raise HTTPException(404, "no prediction has this qid (or it is one of the oldest, no longer kept)")
    if not prediction.done.is_set():
        ready = asyncio.ensure_future(prediction.done.wait())
        gone = asyncio.ensure_future(client_gone(request))
        try:
            await asyncio.wait({ready, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            gone.cancel()
        if not prediction.done.is_set():  # the job goes on: its result stays for a later call
            raise HTTPException(499, "the client closed the request")
    prediction.collected = True  # a drain need not wait for it any longer
    if prediction.failed:
        raise HTTPException(500, "generation failed; the server log has the details")
    return {"context": prediction.context, "completion": prediction.completion, "time": prediction.seconds}


def add_routes(app: FastAPI, service: Service) -> None:
    """device_serve.py's ``/complete`` (add it before GPT-4chan's) and the docker API's routes."""

    async def device_serve(body: schemas.DeviceServeRequest, request: Request):
        """device_serve.py's `/complete`: continue `context` by 256 tokens (as many as the context
        leaves room for beside one context token, on a model whose context is shorter)."""
        return await device_serve_completion(service, body, request)

    app.router.add_api_route(
        "/complete",
        device_serve,
        methods=["POST"],
        response_model=schemas.DeviceServeResponse,
        include_in_schema=False,
        route_class_override=DeviceServeRoute,
    )

    @app.post("/model/predict", response_model=schemas.PredictResponse, include_in_schema=False)
    async def predict(body: schemas.PredictRequest, request: Request):
        """The docker API: queue a completion of `context` and answer its qid at once."""
        return queue_prediction(service, body, request)

    @app.post("/model/get_prediction", response_model=schemas.PredictionResponse, include_in_schema=False)
    async def get_prediction(body: schemas.PredictionRequest, request: Request):
        """The docker API: the qid's result, once it is ready (as the original, this waits for it)."""
        return await collect_prediction(service, body, request)
