"""The notebook- and server-facing API: a :class:`LanguageModel` to ``generate``, ``stream`` and ``score``.

    lm = gptj_flax.load("runs/demo")
    lm.generate("def fib(n):", max_new_tokens=64, temperature=0)            # one Completion
    lm.generate(["a", "b"], 32, temperature=[0, 0.8], top_p=[1, 0.9], seed=[1, 2])  # per-prompt settings
    lm.generate("a", 32, sampling=Sampling(temperature=0.7, top_p=0.9))    # the settings as one value
    for piece in lm.stream("Once upon a time", 100, stop="\\n\\n"):
        print(piece, end="")
    lm.score("The cat sat on the mat").logprobs

A prompt is text or a list of token ids; a *list* of prompts is a batch and gives a list back.
Every setting takes one value for the whole batch or a list with one value per prompt, so a server
can put requests with different settings in one batch.

On a multi-host slice every process loads the model and makes each call with the same arguments;
every process gets the whole result (``stream`` yields the same pieces everywhere), so a script
typically prints on process 0 only. Processes called with different arguments raise
:class:`SamplingError` before anything runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh

from gptj_flax import partitioning
from gptj_flax.config import ModelConfig, dtype_name
from gptj_flax.sampling.adapter_bank import AdapterBank
from gptj_flax.sampling.decoding import EOS, FINISH_REASON_OF_CODE, RUNNING, Decoder, DecodeRun
from gptj_flax.sampling.multihost import check_same_call
from gptj_flax.sampling.samplers import Sampling, SamplingError, SamplingParams, per_example, sampling_rows
from gptj_flax.sampling.score_cache import DEFAULT_BYTES, ScoreCache, sized
from gptj_flax.sampling.slots import Slots
from gptj_flax.sampling.stopping import TextTracker, decode

# Decode steps between two looks at the text when stop strings are set: a sequence whose stop
# string appears runs at most this many steps too far (the extra tokens are discarded).
STOP_CHECK_STEPS = 8


@dataclasses.dataclass
class Completion:
    """One generated continuation (the prompt is not part of it)."""

    text: str | None  # None when the model has no tokenizer
    finish_reason: str  # "eos", "stop" (a stop string) or "length" (max_new_tokens)
    prompt_tokens: int
    completion_tokens: int  # tokens generated, up to the EOS or the one completing a stop string
    tokens: list[int] | None = None  # with return_tokens (or without a tokenizer); the EOS included
    logprobs: list[float] | None = None  # with return_logprobs: the model's log p of each token
    # with return_top_logprobs=k: per token, the k most likely ids at that step → their log p
    top_logprobs: list[dict[int, float]] | None = None


@dataclasses.dataclass
class Scored:
    """``logprobs[j]`` is log p(tokens[j + 1] | tokens[:j + 1]); the first token has no score.

    With ``top_logprobs=k``, ``top_logprobs[j]`` maps the k most likely ids in that same position
    to their log-probabilities (most likely first).
    """

    tokens: list[int]
    logprobs: np.ndarray
    top_logprobs: list[dict[int, float]] | None = None

    @property
    def total(self) -> float:
        return float(np.sum(self.logprobs))


def _is_token_ids(x) -> bool:
    return (
        isinstance(x, (Sequence, np.ndarray))
        and not isinstance(x, (str, bytes))
        and len(x) > 0
        and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in x)
    )


class MissingTokenizer(SamplingError):
    """A call needs text (a text prompt, stop strings, streamed text) and the model has no tokenizer."""


def check_text(text: str, what: str) -> None:
    """Raise :class:`SamplingError` unless ``text`` is valid Unicode, which a tokenizer can encode.

    Python reads bytes that are not UTF-8 (in a command's arguments, or a terminal's input) as lone
    surrogates, U+DC80 to U+DCFF; the message gives such a character back as its byte.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        if 0xDC80 <= code <= 0xDCFF:
            message = f"{what} is not UTF-8 text: the byte 0x{code - 0xDC00:02x} (character {e.start}) is not UTF-8"
        else:
            message = f"{what} holds the lone surrogate U+{code:04X} at character {e.start}, which is no character"
        raise SamplingError(f"{message}; give UTF-8 text") from None


def _as_batch(prompts) -> tuple[list, bool]:
    """(list of prompts, whether a single prompt was given)."""
    if isinstance(prompts, str) or _is_token_ids(prompts):
        batch, single = [prompts], True
    elif not isinstance(prompts, (Sequence, np.ndarray)) or isinstance(prompts, bytes):
        raise SamplingError(
            f"prompts must be a string, a list of token ids, or a list of those; got {type(prompts).__name__}"
        )
    elif len(prompts) == 0:
        raise SamplingError("no prompts given: pass at least one")
    else:
        batch, single = list(prompts), False
    for i, p in enumerate(batch):
        if not (isinstance(p, str) or _is_token_ids(p) or (isinstance(p, (list, tuple)) and len(p) == 0)):
            raise SamplingError(f"prompt {i} must be a string or a list of token ids, got {p!r:.80}")
        if isinstance(p, str):
            check_text(p, "the prompt" if single else f"prompt {i}")
    return batch, single


def _alternatives(ids: np.ndarray, logprobs: np.ndarray) -> list[dict[int, float]]:
    """Rows of top ids [T, k] and their log-probabilities → one {id: log p} per position."""
    return [{int(i): float(lp) for i, lp in zip(row_ids, row_lps)} for row_ids, row_lps in zip(ids, logprobs)]


def _flags(name: str, value, n: int) -> np.ndarray:
    """One bool, or one per prompt → bool array [n]."""
    values = list(value) if isinstance(value, (Sequence, np.ndarray)) else [value] * n
    if len(values) != n or not all(isinstance(v, (bool, np.bool_)) for v in values):
        raise SamplingError(f"{name} must be true or false, or a list of one per prompt; got {value!r}")
    return np.asarray(values, bool)


def _stop_lists(stop, n: int) -> list[list[str]]:
    """``None`` | a string | a list of strings (for every prompt) | one of those per prompt."""

    def one(s, where):
        items = [] if s is None else [s] if isinstance(s, str) else list(s)
        for item in items:
            if not isinstance(item, str) or not item:
                raise SamplingError(f"{where}: stop strings must be non-empty strings, got {item!r}")
        return items

    if stop is None or isinstance(stop, str) or all(isinstance(s, str) for s in stop):
        return [one(stop, "stop")] * n
    if len(stop) != n:
        raise SamplingError(
            f"stop: got {len(stop)} entries for {n} prompts; give one list for all prompts or one per prompt"
        )
    return [one(s, f"stop[{i}]") for i, s in enumerate(stop)]


@dataclasses.dataclass(frozen=True)
class CheckedSettings:
    """Generation settings checked and spread over a batch: one entry per prompt."""

    max_new_tokens: np.ndarray  # int32 [n]
    seeds: np.ndarray  # int64 [n]
    sampling: SamplingParams
    stops: list[list[str]]
    ignore_eos: np.ndarray  # bool [n]


def check_settings(
    n: int = 1,
    *,
    max_new_tokens=128,
    sampling: Sampling | Sequence[Sampling] | None = None,
    stop=None,
    seed=0,
    ignore_eos=False,
    **settings,
) -> CheckedSettings:
    """The settings of a :meth:`LanguageModel.generate` or ``stream`` call for ``n`` prompts, checked
    as those calls check them, which needs no model: a program can refuse bad settings before it
    loads one. ``sampling`` and ``settings`` (the six sampling settings as keywords) are as
    :func:`~gptj_flax.sampling.samplers.sampling_rows` takes them. Raises :class:`SamplingError`
    naming the first setting out of its range.
    """
    max_new = per_example("max_new_tokens", max_new_tokens, n, int, lambda x: x >= 1, "an integer >= 1")
    seeds = per_example("seed", seed, n, int, lambda x: 0 <= x < 2**32, "an integer in [0, 2**32)", np.int64)
    if isinstance(seed, (int, np.integer)):
        seeds = (seeds.astype(np.int64) + np.arange(n)) % 2**32  # distinct draws for repeated prompts
    rows = SamplingParams.of(sampling_rows(n, sampling, **settings))
    return CheckedSettings(max_new, seeds, rows, _stop_lists(stop, n), _flags("ignore_eos", ignore_eos, n))


class _Generation:
    """A batch being generated: the device run plus each row's text."""

    def __init__(
        self,
        run: DecodeRun,
        trackers: list[TextTracker] | None,
        prompt_lengths: list[int],
        check_steps: int,
        top_logprobs: np.ndarray,
    ):
        self.run, self.trackers, self.prompt_lengths = run, trackers, prompt_lengths
        self.check_steps = check_steps  # decode steps per device call when not streaming
        self.top_logprobs = top_logprobs  # alternatives asked for, per row

    def _row_tokens(self, row: int) -> np.ndarray:
        p = self.run.progress
        return p.tokens[row, : p.num_generated[row]]

    def pieces(self) -> list[str]:
        """Bring every row's text up to date; returns each row's newly final text."""
        p = self.run.progress
        if self.trackers is None:
            return [""] * len(self.prompt_lengths)
        out = []
        for row, tracker in enumerate(self.trackers):
            tokens = self._row_tokens(row)
            if p.finish[row] == EOS:
                tokens = tokens[:-1]  # the EOS token ends the text without being part of it
            out.append(tracker.update(tokens, final=p.finish[row] != RUNNING))
        return out

    def stopped_rows(self) -> list[int]:
        return [] if self.trackers is None else [i for i, t in enumerate(self.trackers) if t.stopped]

    @property
    def finished(self) -> bool:
        p = self.run.progress
        stopped = set(self.stopped_rows())
        return all(p.finish[i] != RUNNING or i in stopped for i in range(len(self.prompt_lengths)))

    def advance(self, steps: int) -> list[str]:
        self.run.advance(steps, self.stopped_rows())
        return self.pieces()

    def completions(self, return_tokens: bool, return_logprobs: bool) -> list[Completion]:
        p = self.run.progress
        out = []
        for row, prompt_tokens in enumerate(self.prompt_lengths):
            tracker = None if self.trackers is None else self.trackers[row]
            if tracker is not None and tracker.stopped:
                n, reason = tracker.num_tokens, "stop"
            else:
                n, reason = int(p.num_generated[row]), FINISH_REASON_OF_CODE[int(p.finish[row])]
            tokens = p.tokens[row, :n]
            out.append(
                Completion(
                    text=None if tracker is None else tracker.text,
                    finish_reason=reason,
                    prompt_tokens=prompt_tokens,
                    completion_tokens=n,
                    tokens=[int(t) for t in tokens] if return_tokens or tracker is None else None,
                    logprobs=[float(x) for x in p.logprobs[row, :n]] if return_logprobs else None,
                    top_logprobs=(
                        _alternatives(p.top_ids[row, :n, :k], p.top_logprobs[row, :n, :k])
                        if (k := int(self.top_logprobs[row])) > 0
                        else None
                    ),
                )
            )
        return out


class Piece(str):
    """A streamed piece of text with the tokens generated since the previous piece of its row:
    ``tokens``, their ``logprobs`` and (with ``return_top_logprobs``) ``top_logprobs``.

    A token's text can come in a later piece than the token (a possible start of a stop string
    waits), so a piece with tokens and no text yet is still a piece: it is true when it has either.
    """

    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]] | None

    def __new__(cls, text: str, tokens: list[int], logprobs: list[float], top_logprobs: list[dict[int, float]] | None):
        piece = super().__new__(cls, text)
        piece.tokens, piece.logprobs, piece.top_logprobs = tokens, logprobs, top_logprobs
        return piece

    def __bool__(self) -> bool:
        return bool(self.tokens) or len(self) > 0


class TextStream(Iterator):
    """The iterator :meth:`LanguageModel.stream` returns: text pieces while generating, then
    ``completions`` — a :class:`Completion` per prompt, ``None`` until the last piece is taken (or
    for good, if the stream is closed early). With ``return_logprobs`` the pieces are
    :class:`Piece` strings that also carry their tokens."""

    def __init__(self, job: _Generation, single: bool, return_logprobs: bool = False):
        self.completions: list[Completion] | None = None
        self._job, self._with_tokens = job, return_logprobs
        self._sent = [0] * len(job.prompt_lengths)  # each row's tokens already in a piece
        self._pieces = self._run(job, single)

    def _with_new_tokens(self, texts: list[str]) -> list[str]:
        if not self._with_tokens:
            return texts
        p, job = self._job.run.progress, self._job
        out: list[str] = []
        for row, text in enumerate(texts):
            tracker = None if job.trackers is None else job.trackers[row]
            end = tracker.num_tokens if tracker is not None and tracker.stopped else int(p.num_generated[row])
            start, self._sent[row] = self._sent[row], max(self._sent[row], end)
            k = int(job.top_logprobs[row])
            top = _alternatives(p.top_ids[row, start:end, :k], p.top_logprobs[row, start:end, :k]) if k > 0 else None
            tokens = [int(t) for t in p.tokens[row, start:end]]
            out.append(Piece(text, tokens, [float(x) for x in p.logprobs[row, start:end]], top))
        return out

    def _run(self, job: _Generation, single: bool) -> Iterator:
        new = self._with_new_tokens(job.pieces())
        while True:
            if single and new[0]:
                yield new[0]
            elif not single and any(new):
                yield new
            if job.finished:
                self.completions = job.completions(return_tokens=False, return_logprobs=False)
                return
            new = self._with_new_tokens(job.advance(1))

    def __next__(self):
        return next(self._pieces)

    def close(self) -> None:
        """Stop generating (the rest of the batch is not computed)."""
        self._pieces.close()


class LanguageModel:
    """A GPT-J with its parameters on a mesh and (usually) its tokenizer, ready to sample and score.

    Compiled programs are cached per shape bucket: the first call at a new bucket compiles, later
    calls with other prompts, lengths within the bucket, settings or seeds reuse it.

    Attributes: ``config``, ``tokenizer``, ``mesh``, ``step``, ``decoder`` (the compiled programs and
    the sharded parameters), ``eos_token_id`` (the id that ends a sequence: the tokenizer's EOS,
    ``None`` for none; generation reads it at every call), ``param_dtype`` (how the parameters are
    held) and ``compute_dtype`` (what the matmuls run in).
    """

    def __init__(
        self,
        config: ModelConfig,
        params: Any,
        tokenizer=None,
        mesh: Mesh | None = None,
        step: int | None = None,
        *,
        shardings: Any = None,
    ):
        """
        Args:
          config: the model's config; ``params``: its ``params`` collection (any layout the config
            says, on any devices: it is resharded onto ``mesh``).
          tokenizer: a HuggingFace tokenizer; without one, prompts and outputs are token ids.
          mesh: default one device. Pass a mesh to shard (heads and cache over ``model``, the
            batch over ``data``/``fsdp``).
          step: the checkpoint step the parameters come from, for display.
          shardings: where unrolled ``params`` already are on ``mesh``, as the partitioning rules
            place them (:func:`gptj_flax.convert.place_weights`): they are then used as they are.
        """
        self.config, self.tokenizer, self.step = config, tokenizer, step
        self.mesh = partitioning.make_mesh(partitioning.ONE_DEVICE if mesh is None else mesh)
        valid_vocab = None if tokenizer is None else len(tokenizer)
        self.decoder = Decoder(config, params, self.mesh, valid_vocab=valid_vocab, shardings=shardings)
        self.eos_token_id = None if tokenizer is None else tokenizer.eos_token_id

    @property
    def param_dtype(self) -> str:
        """The dtype the float parameters are held in on the devices (an int8 model's block
        projections are int8 besides: see ``config.quantize``)."""
        return dtype_name(self.decoder.params["wte"].dtype)

    @property
    def compute_dtype(self) -> str:
        return self.config.dtype

    def __repr__(self) -> str:
        c = self.config
        return (
            f"LanguageModel({c.param_count():,} parameters: {c.n_layers} layers, d_model {c.d_model}, "
            f"{c.n_heads} heads, vocab {c.vocab_size}, context {c.max_len}; parameters {self.param_dtype}"
            f"{'' if c.quantize is None else f' (block projections {c.quantize})'}, "
            f"compute {self.compute_dtype}{'' if c.kv_cache is None else f', KV cache {c.kv_cache}'}; step {self.step}; mesh {dict(self.mesh.shape)})"
        )

    # -- text <-> tokens -------------------------------------------------------------------
    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise MissingTokenizer("this model has no tokenizer: give prompts as lists of token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return [int(t) for t in prompt]

    def decode(self, tokens: Sequence[int]) -> str:
        if self.tokenizer is None:
            raise MissingTokenizer("this model has no tokenizer to decode with")
        return decode(self.tokenizer, tokens)

    # -- generation ------------------------------------------------------------------------
    def slots(
        self,
        *,
        slots: int,
        length: int,
        chunk: int = 128,
        steps: int = 1,
        top_logprobs: int = 5,
        prefill_mesh: Mesh | None = None,
        prefix_cache: bool = False,
        adapters: AdapterBank | None = None,
    ) -> Slots:
        """Decode slots over this model's parameters, for continuous batching (see
        :class:`gptj_flax.sampling.slots.Slots`): ``slots`` sequences of up to ``length`` tokens each.

        ``prefill_mesh``: devices other than the model's, to prefill new prompts on beside the decode
        steps (the parameters are copied there); default: prefill between steps on the model's own.
        ``prefix_cache``: reuse the cached full pages of earlier prompts (not with a ``prefill_mesh``).
        ``adapters``: a bank of LoRA adapters over these parameters, one chosen per request
        (:class:`~gptj_flax.sampling.adapter_bank.AdapterBank`; not with a ``prefill_mesh``).
        """
        return Slots(
            self.decoder,
            slots=slots,
            length=length,
            chunk=chunk,
            steps=steps,
            top_logprobs=top_logprobs,
            prefill=None if prefill_mesh is None else self.decoder.on(prefill_mesh),
            prefix_cache=prefix_cache,
            adapters=adapters,
        )

    @property
    def adapters(self) -> AdapterBank | None:
        """The LoRA adapters served beside the base, which ``generate``'s ``adapter`` names (None: none)."""
        return self.decoder.adapters

    def _adapter_rows(self, adapter, n: int, bank: AdapterBank | None = None) -> np.ndarray | None:
        """Each prompt's row of ``bank`` (default: :attr:`adapters`), from ``adapter`` (a name, None,
        or one per prompt)."""
        bank = self.adapters if bank is None else bank
        names = list(adapter) if isinstance(adapter, (list, tuple)) else [adapter] * n
        if len(names) != n:
            raise SamplingError(f"adapter: {len(names)} values for {n} prompts; give one, or one per prompt")
        if all(name is None for name in names):
            return None
        if bank is None:
            raise SamplingError(
                f"adapter={next(a for a in names if a is not None)!r}: this model has no adapters; load it with "
                "gptj_flax.load(BASE, adapters={NAME: DIR, ...})"
            )
        return np.array([bank.index(name) for name in names], np.int32)

    def _start(
        self, method: str, prompts, *, original_order, top_logprobs, adapter=None, **settings
    ) -> tuple[_Generation, bool]:
        """Check a ``generate`` or ``stream`` call and start its device run; ``settings`` are
        :func:`check_settings`' keywords."""
        check_same_call(method, (prompts, settings, original_order, top_logprobs, adapter, self.eos_token_id))
        batch, single = _as_batch(prompts)
        n = len(batch)
        checked = check_settings(n, **settings)
        vocab = self.decoder.valid_vocab
        alternatives = per_example(
            "return_top_logprobs", top_logprobs, n, int, lambda x: 0 <= x <= vocab, f"an integer in [0, {vocab}]"
        )
        if self.tokenizer is None and any(checked.stops):
            raise MissingTokenizer("stop strings need a tokenizer to decode the output; this model has none")
        eos = -1 if self.eos_token_id is None else int(self.eos_token_id)
        eos_ids = np.where(checked.ignore_eos, -1, eos).astype(np.int32)
        token_prompts = [self.encode(p) for p in batch]
        rows = self._adapter_rows(adapter, n)
        run = self.decoder.start(
            token_prompts,
            max_new_tokens=checked.max_new_tokens,
            sampling=checked.sampling,
            seeds=checked.seeds,
            eos_id=eos_ids,
            original_order=bool(original_order),
            top_logprobs=int(np.max(alternatives)),
            adapters=rows,
        )
        trackers = None if self.tokenizer is None else [TextTracker(self.tokenizer, s) for s in checked.stops]
        check_steps = STOP_CHECK_STEPS if any(checked.stops) else run.capacity
        return _Generation(run, trackers, [len(p) for p in token_prompts], check_steps, alternatives), single

    def generate(
        self,
        prompts,
        max_new_tokens=128,
        *,
        temperature=None,
        top_k=None,
        top_p=None,
        typical_p=None,
        min_p=None,
        repetition_penalty=None,
        sampling: Sampling | Sequence[Sampling] | None = None,
        stop=None,
        seed=0,
        ignore_eos=False,
        original_order=False,
        return_tokens=False,
        return_logprobs=False,
        return_top_logprobs=0,
        adapter=None,
    ) -> Completion | list[Completion]:
        """Continue each prompt; a single prompt gives a :class:`Completion`, a list gives a list.

        Args:
          prompts: text, a list of token ids, or a list of those (a batch).
          max_new_tokens: at most this many new tokens (≥ 1).
          temperature: 0 is greedy; otherwise logits are divided by it before sampling (default 1).
          top_k, top_p, typical_p, min_p, repetition_penalty: the usual filters; their defaults
            (0, 1, 1, 0, 1) switch them off. Applied in HuggingFace's order (temperature first), or
            with ``original_order`` temperature last as mesh-transformer-jax did (a separately
            compiled program: the order is fixed at compile time). ``None`` is the default.
          sampling: instead of those six keywords, a :class:`~gptj_flax.sampling.Sampling` (or one
            per prompt) holding them.
          stop: a string or a list of strings ending the output (which is cut before them), or one
            such entry per prompt.
          seed: an int (prompt i draws with seed + i) or one per prompt. The same prompt, settings
            and seed give the same output whatever else is in the batch.
          ignore_eos: keep going past the EOS token (one value or one per prompt).
          return_tokens, return_logprobs: also return the generated ids and their log-probabilities
            under the model (before any sampling filter).
          return_top_logprobs: k > 0 also returns, for every generated token, the k most likely ids
            at that step and their log-probabilities (``Completion.top_logprobs``); one value or
            one per prompt.
          adapter: the LoRA adapter to generate with, by name (``None``: the base), or one per
            prompt, each prompt in the batch with its own: the adapters given to ``gptj_flax.load``'s
            ``adapters=`` (:attr:`adapters`).

        Every setting except ``original_order``, ``return_tokens`` and ``return_logprobs`` takes one
        value for all prompts or a list with one per prompt.
        """
        job, single = self._start(
            "generate",
            prompts,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            typical_p=typical_p,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            stop=stop,
            seed=seed,
            ignore_eos=ignore_eos,
            original_order=original_order,
            top_logprobs=return_top_logprobs,
            adapter=adapter,
        )
        job.pieces()
        while not job.finished:
            job.advance(job.check_steps)
        out = job.completions(return_tokens, return_logprobs)
        return out[0] if single else out

    def stream(
        self,
        prompts,
        max_new_tokens=128,
        *,
        temperature=None,
        top_k=None,
        top_p=None,
        typical_p=None,
        min_p=None,
        repetition_penalty=None,
        sampling: Sampling | Sequence[Sampling] | None = None,
        stop=None,
        seed=0,
        ignore_eos=False,
        original_order=False,
        return_logprobs=False,
        return_top_logprobs=0,
        adapter=None,
    ) -> TextStream:
        """Like :meth:`generate`, but yield text as each token is produced.

        A single prompt yields strings; a batch yields lists of strings, one (possibly empty) per
        prompt. Text is yielded once final: a possible start of a stop string or an incomplete
        character waits for the next token. The pieces add up to ``generate``'s text for the same
        arguments. Once the iterator is exhausted, its ``completions`` attribute holds what
        ``generate`` would have returned (finish reasons, token counts), one per prompt.

        With ``return_logprobs`` (and ``return_top_logprobs``, as :meth:`generate` takes it) every
        piece is a :class:`Piece`: also the tokens generated since the row's previous piece, with
        their log-probabilities (and alternatives); a piece may then have tokens but no text yet.
        """
        if self.tokenizer is None:
            raise MissingTokenizer("stream yields text and this model has no tokenizer; use generate with token ids")
        job, single = self._start(
            "stream",
            prompts,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            typical_p=typical_p,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            stop=stop,
            seed=seed,
            ignore_eos=ignore_eos,
            original_order=original_order,
            top_logprobs=return_top_logprobs,
            adapter=adapter,
        )
        return TextStream(job, single, bool(return_logprobs))

    def score_cache(self, max_bytes: int = DEFAULT_BYTES) -> ScoreCache:
        """A prefix cache for :meth:`score` whose cached keys and values take at most ``max_bytes`` of
        host memory (:mod:`gptj_flax.sampling.score_cache`)."""
        return sized(self.decoder, max_bytes)

    def score(
        self,
        texts_or_token_ids,
        *,
        top_logprobs: int = 0,
        adapter=None,
        adapters: AdapterBank | None = None,
        cache: ScoreCache | None = None,
    ) -> Scored | list[Scored]:
        """Per-token log-probabilities of the given texts or token-id lists under the model.

        A single text (or id list) gives a :class:`Scored`, a list gives a list. ``top_logprobs`` > 0
        also gives each position's most likely ids (``Scored.top_logprobs``), from the same pass.
        ``adapter``: the LoRA adapter to score with, by name (``None``: the base), or one per text,
        as :meth:`generate` takes it; ``adapters``: the bank those names are in, when it is not the
        model's own (:attr:`adapters`), as :meth:`slots` takes one. With a ``cache``
        (:meth:`score_cache`), texts for the base model that start with the same full pages as earlier
        ones score only the rest, one text at a time, with the same result; texts for an adapter
        never use it, so that no text's scores come from another adapter's.
        """
        check_same_call("score", (texts_or_token_ids, top_logprobs, adapter))
        vocab = self.decoder.valid_vocab
        (k,) = per_example(
            "top_logprobs", top_logprobs, 1, int, lambda x: 0 <= x <= vocab, f"an integer in [0, {vocab}]"
        )
        batch, single = _as_batch(texts_or_token_ids)
        rows = self._adapter_rows(adapter, len(batch), adapters)
        sequences = [self.encode(x) for x in batch]
        if cache is not None and rows is None:
            scored = cache.score(sequences, int(k))
        else:
            scored = self.decoder.score_with_alternatives(sequences, int(k), rows, adapters)
        out = [
            Scored(tokens=seq, logprobs=lp, top_logprobs=_alternatives(ids, lps) if k > 0 else None)
            for seq, (lp, ids, lps) in zip(sequences, scored)
        ]
        return out[0] if single else out
