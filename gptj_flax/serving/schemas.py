"""Request and response bodies. Validation is strict: a wrong type or a value out of range is a 422
naming the field, never a silent coercion (``"128"`` is not a length; ``true`` is not a number).

JSON as Python reads it also has ``NaN``, ``Infinity`` (and ``1e309``, which overflows to it) and
strings holding lone UTF-16 surrogates (``"\\ud800"``), which no UTF-8 text can: float fields must
be finite, and every text field has a length limit, which makes pydantic check it as Unicode text
(it refuses a lone surrogate only in constrained strings).

However large a body, its errors are few: a list of token ids is checked in one pass and gives
one error (not one per id), ``prompt``'s shapes are told apart before validation (so a prompt is
checked as one shape, not as each of four), and unknown fields are named up to ``MAX_ERRORS``.
"""

import itertools
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from gptj_flax.sampling import Sampling

MAX_TEXT_CHARS = 16384  # the GPT-4chan limit on prompt and pre_prompt
MAX_STOP_STRINGS, MAX_STOP_CHARS = 4, 256
MAX_LOGPROBS = 20  # alternatives per token, as vLLM's default limit
MAX_PROMPT_TOKENS = MAX_TEXT_CHARS  # a token-id prompt's length limit (the body limit assumes it)
SEED_LIMIT = 2**32  # LanguageModel.generate takes seeds in [0, 2**32)
MAX_KEY_CHARS = 1024  # the longest API key: a keys file's, a Bearer token's or an api_key field's
MAX_ERRORS = 20  # errors a 422 lists; it counts the rest
# The samplers take top_p / typical_p in (0, 1]; the APIs' 0 means "keep as few tokens as the filter
# can" (one, and any tied with it), which the smallest positive float32 gives.
FEWEST_TOKENS = float(np.finfo(np.float32).tiny)
# GPT-4chan's and the original servers' temperatures have no upper limit; beyond float32's range one
# would become inf (and inf / -inf logits are NaN): the largest float32 samples just as uniformly.
HOTTEST = float(np.finfo(np.float32).max)

# Fields that several bodies share: each body sets its own default (and, where it differs, description).
ApiKey = Annotated[
    str | None,
    Field(min_length=1, max_length=MAX_KEY_CHARS, description="API key (or send it as `Authorization: Bearer KEY`)"),
]
Seed = Annotated[
    int | None,
    Field(
        ge=0,
        lt=SEED_LIMIT,
        description="random seed; the same seed, prompt and settings give the same output "
        "(default: a fresh random seed)",
    ),
]
PromptText = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
Temperature = Annotated[float, Field(ge=0, allow_inf_nan=False, description="0 is greedy")]
TopP = Annotated[
    float,
    Field(
        ge=0, le=1, allow_inf_nan=False, description="nucleus sampling; 1 is off, 0 keeps only the most likely token"
    ),
]
TopK = Annotated[int, Field(le=2**31 - 1)]  # the samplers hold it as an int32
Length = Annotated[int, Field(ge=1, description="tokens to generate (fewer if the model ends the text)")]


def fewest(p: float) -> float:
    """An API's top_p or typical_p as the samplers take it (0: keep the fewest tokens they can)."""
    return p if p > 0 else FEWEST_TOKENS


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


def _neutral_only(field: str, neutral: tuple, shown: str, instead: str = "") -> BeforeValidator:
    """Accept one of OpenAI's fields this server does not implement only at a value that changes
    nothing (``neutral``, spelt ``shown``: clients often send the defaults), and refuse any other
    value by name, as one error before its type is checked (a dict of many bad entries gives one)."""

    def check(value):
        if value not in neutral:
            raise PydanticCustomError(
                "not_implemented",
                "this server does not implement {field}: only {shown} is accepted{instead}",
                {"field": field, "shown": shown, "instead": instead},
            )
        return value

    return BeforeValidator(check)


def _unknown_fields_refused(model: type[BaseModel], data: Any) -> Any:
    """Refuse the fields ``model`` does not have, naming the first ``MAX_ERRORS`` (pydantic's
    ``extra="forbid"`` makes an error of each, and a body can hold hundreds of thousands)."""
    if not isinstance(data, dict):
        return data
    known = model.model_fields.keys()
    unknown = list(itertools.islice((name for name in data if name not in known), MAX_ERRORS))
    if unknown:
        errors = [InitErrorDetails(type="extra_forbidden", loc=(name,), input=None) for name in unknown]
        raise ValidationError.from_exception_data(model.__name__, errors)
    return data


ModelName = Annotated[str, Field(max_length=256, description="must be the served model's id, if given")]


class CompleteRequest(StrictModel):
    """The GPT-4chan `/complete` body: its fields, defaults and limits, plus an optional seed."""

    prompt: PromptText = Field(
        description="text to continue; its oldest tokens are dropped when it does not fit the context with `length`"
    )
    pre_prompt: PromptText = Field(
        "", description="text put before the prompt; its first `pre_prompt_length` tokens are kept"
    )
    api_key: ApiKey = None
    length: Annotated[Length, Field(le=1024)] = 128
    top_p: TopP = 1.0
    temperature: Temperature = 1.0
    typical_p: float = Field(
        1.0,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="locally typical sampling; 1 is off, 0 keeps only the most typical token",
    )
    seed: Seed = None
    model: ModelName | None = Field(
        None, description="an extension: the served model to complete with, the base's id or an adapter's"
    )

    @property
    def sampling(self) -> Sampling:
        return Sampling(
            temperature=min(self.temperature, HOTTEST), top_p=fewest(self.top_p), typical_p=fewest(self.typical_p)
        )


class CompleteResponse(BaseModel):
    response: str = Field(description="the generated text only (not the prompt)")


StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


def _in_vocabulary(vocab: int) -> AfterValidator:
    """One pass over a list of token ids: every one an integer in [0, ``vocab``), or one error saying
    how many are not and where the first is (never the values)."""

    def check(ids: list) -> list:
        if all(type(t) is int for t in ids) and (not ids or (min(ids) >= 0 and max(ids) < vocab)):
            return ids
        bad = [i for i, t in enumerate(ids) if type(t) is not int or not 0 <= t < vocab]
        raise PydanticCustomError(
            "token_id",
            "token ids must be integers in [0, {vocab}): {count} of {total} are not, the first at position {first}",
            {"vocab": vocab, "count": len(bad), "total": len(ids), "first": bad[0]},
        )

    return AfterValidator(check)


def token_ids(vocab: int, min_length: int = 1) -> type:
    """A list of token ids in [0, ``vocab``), ``min_length`` to ``MAX_PROMPT_TOKENS`` of them."""
    schema = {"type": "integer", "minimum": 0, "maximum": vocab - 1}
    return Annotated[
        list[Annotated[Any, WithJsonSchema(schema)]],
        Field(min_length=min_length, max_length=MAX_PROMPT_TOKENS),
        _in_vocabulary(vocab),
    ]


def _prompt_shape(prompt: Any) -> str | None:
    """Which of the prompt's shapes a value has, told by its first item (None: none of them)."""
    if isinstance(prompt, str):
        return "text"
    if not isinstance(prompt, list):
        return None
    if not prompt or isinstance(prompt[0], str):
        return "texts"
    return "token_lists" if isinstance(prompt[0], list) else "tokens"


def prompt_type(max_prompts: int, vocab: int) -> type:
    """`/v1/completions`' prompt: a text, up to ``max_prompts`` texts, token ids, or lists of them."""
    TokenIds = token_ids(vocab)
    return Annotated[
        Annotated[PromptText, Tag("text")]
        | Annotated[list[PromptText], Field(min_length=1, max_length=max_prompts), Tag("texts")]
        | Annotated[TokenIds, Tag("tokens")]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=max_prompts), Tag("token_lists")],
        Discriminator(
            _prompt_shape,
            custom_error_type="prompt_type",
            custom_error_message="prompt must be a text, a list of texts, a list of token ids, or a list of such lists",
        ),
    ]


def _unimplemented_penalty(field: str) -> Any:
    """OpenAI's presence or frequency penalty: a finite number, accepted only at 0."""
    return Annotated[float, Field(allow_inf_nan=False), _neutral_only(field, (0,), "0", "; repetition_penalty is")]


class GenerationFields(StrictModel):
    """What OpenAI's completions and chat completions requests share: the sampling settings (with
    vLLM's `top_k`, `min_p` and `repetition_penalty`), stop strings, seed and stream.

    As OpenAI does, a field it does not know is refused by name. OpenAI's fields this server
    does not implement are accepted only at their neutral values.
    """

    # Unknown fields are refused by _no_unknown_fields; the schema says so as extra="forbid" would.
    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={"additionalProperties": False})

    model: ModelName | None = None
    n: int  # the request model gives its limit
    temperature: Annotated[Temperature, Field(le=2)] = 1.0
    top_p: TopP = 1.0
    top_k: Annotated[TopK, Field(ge=-1, description="keep the k most likely tokens; 0 or -1 is off")] = 0
    min_p: float = Field(
        0.0, ge=0, le=1, allow_inf_nan=False, description="drop tokens below min_p × the most likely's probability"
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0,
        le=10,
        allow_inf_nan=False,
        description="divide (multiply, if negative) the logits of tokens already seen; 1 is off",
    )
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description="up to 4 strings that end the text (they are not part of it)"
    )
    seed: Seed = None
    stream: bool = Field(False, description="send the text as server-sent events while it is generated")
    api_key: ApiKey = None
    presence_penalty: _unimplemented_penalty("presence_penalty") = 0.0
    frequency_penalty: _unimplemented_penalty("frequency_penalty") = 0.0
    logit_bias: Annotated[dict[str, float] | None, _neutral_only("logit_bias", (None, {}), "null or {}")] = None

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_fields(cls, data: Any) -> Any:
        return _unknown_fields_refused(cls, data)

    @property
    def sampling(self) -> Sampling:
        return Sampling(
            temperature=self.temperature,
            top_p=fewest(self.top_p),
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
        )


class CompletionFields(GenerationFields):
    """OpenAI's legacy completions request, with vLLM's `top_k`, `min_p` and `repetition_penalty`."""

    prompt: Any  # a text, texts or token ids: completion_request_model gives its type
    max_tokens: int = Field(
        16,
        ge=0,
        le=2**20,
        description="tokens to generate per prompt; prompt and max_tokens must fit the model's context; "
        "0 (with `echo`) only scores the prompt",
    )
    echo: bool = Field(False, description="return the prompt before the completion (and its log-probs)")
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description=f"return each token's log-probability and the {MAX_LOGPROBS} at most most likely "
        "alternatives at its position (the chosen token is always among them)",
    )
    best_of: int | None = Field(None, description="accepted only as null or equal to `n`")
    suffix: Annotated[str | None, _neutral_only("suffix", (None, ""), 'null or ""')] = None
    stream_options: Annotated[
        dict[str, bool] | None,
        _neutral_only(
            "stream_options",
            (None, {}, {"include_usage": False}),
            'null or {"include_usage": false}',
            "; a stream does not end with its usage",
        ),
    ] = None

    @model_validator(mode="after")
    def _best_of_is_n(self):
        if self.best_of is not None and self.best_of != self.n:
            raise PydanticCustomError(
                "not_implemented",
                "this server does not implement best_of: only null or best_of equal to n ({n}) is accepted",
                {"n": self.n},
            )
        return self


def completion_request_model(max_prompts: int, vocab: int) -> type[CompletionFields]:
    """The OpenAI-style `/v1/completions` body; a list prompt holds at most ``max_prompts`` (the batch
    size), token ids lie in [0, ``vocab``)."""
    prompt = Field(
        description=f"a text, a list of up to {max_prompts} texts, a list of token ids, or a list of up "
        f"to {max_prompts} such lists; `n` × prompts must not exceed {max_prompts}"
    )
    n = Field(1, ge=1, le=max_prompts, description="completions per prompt, each with its own seed")
    return create_model(
        "CompletionRequest",
        __base__=CompletionFields,
        __doc__=CompletionFields.__doc__,
        __module__=__name__,
        prompt=(prompt_type(max_prompts, vocab), prompt),
        n=(int, n),
    )


# -- /v1/chat/completions --------------------------------------------------------------------------
ROLES = ("system", "user", "assistant")
MAX_MESSAGES = 1024  # a conversation's messages; each content has MAX_TEXT_CHARS at most


def _text_part_only(part: Any) -> Any:
    """A content part of another type than text (an image, audio, a file) is refused by its field."""
    if isinstance(part, dict) and part.get("type") != "text":
        raise PydanticCustomError(
            "content_part",
            'only content parts of type "text" are accepted: this model reads text only',
        )
    return part


class TextPart(StrictModel):
    type: Literal["text"]
    text: PromptText

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_fields(cls, data: Any) -> Any:
        return _unknown_fields_refused(cls, _text_part_only(data))


def _content_shape(content: Any) -> str | None:
    return "text" if isinstance(content, str) else "parts" if isinstance(content, list) else None


MessageContent = Annotated[
    Annotated[PromptText, Tag("text")]
    | Annotated[list[TextPart], Field(min_length=1, max_length=MAX_MESSAGES), Tag("parts")],
    Discriminator(
        _content_shape,
        custom_error_type="content_type",
        custom_error_message="content must be a text or a list of text parts",
    ),
]


class ChatMessage(StrictModel):
    """One message of the conversation; a list of text parts is read as their texts joined by newlines."""

    role: Literal[ROLES] = Field(description="who wrote it: " + ", ".join(ROLES))
    content: MessageContent
    name: Annotated[str, Field(min_length=1, max_length=256)] | None = Field(
        None, description="the author's name, for templates that use it"
    )

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_fields(cls, data: Any) -> Any:
        return _unknown_fields_refused(cls, data)

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


class StreamOptions(StrictModel):
    include_usage: bool = Field(False, description="end the stream with a chunk that holds the request's usage")

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_fields(cls, data: Any) -> Any:
        return _unknown_fields_refused(cls, data)


ChatLength = Annotated[
    int | None,
    Field(
        ge=1,
        le=2**20,
        description="tokens to generate per choice; the rendered messages and it must fit the model's context "
        "(default: as many as the context leaves)",
    ),
]


class ChatFields(GenerationFields):
    """OpenAI's chat completions request: the messages, rendered into the prompt by the chat
    template, then completed as `/v1/completions` completes that prompt."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: ChatLength = None
    max_completion_tokens: ChatLength = None
    logprobs: bool = Field(False, description="return each generated token's log-probability")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="with `logprobs`: the most likely tokens at each position"
    )
    stream_options: StreamOptions | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise PydanticCustomError("logprobs_needed", "top_logprobs needs logprobs: true")
        return value

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_length(cls, value: int | None, info: ValidationInfo) -> int | None:
        given = info.data.get("max_tokens")
        if None not in (value, given) and value != given:
            raise PydanticCustomError(
                "conflict", "max_tokens and max_completion_tokens differ: give one (max_tokens is its older name)"
            )
        return value

    @property
    def length(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def chat_request_model(max_choices: int) -> type[ChatFields]:
    """The `/v1/chat/completions` body: `n` is at most ``max_choices`` (the batch size)."""
    n = Field(1, ge=1, le=max_choices, description="choices, each with its own seed")
    return create_model(
        "ChatCompletionRequest", __base__=ChatFields, __doc__=ChatFields.__doc__, __module__=__name__, n=(int, n)
    )


class Logprobs(BaseModel):
    """OpenAI's logprobs object; with `echo`, the first prompt token has no log-probability (null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class Choice(BaseModel):
    text: str
    index: int
    logprobs: Logprobs | None = None
    finish_reason: Literal["stop", "length"] | None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] = Field(description="the token's UTF-8 bytes (part of a character's, for some tokens)")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(description="the most likely tokens at this position, most likely first")


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TokenizeRequest(StrictModel):
    """vLLM's `/tokenize` body for a text."""

    model: ModelName | None = None
    prompt: PromptText
    add_special_tokens: bool = Field(True, description="add the tokenizer's special tokens (GPT-J's has none)")
    return_token_strs: bool = Field(False, description="also return each token as the tokenizer spells it")


def detokenize_request_model(vocab: int) -> type[StrictModel]:
    class DetokenizeRequest(StrictModel):
        """vLLM's `/detokenize` body."""

        model: ModelName | None = None
        tokens: token_ids(vocab, min_length=0)

    return DetokenizeRequest


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """What lm-eval's remote tokenizer reads: the special tokens (it finds their ids through `/tokenize`)."""

    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    unk_token: str | None
    model_max_length: int
    vocab_size: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "gptj_flax"
    max_model_len: int
    # Beyond OpenAI's fields (its clients keep extra ones): what the model computes in, for people.
    dtype: str = Field(description="the dtype the model computes in: float32, bfloat16 or float16")
    quantization: str | None = Field(None, description="int8 where the block projections are stored as int8")
    parent: str | None = Field(None, description="for a LoRA adapter served beside the base: the base's id")


class AdapterRequest(StrictModel):
    """`POST /v1/adapters`: the adapter's name (what a request's `model` gives) and its directory."""

    name: str = Field(max_length=128, description="letters, digits, '.', '_', ':' or '-'")
    path: str = Field(
        min_length=1, max_length=4096, description="a LoRA run or step directory, or a PEFT directory, on the server"
    )


class AdapterCard(BaseModel):
    id: str
    object: Literal["adapter"] = "adapter"
    parent: str = Field(description="the base model's id")
    path: str
    rank: int
    projections: list[str]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["warming_up", "ready", "draining", "failed", "stopped"]
    model: str
    queued_prompts: int
    error: str | None = None


class ErrorBody(BaseModel):
    detail: str


# -- the original mesh-transformer-jax servers' bodies -----------------------------------------------
# Fields only GPT-4chan's /complete body has: a device_serve.py body with one of them is refused, not
# half-read. top_p and api_key are in both.
GPT4CHAN_ONLY_FIELDS = frozenset(CompleteRequest.model_fields) - {"top_p", "api_key"}
# The docker API numbered jobs from 1; ours are random (so one client cannot read another's by
# counting) and below 2**53, so that JavaScript clients read them exactly.
QID_LIMIT = 2**53


class DeviceServeRequest(StrictModel):
    """mesh-transformer-jax's `device_serve.py` body on `/complete`: every field required, as there."""

    context: PromptText = Field(
        description="text to continue; its oldest tokens are dropped when it does not fit the context"
    )
    top_p: TopP
    temp: Temperature = Field(description="temperature; 0 is greedy")
    api_key: ApiKey = None

    @model_validator(mode="before")
    @classmethod
    def _not_a_gpt4chan_body(cls, data: Any) -> Any:
        if isinstance(data, dict) and (mixed := sorted(GPT4CHAN_ONLY_FIELDS.intersection(data))):
            raise PydanticCustomError(
                "mixed_body",
                "a /complete body is GPT-4chan's (with prompt) or device_serve.py's (context, top_p, temp), "
                "not both: this one has context or temp, and GPT-4chan's {fields}",
                {"fields": ", ".join(mixed)},
            )
        return data

    @property
    def sampling(self) -> Sampling:
        return Sampling(temperature=min(self.temp, HOTTEST), top_p=fewest(self.top_p))


class DeviceServeResponse(BaseModel):
    completion: str = Field(description="the generated text only (not the context)")


class PredictRequest(StrictModel):
    """The `docker/` API's `/model/predict` body: its fields and defaults."""

    context: PromptText = Field(
        description="text to continue; its oldest tokens are dropped when it does not fit the context with `length`"
    )
    temp: Temperature = Field(1.0, description="temperature; 0 is greedy")
    top_p: TopP = 0.9
    top_k: Annotated[TopK, Field(ge=0, description="keep only the k most likely tokens; 0 is off")] = 50
    length: Annotated[Length, Field(le=2**20)] = 256
    api_key: ApiKey = None

    @property
    def sampling(self) -> Sampling:
        return Sampling(temperature=min(self.temp, HOTTEST), top_p=fewest(self.top_p), top_k=self.top_k)


class PredictResponse(BaseModel):
    qid: int = Field(description="the job's id, for `/model/get_prediction`")


class PredictionRequest(StrictModel):
    qid: int = Field(ge=1, lt=QID_LIMIT, description="a `/model/predict` answer's qid")
    api_key: ApiKey = None


class PredictionResponse(BaseModel):
    context: str = Field(description="the context sent to `/model/predict`")
    completion: str = Field(description="the generated text only (not the context)")
    time: float = Field(description="seconds from `/model/predict` until the completion was ready")
