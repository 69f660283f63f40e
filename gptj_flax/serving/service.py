"""What every route serves with: the :class:`Service` (the model, its engine, API keys, metrics,
request log and drain state), the middleware that drains and counts requests, the probes
(``/health``, ``/metrics``), and what the route modules share.
"""

import asyncio
import collections
import logging
import secrets
import time
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response

from gptj_flax import partitioning
from gptj_flax.sampling.adapter_bank import AdapterBank
from gptj_flax.serving import chat, schemas
from gptj_flax.serving.auth import KEY_ID, PUBLIC_PATHS, KeyStore
from gptj_flax.serving.engine import Engine
from gptj_flax.serving.metrics import Metrics
from gptj_flax.serving.offsets import TextOffsets
from gptj_flax.serving.predictions import PredictionStore
from gptj_flax.serving.request_log import RequestLog
from gptj_flax.serving.scoring import PLACEHOLDER, PromptScorer, next_token
from gptj_flax.serving.settings import DEFAULT_ADAPTER_RANK, DEFAULT_ADAPTER_TARGETS, ServeSettings, ServingError
from gptj_flax.serving.worker import READY, WARMING_UP, Job, NotAccepting, QueueFull

logger = logging.getLogger(__name__)

GENERATION_PATHS = ("/complete", "/v1/completions", "/v1/chat/completions")
TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")
DOCKER_API_PATHS = ("/model/predict", "/model/get_prediction")
KNOWN_PATHS = (
    *GENERATION_PATHS,
    *TOKENIZER_PATHS,
    *DOCKER_API_PATHS,
    "/v1/models",
    "/v1/adapters",
    *PUBLIC_PATHS,
    "/openapi.json",
    "/docs",
)
CHAT_BODY_TEXTS = 8  # the full-length messages a chat body has room for on a server of a small --max-batch
# Open while draining: the probes, and the docker API's collection of results accepted before it.
OPEN_WHILE_DRAINING = (*PUBLIC_PATHS, "/model/get_prediction")


def error_response(description: str) -> dict:
    """An error answer as a route's ``responses`` documents it."""
    return {"model": schemas.ErrorBody, "description": description}


ERRORS = {
    400: error_response("malformed JSON"),
    401: error_response("missing or invalid API key"),
    413: error_response("the prompt cannot fit the model's context, or the body is too large"),
    429: error_response("the queue is full; retry after `Retry-After` seconds"),
    503: error_response("warming up, or shutting down"),
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


def adapter_bank(model, settings: ServeSettings) -> AdapterBank | None:
    """The bank of adapters served beside the base (None when the server holds none): the named
    ``--adapter`` flags' loaded, room for ``--max-adapters``, shaped by ``--max-adapter-rank`` and
    ``--adapter-targets`` or else by those adapters."""
    if settings.adapter_slots == 0:
        return None
    named = settings.served_adapters
    targets = tuple(t.strip() for t in (settings.adapter_targets or "").split(",") if t.strip())
    return AdapterBank.build(
        model.config,
        model.mesh,
        named,
        max_adapters=settings.adapter_slots,
        rank=settings.max_adapter_rank or (None if named else DEFAULT_ADAPTER_RANK),
        projections=targets or (() if named else DEFAULT_ADAPTER_TARGETS),
        base=settings.checkpoint,
    )


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
        self._token_bytes: dict[int, list[int]] = {}
        self.chat_template = chat.chat_template(settings.chat_template, model.tokenizer)
        self.metrics = Metrics()
        self.adapters = adapter_bank(model, settings)
        self._adapter_jobs: dict[int, set[Job]] = {}  # bank row → the jobs submitted with it
        self._adapter_scoring: collections.Counter[int] = collections.Counter()  # bank row → requests being scored
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
            prefix_cache=not settings.no_prefix_cache,
            decode_steps=settings.decode_steps,
            adapters=self.adapters,
        )
        self.scorer = PromptScorer(
            model,
            max_rows=settings.queue_size,
            metrics=self.metrics,
            adapters=self.adapters,
            prefix_cache=not settings.no_prefix_cache,
        )
        # Prompts and pre_prompts of a full batch, JSON-escaped at worst, with room for the rest; a
        # chat request carries a whole conversation, so at least CHAT_BODY_TEXTS full texts, whatever the batch.
        texts = max(2 * settings.max_batch, CHAT_BODY_TEXTS)
        self.max_body_bytes = 2**16 + texts * schemas.MAX_TEXT_CHARS * 6
        self.predictions = PredictionStore(settings.predictions_kept)  # the docker API's jobs
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
    @property
    def model_names(self) -> list[str]:
        """The base's name, then every adapter's."""
        return [self.name, *([] if self.adapters is None else self.adapters.adapters)]

    def adapter_of(self, name: str | None) -> int:
        """The adapter-bank row a request's ``model`` picks: 0 for the base (or none given); a 404
        naming it if nothing here has that name."""
        if name is None or name == self.name:
            return 0
        if self.adapters is not None and name in self.adapters.adapters:
            return self.adapters.adapters[name].index
        names = ", ".join(repr(n) for n in self.model_names)
        raise HTTPException(404, f"model {name!r} is not served here; this server has {names}")

    def check_model(self, name: str | None) -> None:
        self.adapter_of(name)

    def adapter_busy(self, index: int) -> int:
        """Requests submitted with adapter row ``index`` that have not ended yet, or being scored with it."""
        jobs = self._adapter_jobs.get(index, set())
        jobs -= {job for job in jobs if job.answered or job.cancelled or job.result.done()}
        return len(jobs) + self._adapter_scoring[index]

    def encode(self, text: str) -> list[int]:
        return self.model.encode(text) if text else []

    def last_tokens(self, text: str, length: int) -> list[int]:
        """``text``'s last tokens that fit the context with ``length`` new ones (its start token if empty)."""
        tokens = self.encode(text)
        return tokens[max(0, len(tokens) - (self.context - length)) :] or [self.start_token]

    def token_text(self, token: int) -> str:
        """One token's text, as the logprobs object shows it (remembered: lm-eval asks for many)."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.model.decode([token])
        return text

    def token_bytes(self, token: int) -> list[int]:
        """One token's bytes, as OpenAI's chat logprobs show them (remembered, as its text is)."""
        found = self._token_bytes.get(token)
        if found is None:
            found = self._token_bytes[token] = chat.token_bytes(self.model.tokenizer, token, self.token_text(token))
        return found

    def render_chat(self, messages: list[dict]) -> str:
        """The prompt text of a conversation (``chat.RenderError`` if the template refuses it); a 400
        naming --chat-template on a server without a template."""
        if self.chat_template is None:
            raise HTTPException(
                400,
                "this server has no chat template: its tokenizer has none; start it with --chat-template FILE "
                "(a Jinja chat template) to serve /v1/chat/completions, or send the prompt to /v1/completions",
            )
        return chat.render(self.model.tokenizer, self.chat_template, messages)

    async def score_and_continue(self, prompts: list[list[int]], top_logprobs: int, model: str | None = None) -> list:
        """Each prompt's scores and its one greedy token, from one scoring pass (see
        :func:`~gptj_flax.serving.scoring.next_token`): ``(Scored or None, Completion)`` per prompt."""
        scored = await self.score([[*p, PLACEHOLDER] for p in prompts], max(top_logprobs, 1), model)
        eos, tokenizer = self.model.eos_token_id, self.model.tokenizer
        out = [next_token(s, top_logprobs, None if eos is None else int(eos), tokenizer) for s in scored]
        self.metrics.generated_tokens.inc(len(out))
        return out

    def text_offsets(self, start: int) -> TextOffsets:
        """The ``text_offset`` of tokens whose text begins at character ``start``."""
        return TextOffsets(lambda t: self.token_text(t[0]) if len(t) == 1 else self.model.decode(t), start)

    async def score(self, prompts: list[list[int]], top_logprobs: int, model: str | None = None) -> list:
        """Each prompt's scores under the model a request named (the base's name or an adapter's);
        the adapter cannot be removed meanwhile."""
        index = self.adapter_of(model)
        self._adapter_scoring[index] += 1  # counted before any await: a removal sees it at once
        try:
            return await self.scorer.score(prompts, top_logprobs, None if index == 0 else model)
        except QueueFull as e:
            raise HTTPException(429, str(e), headers={"Retry-After": str(e.retry_after)}) from None
        except Exception:  # the prompts were checked: what fails here is the device, not the request
            logger.exception("scoring %d prompt(s) failed", len(prompts))
            raise HTTPException(500, "scoring the prompt failed; the server log has the details") from None
        finally:
            self._adapter_scoring[index] -= 1

    def submit(self, job: Job) -> None:
        try:
            self.worker.submit(job)
            for index in {row.adapter for row in job.rows if row.adapter}:  # a removal waits for it
                self._adapter_jobs.setdefault(index, set()).add(job)
        except QueueFull as e:
            raise HTTPException(429, str(e), headers={"Retry-After": str(e.retry_after)}) from None
        except NotAccepting as e:
            retry = {"Retry-After": "5"} if self.worker.state == WARMING_UP else None
            raise HTTPException(503, str(e), headers=retry) from None

    async def run(self, request: Request, job: Job) -> list:
        """Queue ``job`` and wait for its completions; if the client disconnects first, drop the job."""
        self.submit(job)
        gone = asyncio.ensure_future(client_gone(request))
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


def caller(request: Request) -> str | None:
    """The id of the key the request was let in with (None without authentication), as
    :class:`~gptj_flax.serving.auth.KeyCheck` found it."""
    return request.scope.get(KEY_ID)


async def client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the next message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def draw_seed(seed: int | None, offset: int = 0) -> int:
    """The seed of a request's row ``offset``: from the request's ``seed``, or a fresh random one."""
    return secrets.randbelow(schemas.SEED_LIMIT) if seed is None else (seed + offset) % schemas.SEED_LIMIT


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


# -- the probes --------------------------------------------------------------------------------------
def health_status(service: Service) -> JSONResponse:
    """The service's state: 200 once it takes requests, 503 before and while draining."""
    status = service.status
    body = schemas.Health(
        status=status, model=service.name, queued_prompts=service.worker.queued_rows, error=service.worker.error
    )
    return JSONResponse(body.model_dump(), status_code=200 if status == READY else 503)


def render_metrics(service: Service) -> Response:
    return Response(service.metrics.render(), media_type=service.metrics.content_type)


def add_probe_routes(app: FastAPI, service: Service) -> None:
    """``/health`` and ``/metrics``, which need no API key."""

    @app.get("/health", response_model=schemas.Health, responses={503: {"model": schemas.Health}})
    async def health():
        """200 once the model is warmed up (compiled) and taking requests; 503 before, and while draining."""
        return health_status(service)

    @app.get(
        "/metrics",
        response_class=Response,
        responses={
            200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text format"}
        },
    )
    async def metrics():
        return render_metrics(service)
