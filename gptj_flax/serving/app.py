"""The FastAPI app: GPT-4chan's ``/complete``, OpenAI-style ``/v1/completions`` and ``/v1/models``,
``/health`` and ``/metrics``, in front of the serving engine (continuous batching).

Status codes: 400 malformed JSON, 401 missing or wrong API key, 404 unknown model, 413 a prompt
that cannot fit the context (or an over-large body), 422 a field of the wrong type or out of range
(the error names it and the problem, never the value sent), 429 queue full (with ``Retry-After``),
503 warming up, shutting down, or an unusable API keys file. Bad input never reaches the model, so
it never produces a 500; no request body is ever logged.
"""

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from typing import Any

import numpy as np
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gptj_flax.serving import schemas
from gptj_flax.serving.auth import KeyStore, KeysUnavailable, bearer_token, key_id
from gptj_flax.serving.metrics import Metrics
from gptj_flax.serving.request_log import RequestLog
from gptj_flax.serving.settings import ServeSettings, ServingError
from gptj_flax.serving.engine import Engine
from gptj_flax.serving.worker import READY, WARMING_UP, Job, NotAccepting, Prompt, QueueFull, StreamEnd

logger = logging.getLogger(__name__)

GENERATION_PATHS = ("/complete", "/v1/completions")
OPEN_WHILE_DRAINING = ("/health", "/metrics")
KNOWN_PATHS = (*GENERATION_PATHS, "/v1/models", *OPEN_WHILE_DRAINING, "/openapi.json", "/docs")
OPENAI_FINISH_REASON = {"eos": "stop", "stop": "stop", "length": "length"}
# The samplers take top_p / typical_p in (0, 1]; the API's 0 means "keep as few tokens as the filter
# can" (one, and any tied with it), which the smallest positive float32 gives.
FEWEST_TOKENS = float(np.finfo(np.float32).tiny)
# /complete puts no upper limit on temperature; beyond float32's range it would become inf (and
# inf / -inf logits are NaN): the largest float32 samples just as uniformly.
HOTTEST = float(np.finfo(np.float32).max)


def _error(description: str) -> dict:
    return {"model": schemas.ErrorBody, "description": description}


ERRORS = {
    400: _error("malformed JSON"),
    401: _error("missing or invalid API key"),
    413: _error("the prompt cannot fit the model's context, or the body is too large"),
    429: _error("the queue is full; retry after `Retry-After` seconds"),
    503: _error("warming up, or shutting down"),
}


# One server-sent event of a streamed completion, as OpenAPI describes SSE responses.
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {"type": "string", "description": "a completion chunk (JSON, one choice's new text) or, last, `[DONE]`"}
    },
}


class Service:
    """What one app serves with: the model, its worker, keys, metrics, request log, and drain state."""

    def __init__(
        self, model, settings: ServeSettings, keys: KeyStore | None = None, request_log: RequestLog | None = None
    ):
        if model.tokenizer is None:
            raise ServingError(
                f"{settings.checkpoint} has no tokenizer; serving needs one saved beside the checkpoint (tokenizer/)"
            )
        self.model, self.settings = model, settings
        self.name = settings.served_model_name
        self.context = int(model.config.max_len if settings.max_len is None else settings.max_len)
        if not 2 <= self.context <= model.config.max_len:
            raise ServingError(
                f"--max-len {settings.max_len} exceeds the model's context of {model.config.max_len} tokens"
            )
        self.start_token = int(model.eos_token_id) if model.eos_token_id is not None else 0
        self.metrics = Metrics()
        self.keys = keys if keys is not None else open_keys(settings)
        self.request_log = request_log if request_log is not None else open_request_log(settings)
        self.worker = Engine(
            model,
            slots=settings.max_batch,
            queue_size=settings.queue_size,
            length=self.context,
            chunk=settings.prefill_chunk,
            metrics=self.metrics,
        )
        # Prompts and pre_prompts of a full batch, JSON-escaped at worst, with room for the rest.
        self.max_body_bytes = 2**16 + 2 * settings.max_batch * schemas.MAX_TEXT_CHARS * 6
        self.created = int(time.time())
        self.draining = False
        self.in_flight = 0

    @property
    def status(self) -> str:
        return "draining" if self.draining and self.worker.state == READY else self.worker.state

    def begin_drain(self) -> None:
        """Stop taking requests (503); the server exits once ``in_flight`` reaches 0."""
        if not self.draining:
            logger.info("draining: refusing new requests, finishing %d in flight", self.in_flight)
        self.draining = True

    # -- request handling ------------------------------------------------------------------------
    def authorize(self, request: Request, body_key: str | None) -> str | None:
        """The caller's key id; 401 unless the body's ``api_key`` or the bearer token is a valid key."""
        if self.keys is None:
            return None
        key = body_key or bearer_token(request.headers.get("authorization"))
        try:
            valid = self.keys.is_valid(key)
        except KeysUnavailable:  # the keys file changed into something unusable; its error is logged once
            raise HTTPException(503, "the server cannot check API keys at the moment; try again later") from None
        if not valid:
            logger.info("refused %s: %s API key", request.url.path, "no" if key is None else "an invalid")
            raise HTTPException(
                401,
                "a valid API key is required (the api_key field or Authorization: Bearer)",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return key_id(key)

    def encode(self, text: str) -> list[int]:
        return self.model.encode(text) if text else []

    def submit(self, job: Job) -> None:
        try:
            self.worker.submit(job)
        except QueueFull as e:
            raise HTTPException(429, str(e), headers={"Retry-After": str(e.retry_after)}) from None
        except NotAccepting as e:
            retry = {"Retry-After": "5"} if self.worker.state == WARMING_UP else None
            raise HTTPException(503, str(e), headers=retry) from None

    async def run(self, request: Request, job: Job) -> list:
        """Queue ``job`` and wait for its completions; if the client disconnects first, drop the job."""
        self.submit(job)
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({job.result, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not job.result.done():
                raise HTTPException(499, "the client closed the request")
            if job.result.exception() is not None:
                raise HTTPException(500, "generation failed; the server log has the details")
            return job.result.result()
        finally:
            gone.cancel()
            if not job.result.done():
                self.worker.cancel(job)
                job.result.cancel()

    def log(
        self,
        *,
        key: str | None,
        endpoint: str,
        prompt: str | list[str],
        pre_prompt: str,
        settings: dict[str, Any],
        response: str | list[str],
        started: float,
    ) -> None:
        if self.request_log is not None:
            self.request_log.write(
                key_id=key,
                endpoint=endpoint,
                prompt=prompt,
                pre_prompt=pre_prompt,
                settings=settings,
                response=response,
                latency_s=time.monotonic() - started,
            )

    def close(self) -> None:
        if self.request_log is not None:
            self.request_log.close()


def open_keys(settings: ServeSettings) -> KeyStore | None:
    """The settings' API keys file, read and checked (``KeysFileError`` names what is wrong)."""
    return KeyStore(settings.api_keys_file) if settings.api_keys_file else None


def open_request_log(settings: ServeSettings) -> RequestLog | None:
    return (
        None
        if not settings.log_file
        else RequestLog(
            settings.log_file,
            log_format=settings.log_format,
            max_bytes=settings.log_max_bytes,
            backups=settings.log_backups,
        )
    )


def validation_errors(exc: RequestValidationError) -> list[dict]:
    """Each error's field and problem, without the value sent (it may be a key, or not JSON at all)."""
    return [
        {
            "loc": [part if isinstance(part, int) else str(part) for part in error["loc"]],
            "msg": str(error["msg"]),
            "type": str(error["type"]),
        }
        for error in exc.errors()
    ]


def json_response(content: Any, status_code: int) -> Response:
    # ASCII escapes keep any character JSON-encodable, even one that has no UTF-8 form.
    return Response(json.dumps(content, ensure_ascii=True, allow_nan=False), status_code, media_type="application/json")


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the next message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _seed(seed: int | None, offset: int = 0) -> int:
    return secrets.randbelow(schemas.SEED_LIMIT) if seed is None else (seed + offset) % schemas.SEED_LIMIT


def _fewest(p: float) -> float:
    return p if p > 0 else FEWEST_TOKENS


class ServiceMiddleware:
    """Refuses requests while draining, counts requests in flight (the drain waits for them) and
    records request counts and latencies."""

    def __init__(self, app, service: Service):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        service, path = self.service, scope["path"]
        endpoint = path if path in KNOWN_PATHS else "other"
        status = 500
        started = time.monotonic()

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        service.in_flight += 1
        try:
            if service.draining and path not in OPEN_WHILE_DRAINING:
                response = JSONResponse({"detail": "the server is shutting down"}, 503, headers={"Connection": "close"})
            else:
                response = self.app
            await response(scope, receive, send_status)
        finally:
            service.in_flight -= 1
            service.metrics.requests.labels(endpoint, str(status)).inc()
            if path in GENERATION_PATHS and status == 200:
                service.metrics.request_latency.labels(endpoint).observe(time.monotonic() - started)


class JobStream(StreamingResponse):
    """Server-sent events of a streaming job; however the response ends (done, client gone, or never
    started), ``on_close`` runs, so a departed client's job is dropped."""

    def __init__(self, events, on_close):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(payload: Any) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


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
    CompletionRequest = schemas.completion_request_model(settings.max_batch)

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
        description="GPT-J completions: the GPT-4chan `/complete` API and OpenAI-style `/v1/completions`.",
    )
    app.state.service = service
    app.add_middleware(ServiceMiddleware, service=service)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
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

    @app.post("/complete", response_model=schemas.CompleteResponse, responses=ERRORS)
    async def complete(body: schemas.CompleteRequest, request: Request):
        """GPT-4chan's API: continue `pre_prompt` + `prompt`; the prompt loses its oldest tokens to fit
        the context with `length` new tokens (413 if even the pre_prompt and one prompt token cannot)."""
        started = time.monotonic()
        key = service.authorize(request, body.api_key)
        pre = service.encode(body.pre_prompt)[: settings.pre_prompt_length]
        prompt = service.encode(body.prompt)
        shortest = len(pre) + min(len(prompt), 1) or 1  # nothing at all: start from the EOS token
        if shortest + body.length > service.context:
            raise HTTPException(
                413,
                f"length {body.length} with a pre_prompt of {len(pre)} tokens and at least one "
                f"prompt token exceeds the model's context of {service.context} tokens",
            )
        room = service.context - body.length - len(pre)
        tokens = pre + prompt[max(0, len(prompt) - room) :] or [service.start_token]
        row = Prompt(
            tokens,
            body.length,
            min(body.temperature, HOTTEST),
            _fewest(body.top_p),
            _fewest(body.typical_p),
            _seed(body.seed),
        )
        (completion,) = await service.run(request, Job([row]))
        service.log(
            key=key,
            endpoint="/complete",
            prompt=body.prompt,
            pre_prompt=body.pre_prompt,
            settings=dict(
                length=body.length,
                top_p=body.top_p,
                temperature=body.temperature,
                typical_p=body.typical_p,
                seed=row.seed,
            ),
            response=completion.text,
            started=started,
        )
        return {"response": completion.text}

    @app.post(
        "/v1/completions",
        response_model=schemas.CompletionResponse,
        responses={
            **ERRORS,
            404: _error("unknown model"),
            200: {
                "content": {"text/event-stream": {"schema": SSE_EVENT}},
                "description": "a completion; with `stream`, server-sent events",
            },
        },
    )
    async def completions(body: CompletionRequest, request: Request):
        """OpenAI-style completions of one prompt or a list; `stream` sends server-sent events."""
        started = time.monotonic()
        key = service.authorize(request, body.api_key)
        if body.model is not None and body.model != service.name:
            raise HTTPException(404, f"model {body.model!r} is not served here; this server has {service.name!r}")
        if body.stream and body.logprobs is not None:  # the streaming API yields text only
            raise RequestValidationError(
                [
                    {
                        "type": "value_error",
                        "loc": ("body", "logprobs"),
                        "input": body.logprobs,
                        "msg": "logprobs is not available with stream",
                    }
                ]
            )
        texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        stop = () if body.stop is None else (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
        rows = []
        for i, text in enumerate(texts):
            tokens = service.encode(text) or [service.start_token]
            if len(tokens) + body.max_tokens > service.context:
                raise HTTPException(
                    413,
                    f"prompt {i} has {len(tokens)} tokens; with max_tokens={body.max_tokens} "
                    f"that exceeds the model's context of {service.context} tokens",
                )
            rows.append(
                Prompt(tokens, body.max_tokens, body.temperature, _fewest(body.top_p), 1.0, _seed(body.seed, i), stop)
            )
        settings_logged = dict(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            stop=list(stop),
            seed=body.seed,
            stream=body.stream,
        )
        completion_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def log(responses: list[str]) -> None:
            service.log(
                key=key,
                endpoint="/v1/completions",
                prompt=body.prompt,
                pre_prompt="",
                settings=settings_logged,
                response=responses[0] if isinstance(body.prompt, str) else responses,
                started=started,
            )

        if body.stream:
            job = Job(rows, stream=True)
            service.submit(job)
            return JobStream(
                _events(job, completion_id, created, service.name, log), on_close=lambda: service.worker.cancel(job)
            )

        job = Job(rows, logprobs=body.logprobs is not None)
        results = await service.run(request, job)
        choices = [
            schemas.Choice(
                text=c.text,
                index=i,
                finish_reason=OPENAI_FINISH_REASON[c.finish_reason],
                logprobs=_logprobs(service.model, c, len(texts[i])) if job.logprobs else None,
            )
            for i, c in enumerate(results)
        ]
        prompt_tokens = sum(c.prompt_tokens for c in results)
        completion_tokens = sum(c.completion_tokens for c in results)
        log([c.text for c in results])
        return schemas.CompletionResponse(
            id=completion_id,
            created=created,
            model=service.name,
            choices=choices,
            usage=schemas.Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens,
            ),
        )

    @app.get("/v1/models", response_model=schemas.ModelList)
    async def models():
        return schemas.ModelList(
            data=[schemas.ModelCard(id=service.name, created=service.created, max_model_len=service.context)]
        )

    @app.get("/health", response_model=schemas.Health, responses={503: {"model": schemas.Health}})
    async def health():
        """200 once the model is warmed up (compiled) and taking requests; 503 before, and while draining."""
        status = service.status
        body = schemas.Health(
            status=status, model=service.name, queued_prompts=service.worker.queued_rows, error=service.worker.error
        )
        return JSONResponse(body.model_dump(), status_code=200 if status == READY else 503)

    @app.get(
        "/metrics",
        response_class=Response,
        responses={
            200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text format"}
        },
    )
    async def metrics():
        return Response(service.metrics.render(), media_type=service.metrics.content_type)

    return app


async def _events(job: Job, completion_id: str, created: int, model_name: str, log):
    """The job's text as OpenAI completion chunks, then ``data: [DONE]``."""
    texts = [""] * len(job.rows)
    while True:
        item = await job.pieces.get()
        if isinstance(item, StreamEnd):
            if item.error is not None:
                yield _sse(
                    {"error": {"message": "generation failed; the server log has the details", "type": "server_error"}}
                )
                return
            break
        for index, piece in enumerate(item):
            if piece:
                texts[index] += piece
                yield _sse(
                    {
                        "id": completion_id,
                        "object": "text_completion",
                        "created": created,
                        "model": model_name,
                        "choices": [{"text": piece, "index": index, "logprobs": None, "finish_reason": None}],
                    }
                )
    for index, reason in enumerate(item.finish_reasons):  # as OpenAI: a last chunk per choice says why it ended
        if reason is not None:
            yield _sse(
                {
                    "id": completion_id,
                    "object": "text_completion",
                    "created": created,
                    "model": model_name,
                    "choices": [
                        {"text": "", "index": index, "logprobs": None, "finish_reason": OPENAI_FINISH_REASON[reason]}
                    ],
                }
            )
    log(texts)
    yield _sse("[DONE]")


def _logprobs(model, completion, prompt_chars: int) -> schemas.Logprobs:
    """OpenAI's logprobs object for the chosen tokens; offsets count characters from the prompt's start."""
    tokens = [model.decode([t]) for t in completion.tokens]
    offsets = (prompt_chars + np.cumsum([0] + [len(t) for t in tokens[:-1]])).tolist() if tokens else []
    return schemas.Logprobs(tokens=tokens, token_logprobs=completion.logprobs, text_offset=offsets)
