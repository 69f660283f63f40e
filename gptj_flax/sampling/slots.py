"""Decode slots, the device side of continuous batching.

One preallocated KV cache of ``slots`` rows and ``length`` columns holds up to ``slots`` independent
sequences, one per row, each at its own position. A sequence's prompt is prefilled on its own (in
a batch of new prompts, or chunk by chunk when long) and *inserted* into a free row between decode
steps; each decode step then advances every running row by one token, each with its own sampling
settings, seed, stopping rule and length. A row that finishes simply stops running, and the next
insert reuses it. Nothing here knows about requests: :mod:`gptj_flax.serving.engine` schedules.

A row's sequence occupies slots ``0 … n-1`` of its own (prompt first, no padding), so its position
is its length. The cache is a :class:`~gptj_flax.model.PagedKVCache`: one pool of pages that all
rows share, a page table (kept here, on the host) naming the pages each row's sequence lies in.
Pages are handed out lowest first as sequences grow and return to the pool when they end, so the
pages in use stay at the front of the pool, and each step reads only the pool blocks that hold
them: the work of a step follows the tokens the running sequences hold, not the longest of them.
Every step runs the first ``R`` rows only, ``R`` the power of two past the highest busy slot (new
sequences take the lowest free one), so a lone request costs a few rows, not all of them.

With a *prefill decoder* (the same parameters on a mesh of other devices), new prompts are
prefilled there, beside the decode step running here, and their first tokens chosen there
(:meth:`Slots.dispatch_prefill`); :meth:`Slots.place` then moves the prefilled rows into free slots
between two steps, which costs a copy, not a prefill.

Draws are those of :meth:`Decoder.start`: a row's ``n``-th token uses ``fold_in(key(seed), n)``,
so a sequence comes out the same in a slot as in a batch of its own.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Iterator
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from gptj_flax import partitioning
from gptj_flax.losses import token_log_probs
from gptj_flax.model import GPTJ, KVCache, PagedKVCache, pool_blocks, write_pool
from gptj_flax.sampling.decoding import EOS, LENGTH, RUNNING, STOPPED, Decoder, bucket, per_row_axes
from gptj_flax.sampling.multihost import to_device, to_host
from gptj_flax.sampling.samplers import SamplingParams, next_tokens, top_logprobs

Array = jax.Array

MAX_PREFILL_ROWS = 8  # prompts prefilled together; more would stall decoding for longer
# Pages in the first pool block (see model.pool_blocks): a step reads whole blocks, so smaller ones
# read fewer idle pages, while each block costs a few operations per layer, and a decode program is
# compiled for each count of blocks (XLA:CPU maps each compiled kernel into memory, and a process
# may hold only so many maps).
FIRST_BLOCK = 4


@flax.struct.dataclass
class SlotState:
    """Every slot's sequence and settings, on the device. ``cache.index[r]`` is row r's length."""

    cache: PagedKVCache
    last: Array  # int32 [S]: the newest token, fed at the next step
    num_generated: Array  # int32 [S]
    max_new_tokens: Array  # int32 [S]
    finish: Array  # int32 [S]: RUNNING, EOS, LENGTH or STOPPED (a free slot is never RUNNING)
    eos_id: Array  # int32 [S]; -1: do not stop at EOS
    seeds: Array  # uint32 [S]
    seen: Array  # bool [S, V]: prompt and generated ids, for the repetition penalty
    want_top: Array  # bool [S]: record the most likely alternatives of each token
    sampling: SamplingParams

    @classmethod
    def logical_axes(cls, config) -> SlotState:
        rows = PartitionSpec("batch")
        return cls(cache=PagedKVCache.logical_axes(config), last=rows, want_top=rows, **per_row_axes())


@flax.struct.dataclass
class Tokens:
    """Tokens chosen for some rows over ``steps`` steps; on the host after :func:`to_host`."""

    tokens: Array  # int32 [R, K] (0 where a row was not running)
    logprobs: Array  # float32 [R, K]
    top_ids: Array  # int32 [R, K, T]: the T most likely ids at each step (where a row asked)
    top_logprobs: Array  # float32 [R, K, T]
    finish: Array  # int32 [R] after the last step
    num_generated: Array  # int32 [R] after the last step


@dataclasses.dataclass
class Request:
    """One sequence to insert: its prompt (token ids) and settings."""

    tokens: list[int]
    max_new_tokens: int
    eos_id: int  # -1: do not stop at EOS
    seed: int
    sampling: SamplingParams  # host settings of one row
    want_top: bool = False


@dataclasses.dataclass
class Prefill:
    """A long prompt being prefilled chunk by chunk into a cache of its own (batch 1)."""

    request: Request
    tokens: np.ndarray  # int32 [1, P]: the prompt, left-padded to a power of two
    next_column: int  # where the next chunk starts
    cache: Any = None
    logits: Any = None

    @property
    def done(self) -> bool:
        return self.next_column >= self.tokens.shape[1]


@dataclasses.dataclass
class Pending:
    """The tokens of a device call that has been dispatched and may still be running."""

    out: Tokens
    rows: int  # the rows of ``out`` that are real

    def result(self) -> Tokens:
        """Wait for the call and bring its tokens to the host."""
        return jax.tree.map(lambda x: x[: self.rows], to_host(self.out))


@dataclasses.dataclass
class Prefilled:
    """Prompts prefilled on the prefill mesh, their first tokens chosen, waiting to be placed in slots."""

    requests: list[Request]
    tokens: np.ndarray  # int32 [b, P]: the prompts, left-padded (rows past the requests are padding)
    lengths: np.ndarray  # int32 [b]
    cache: KVCache  # on the prefill mesh
    first: Tokens  # on the prefill mesh
    seen: Array  # bool [b, V]: each prompt's ids and its first token

    @property
    def pending(self) -> Pending:
        return Pending(self.first, len(self.requests))


class PageTable:
    """Which pages of a :class:`~gptj_flax.model.PagedKVCache` each slot's sequence holds, on the host.

    ``ids[s, i]`` is the page that holds slots ``i·page … (i+1)·page − 1`` of slot ``s``'s sequence
    (``pages``, past the pool's end, where it holds none). Pages are handed out lowest first, so the
    pages in use stay at the front of the pool. ``reach[s]`` counts the slots that the calls queued so
    far may have written for slot ``s``'s sequence: its pages cover at least that many.
    """

    def __init__(self, rows: int, per_row: int, page: int):
        self.page, self.per_row, self.pages = page, per_row, rows * per_row
        self.ids = np.full((rows, per_row), self.pages, np.int32)
        self.held = np.zeros(rows, np.int64)
        self.reach = np.zeros(rows, np.int64)
        self._free = list(range(self.pages))  # a heap: the lowest free page first

    def start(self, row: int, length: int) -> None:
        """Row ``row`` now holds a new sequence of ``length`` slots (its old pages return to the pool)."""
        self.free(row)
        self.grow(row, length)

    def grow(self, row: int, slots: int) -> None:
        """Let row ``row``'s sequence reach ``slots`` more slots (never past its last page)."""
        self.reach[row] = min(self.reach[row] + slots, self.per_row * self.page)
        while self.held[row] * self.page < self.reach[row]:
            self.ids[row, self.held[row]] = heapq.heappop(self._free)
            self.held[row] += 1

    def free(self, row: int) -> None:
        for page in self.ids[row, : self.held[row]]:
            heapq.heappush(self._free, int(page))
        self.ids[row] = self.pages
        self.held[row] = self.reach[row] = 0

    def end(self) -> int:
        """One past the highest page held (0 when none is)."""
        held = self.ids[self.ids < self.pages]
        return int(held.max()) + 1 if held.size else 0

    @property
    def in_use(self) -> int:
        return int(self.held.sum())


class Slots:
    """Compiled programs over one slot cache, for a :class:`Decoder`'s model and parameters.

    Args:
      decoder: gives the model, its placed parameters, the mesh and the valid vocabulary.
      slots: rows of the cache (rounded up to a multiple of the mesh's data-parallel size).
      length: columns per row: the longest prompt + completion one sequence may have.
      chunk: prompts longer than this are prefilled in chunks of this many tokens (a power of two).
      steps: the most decode steps one :meth:`decode` call runs.
      top_logprobs: how many alternatives a row that asks for them gets for each token.
      prefill: the same model on other devices, to prefill new prompts on beside the decode steps
        (:meth:`dispatch_prefill`, :meth:`place`); without one, :meth:`admit` prefills between them.
    """

    def __init__(
        self,
        decoder: Decoder,
        *,
        slots: int,
        length: int,
        chunk: int,
        steps: int,
        top_logprobs: int,
        prefill: Decoder | None = None,
    ):
        if chunk < 16 or chunk & (chunk - 1):
            raise ValueError(f"the prefill chunk must be a power of two >= 16, got {chunk}")
        if not 1 <= length <= decoder.config.max_len:
            raise ValueError(f"the slot length must be in [1, {decoder.config.max_len}] (the context), got {length}")
        if prefill is not None and set(prefill.mesh.devices.flat) & set(decoder.mesh.devices.flat):
            raise ValueError("the prefill decoder's devices must be other than the decode slots'")
        self.decoder, self.config, self.prefill = decoder, decoder.config, prefill
        self._prefiller = decoder if prefill is None else prefill  # where prompts are prefilled
        multiple = decoder.batch_multiple
        self.slots = -(-slots // multiple) * multiple
        self.length, self.chunk, self.steps, self.top = length, chunk, steps, top_logprobs
        # the pool: every slot's whole length in pages, in blocks of pages (each a multiple of the
        # data-parallel size, as the pages are split like rows); see the module's docstring
        self.page, self._per_row = decoder.page_columns, -(-length // decoder.page_columns)
        self.blocks = pool_blocks(self.slots * self._per_row, multiple * -(-FIRST_BLOCK // multiple))
        self._block_ends = np.cumsum(self.blocks)  # pages held by the first 1, 2 … blocks
        self._model = GPTJ(self.config)
        mesh, rules = decoder.mesh, decoder.rules
        self._rows = partitioning.named_sharding(mesh, ("batch",), rules)
        self._state_sharding = partitioning.logical_to_sharding(SlotState.logical_axes(self.config), mesh, rules)
        # The programs depend on the shapes alone (the state is an argument), so every Slots of one
        # decoder and shape shares them, as its Decoder's programs are shared: a new server on a
        # loaded model compiles nothing new, and no compiled program is freed while one compiles.
        programs = decoder.slot_programs
        key = (self.slots, length, chunk, steps, top_logprobs, None if prefill is None else prefill.mesh)
        if key not in programs:
            # a long prompt's cache starts on the devices that prefill it
            new_cache = None if prefill is None else NamedSharding(prefill.mesh, PartitionSpec())
            programs[key] = (
                jax.jit(self._decode_fn, static_argnums=(5, 6), donate_argnums=(1,)),
                jax.jit(self._admit_fn, donate_argnums=(1,)),
                jax.jit(self._chunk_fn, donate_argnums=(1,)),
                jax.jit(self._new_cache_fn, static_argnums=(0,), out_shardings=new_cache),
                jax.jit(self._insert_fn, donate_argnums=(0,)),
                jax.jit(self._empty_fn, out_shardings=self._state_sharding),
                jax.jit(self._prefill_fn),
                jax.jit(self._first_fn),
                jax.jit(self._place_fn, donate_argnums=(0,)),
            )
        (
            self._decode,
            self._admit,
            self._chunk,
            self._new_cache,
            self._insert,
            self._build,
            self._prefill,
            self._first,
            self._place,
        ) = programs[key]
        self.reset()

    def reset(self) -> None:
        """Empty every slot (a fresh cache and state)."""
        self.table = PageTable(self.slots, self._per_row, self.page)
        with partitioning.sharding_scope(self.decoder.mesh, self.decoder.rules):
            self.state: SlotState = self._build()

    # -- device programs ---------------------------------------------------------------------
    def _empty_fn(self) -> SlotState:
        s, cfg = self.slots, self.config
        return SlotState(
            cache=PagedKVCache.empty(cfg, self.blocks, self.page, s),
            last=jnp.zeros((s,), jnp.int32),
            num_generated=jnp.zeros((s,), jnp.int32),
            max_new_tokens=jnp.zeros((s,), jnp.int32),
            finish=jnp.full((s,), LENGTH, jnp.int32),
            eos_id=jnp.full((s,), -1, jnp.int32),
            seeds=jnp.zeros((s,), jnp.uint32),
            seen=jnp.zeros((s, cfg.vocab_size), bool),
            want_top=jnp.zeros((s,), bool),
            sampling=jax.tree.map(jnp.asarray, SamplingParams.build(s, temperature=0.0)),
        )

    def _choose(self, logits, sampling, seen, seeds, n, want_top):
        """Each row's next token, its log-probability and (where asked) the ``top`` likeliest ids."""
        keys = jax.vmap(lambda seed, i: jax.random.fold_in(jax.random.key(seed), i))(seeds, n)
        token = next_tokens(logits, sampling, seen, keys, self.decoder.valid_vocab)
        logprob = token_log_probs(logits, token)
        rows, top = logits.shape[0], self.top

        def alternatives(logits):
            return top_logprobs(logits, top, self.decoder.valid_vocab)

        def nothing(logits):
            return jnp.zeros((rows, top), jnp.int32), jnp.zeros((rows, top), jnp.float32)

        top_ids, top_values = lax.cond(jnp.any(want_top), alternatives, nothing, logits)
        return token, logprob, top_ids, top_values

    def _decode_fn(
        self, params, state: SlotState, release, steps, table, blocks: int, rows: int
    ) -> tuple[SlotState, Tokens]:
        """Up to ``steps`` steps of the first ``rows`` slots (every busy one), over the first
        ``blocks`` pool blocks (every page that ``table`` names for them)."""
        state = state.replace(finish=jnp.where(release & (state.finish == RUNNING), STOPPED, state.finish))
        cache = state.cache.view(blocks)  # whole buffers, each read and written in place
        s = jax.tree.map(lambda x: x[:rows], state.replace(cache=None))
        k_, t_ = self.steps, self.top
        out = Tokens(
            tokens=jnp.zeros((rows, k_), jnp.int32),
            logprobs=jnp.zeros((rows, k_), jnp.float32),
            top_ids=jnp.zeros((rows, k_, t_), jnp.int32),
            top_logprobs=jnp.zeros((rows, k_, t_), jnp.float32),
            finish=s.finish,
            num_generated=s.num_generated,
        )

        def unfinished(carry):
            s, _, _, i = carry
            return (i < steps) & jnp.any(s.finish == RUNNING)

        def step(carry):
            s, cache, o, i = carry
            active = s.finish == RUNNING
            logits, cache = self._model.apply(
                {"params": params},
                s.last[:, None],
                cache.index[:rows, None],
                active,
                cache,
                table[:rows],
                method=GPTJ.decode_slots,
            )
            token, logprob, top_ids, top_values = self._choose(
                logits[:, -1], s.sampling, s.seen, s.seeds, s.num_generated, s.want_top & active
            )
            token = jnp.where(active, token, 0)
            num = s.num_generated + active
            finish = jnp.where(active & (token == s.eos_id), EOS, s.finish)
            finish = jnp.where((finish == RUNNING) & (num >= s.max_new_tokens), LENGTH, finish)
            s = s.replace(
                last=jnp.where(active, token, s.last),
                num_generated=num,
                finish=finish,
                seen=s.seen.at[jnp.arange(rows), token].max(active),
            )
            o = o.replace(
                tokens=o.tokens.at[:, i].set(token),
                logprobs=o.logprobs.at[:, i].set(jnp.where(active, logprob, 0.0)),
                top_ids=o.top_ids.at[:, i].set(top_ids),
                top_logprobs=o.top_logprobs.at[:, i].set(top_values),
            )
            return s, cache, o, i + 1

        s, cache, out, _ = lax.while_loop(unfinished, step, (s, cache, out, jnp.zeros((), jnp.int32)))
        whole = jax.tree.map(
            lambda full, part: lax.dynamic_update_slice_in_dim(full, part, 0, axis=0),
            state.replace(cache=None),
            s,
        )
        return whole.replace(cache=state.cache.merge(cache)), out.replace(
            finish=s.finish, num_generated=s.num_generated
        )

    def _prompt_fn(self, params, tokens, lengths) -> tuple[KVCache, Array]:
        """Prefill short prompts [b, P] (left-padded) at once: their cache and last logits."""
        columns = jnp.arange(tokens.shape[1])[None, :]
        padding = (tokens.shape[1] - lengths)[:, None]
        segments, positions = (columns >= padding).astype(jnp.int32), jnp.maximum(columns - padding, 0)
        cache = KVCache.empty(self.config, *tokens.shape)
        logits, cache = self._model.apply(
            {"params": params}, tokens, positions, segments, cache, last_logits_only=True, method=GPTJ.decode
        )
        return cache, logits[:, -1]

    def _admit_fn(self, params, state, tokens, lengths, slots, max_new, eos_id, seeds, sampling, want_top, table):
        """Prefill short prompts [b, P] (left-padded) at once and insert them into rows ``slots``."""
        cache, logits = self._prompt_fn(params, tokens, lengths)
        return self._insert_fn(
            state, cache, logits, tokens, lengths, slots, max_new, eos_id, seeds, sampling, want_top, table
        )

    def _prefill_fn(self, params, tokens, lengths, max_new, eos_id, seeds, sampling, want_top):
        """Prefill short prompts as :meth:`_admit_fn` does, and choose their first tokens, without
        touching the slots (on the prefill mesh)."""
        cache, logits = self._prompt_fn(params, tokens, lengths)
        return (cache, *self._first_fn(logits, tokens, lengths, max_new, eos_id, seeds, sampling, want_top))

    def _new_cache_fn(self, columns: int) -> KVCache:
        return KVCache.empty(self.config, 1, columns)

    def _chunk_fn(self, params, cache: KVCache, prompt, length, start) -> tuple[KVCache, Array]:
        """Prefill the chunk of ``prompt`` [1, P] (left-padded) that starts at column ``start``."""
        columns = prompt.shape[1]
        chunk = lax.dynamic_slice_in_dim(prompt, start, self.chunk, axis=1)
        index = start + jnp.arange(self.chunk)[None, :]
        padding = columns - length
        segments, positions = (index >= padding).astype(jnp.int32), jnp.maximum(index - padding, 0)
        logits, cache = self._model.apply(
            {"params": params},
            chunk,
            positions,
            segments,
            cache.replace(index=start),
            last_logits_only=True,
            method=GPTJ.decode,
        )
        return cache, logits[:, -1]

    def _insert_fn(
        self,
        state: SlotState,
        cache: KVCache,
        logits,
        tokens,
        lengths,
        slots,
        max_new,
        eos_id,
        seeds,
        sampling,
        want_top,
        table,
    ) -> tuple[SlotState, Tokens]:
        """Move prefilled prompts into rows ``slots`` and choose their first tokens."""
        first, seen = self._first_fn(logits, tokens, lengths, max_new, eos_id, seeds, sampling, want_top)
        state = self._place_fn(
            state, cache, tokens, lengths, slots, max_new, eos_id, seeds, sampling, want_top, first, seen, table
        )
        return state, first

    def _first_fn(self, logits, tokens, lengths, max_new, eos_id, seeds, sampling, want_top) -> tuple[Tokens, Array]:
        """The first tokens of prefilled prompts [b, P] (left-padded), and the ids each row has seen."""
        b, columns = tokens.shape
        real = jnp.arange(columns)[None, :] >= (columns - lengths)[:, None]
        seen = jnp.zeros((b, self.config.vocab_size), bool).at[jnp.arange(b)[:, None], tokens].max(real)
        token, logprob, top_ids, top_values = self._choose(
            logits, sampling, seen, seeds, jnp.zeros((b,), jnp.int32), want_top
        )
        seen = seen.at[jnp.arange(b), token].set(True)
        finish = jnp.where(token == eos_id, EOS, jnp.where(max_new <= 1, LENGTH, RUNNING)).astype(jnp.int32)
        first = Tokens(
            tokens=token[:, None],
            logprobs=logprob[:, None],
            top_ids=top_ids[:, None],
            top_logprobs=top_values[:, None],
            finish=finish,
            num_generated=jnp.ones((b,), jnp.int32),
        )
        return first, seen

    def _place_fn(
        self, state, cache, tokens, lengths, slots, max_new, eos_id, seeds, sampling, want_top, first, seen, table
    ) -> SlotState:
        """Write prefilled prompts (real tokens first) and their first tokens into rows ``slots``, the
        prompts' keys and values into the pages ``table`` names for those rows.

        Rows whose slot is out of range (batch padding, or a row not to be placed) change nothing.
        """
        b, columns = tokens.shape
        kept = min(columns, self.length)  # a prompt never needs more columns than a row has
        pages = -(-kept // self.page)
        # row j's real tokens sit in its last lengths[j] columns: rotate them to the front
        source = (jnp.arange(kept)[None, :] + (columns - lengths)[:, None]) % columns
        inside = (slots >= 0) & (slots < self.slots)
        targets = jnp.where(inside[:, None], table[jnp.where(inside, slots, 0), :pages], sum(self.blocks))

        def paged(new: Array, axis: int) -> Array:
            """``new``'s rotated rows cut into pages: [b·pages, …] with the page's slots at ``axis``."""
            shape = [1] * new.ndim
            shape[0], shape[axis] = b, kept
            new = jnp.take_along_axis(new, source.reshape(shape), axis=axis)
            padding = [(0, 0)] * new.ndim
            padding[axis] = (0, pages * self.page - kept)
            new = jnp.pad(new, padding)
            new = jnp.moveaxis(new.reshape(*new.shape[:axis], pages, self.page, *new.shape[axis + 1 :]), axis, 1)
            return new.reshape(b * pages, *new.shape[2:])

        def put(pools, new, axis):
            return tuple(
                write_pool(pool, targets.reshape(-1), None, paged(x, axis), 0)
                for pool, x in zip(pools, new, strict=True)
            )

        old = state.cache
        row_values = {
            "last": first.tokens[:, 0],
            "num_generated": jnp.ones((b,), jnp.int32),
            "max_new_tokens": max_new,
            "finish": first.finish,
            "eos_id": eos_id,
            "seeds": seeds,
            "seen": seen,
            "want_top": want_top,
        }

        def put_rows(big, rows):
            return big.at[slots].set(rows.astype(big.dtype), mode="drop")

        return state.replace(
            cache=PagedKVCache(
                k=put(old.k, cache.k, 3),
                v=put(old.v, cache.v, 2),
                index=put_rows(old.index, lengths),
                # an int8 cache's scales, [rows, heads, columns], move with the keys and values they scale
                k_scale=put(old.k_scale, cache.k_scale, 2),
                v_scale=put(old.v_scale, cache.v_scale, 2),
            ),
            sampling=jax.tree.map(put_rows, state.sampling, sampling),
            **{name: put_rows(getattr(state, name), value) for name, value in row_values.items()},
        )

    # -- host side ---------------------------------------------------------------------------
    def prompt_columns(self, n: int) -> int:
        """Columns a prompt of ``n`` tokens is prefilled in: a power of two (at least 16)."""
        return bucket(n)

    def _settings(self, requests: list[Request], rows: int, slots: list[int]):
        n = len(requests)

        def pad(values, dtype, fill=0):
            out = np.full(rows, fill, dtype)
            out[:n] = values
            return out

        sampling = jax.tree.map(lambda *xs: np.concatenate(xs), *(r.sampling for r in requests))
        return (
            pad(slots, np.int32, self.slots),  # padding rows point past the last slot: dropped
            pad([r.max_new_tokens for r in requests], np.int32),
            pad([r.eos_id for r in requests], np.int32, -1),
            pad([r.seed for r in requests], np.uint32),
            sampling.pad_to(rows),
            pad([r.want_top for r in requests], bool, False),
        )

    def admit(self, requests: list[Request], slots: list[int]) -> Tokens:
        """Prefill short prompts (at most ``chunk`` columns) together and insert them into ``slots``."""
        return self.dispatch_admit(requests, slots).result()

    def _prompts(self, requests: list[Request]) -> tuple[np.ndarray, np.ndarray]:
        """Short prompts left-padded into [rows, columns] (rows a power of two), and their lengths."""
        rows = bucket(len(requests), 1)
        columns = max(self.prompt_columns(len(r.tokens)) for r in requests)
        tokens = np.zeros((rows, columns), np.int32)
        lengths = np.zeros(rows, np.int32)
        for i, r in enumerate(requests):
            tokens[i, columns - len(r.tokens) :] = r.tokens
            lengths[i] = len(r.tokens)
        return tokens, lengths

    def _start(self, requests: list[Request], slots: list[int | None]) -> np.ndarray:
        """Give each of ``slots`` (None or past the last: none) pages for its new request's prompt;
        the page table, for the call that writes them."""
        for request, slot in zip(requests, slots, strict=True):
            if slot is not None and 0 <= slot < self.slots:
                self.table.start(slot, len(request.tokens))
        return self.table.ids.copy()  # the call may read it after the host has moved on

    def free(self, slots: list[int]) -> None:
        """The sequences in ``slots`` have ended: their pages return to the pool. A row that may still
        be running must be in the ``release`` of the next decode call, which stops it before its
        step writes anything (so a later call may already have given its pages to another row)."""
        for slot in slots:
            self.table.free(slot)

    def dispatch_admit(self, requests: list[Request], slots: list[int]) -> Pending:
        """:meth:`admit`, returning as soon as the call is queued on the device."""
        tokens, lengths = self._prompts(requests)
        table = self._start(requests, slots)
        with partitioning.sharding_scope(self.decoder.mesh, self.decoder.rules):
            self.state, first = self._admit(
                self.decoder.params, self.state, tokens, lengths, *self._settings(requests, len(tokens), slots), table
            )
        return Pending(first, len(requests))

    def dispatch_prefill(self, requests: list[Request]) -> Prefilled:
        """Prefill short prompts together on the prefill decoder and choose their first tokens
        (``.pending``), leaving the slots as they are: :meth:`place` puts them in."""
        if self.prefill is None:
            raise ValueError("these slots have no prefill decoder: admit() prefills between decode steps")
        tokens, lengths = self._prompts(requests)
        _, *settings = self._settings(requests, len(tokens), [self.slots] * len(requests))
        with partitioning.sharding_scope(self.prefill.mesh, self.prefill.rules):
            cache, first, seen = self._prefill(self.prefill.params, tokens, lengths, *settings)
        return Prefilled(requests, tokens, lengths, cache, first, seen)

    def dispatch_first(self, prefill: Prefill) -> Prefilled:
        """A long prompt prefilled chunk by chunk on the prefill decoder: its first token, to :meth:`place`."""
        if self.prefill is None:
            raise ValueError("these slots have no prefill decoder: insert() finishes a prefill between decode steps")
        requests = [prefill.request]
        lengths = np.array([len(prefill.request.tokens)], np.int32)
        _, *settings = self._settings(requests, 1, [self.slots])
        with partitioning.sharding_scope(self.prefill.mesh, self.prefill.rules):
            first, seen = self._first(prefill.logits, prefill.tokens, lengths, *settings)
        return Prefilled(requests, prefill.tokens, lengths, prefill.cache, first, seen)

    def place(self, prefilled: Prefilled, slots: list[int | None]) -> None:
        """Put prefilled prompts into ``slots`` (one per request; None: not placed, as for a row that
        ended at its first token or whose client left), queued behind the decode step in flight."""
        mesh, rules = self.decoder.mesh, self.decoder.rules
        moved = jax.device_put((prefilled.cache, prefilled.first, prefilled.seen), NamedSharding(mesh, PartitionSpec()))
        cache, first, seen = moved
        targets = [self.slots if s is None else s for s in slots]
        table = self._start(prefilled.requests, slots)
        with partitioning.sharding_scope(mesh, rules):
            self.state = self._place(
                self.state,
                cache,
                prefilled.tokens,
                prefilled.lengths,
                *self._settings(prefilled.requests, len(prefilled.tokens), targets),
                first,
                seen,
                table,
            )

    def start_prefill(self, request: Request) -> Prefill:
        """A long prompt's prefill, to be advanced with :meth:`prefill_chunk` until done."""
        columns = self.prompt_columns(len(request.tokens))
        tokens = np.zeros((1, columns), np.int32)
        tokens[0, columns - len(request.tokens) :] = request.tokens
        first = (columns - len(request.tokens)) // self.chunk * self.chunk  # chunks of padding only are skipped
        with partitioning.sharding_scope(self._prefiller.mesh, self._prefiller.rules):
            cache = self._new_cache(columns)
        return Prefill(request, tokens, first, cache)

    def prefill_chunk(self, prefill: Prefill) -> None:
        with partitioning.sharding_scope(self._prefiller.mesh, self._prefiller.rules):
            prefill.cache, prefill.logits = self._chunk(
                self._prefiller.params,
                prefill.cache,
                prefill.tokens,
                np.int32(len(prefill.request.tokens)),
                np.int32(prefill.next_column),
            )
        prefill.next_column += self.chunk

    def insert(self, prefill: Prefill, slot: int) -> Tokens:
        """Insert a finished :class:`Prefill` into ``slot`` and choose its first token."""
        return self.dispatch_insert(prefill, slot).result()

    def dispatch_insert(self, prefill: Prefill, slot: int) -> Pending:
        """:meth:`insert`, returning as soon as the call is queued on the device."""
        request = prefill.request
        table = self._start([request], [slot])
        with partitioning.sharding_scope(self.decoder.mesh, self.decoder.rules):
            self.state, first = self._insert(
                self.state,
                prefill.cache,
                prefill.logits,
                prefill.tokens,
                np.array([len(request.tokens)], np.int32),
                *self._settings([request], 1, [slot]),
                table,
            )
        return Pending(first, 1)

    def blocks_for(self, pages: int) -> int:
        """The pool blocks a step reads when the first ``pages`` pages hold every sequence's: the
        fewest that hold them (at least one)."""
        return max(1, int(np.searchsorted(self._block_ends, pages)) + 1)

    def busy_rows(self, highest: int) -> int:
        """The rows a decode step runs when ``highest`` is the highest busy slot: a power of two (and
        a multiple of the data-parallel size) above it."""
        multiple = self.decoder.batch_multiple
        return min(self.slots, -(-bucket(highest + 1, 1) // multiple) * multiple)

    def decode(self, release: list[int], steps: int, highest: int | None = None) -> Tokens:
        """Stop the rows in ``release``, then run up to ``steps`` decode steps of every running row.

        ``highest``: the highest busy slot (default: the last). Returns the first :meth:`busy_rows`
        rows' tokens.
        """
        return self.dispatch_decode(release, steps, highest).result()

    def dispatch_decode(self, release: list[int], steps: int, highest: int | None = None) -> Pending:
        """:meth:`decode`, returning as soon as the call is queued on the device: the host may work
        on the last call's tokens while this one runs."""
        highest = self.slots - 1 if highest is None else highest
        steps = min(steps, self.steps)
        # The released rows stop before this call writes anything: their pages may go to others now.
        self.free(release)
        for slot in np.flatnonzero(self.table.held):
            self.table.grow(slot, steps)
        return self._run(release, steps, self.blocks_for(self.table.end()), self.busy_rows(highest))

    def wait(self) -> None:
        """Block until every call dispatched so far has finished."""
        self.state.finish.block_until_ready()

    def _run(self, release: list[int], steps: int, blocks: int, rows: int) -> Pending:
        stop = np.zeros(self.slots, bool)
        stop[release] = True
        with partitioning.sharding_scope(self.decoder.mesh, self.decoder.rules):
            self.state, out = self._decode(
                self.decoder.params,
                self.state,
                to_device(stop, self._rows),
                np.int32(steps),
                self.table.ids.copy(),
                blocks,
                rows,
            )
        return Pending(out, rows)

    def warm_up(self, stop: Callable[[], bool] = lambda: False) -> bool:
        """Compile every program a request can need: nothing compiles once requests come. ``stop`` is
        asked before each program (a compile cannot be cut short); False if it said stop."""
        return not any(stop() for _ in self._compile_each())

    def _compile_each(self) -> Iterator[None]:
        """Runs each program once with dummy rows that change nothing; yields before each one."""
        dummy = Request([0], 1, -1, 0, SamplingParams.build(1, temperature=0.0))
        nowhere = [self.slots] * MAX_PREFILL_ROWS  # past the last slot: the inserts change nothing
        longest = self.prompt_columns(self.length)
        for columns in (1 << i for i in range(4, longest.bit_length())):
            request = dataclasses.replace(dummy, tokens=[0] * min(columns, self.length))
            if columns <= self.chunk:
                for rows in {min(1 << i, MAX_PREFILL_ROWS, self.slots) for i in range(MAX_PREFILL_ROWS.bit_length())}:
                    yield
                    if self.prefill is None:
                        self.admit([request] * rows, nowhere[:rows])
                    else:
                        self.place(self.dispatch_prefill([request] * rows), [None] * rows)
            else:
                yield
                prefill = self.start_prefill(request)
                self.prefill_chunk(prefill)
                if self.prefill is None:
                    self.insert(prefill, self.slots)
                else:
                    self.place(self.dispatch_first(prefill), [None])
            self.wait()
        for rows in sorted({self.busy_rows(s) for s in range(self.slots)}):
            for blocks in range(1, len(self.blocks) + 1):
                yield
                self._run([], 1, blocks, rows).result()

    def compilations(self) -> int:
        """Programs compiled so far, for checking that nothing recompiles as requests come and go."""
        programs = (self._decode, self._admit, self._chunk, self._new_cache, self._insert)
        return sum(f._cache_size() for f in (*programs, self._prefill, self._first, self._place))
