"""The FastAPI app: its middleware, its answer to an invalid request, and the routes of each API
family, which live in their own modules:

- :mod:`~gptj_flax.serving.gpt4chan`: GPT-4chan's ``/complete``;
- :mod:`~gptj_flax.serving.openai`: OpenAI-style ``/v1/completions``, ``/v1/chat/completions`` and
  ``/v1/models``, vLLM-style
  ``/tokenize``, ``/detokenize`` and ``/tokenizer_info``;
- :mod:`~gptj_flax.serving.legacy`: mesh-transformer-jax's own servers, ``device_serve.py``'s body on
  ``/complete`` and the ``docker/`` API's ``/model/predict`` and ``/model/get_prediction``;
- :mod:`~gptj_flax.serving.service`: ``/health`` and ``/metrics``, and the service they all share
  (the serving engine: continuous batching, echoed prompts scored beside it).

Status codes: 400 malformed JSON (or a chat request to a server without a chat template), 401 missing or wrong API key (with a keys file, on every route but
``/health`` and ``/metrics``, before the body is validated: see ``auth``), 404 unknown model or qid,
413 a prompt that cannot fit the context (or an over-large body), 422 a field of the wrong type or
out of range (the error names it and the problem, never the value sent; the first 20 errors and a
count of the rest), 429 queue full (with ``Retry-After``),
503 warming up, shutting down, or an unusable API keys file. Bad input never reaches the model, so
it never produces a 500; no request body is ever logged.
"""

import asyncio
import contextlib
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.middleware.cors import CORSMiddleware

from gptj_flax.serving import adapters, gpt4chan, legacy, openai, schemas, ui
from gptj_flax.serving.auth import PUBLIC_PATHS, KeyCheck, KeyStore
from gptj_flax.serving.request_log import RequestLog
from gptj_flax.serving.service import Service, ServiceMiddleware, add_probe_routes
from gptj_flax.serving.settings import ServeSettings

MAX_LOC_CHARS = 64


def create_app(
    model, settings: ServeSettings, keys: KeyStore | None = None, request_log: RequestLog | None = None
) -> FastAPI:
    """The app serving ``model`` (a :class:`~gptj_flax.sampling.LanguageModel`).

    Its lifespan starts the batch worker (which warms the model up before ``/health`` says ready)
    and, at shutdown, lets it finish its queue. ``app.state.service`` is the :class:`Service`.
    ``keys`` and ``request_log``, if already opened from ``settings``, are used instead of
    opening them again.
    """
    service = Service(model, settings, keys, request_log)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        service.worker.start()
        yield
        await asyncio.to_thread(service.worker.stop)
        service.close()

    app = FastAPI(
        title="gptj_flax",
        version="1",
        lifespan=lifespan,
        max_body_size=service.max_body_bytes,
        description="GPT-J completions: the GPT-4chan `/complete` API and OpenAI-style `/v1/completions` "
        "and `/v1/chat/completions`.",
    )
    app.state.service = service
    app.add_middleware(legacy.CompleteBodyDispatch)  # inside ServiceMiddleware: drained, counted as /complete
    # Before anything reads or validates a body; the playground page's files hold no data, and stay open.
    app.add_middleware(KeyCheck, keys=service.keys, public=(*PUBLIC_PATHS, *ui.public_paths(settings)))
    app.add_middleware(ServiceMiddleware, service=service)
    if settings.cors:  # outermost, so that refusals (401, 429, 503) reach the page with their headers too
        app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])
    app.exception_handler(RequestValidationError)(invalid_request)
    legacy.add_routes(app, service)  # first: its /complete takes only device_serve.py bodies
    ui.add_page(app, settings)
    gpt4chan.add_routes(app, service)
    openai.add_routes(app, service)
    adapters.add_routes(app, service)
    add_probe_routes(app, service)
    return app


async def invalid_request(request: Request, exc: RequestValidationError) -> Response:
    """Malformed JSON is a 400 (as a body that is not UTF-8 already is); a bad field, a 422 in
    FastAPI's shape (``loc``, ``msg``, ``type``) without the ``input`` it would echo."""
    for error in exc.errors():
        if error.get("type") == "json_invalid":
            return json_response(
                {
                    "detail": f"malformed JSON at character {error['loc'][-1]}: "
                    f"{error.get('ctx', {}).get('error', 'cannot parse')}"
                },
                400,
            )
    return json_response({"detail": validation_errors(exc)}, 422)


def _shown(part: Any) -> int | str:
    """One part of an error's location; a field name the body made up is cut short."""
    return part if isinstance(part, int) else str(part)[:MAX_LOC_CHARS]


def validation_errors(exc: RequestValidationError) -> list[dict]:
    """The first errors' field and problem, without the value sent (it may be a key, or not JSON at
    all), and a count of the rest: a 422 stays small whatever was sent."""
    errors = exc.errors()
    shown = [
        {"loc": [_shown(part) for part in error["loc"]], "msg": str(error["msg"]), "type": str(error["type"])}
        for error in errors[: schemas.MAX_ERRORS]
    ]
    if len(errors) > schemas.MAX_ERRORS:
        more = len(errors) - schemas.MAX_ERRORS
        shown.append({"loc": ["body"], "msg": f"and {more} more errors not listed", "type": "too_many_errors"})
    return shown


def json_response(content: Any, status_code: int) -> Response:
    # ASCII escapes keep any character JSON-encodable, even one that has no UTF-8 form.
    return Response(json.dumps(content, ensure_ascii=True, allow_nan=False), status_code, media_type="application/json")
