"""The compiled generation loop: one prefill of the prompts, then a decode loop on the device.

Prompt length, generation length and batch are padded to powers of two (see
:meth:`Decoder.start`), and every setting is a traced value, so compiled programs are reused. The
decode loop runs on the device until every row has finished or the host's step budget for the
call is spent; between calls the host checks stop strings or streams text, while the cache stays
on the device, updated in place.

On several processes (a multi-host slice) every process calls with the same prompts: inputs are
placed as global arrays, and what the host reads back is gathered whole on every process.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from gptj_flax import convert, partitioning
from gptj_flax.config import ModelConfig
from gptj_flax.losses import greedy_matches, token_log_probs
from gptj_flax.model import GPTJ, AdapterSlots, KVCache, unstack_layers
from gptj_flax.sampling.adapter_bank import AdapterBank
from gptj_flax.sampling.multihost import to_device, to_host
from gptj_flax.sampling.samplers import SamplingError, SamplingParams, next_tokens, top_bucket, top_logprobs

Array = jax.Array

# finish codes, one per row
RUNNING, EOS, LENGTH, STOPPED = 0, 1, 2, 3
FINISH_REASON_OF_CODE = {EOS: "eos", LENGTH: "length", STOPPED: "stop"}

MIN_BUCKET = 16

# Slots per page of the decode slots' cache (model.PagedKVCache), by platform. A sequence holds whole
# pages, so smaller pages waste fewer slots, and a step runs a few small operations per pool block.
PAGE_COLUMNS = {"cpu": 64}
DEFAULT_PAGE_COLUMNS = 256


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """The power of two ≥ ``n`` (and ≥ ``minimum``) that shapes are padded to."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def per_row_axes() -> dict[str, Any]:
    """The logical axes of the fields :class:`DecodeState` and the decode slots' ``SlotState`` share,
    each a value per row (a batch entry or a slot): rows split over the data-parallel axes."""
    rows = PartitionSpec("batch")
    return {
        "num_generated": rows,
        "max_new_tokens": rows,
        "finish": rows,
        "eos_id": rows,
        "seeds": rows,
        "seen": PartitionSpec("batch", None),
        "sampling": SamplingParams.logical_axes(),
    }


@flax.struct.dataclass
class DecodeState:
    """Everything the decode loop carries, on the device. Rows are batch entries."""

    cache: KVCache
    tokens: Array  # int32 [B, N]: generated ids (0 where nothing was generated)
    logprobs: Array  # float32 [B, N]: the model's log-probability of each generated id
    # int32 / float32 [B, N, K]: at each step the K most likely ids and their log-probabilities
    # (K, static, is 0 unless some row asked for alternatives: then nothing is computed)
    top_ids: Array
    top_logprobs: Array
    num_generated: Array  # int32 [B]
    finish: Array  # int32 [B]: RUNNING, EOS, LENGTH or STOPPED
    step: Array  # int32 scalar: loop steps taken; the next token is fed from tokens[:, step - 1]
    prompt_lengths: Array  # int32 [B]: real prompt tokens (positions continue from here)
    max_new_tokens: Array  # int32 [B]
    eos_id: Array  # int32 [B]; -1: do not stop at EOS
    seeds: Array  # uint32 [B]: row i's draw at step s uses fold_in(key(seeds[i]), s)
    seen: Array  # bool [B, V]: prompt and generated ids, for the repetition penalty
    sampling: SamplingParams
    adapter: Array  # int32 [B]: the row of the decoder's adapter bank each row applies (0: none)

    @classmethod
    def logical_axes(cls, config: ModelConfig) -> DecodeState:
        table, cube = PartitionSpec("batch", None), PartitionSpec("batch", None, None)
        return cls(
            cache=KVCache.logical_axes(config),
            tokens=table,
            logprobs=table,
            top_ids=cube,
            top_logprobs=cube,
            step=PartitionSpec(),
            prompt_lengths=PartitionSpec("batch"),
            adapter=PartitionSpec("batch"),
            **per_row_axes(),
        )


class ScoredRun(NamedTuple):
    """What :meth:`Decoder.score_after` says of a run of tokens after a cached past (host arrays)."""

    logprobs: np.ndarray  # [n - 1]: log p(tokens[j + 1] | past, tokens[: j + 1])
    top_ids: np.ndarray  # [n - 1, width]
    top_logprobs: np.ndarray
    k: tuple[np.ndarray, ...]  # per layer, the run's inputs' keys [heads, head_dim, n - 1]
    v: tuple[np.ndarray, ...]  # and values [heads, n - 1, head_dim]


class TokenScores(NamedTuple):
    """What one forward pass says of every target of a batch of right-padded rows (see :func:`score_tokens`)."""

    log_probs: Array  # float32 [B, L]: log p(targets[:, j] | inputs[:, : j + 1])
    greedy: Array  # bool [B, L]: targets[:, j] is greedy decoding's choice there
    top_ids: Array  # int32 [B, L, K]: the K most likely ids at each position
    top_logprobs: Array  # float32 [B, L, K]: and their log-probabilities


def score_tokens(
    model: GPTJ,
    params: Any,
    inputs: Array,
    targets: Array,
    segment_ids: Array,
    valid_vocab: int,
    top_width: int = 0,
    *,
    bank: Any = None,
    adapter: Array | None = None,
) -> TokenScores:
    """Score ``targets`` [B, L] after ``inputs`` [B, L] (a sequence's tokens and the same shifted by
    one) in one forward pass; ``segment_ids`` [B, L] is 1 on real inputs and 0 on the right padding,
    which causal attention never lets a real position see. With ``bank`` (the ``adapters``
    collection of a ``model`` with slots), row i applies the served adapter ``adapter[i]`` (0: none).

    The one scoring program behind :meth:`Decoder.score_with_alternatives` and the lm-eval scorer
    (:class:`gptj_flax.evaluation.scoring.TokenScorer`): each jits it and keeps what it reports, and
    XLA computes nothing for the rest. Ids at or above ``valid_vocab`` are never greedy choices nor
    among the ``top_width`` (static) alternatives.
    """
    variables = {"params": params} if bank is None else {"params": params, "adapters": bank}
    logits = model.apply(variables, inputs, segment_ids=segment_ids, adapter=adapter)
    if top_width > 0:
        ids, lps = top_logprobs(logits, top_width, valid_vocab)
    else:
        ids = jnp.zeros((*targets.shape, 0), jnp.int32)
        lps = jnp.zeros(ids.shape, jnp.float32)
    return TokenScores(token_log_probs(logits, targets), greedy_matches(logits, targets, valid_vocab), ids, lps)


@dataclasses.dataclass
class Progress:
    """Host copy of the generated tokens after a prefill or a decode call (real rows only)."""

    tokens: np.ndarray  # int32 [rows, N]
    logprobs: np.ndarray  # float32 [rows, N]
    top_ids: np.ndarray  # int32 [rows, N, K]
    top_logprobs: np.ndarray  # float32 [rows, N, K]
    num_generated: np.ndarray  # int32 [rows]
    finish: np.ndarray  # int32 [rows]

    @property
    def all_finished(self) -> bool:
        return bool(np.all(self.finish != RUNNING))


def _as_run(config: ModelConfig, params: Any, mesh: Mesh, rules: partitioning.Rules, shardings: Any):
    """``(config, params, shardings)`` as the Decoder runs them: unrolled, without remat (it only
    matters for gradients), ``params`` placed as ``rules`` say unless ``shardings`` says they are."""
    if shardings is None and config.scan_layers:
        params = unstack_layers(params)
    config = dataclasses.replace(config, scan_layers=False, remat_policy="none")
    if shardings is None:
        _, shardings = convert.param_targets(config, mesh, rules)
        params = jax.device_put(params, shardings)
    return config, params, shardings


class Decoder:
    """Compiled prefill, decode loop and scoring for one model's parameters on one mesh.

    It always runs the unrolled layer stack, converting scanned parameters once (``gptj_flax.load``
    hands it unrolled ones already placed): every layer's weights and cache are then buffers of
    their own that each decode step reads in place, where a scanned stack would slice (on the CPU:
    copy) every layer's weights out of the stacked arrays at every step.
    """

    def __init__(
        self,
        config: ModelConfig,
        params: Any,
        mesh: Mesh,
        *,
        valid_vocab: int | None = None,
        rules: partitioning.Rules = partitioning.DEFAULT_RULES,
        shardings: Any = None,
    ):
        """
        Args:
          config: the model; ``params`` must match it (scanned or unrolled layout).
          params: the ``params`` collection; placed onto ``mesh`` as the rules say.
          valid_vocab: ids at or above it are never generated (the tokenizer's size when the
            embedding is padded); default: the whole vocabulary.
          shardings: where ``params`` are placed already, unrolled whatever ``config.scan_layers``
            says, as the rules place them on ``mesh`` (:func:`gptj_flax.convert.place_weights`):
            they are then used as they are.
        """
        config, self.params, param_shardings = _as_run(config, params, mesh, rules, shardings)
        self.config, self.mesh, self.rules = config, mesh, rules
        self.valid_vocab = config.vocab_size if valid_vocab is None else min(valid_vocab, config.vocab_size)
        self.model = GPTJ(config)
        self.batch_multiple = partitioning.data_parallel_size(mesh, rules)
        self.page_columns = PAGE_COLUMNS.get(mesh.devices.flat[0].platform, DEFAULT_PAGE_COLUMNS)
        self.slot_programs: dict = {}  # the decode slots' programs, by SlotShape (sampling.slot_programs)
        self._copies: dict[Mesh, Decoder] = {}
        self.adapters: AdapterBank | None = None
        self._scorers: dict[AdapterSlots | None, Any] = {}  # the scoring programs, by the bank's shape
        self._param_shardings = param_shardings
        self._compile_programs()

    def use_adapters(self, bank: AdapterBank) -> None:
        """Generate and score with ``bank``'s adapters from now on, each prompt applying the one
        :meth:`start`'s (or :meth:`score_with_alternatives`') ``adapters`` names (its programs
        compile again, with the bank)."""
        self.adapters, self.model = bank, GPTJ(self.config, slots=bank.slots)
        self._compile_programs()

    def _weights(self) -> Any:
        """What the generation programs take as parameters: with an adapter bank, its arrays too."""
        return self.params if self.adapters is None else (self.params, self.adapters.arrays)

    def _apply(self, weights, *args, **kwargs):
        if self.adapters is None:
            return self.model.apply({"params": weights}, *args, **kwargs)
        params, bank = weights
        return self.model.apply({"params": params, "adapters": bank}, *args, **kwargs)

    def _compile_programs(self) -> None:
        mesh, rules, param_shardings = self.mesh, self.rules, self._param_shardings
        if self.adapters is not None:
            param_shardings = (param_shardings, self.adapters.shardings)

        def sharding(*axes):
            return partitioning.named_sharding(mesh, axes, rules)

        state = partitioning.logical_to_sharding(DecodeState.logical_axes(self.config), mesh, rules)
        rows, table = sharding("batch"), sharding("batch", "length")
        sampling = partitioning.logical_to_sharding(SamplingParams.logical_axes(), mesh, rules)
        self._rows, self._table, self._sampling, self._scalar = rows, table, sampling, sharding()
        cube = sharding("batch", "length", None)
        self._prefill = jax.jit(
            self._prefill_fn,
            static_argnums=(8, 9, 10),
            in_shardings=(param_shardings, table, rows, rows, rows, rows, sampling, rows),
            out_shardings=state,
        )
        self._decode = jax.jit(
            self._decode_fn,
            static_argnums=(4,),
            donate_argnums=(1,),
            in_shardings=(param_shardings, state, sharding(), rows),
            out_shardings=state,
        )
        self._cube = cube
        self._score_after = jax.jit(self._score_after_fn, static_argnums=(7,))

    def _scorer(self, bank: AdapterBank | None):
        """The scoring program for ``bank``'s shape (None: no bank), compiled once per shape bucket:
        a bank's contents and each row's adapter are arguments, so neither recompiles it."""
        slots = None if bank is None else bank.slots
        if slots not in self._scorers:
            weights = self._param_shardings if bank is None else (self._param_shardings, bank.shardings)
            self._scorers[slots] = jax.jit(
                functools.partial(self._score_fn, GPTJ(self.config, slots=slots)),
                static_argnums=(4,),
                in_shardings=(weights, self._table, self._table, self._rows),
                out_shardings=(self._table, self._cube, self._cube),
            )
        return self._scorers[slots]

    # -- device programs ---------------------------------------------------------------------
    def _emit(self, state: DecodeState, logits: Array, original_order: bool) -> DecodeState:
        """Choose every running row's next token from ``logits`` [B, V], record it, update finish."""
        keys = jax.vmap(lambda seed: jax.random.fold_in(jax.random.key(seed), state.step))(state.seeds)
        token = next_tokens(logits, state.sampling, state.seen, keys, self.valid_vocab, original_order)
        logprob = token_log_probs(logits, token)
        running = state.finish == RUNNING
        token = jnp.where(running, token, 0)
        num_generated = state.num_generated + running
        finish = jnp.where(running & (token == state.eos_id), EOS, state.finish)
        finish = jnp.where((finish == RUNNING) & (num_generated >= state.max_new_tokens), LENGTH, finish)
        rows = jnp.arange(token.shape[0])
        top_ids, top_lps = state.top_ids, state.top_logprobs
        if top_ids.shape[-1] > 0:
            ids, lps = top_logprobs(logits, top_ids.shape[-1], self.valid_vocab)
            top_ids = lax.dynamic_update_slice_in_dim(top_ids, ids[:, None], state.step, axis=1)
            top_lps = lax.dynamic_update_slice_in_dim(top_lps, lps[:, None], state.step, axis=1)
        return state.replace(
            tokens=lax.dynamic_update_slice_in_dim(state.tokens, token[:, None], state.step, axis=1),
            top_ids=top_ids,
            top_logprobs=top_lps,
            logprobs=lax.dynamic_update_slice_in_dim(
                state.logprobs, jnp.where(running, logprob, 0.0)[:, None], state.step, axis=1
            ),
            num_generated=num_generated,
            finish=finish,
            step=state.step + 1,
            seen=state.seen.at[rows, token].max(running),
        )

    def _prefill_fn(
        self,
        params,
        prompt_tokens,
        prompt_lengths,
        max_new_tokens,
        eos_id,
        seeds,
        sampling,
        adapter,
        new_tokens: int,
        original_order: bool,
        top_width: int,
    ) -> DecodeState:
        batch, prompt_len = prompt_tokens.shape
        slots = jnp.arange(prompt_len)[None, :]
        padding = (prompt_len - prompt_lengths)[:, None]
        segment_ids = (slots >= padding).astype(jnp.int32)
        positions = jnp.maximum(slots - padding, 0)
        cache = KVCache.empty(self.config, batch, prompt_len + new_tokens)
        logits, cache = self._apply(
            params,
            prompt_tokens,
            positions,
            segment_ids,
            cache,
            last_logits_only=True,
            adapter=adapter,
            method=GPTJ.decode,
        )
        rows = jnp.arange(batch)[:, None]
        seen = jnp.zeros((batch, self.config.vocab_size), bool).at[rows, prompt_tokens].max(segment_ids > 0)
        state = DecodeState(
            cache=cache,
            tokens=jnp.zeros((batch, new_tokens), jnp.int32),
            logprobs=jnp.zeros((batch, new_tokens), jnp.float32),
            top_ids=jnp.zeros((batch, new_tokens, top_width), jnp.int32),
            top_logprobs=jnp.zeros((batch, new_tokens, top_width), jnp.float32),
            num_generated=jnp.zeros((batch,), jnp.int32),
            finish=jnp.where(max_new_tokens > 0, RUNNING, LENGTH).astype(jnp.int32),  # padding rows ask for 0
            step=jnp.zeros((), jnp.int32),
            prompt_lengths=prompt_lengths,
            max_new_tokens=max_new_tokens,
            eos_id=eos_id,
            seeds=seeds,
            seen=seen,
            sampling=sampling,
            adapter=adapter,
        )
        return self._emit(state, logits[:, -1], original_order)

    def _decode_fn(self, params, state: DecodeState, stop_at, stopped, original_order: bool) -> DecodeState:
        finish = jnp.where(stopped & (state.finish == RUNNING), STOPPED, state.finish)
        state = state.replace(finish=finish)

        def unfinished(s):
            return (s.step < stop_at) & jnp.any(s.finish == RUNNING)

        def step(s):
            fed = lax.dynamic_slice_in_dim(s.tokens, s.step - 1, 1, axis=1)
            positions = (s.prompt_lengths + s.step - 1)[:, None]
            logits, cache = self._apply(
                params,
                fed,
                positions,
                jnp.ones_like(fed),
                s.cache,
                last_logits_only=True,
                adapter=s.adapter,
                method=GPTJ.decode,
            )
            return self._emit(s.replace(cache=cache), logits[:, -1], original_order)

        return lax.while_loop(unfinished, step, state)

    def _score_fn(self, model: GPTJ, weights, tokens, segment_ids, adapter, top_width: int):
        params, bank = (weights, None) if model.slots is None else weights
        scores = score_tokens(
            model,
            params,
            tokens[:, :-1],
            tokens[:, 1:],
            segment_ids,
            self.valid_vocab,
            top_width,
            bank=bank,
            adapter=None if bank is None else adapter,
        )
        return scores.log_probs, scores.top_ids, scores.top_logprobs

    def _score_after_fn(self, params, k, v, tokens, targets, segments, past, top_width: int):
        """Score ``targets`` after ``tokens`` [B, T] written at slot ``past`` of a float cache whose
        first ``past`` slots hold ``k`` and ``v``; return the scores and the run's keys and values."""
        slots = k[0].shape[-1]
        cache = KVCache(
            k=k,
            v=v,
            segment_ids=jnp.broadcast_to((jnp.arange(slots) < past).astype(jnp.int32), (tokens.shape[0], slots)),
            index=past,
        )
        positions = jnp.broadcast_to(past + jnp.arange(tokens.shape[1]), tokens.shape)
        # the base model, whatever adapter bank generation uses: cached scores are the base's
        logits, cache = GPTJ(self.config).apply(
            {"params": params}, tokens, positions, segments, cache, method=GPTJ.decode
        )
        if top_width > 0:
            ids, lps = top_logprobs(logits, top_width, self.valid_vocab)
        else:
            ids = jnp.zeros((*targets.shape, 0), jnp.int32)
            lps = jnp.zeros(ids.shape, jnp.float32)
        run = tokens.shape[1]
        new_k = tuple(lax.dynamic_slice_in_dim(x, past, run, axis=3) for x in cache.k)
        new_v = tuple(lax.dynamic_slice_in_dim(x, past, run, axis=2) for x in cache.v)
        return token_log_probs(logits, targets), ids, lps, new_k, new_v

    # -- host side ---------------------------------------------------------------------------
    def on(self, mesh: Mesh) -> Decoder:
        """This model and its parameters on ``mesh``: one copy per mesh, kept while this decoder
        lives, so a second server on a loaded model copies no parameters again."""
        if mesh == self.mesh:
            return self
        if mesh not in self._copies:
            self._copies[mesh] = Decoder(self.config, self.params, mesh, valid_vocab=self.valid_vocab, rules=self.rules)
        return self._copies[mesh]

    def padded_batch(self, n: int) -> int:
        """Rows actually run for ``n`` requests: a power of two, a multiple of the data-parallel size."""
        return -(-bucket(n, 1) // self.batch_multiple) * self.batch_multiple

    def _check_lengths(self, prompts: Sequence[Sequence[int]], extra: Sequence[int]) -> None:
        if not prompts:
            raise SamplingError("no prompts given: pass at least one")
        for i, (prompt, more) in enumerate(zip(prompts, extra, strict=True)):
            if len(prompt) == 0:
                raise SamplingError(
                    f"prompt {i} has no tokens; GPT-J has no start token, so give at least one "
                    "(e.g. the tokenizer's EOS, <|endoftext|>)"
                )
            bad = [t for t in prompt if not 0 <= int(t) < self.config.vocab_size]
            if bad:
                raise SamplingError(f"prompt {i} has token id {bad[0]} outside [0, {self.config.vocab_size})")
            if len(prompt) + more > self.config.max_len:
                raise SamplingError(
                    f"prompt {i} has {len(prompt)} tokens; with max_new_tokens={more} that exceeds the "
                    f"model's context of {self.config.max_len} tokens: shorten the prompt or ask for fewer tokens"
                )

    def start(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: np.ndarray,
        sampling: SamplingParams,
        seeds: np.ndarray,
        eos_id: np.ndarray,
        original_order: bool = False,
        top_logprobs: int = 0,
        adapters: np.ndarray | None = None,
    ) -> DecodeRun:
        """Prefill ``prompts`` (token ids) and choose each row's first token.

        Prompts are left-padded to a power-of-two length ``P`` (at least 16), so every row's newest
        token sits in the same cache slot, with positions counted from each row's first real token;
        the generated tokens get a power-of-two buffer ``N`` ≥ the largest ``max_new_tokens``, the
        cache ``P + N`` slots; the batch is padded to a power of two (and a multiple of the
        data-parallel size) with rows finished from the start.

        ``max_new_tokens``, ``seeds``, ``eos_id`` and ``sampling`` hold one value per prompt
        (``eos_id`` -1: never stop at EOS). ``top_logprobs`` > 0 also records, at every step, at
        least that many most likely ids and their log-probabilities (``Progress.top_ids``; the width
        is rounded up to a power of two so that nearby counts share a program). ``adapters``: each
        prompt's row of the adapter bank (:meth:`use_adapters`; 0 or None: the base). Returns the
        run, to be advanced with ``DecodeRun.advance``.
        """
        self._check_lengths(prompts, [int(m) for m in max_new_tokens])
        n = len(prompts)
        batch = self.padded_batch(n)
        prompt_len = min(bucket(max(len(p) for p in prompts)), self.config.max_len)
        new_tokens = bucket(int(np.max(max_new_tokens)))
        tokens = np.zeros((batch, prompt_len), np.int32)
        for row, prompt in enumerate(prompts):
            tokens[row, prompt_len - len(prompt) :] = prompt
        lengths = np.zeros(batch, np.int32)
        lengths[:n] = [len(p) for p in prompts]

        def pad(values, dtype):
            out = np.zeros(batch, dtype)
            out[:n] = values
            return out

        with partitioning.sharding_scope(self.mesh, self.rules):
            state = self._prefill(
                self._weights(),
                to_device(tokens, self._table),
                to_device(lengths, self._rows),
                to_device(pad(max_new_tokens, np.int32), self._rows),
                to_device(pad(eos_id, np.int32), self._rows),
                to_device(pad(seeds, np.uint32), self._rows),
                jax.tree.map(to_device, sampling.pad_to(batch), self._sampling),
                to_device(pad(np.zeros(n) if adapters is None else adapters, np.int32), self._rows),
                new_tokens,
                original_order,
                top_bucket(top_logprobs),
            )
        return DecodeRun(self, state, n, original_order)

    def score(self, sequences: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Per-token log-probabilities: ``out[i][j] = log p(seq_i[j+1] | seq_i[:j+1])``.

        Each sequence needs at least two tokens (the first has no context to be scored in).
        """
        return [logprobs for logprobs, _, _ in self.score_with_alternatives(sequences, 0)]

    def check_scorable(self, sequences: Sequence[Sequence[int]]) -> None:
        """Raise a :class:`SamplingError` unless there are sequences, each of at least two tokens,
        each within the context."""
        if not sequences:
            raise SamplingError("no sequences given to score: pass at least one")
        for i, seq in enumerate(sequences):
            if len(seq) < 2:
                raise SamplingError(
                    f"sequence {i} has {len(seq)} token(s); scoring needs at least 2 "
                    "(the first token is the context of the second)"
                )
        self._check_lengths(sequences, [0] * len(sequences))

    def score_with_alternatives(
        self,
        sequences: Sequence[Sequence[int]],
        top_logprobs: int,
        adapters: np.ndarray | None = None,
        bank: AdapterBank | None = None,
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """:meth:`score` in the same forward pass, with each position's ``top_logprobs`` most likely
        ids and their log-probabilities: per sequence ``(logprobs [L-1], top_ids [L-1, k],
        top_logprobs [L-1, k])``, where row j is the distribution that predicts ``seq[j+1]``.

        ``adapters``: each sequence's row of ``bank`` (default: :meth:`use_adapters`' bank; 0 or
        None: the base), applied as generation applies it. With a bank, every mix of rows runs one
        program, the base's rows included."""
        bank = self.adapters if bank is None else bank
        if bank is None and adapters is not None and np.any(adapters):
            raise SamplingError("adapters named for scoring, and this decoder has no adapter bank")
        self.check_scorable(sequences)
        batch = self.padded_batch(len(sequences))
        # a power of two of inputs (every token but the last), as the lm-eval scorer pads them
        inputs = min(bucket(max(len(s) for s in sequences) - 1), self.config.max_len)
        tokens = np.zeros((batch, inputs + 1), np.int32)
        segments = np.zeros((batch, inputs), np.int32)
        for row, seq in enumerate(sequences):  # right-padded: causal attention never sees the padding
            tokens[row, : len(seq)] = seq
            segments[row, : len(seq) - 1] = 1
        rows = np.zeros(batch, np.int32)
        rows[: len(sequences)] = 0 if adapters is None else adapters
        weights = self.params if bank is None else (self.params, bank.arrays)
        with partitioning.sharding_scope(self.mesh, self.rules):
            out, ids, lps = to_host(
                self._scorer(bank)(
                    weights,
                    to_device(tokens, self._table),
                    to_device(segments, self._table),
                    to_device(rows, self._rows),
                    top_bucket(top_logprobs),
                )
            )
        return [
            (out[row, : len(seq) - 1], ids[row, : len(seq) - 1, :top_logprobs], lps[row, : len(seq) - 1, :top_logprobs])
            for row, seq in enumerate(sequences)
        ]

    def score_after(self, past_kv, tokens: Sequence[int], past: int, top_width: int) -> ScoredRun:
        """Score ``tokens[1:]`` after the ``past`` tokens whose keys and values ``past_kv`` holds
        (per layer, as :class:`ScoredRun` gives them; empty with ``past`` 0) and ``tokens[:-1]``.
        ``top_width`` is a :func:`top_bucket`. Shapes are padded to powers of two."""
        n = len(tokens) - 1
        run = bucket(n)
        slots = bucket(past + run)
        batch = self.padded_batch(1)
        cfg, dtype = self.config, jnp.dtype(self.config.compute_dtype)
        k = [np.zeros((batch, cfg.n_heads, cfg.head_dim, slots), dtype) for _ in range(cfg.n_layers)]
        v = [np.zeros((batch, cfg.n_heads, slots, cfg.head_dim), dtype) for _ in range(cfg.n_layers)]
        for i, (pk, pv) in enumerate(zip(*past_kv)):
            k[i][0, ..., :past], v[i][0, :, :past] = pk, pv
        inputs, targets, segments = (np.zeros((batch, run), np.int32) for _ in range(3))
        inputs[0, :n], targets[0, :n], segments[0, :n] = tokens[:-1], tokens[1:], 1
        with partitioning.sharding_scope(self.mesh, self.rules):
            out = to_host(
                self._score_after(self.params, tuple(k), tuple(v), inputs, targets, segments, np.int32(past), top_width)
            )
        logprobs, ids, lps, new_k, new_v = out
        return ScoredRun(
            logprobs[0, :n],
            ids[0, :n],
            lps[0, :n],
            tuple(x[0, ..., :n] for x in new_k),
            tuple(x[0, :, :n] for x in new_v),
        )

    def compilations(self) -> int:
        """Programs compiled so far (prefill + decode + score), for checking that nothing recompiles."""
        return sum(f._cache_size() for f in (self._prefill, self._decode, self._score_after, *self._scorers.values()))


class DecodeRun:
    """One batch being generated: the device state and the host's view of it."""

    def __init__(self, decoder: Decoder, state: DecodeState, rows: int, original_order: bool):
        self._decoder, self._state, self._rows = decoder, state, rows
        self._original_order = original_order
        self.capacity = state.tokens.shape[1]
        self.progress = self._fetch()

    def _fetch(self) -> Progress:
        s, n = self._state, self._rows
        tokens, logprobs, top_ids, top_lps, num, finish, self._step = to_host(
            (s.tokens, s.logprobs, s.top_ids, s.top_logprobs, s.num_generated, s.finish, s.step)
        )
        return Progress(tokens[:n], logprobs[:n], top_ids[:n], top_lps[:n], num[:n], finish[:n])

    def decode_hlo(self) -> str:
        """The optimised HLO of the decode loop :meth:`advance` runs, as text (for profiles)."""
        decoder, rows = self._decoder, self._state.finish.shape[0]
        with partitioning.sharding_scope(decoder.mesh, decoder.rules):
            lowered = decoder._decode.lower(
                decoder.params, self._state, np.int32(0), np.zeros(rows, bool), self._original_order
            )
        text = lowered.compile().as_text()
        assert text is not None  # None only for backends that keep no HLO, which XLA's do
        return text

    def advance(self, steps: int, stop_rows: Sequence[int] = ()) -> Progress:
        """Finish ``stop_rows`` (stop string seen), then decode up to ``steps`` more tokens per row."""
        if steps < 1:
            raise SamplingError(f"steps must be >= 1, got {steps}")
        stopped = np.zeros(self._state.finish.shape[0], bool)
        stopped[list(stop_rows)] = True
        stop_at = min(int(self._step) + steps, self.capacity)
        with partitioning.sharding_scope(self._decoder.mesh, self._decoder.rules):
            decoder = self._decoder
            self._state = decoder._decode(
                decoder._weights(),
                self._state,
                to_device(np.int32(stop_at), decoder._scalar),
                to_device(stopped, decoder._rows),
                self._original_order,
            )
        self.progress = self._fetch()
        return self.progress
