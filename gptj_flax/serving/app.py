"""The FastAPI app: GPT-4chan's ``/complete``, OpenAI-style ``/v1/completions`` and ``/v1/models``,
vLLM-style ``/tokenize``, ``/detokenize`` and ``/tokenizer_info``, ``/health`` and ``/metrics``, in
front of the serving engine (continuous batching; echoed prompts are scored beside it); and the
APIs of mesh-transformer-jax's own servers: ``device_serve.py``'s body on ``/complete`` and the
``docker/`` API's ``/model/predict`` and ``/model/get_prediction`` (``legacy`` has what routes them).

Status codes: 400 malformed JSON, 401 missing or wrong API key (with a keys file, on every route but
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
import logging
import secrets
import time
import uuid
from typing import Any

import numpy as np
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.middleware.cors import CORSMiddleware

from gptj_flax import partitioning
from gptj_flax.serving import legacy, schemas
from gptj_flax.serving.auth import KEY_ID, PUBLIC_PATHS, KeyCheck, KeyStore
from gptj_flax.serving.engine import Engine
from gptj_flax.serving.metrics import Metrics
from gptj_flax.serving.offsets import TextOffsets
from gptj_flax.serving.request_log import RequestLog
from gptj_flax.serving.scoring import PromptScorer
from gptj_flax.serving.settings import ServeSettings, ServingError
from gptj_flax.serving.worker import READY, WARMING_UP, Job, NotAccepting, Prompt, QueueFull, StreamEnd

logger = logging.getLogger(__name__)

GENERATION_PATHS = ("/complete", "/v1/completions")
TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")
DOCKER_API_PATHS = ("/model/predict", "/model/get_prediction")
KNOWN_PATHS = (
    *GENERATION_PATHS,
    *TOKENIZER_PATHS,
    *DOCKER_API_PATHS,
    "/v1/models",
    *PUBLIC_PATHS,
    "/openapi.json",
    "/docs",
)
# Open while draining: the probes, and the docker API's collection of results accepted before it.
OPEN_WHILE_DRAINING = (*PUBLIC_PATHS, "/model/get_prediction")
MAX_LOC_CHARS = 64
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


def prefill_mesh(mesh, place: str):
    """The devices new prompts are prefilled on beside decoding on ``mesh`` (``--prefill beside``), or None."""
    if place == "between":
        return None
    spare = partitioning.spare_mesh(mesh)
    if spare is None:
        n, platform = mesh.devices.size, mesh.devices.flat[0].platform
        hint = (
            f"; on CPU, start with XLA_FLAGS=--xla_force_host_platform_device_count={2 * n}"
            if platform == "cpu"
            else ""
        )
        raise ServingError(
            f"--prefill beside needs {n} spare device(s) outside the model's mesh of {n} in this process{hint}"
        )
    logger.info("prefilling on %s, beside the decode slots on %s", _devices(spare), _devices(mesh))
    return spare


def _devices(mesh) -> str:
    return ", ".join(str(d) for d in mesh.devices.flat)


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
        self.vocab = int(model.decoder.valid_vocab)  # the ids a prompt may hold: the tokenizer's
        self._token_texts: dict[int, str] = {}
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
            top_logprobs=schemas.MAX_LOGPROBS,
            prefill_mesh=prefill_mesh(model.mesh, settings.prefill),
        )
        self.scorer = PromptScorer(model, max_rows=settings.queue_size)
        # Prompts and pre_prompts of a full batch, JSON-escaped at worst, with room for the rest.
        self.max_body_bytes = 2**16 + 2 * settings.max_batch * schemas.MAX_TEXT_CHARS * 6
        self.predictions = legacy.PredictionStore(settings.predictions_kept)  # the docker API's jobs
        self.created = int(time.time())
        self.draining = False
        self.in_flight = 0

    @property
    def status(self) -> str:
        return "draining" if self.draining and self.worker.state == READY else self.worker.state

    def begin_drain(self) -> None:
        """Stop taking requests (503) but ``/model/get_prediction``; the server exits once :meth:`drained`."""
        if not self.draining:
            logger.info(
                "draining: refusing new requests, finishing %d in flight and %d /model/predict job(s)",
                self.in_flight,
                self.predictions.running,
            )
        self.draining = True

    def drained(self) -> bool:
        """Draining, nothing in flight, and the docker API's results finished and collected (or given
        ``--predictions-grace`` seconds to be)."""
        return self.draining and self.in_flight == 0 and self.predictions.settled(self.settings.predictions_grace)

    # -- request handling ------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.name:
            raise HTTPException(404, f"model {name!r} is not served here; this server has {self.name!r}")

    def encode(self, text: str) -> list[int]:
        return self.model.encode(text) if text else []

    def token_text(self, token: int) -> str:
        """One token's text, as the logprobs object shows it (remembered: lm-eval asks for many)."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.model.decode([token])
        return text

    def text_offsets(self, start: int) -> TextOffsets:
        """The ``text_offset`` of tokens whose text begins at character ``start``."""
        return TextOffsets(lambda t: self.token_text(t[0]) if len(t) == 1 else self.model.decode(t), start)

    async def score(self, prompts: list[list[int]], top_logprobs: int) -> list:
        try:
            return await self.scorer.score(prompts, top_logprobs)
        except QueueFull as e:
            raise HTTPException(429, str(e), headers={"Retry-After": str(e.retry_after)}) from None
        except Exception:  # the prompts were checked: what fails here is the device, not the request
            logger.exception("scoring %d prompt(s) failed", len(prompts))
            raise HTTPException(500, "scoring the prompt failed; the server log has the details") from None

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
        self.scorer.close()
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


def caller(request: Request) -> str | None:
    """The id of the key the request was let in with (None without authentication), as
    :class:`~gptj_flax.serving.auth.KeyCheck` found it."""
    return request.scope.get(KEY_ID)


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


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the next message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _seed(seed: int | None, offset: int = 0) -> int:
    return secrets.randbelow(schemas.SEED_LIMIT) if seed is None else (seed + offset) % schemas.SEED_LIMIT


def _fewest(p: float) -> float:
    return p if p > 0 else FEWEST_TOKENS


def _invalid(field: str, message: str) -> RequestValidationError:
    """A 422 naming ``field``, in the shape pydantic's own errors have."""
    return RequestValidationError([{"type": "value_error", "loc": ("body", field), "msg": message, "input": None}])


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
    CompletionRequest = schemas.completion_request_model(settings.max_batch, service.vocab)
    DetokenizeRequest = schemas.detokenize_request_model(service.vocab)

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
    app.add_middleware(legacy.CompleteBodyDispatch)  # inside ServiceMiddleware: drained, counted as /complete
    app.add_middleware(KeyCheck, keys=service.keys)  # before anything reads or validates a body
    app.add_middleware(ServiceMiddleware, service=service)
    if settings.cors:  # outermost, so that refusals (401, 429, 503) reach the page with their headers too
        app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])

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

    _add_original_server_routes(app, service)  # first: its /complete takes only device_serve.py bodies

    @app.post("/complete", response_model=schemas.CompleteResponse, responses=ERRORS)
    async def complete(body: schemas.CompleteRequest, request: Request):
        """GPT-4chan's API: continue `pre_prompt` + `prompt`; the prompt loses its oldest tokens to fit
        the context with `length` new tokens (413 if even the pre_prompt and one prompt token cannot)."""
        started = time.monotonic()
        key = caller(request)
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
        """OpenAI-style completions of one prompt or a list (texts or token ids), `n` each; `stream`
        sends server-sent events; `echo` with `logprobs` scores the prompt too (`max_tokens` 0: only that)."""
        started = time.monotonic()
        key = caller(request)
        service.check_model(body.model)
        if body.echo and body.stream:
            raise _invalid("echo", "echo is not available with stream")
        if body.max_tokens == 0 and not body.echo:
            raise _invalid("max_tokens", "max_tokens 0 generates nothing: it is only for scoring the prompt with echo")
        prompts = _prompts(service, body.prompt)
        if len(prompts) * body.n > settings.max_batch:
            raise _invalid(
                "n",
                f"n={body.n} completions of {len(prompts)} prompt(s) exceed the {settings.max_batch} "
                "a request may ask for",
            )
        stop = () if body.stop is None else (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
        alternatives = body.logprobs or 0
        rows: list[Prompt] = []
        for i, (_, tokens) in enumerate(prompts):
            if len(tokens) + body.max_tokens > service.context:
                raise HTTPException(
                    413,
                    f"prompt {i} has {len(tokens)} tokens; with max_tokens={body.max_tokens} "
                    f"that exceeds the model's context of {service.context} tokens",
                )
            rows.extend(
                Prompt(
                    tokens,
                    body.max_tokens,
                    body.temperature,
                    _fewest(body.top_p),
                    1.0,
                    _seed(body.seed, i * body.n + j),  # choice i·n + j, as OpenAI numbers them
                    stop,
                    top_k=max(body.top_k, 0),
                    min_p=body.min_p,
                    repetition_penalty=body.repetition_penalty,
                    top_logprobs=alternatives,
                )
                for j in range(body.n)
            )
        settings_logged = dict(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            repetition_penalty=body.repetition_penalty,
            stop=list(stop),
            seed=body.seed,
            n=body.n,
            echo=body.echo,
            logprobs=body.logprobs,
            stream=body.stream,
        )
        completion_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def log(responses: list[str]) -> None:
            # a text prompt with one choice is logged as texts; otherwise a response per choice (n per prompt)
            single = isinstance(body.prompt, str) and len(responses) == 1
            service.log(
                key=key,
                endpoint="/v1/completions",
                prompt=body.prompt if isinstance(body.prompt, str) else [text for text, _ in prompts],
                pre_prompt="",
                settings=settings_logged,
                response=responses[0] if single else responses,
                started=started,
            )

        if body.stream:
            job = Job(rows, stream=True, logprobs=body.logprobs is not None)
            service.submit(job)
            prompt_chars = [len(prompts[i // body.n][0]) for i in range(len(rows))]
            return JobStream(
                _events(service, job, completion_id, created, prompt_chars, log),
                on_close=lambda: service.worker.cancel(job),
            )

        scored = (
            await service.score([tokens for _, tokens in prompts], alternatives)
            if body.echo and body.logprobs is not None
            else [None] * len(prompts)
        )
        results = (
            await service.run(request, Job(rows, logprobs=body.logprobs is not None))
            if body.max_tokens > 0
            else [None] * len(rows)
        )
        choices = []
        for index, completion in enumerate(results):
            text, tokens = prompts[index // body.n]
            choices.append(
                schemas.Choice(
                    text=(text if body.echo else "") + ("" if completion is None else completion.text),
                    index=index,
                    # scoring only, as vLLM answers it: the choice ended at its (zero) length
                    finish_reason="length" if completion is None else OPENAI_FINISH_REASON[completion.finish_reason],
                    logprobs=(
                        None
                        if body.logprobs is None
                        else _logprobs(
                            service,
                            text,
                            tokens if body.echo else None,
                            scored[index // body.n],
                            completion,
                        )
                    ),
                )
            )
        prompt_tokens = sum(len(tokens) for _, tokens in prompts)
        completion_tokens = sum(c.completion_tokens for c in results if c is not None)
        log([c.text for c in choices])
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

    @app.post("/tokenize", response_model=schemas.TokenizeResponse, responses={**ERRORS, 404: _error("unknown model")})
    async def tokenize(body: schemas.TokenizeRequest):
        """vLLM's `/tokenize` of a text: its token ids, their count and the model's context."""
        service.check_model(body.model)
        tokens = service.model.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return schemas.TokenizeResponse(
            count=len(tokens),
            max_model_len=service.context,
            tokens=tokens,
            token_strs=service.model.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None,
        )

    @app.post(
        "/detokenize", response_model=schemas.DetokenizeResponse, responses={**ERRORS, 404: _error("unknown model")}
    )
    async def detokenize(body: DetokenizeRequest):
        """vLLM's `/detokenize`: the text of token ids (special tokens kept, as generation writes them)."""
        service.check_model(body.model)
        return schemas.DetokenizeResponse(prompt=service.model.decode(body.tokens))

    @app.get("/tokenizer_info", response_model=schemas.TokenizerInfo, responses={401: ERRORS[401]})
    async def tokenizer_info():
        """The tokenizer's special tokens, as vLLM's `/tokenizer_info` (lm-eval's remote tokenizer reads them)."""
        tokenizer = service.model.tokenizer
        return schemas.TokenizerInfo(
            tokenizer_class=type(tokenizer).__name__,
            eos_token=tokenizer.eos_token,
            bos_token=tokenizer.bos_token,
            pad_token=tokenizer.pad_token,
            unk_token=tokenizer.unk_token,
            model_max_length=service.context,
            vocab_size=service.vocab,
        )

    @app.get("/v1/models", response_model=schemas.ModelList, responses={401: ERRORS[401]})
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


def _prompts(service: Service, prompt) -> list[tuple[str, list[int]]]:
    """Each prompt's text and tokens: a text is encoded (an empty one is the start token alone), token
    ids are decoded for the echo."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append((p, service.encode(p) or [service.start_token]))
        else:
            out.append((service.model.decode(p), list(p)))
    return out


async def _events(service: Service, job: Job, completion_id: str, created: int, prompt_chars: list[int], log):
    """The job's text as OpenAI completion chunks (with the logprobs of each chunk's tokens, if the job
    asks), then ``data: [DONE]``."""
    texts = [""] * len(job.rows)
    offsets = [service.text_offsets(start) for start in prompt_chars]  # each row's, across its pieces

    def chunk(index: int, text: str, logprobs, finish_reason) -> str:
        return _sse(
            {
                "id": completion_id,
                "object": "text_completion",
                "created": created,
                "model": service.name,
                "choices": [{"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}],
            }
        )

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
            # A piece may hold tokens and no text yet (a possible stop string waits): a chunk only
            # for a job that reports tokens (its batch neighbours may have asked for them).
            if len(piece) > 0 or (job.logprobs and piece):
                texts[index] += piece
                logprobs = None
                if job.logprobs:
                    logprobs = _token_logprobs(
                        service, piece.tokens, piece.logprobs, piece.top_logprobs, offsets[index]
                    ).model_dump()
                yield chunk(index, str(piece), logprobs, None)
    for index, reason in enumerate(item.finish_reasons):  # as OpenAI: a last chunk per choice says why it ended
        if reason is not None:
            yield chunk(index, "", None, OPENAI_FINISH_REASON[reason])
    log(texts)
    yield _sse("[DONE]")


def _top(service: Service, alternatives: dict[int, float] | None, token: int, logprob: float) -> dict[str, float]:
    """One position's alternatives by text, most likely first, the chosen token always among them (as
    vLLM reports it: up to ``logprobs`` + 1 entries). Where two ids share a text the likelier one is kept."""
    top: dict[str, float] = {}
    for other, value in (alternatives or {}).items():
        top.setdefault(service.token_text(other), value)
    if token in (alternatives or {}) or service.token_text(token) not in top:
        top[service.token_text(token)] = logprob  # the chosen token's value, exactly as token_logprobs has it
    return top


def _token_logprobs(
    service: Service,
    tokens: list[int],
    logprobs: list[float | None],
    alternatives: list[dict[int, float]] | None,
    offsets: TextOffsets,
) -> schemas.Logprobs:
    """OpenAI's logprobs object for tokens that follow those ``offsets`` has taken."""
    tops: list[dict[int, float]] = alternatives or [{}] * len(tokens)
    return schemas.Logprobs(
        tokens=[service.token_text(t) for t in tokens],
        token_logprobs=list(logprobs),
        top_logprobs=[_top(service, top, t, lp) for top, t, lp in zip(tops, tokens, logprobs, strict=True)],
        text_offset=offsets.add(tokens),
    )


def _joined(*parts: schemas.Logprobs) -> schemas.Logprobs:
    return schemas.Logprobs(
        tokens=[t for p in parts for t in p.tokens],
        token_logprobs=[x for p in parts for x in p.token_logprobs],
        top_logprobs=[top for p in parts for top in p.top_logprobs],
        text_offset=[o for p in parts for o in p.text_offset],
    )


def _logprobs(service: Service, prompt_text: str, echoed: list[int] | None, scored, completion) -> schemas.Logprobs:
    """OpenAI's logprobs object of one choice: with ``echoed`` (the prompt's tokens) those first, the
    first with ``null`` for its log-probability and alternatives (nothing comes before it); then the
    generated tokens. Offsets index the choice's text as :mod:`~gptj_flax.serving.offsets` says: the
    generated tokens' start at the prompt's end, echoed or not (as OpenAI counts them)."""
    generated = _token_logprobs(
        service,
        [] if completion is None else completion.tokens,
        [] if completion is None else completion.logprobs,
        None if completion is None else completion.top_logprobs,
        service.text_offsets(len(prompt_text)),
    )
    if echoed is None:
        return generated
    offsets = service.text_offsets(0)
    first = schemas.Logprobs(
        tokens=[service.token_text(echoed[0])],
        token_logprobs=[None],
        top_logprobs=[None],
        text_offset=offsets.add(echoed[:1]),
    )
    rest = (  # scored is None for a one-token prompt: nothing to score it after
        _token_logprobs(service, [], [], None, offsets)
        if scored is None
        else _token_logprobs(service, echoed[1:], scored.logprobs.tolist(), scored.top_logprobs, offsets)
    )
    return _joined(first, rest, generated)


# -- the original mesh-transformer-jax servers' APIs --------------------------------------------------
# Undocumented in /openapi.json (their clients were written against the originals, not a schema),
# they share the engine, authentication, queue limits and request log with the routes above.
def _add_original_server_routes(app: FastAPI, service: Service) -> None:
    predictions = service.predictions

    def prompt_row(text: str, length: int, temperature: float, top_p: float, top_k: int = 0) -> Prompt:
        """``text``'s last tokens that fit the context with ``length`` new ones (its start token if empty)."""
        tokens = service.encode(text)
        room = service.context - length
        return Prompt(
            tokens[max(0, len(tokens) - room) :] or [service.start_token],
            length,
            min(temperature, HOTTEST),
            _fewest(top_p),
            1.0,
            _seed(None),
            top_k=top_k,
        )

    async def device_serve(body: schemas.DeviceServeRequest, request: Request):
        """device_serve.py's `/complete`: continue `context` by 256 tokens (as many as the context
        leaves room for beside one context token, on a model whose context is shorter)."""
        started = time.monotonic()
        key = caller(request)
        row = prompt_row(body.context, min(legacy.DEVICE_SERVE_LENGTH, service.context - 1), body.temp, body.top_p)
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

    app.router.add_api_route(
        "/complete",
        device_serve,
        methods=["POST"],
        response_model=schemas.DeviceServeResponse,
        include_in_schema=False,
        route_class_override=legacy.DeviceServeRoute,
    )

    @app.post("/model/predict", response_model=schemas.PredictResponse, include_in_schema=False)
    async def predict(body: schemas.PredictRequest, request: Request):
        """The docker API: queue a completion of `context` and answer its qid at once."""
        key = caller(request)
        if body.length + 1 > service.context:
            raise HTTPException(
                413,
                f"length {body.length} with at least one context token exceeds the model's context of "
                f"{service.context} tokens",
            )
        job = Job([prompt_row(body.context, body.length, body.temp, body.top_p, body.top_k)])
        service.submit(job)
        qid, prediction = predictions.add(key, body.context)

        def finished(result: asyncio.Future) -> None:
            if result.cancelled() or result.exception() is not None:  # the worker has logged the error
                predictions.finish(qid, None)
                return
            (completion,) = result.result()
            predictions.finish(qid, completion.text)
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

    @app.post("/model/get_prediction", response_model=schemas.PredictionResponse, include_in_schema=False)
    async def get_prediction(body: schemas.PredictionRequest, request: Request):
        """The docker API: the qid's result, once it is ready (as the original, this waits for it)."""
        key = caller(request)
        prediction = predictions.get(body.qid, key)
        if prediction is None:  # another key's qid reads as unknown: a qid says nothing to its non-owner
            raise HTTPException(404, "no prediction has this qid (or it is one of the oldest, no longer kept)")
        if not prediction.done.is_set():
            ready = asyncio.ensure_future(prediction.done.wait())
            gone = asyncio.ensure_future(_client_gone(request))
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
