"""OpenAI's legacy completions (``POST /v1/completions``, ``GET /v1/models``), its chat completions
(``POST /v1/chat/completions``: the messages rendered by the chat template, then completed as
``/v1/completions`` completes that prompt) and vLLM's tokenizer routes (``POST /tokenize``,
``POST /detokenize``, ``GET /tokenizer_info``), with OpenAI's logprobs objects and server-sent events.

Each route is a module-level function of the :class:`~gptj_flax.serving.service.Service` and the
request; :func:`add_routes` registers thin wrappers around them (the request types of
``/v1/completions`` and ``/detokenize`` depend on the batch size and the vocabulary).
"""

import functools
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse

from gptj_flax.serving import schemas
from gptj_flax.serving.chat import RenderError
from gptj_flax.serving.offsets import TextOffsets
from gptj_flax.serving.service import ERRORS, Service, caller, draw_seed, error_response
from gptj_flax.serving.worker import Job, Prompt, StreamEnd

OPENAI_FINISH_REASON = {"eos": "stop", "stop": "stop", "length": "length"}
# One server-sent event of a streamed completion, as OpenAPI describes SSE responses.
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {"type": "string", "description": "a completion chunk (JSON, one choice's new text) or, last, `[DONE]`"}
    },
}
UNKNOWN_MODEL = {404: error_response("unknown model")}
COMPLETION_RESPONSES = {
    **ERRORS,
    **UNKNOWN_MODEL,
    200: {
        "content": {"text/event-stream": {"schema": SSE_EVENT}},
        "description": "a completion; with `stream`, server-sent events",
    },
}

CHAT_RESPONSES = {
    **COMPLETION_RESPONSES,
    400: error_response("malformed JSON, or the server has no chat template (start it with --chat-template)"),
    200: {
        "content": {"text/event-stream": {"schema": SSE_EVENT}},
        "description": "a chat completion; with `stream`, server-sent events of `chat.completion.chunk` objects",
    },
}

Prompts = list[tuple[str, list[int]]]  # each prompt's text and tokens
Body = schemas.CompletionFields  # the /v1/completions body: completion_request_model fills in its limits
ChatBody = schemas.ChatFields  # the /v1/chat/completions body: chat_request_model fills in its limits


# -- /v1/completions ---------------------------------------------------------------------------------
async def create_completion(service: Service, body: Body, request: Request):
    """Answer ``body`` (of :func:`~gptj_flax.serving.schemas.completion_request_model`'s type): a
    completion, or (``stream``) its server-sent events."""
    started, key = time.monotonic(), caller(request)
    prompts = checked_prompts(service, body)
    model = body.model or service.name
    rows = completion_rows(body, prompts, service.adapter_of(model))
    completion_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    log = functools.partial(_log, service, "/v1/completions", body, prompts, key, started)
    if body.stream:
        prompt_chars = [len(prompts[i // body.n][0]) for i in range(len(rows))]
        return _streamed(
            service,
            Job(rows, stream=True, logprobs=body.logprobs is not None, model=model),
            lambda job: CompletionChunks(service, job, completion_id, created, prompt_chars),
            log,
        )
    results = await _results(service, body, request, prompts, rows)
    choices = [
        _choice(service, body, prompts[index // body.n], scored, index, completion)
        for index, (scored, completion) in enumerate(results)
    ]
    log([c.text for c in choices])
    prompt_tokens = sum(len(tokens) for _, tokens in prompts)
    completion_tokens = sum(c.completion_tokens for _, c in results if c is not None)
    return schemas.CompletionResponse(
        id=completion_id,
        created=created,
        model=model,
        choices=choices,
        usage=_usage(prompt_tokens, completion_tokens),
    )


def _usage(prompt_tokens: int, completion_tokens: int) -> schemas.Usage:
    return schemas.Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )


def checked_prompts(service: Service, body: Body) -> Prompts:
    """The request's prompts, once the request as a whole is one this server can answer."""
    if body.echo and body.stream:
        raise _invalid("echo", "echo is not available with stream")
    if body.max_tokens == 0 and not body.echo:
        raise _invalid("max_tokens", "max_tokens 0 generates nothing: it is only for scoring the prompt with echo")
    prompts = _prompts(service, body.prompt)
    check_room(service, body, prompts)
    return prompts


def check_room(service: Service, body: Body, prompts: Prompts, label: str = "prompt {index}") -> None:
    """The request's rows fit the batch, and each prompt with ``max_tokens`` fits the context (413)."""
    if len(prompts) * body.n > service.settings.max_batch:
        raise _invalid(
            "n",
            f"n={body.n} completions of {len(prompts)} prompt(s) exceed the {service.settings.max_batch} "
            "a request may ask for",
        )
    for i, (_, tokens) in enumerate(prompts):
        if len(tokens) + body.max_tokens > service.context:
            raise HTTPException(
                413,
                f"{label.format(index=i)} has {len(tokens)} tokens; with max_tokens={body.max_tokens} "
                f"that exceeds the model's context of {service.context} tokens",
            )


def completion_rows(body: Body, prompts: Prompts, adapter: int = 0) -> list[Prompt]:
    """``n`` rows per prompt, choice i·n + j drawing with seed + i·n + j (as OpenAI numbers choices),
    each applying the adapter in row ``adapter`` of the server's bank (0: none)."""
    return [
        Prompt(
            tokens,
            body.max_tokens,
            body.sampling,
            draw_seed(body.seed, i * body.n + j),
            _stop_strings(body.stop),
            top_logprobs=body.logprobs or 0,
            adapter=adapter,
        )
        for i, (_, tokens) in enumerate(prompts)
        for j in range(body.n)
    ]


async def _results(service: Service, body: Body, request: Request, prompts: Prompts, rows: list[Prompt]) -> list:
    """Each choice's prompt score (with ``echo`` and ``logprobs``) and completion (unless
    ``max_tokens`` is 0), ``None`` where not asked for."""
    if _one_greedy_token(service, body):
        return await service.score_and_continue([tokens for _, tokens in prompts], body.logprobs or 0, body.model)
    scored = (
        await service.score([tokens for _, tokens in prompts], body.logprobs, body.model)
        if body.echo and body.logprobs is not None
        else [None] * len(prompts)
    )
    completions = (
        await service.run(request, Job(rows, logprobs=body.logprobs is not None, model=body.model or service.name))
        if body.max_tokens > 0
        else [None] * len(rows)
    )
    return [(scored[index // body.n], completion) for index, completion in enumerate(completions)]


def _one_greedy_token(service: Service, body: Body) -> bool:
    """Whether the request is lm-eval's log-likelihood request: the echoed prompt's scores and one
    greedy token, unpenalised and with no stop strings. The scoring pass gives that token too (the
    distribution after the prompt), so the prompt is not also prefilled in a decode slot. Only with a
    float KV cache, which scoring uses: an int8 one could choose another token."""
    sampling = body.sampling
    return (
        body.echo
        and body.logprobs is not None
        and body.max_tokens == 1
        and body.n == 1
        and not body.stop
        and sampling.temperature == 0
        and sampling.repetition_penalty == 1
        and service.settings.kv_cache is None
    )


def _choice(service: Service, body: Body, prompt: tuple[str, list[int]], scored, index: int, completion):
    text, tokens = prompt
    return schemas.Choice(
        text=(text if body.echo else "") + ("" if completion is None else completion.text),
        index=index,
        # scoring only, as vLLM answers it: the choice ended at its (zero) length
        finish_reason="length" if completion is None else OPENAI_FINISH_REASON[completion.finish_reason],
        logprobs=(
            None
            if body.logprobs is None
            else _logprobs(service, text, tokens if body.echo else None, scored, completion)
        ),
    )


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    return () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)


def _log(
    service: Service,
    endpoint: str,
    body: Body,
    prompts: Prompts,
    key: str | None,
    started: float,
    responses: list[str],
):
    """The request log's record: a text prompt (a chat's rendered messages) with one choice as texts,
    otherwise a response per choice (``n`` per prompt)."""
    single = isinstance(body.prompt, str) and len(responses) == 1
    service.log(
        key=key,
        endpoint=endpoint,
        prompt=body.prompt if isinstance(body.prompt, str) else [text for text, _ in prompts],
        pre_prompt="",
        settings=dict(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            repetition_penalty=body.repetition_penalty,
            stop=list(_stop_strings(body.stop)),
            seed=body.seed,
            n=body.n,
            echo=body.echo,
            logprobs=body.logprobs,
            stream=body.stream,
        ),
        response=responses[0] if single else responses,
        started=started,
    )


def _invalid(field: str, message: str) -> RequestValidationError:
    """A 422 naming ``field``, in the shape pydantic's own errors have."""
    return RequestValidationError([{"type": "value_error", "loc": ("body", field), "msg": message, "input": None}])


def _prompts(service: Service, prompt) -> Prompts:
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


# -- /v1/chat/completions ----------------------------------------------------------------------------
async def create_chat_completion(service: Service, body: ChatBody, request: Request):
    """Answer ``body`` (of :func:`~gptj_flax.serving.schemas.chat_request_model`'s type): its messages
    rendered by the chat template and completed as ``/v1/completions`` completes that text; a chat
    completion, or (``stream``) its server-sent events."""
    started, key = time.monotonic(), caller(request)
    adapter = service.adapter_of(body.model)
    try:
        text = service.render_chat([_message(m) for m in body.messages])
    except RenderError as e:  # the template's raise_exception, or its failure on these messages
        raise _invalid("messages", str(e)) from None
    prompts = _prompts(service, text)
    prompt_tokens = len(prompts[0][1])
    room = service.context - prompt_tokens  # the default length: what the context leaves
    completion = _as_completion(body, text, body.length if body.length is not None else max(room, 1))
    check_room(service, completion, prompts, "the rendered messages")
    rows = completion_rows(completion, prompts, adapter)
    chat_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    log = functools.partial(_log, service, "/v1/chat/completions", completion, prompts, key, started)
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return _streamed(
            service,
            Job(rows, stream=True, logprobs=body.logprobs, model=body.model or service.name),
            lambda job: ChatChunks(service, job, chat_id, created, prompt_tokens, usage),
            log,
        )
    completions = [c for _, c in await _results(service, completion, request, prompts, rows)]
    log([c.text for c in completions])
    return schemas.ChatCompletionResponse(
        id=chat_id,
        created=created,
        model=body.model or service.name,
        choices=[_chat_choice(service, body.logprobs, index, c) for index, c in enumerate(completions)],
        usage=_usage(prompt_tokens, sum(c.completion_tokens for c in completions)),
    )


def _message(message: schemas.ChatMessage) -> dict[str, str]:
    """A message as chat templates read it: its role, its content as one text, and its name if given."""
    out = {"role": message.role, "content": message.text}
    if message.name is not None:
        out["name"] = message.name
    return out


def _as_completion(body: ChatBody, prompt: str, max_tokens: int) -> Body:
    """The ``/v1/completions`` request a chat request is: its rendered prompt with the same settings
    (the same Sampling, seeds and stop strings), ``top_logprobs`` alternatives with ``logprobs``."""
    shared = {name: getattr(body, name) for name in schemas.GenerationFields.model_fields}
    alternatives = (body.top_logprobs or 0) if body.logprobs else None
    return Body.model_construct(**shared, prompt=prompt, max_tokens=max_tokens, logprobs=alternatives)


def _chat_choice(service: Service, logprobs: bool, index: int, completion) -> schemas.ChatChoice:
    return schemas.ChatChoice(
        index=index,
        message=schemas.AssistantMessage(content=completion.text),
        logprobs=(
            _chat_logprobs(service, completion.tokens, completion.logprobs, completion.top_logprobs)
            if logprobs
            else None
        ),
        finish_reason=OPENAI_FINISH_REASON[completion.finish_reason],
    )


def _chat_entry(service: Service, token: int, logprob: float) -> dict:
    return {"token": service.token_text(token), "logprob": logprob, "bytes": service.token_bytes(token)}


def _chat_logprobs(
    service: Service, tokens: list[int], logprobs: list[float], alternatives: list[dict[int, float]] | None
) -> schemas.ChatLogprobs:
    """OpenAI's chat logprobs: each token's text, log-prob and bytes, and the most likely tokens at its
    position (one entry per token id, so two may share a text; their bytes tell them apart)."""
    tops = alternatives or [{}] * len(tokens)
    return schemas.ChatLogprobs(
        content=[
            schemas.TokenLogprob(
                **_chat_entry(service, token, logprob),
                top_logprobs=[
                    schemas.TopLogprob(**_chat_entry(service, other, value))
                    for other, value in sorted(top.items(), key=lambda item: -item[1])
                ],
            )
            for token, logprob, top in zip(tokens, logprobs, tops, strict=True)
        ]
    )


# -- streaming ---------------------------------------------------------------------------------------
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


def _streamed(service: Service, job: Job, chunks, log) -> JobStream:
    """Queue the streaming ``job`` and answer with its events, as ``chunks(job)`` formats them."""
    service.submit(job)
    return JobStream(_events(job, chunks(job), log), on_close=lambda: service.worker.cancel(job))


async def _events(job: Job, chunks, log):
    """The job's text as ``chunks`` (:class:`CompletionChunks` or :class:`ChatChunks`) formats it, a
    last chunk per choice saying why it ended, then ``data: [DONE]``."""
    texts = [""] * len(job.rows)
    for event in chunks.opening():
        yield event
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
                yield chunks.piece(index, piece)
    for index, reason in enumerate(item.finish_reasons):  # as OpenAI: a last chunk per choice says why it ended
        if reason is not None:
            yield chunks.finish(index, OPENAI_FINISH_REASON[reason])
    for event in chunks.closing():
        yield event
    log(texts)
    yield _sse("[DONE]")


class CompletionChunks:
    """OpenAI's ``text_completion`` chunks: a piece's text, with its tokens' logprobs object if the job asks."""

    def __init__(self, service: Service, job: Job, completion_id: str, created: int, prompt_chars: list[int]):
        self.service, self.job, self.id, self.created = service, job, completion_id, created
        self.offsets = [service.text_offsets(start) for start in prompt_chars]  # each row's, across its pieces

    def opening(self) -> list[str]:
        return []

    def piece(self, index: int, piece) -> str:
        logprobs = None
        if self.job.logprobs:
            logprobs = _token_logprobs(
                self.service, piece.tokens, piece.logprobs, piece.top_logprobs, self.offsets[index]
            ).model_dump()
        return self._chunk(index, str(piece), logprobs, None)

    def finish(self, index: int, reason: str) -> str:
        return self._chunk(index, "", None, reason)

    def closing(self) -> list[str]:
        return []

    def _chunk(self, index: int, text: str, logprobs, finish_reason) -> str:
        choice = {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}
        return _sse(
            {
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.job.model or self.service.name,
                "choices": [choice],
            }
        )


class ChatChunks:
    """OpenAI's ``chat.completion.chunk`` objects: first each choice's role, then its text as content
    deltas (with their tokens' logprobs if asked), and with ``include_usage`` a last chunk of no
    choices holding the request's usage (every other chunk has ``usage: null``)."""

    def __init__(self, service: Service, job: Job, chat_id: str, created: int, prompt_tokens: int, usage: bool):
        self.service, self.job, self.id, self.created = service, job, chat_id, created
        self.prompt_tokens, self.usage = prompt_tokens, usage

    def opening(self) -> list[str]:
        return [self._chunk(index, {"role": "assistant", "content": ""}) for index in range(len(self.job.rows))]

    def piece(self, index: int, piece) -> str:
        logprobs = None
        if self.job.logprobs:
            logprobs = _chat_logprobs(self.service, piece.tokens, piece.logprobs, piece.top_logprobs).model_dump()
        return self._chunk(index, {"content": str(piece)}, logprobs)

    def finish(self, index: int, reason: str) -> str:
        return self._chunk(index, {}, finish_reason=reason)

    def closing(self) -> list[str]:
        if not self.usage:
            return []
        generated = sum(c.completion_tokens for c in self.job.outputs if c is not None)  # filled before StreamEnd
        return [self._event([], _usage(self.prompt_tokens, generated).model_dump())]

    def _chunk(self, index: int, delta: dict, logprobs=None, finish_reason=None) -> str:
        return self._event([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])

    def _event(self, choices: list, usage=None) -> str:
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.job.model or self.service.name,
            "choices": choices,
        }
        if self.usage:
            chunk["usage"] = usage
        return _sse(chunk)


# -- OpenAI's logprobs object ------------------------------------------------------------------------
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


# -- the tokenizer and the model list ----------------------------------------------------------------
def encode_text(service: Service, body: schemas.TokenizeRequest) -> schemas.TokenizeResponse:
    service.check_model(body.model)
    tokenizer = service.model.tokenizer
    tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return schemas.TokenizeResponse(
        count=len(tokens),
        max_model_len=service.context,
        tokens=tokens,
        token_strs=tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None,
    )


def decode_tokens(service: Service, body: Any) -> schemas.DetokenizeResponse:
    service.check_model(body.model)
    return schemas.DetokenizeResponse(prompt=service.model.decode(body.tokens))


def describe_tokenizer(service: Service) -> schemas.TokenizerInfo:
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


def list_models(service: Service) -> schemas.ModelList:
    """The base, then each adapter served beside it (its ``parent`` the base)."""
    return schemas.ModelList(
        data=[
            schemas.ModelCard(
                id=name,
                created=service.created,
                max_model_len=service.context,
                dtype=service.model.compute_dtype,
                quantization=service.model.config.quantize,
                parent=None if name == service.name else service.name,
            )
            for name in service.model_names
        ]
    )


def add_routes(app: FastAPI, service: Service) -> None:
    CompletionRequest = schemas.completion_request_model(service.settings.max_batch, service.vocab)
    DetokenizeRequest = schemas.detokenize_request_model(service.vocab)
    ChatRequest = schemas.chat_request_model(service.settings.max_batch)

    @app.post("/v1/completions", response_model=schemas.CompletionResponse, responses=COMPLETION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        """OpenAI-style completions of one prompt or a list (texts or token ids), `n` each; `stream`
        sends server-sent events; `echo` with `logprobs` scores the prompt too (`max_tokens` 0: only that)."""
        return await create_completion(service, body, request)

    @app.post("/v1/chat/completions", response_model=schemas.ChatCompletionResponse, responses=CHAT_RESPONSES)
    async def chat_completions(body: ChatRequest, request: Request):
        """OpenAI-style chat completions: the messages rendered by the chat template (the tokenizer's, or
        `--chat-template`), then completed as `/v1/completions` completes that text; `n` choices, `stream`
        (server-sent events), `logprobs` with `top_logprobs`."""
        return await create_chat_completion(service, body, request)

    @app.post("/tokenize", response_model=schemas.TokenizeResponse, responses={**ERRORS, **UNKNOWN_MODEL})
    async def tokenize(body: schemas.TokenizeRequest):
        """vLLM's `/tokenize` of a text: its token ids, their count and the model's context."""
        return encode_text(service, body)

    @app.post("/detokenize", response_model=schemas.DetokenizeResponse, responses={**ERRORS, **UNKNOWN_MODEL})
    async def detokenize(body: DetokenizeRequest):
        """vLLM's `/detokenize`: the text of token ids (special tokens kept, as generation writes them)."""
        return decode_tokens(service, body)

    @app.get("/tokenizer_info", response_model=schemas.TokenizerInfo, responses={401: ERRORS[401]})
    async def tokenizer_info():
        """The tokenizer's special tokens, as vLLM's `/tokenizer_info` (lm-eval's remote tokenizer reads them)."""
        return describe_tokenizer(service)

    @app.get("/v1/models", response_model=schemas.ModelList, responses={401: ERRORS[401]})
    async def models():
        return list_models(service)
