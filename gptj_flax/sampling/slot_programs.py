"""The decode slots' device programs (:mod:`gptj_flax.sampling.slots` runs them).

Each program is a pure function of a :class:`SlotShape`, which says what it is compiled for (the
model's config and the slots' sizes), and of device pytrees: the parameters, the :class:`SlotState`
of every slot, and the :class:`NewRows` that a prefill starts. :class:`SlotPrograms` jits them for
one shape; the serving engine's slots and the AOT serving fit (:mod:`gptj_flax.sampling.serving_fit`)
both compile them from there. A program runs (or is lowered) under ``jax.set_mesh`` of the devices
it runs on, and resolves logical axis names with the shape's rules.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gptj_flax.config import ModelConfig
from gptj_flax.losses import token_log_probs
from gptj_flax.model import GPTJ, AdapterSlots, KVCache, PagedKVCache, pool_blocks, write_pool
from gptj_flax.partitioning import DEFAULT_RULES, Rules
from gptj_flax.sampling.decoding import EOS, LENGTH, RUNNING, STOPPED, per_row_axes
from gptj_flax.sampling.samplers import SamplingParams, next_tokens, top_logprobs

Array = jax.Array

# Pages in the first pool block (see model.pool_blocks): a step reads whole blocks, so smaller ones
# read fewer idle pages, while each block costs a conditional and a few operations per layer.
FIRST_BLOCK = 4


@dataclasses.dataclass(frozen=True)
class SlotShape:
    """What the slot programs are compiled for; hashable, a static argument of each.

    ``slots`` rows of ``length`` columns, in pages of ``page`` columns drawn from a pool of pages in
    blocks of ``blocks`` pages; prompts longer than ``chunk`` prefilled chunk by chunk; at most
    ``steps`` decode steps a call; ``top_logprobs`` alternatives for a row that asks for them; ids
    from ``valid_vocab`` up never generated; logical names resolved by ``rules``; with ``adapters``
    (a bank's shape), each row applies the served adapter it names, and the programs take the
    parameters as ``(params, bank arrays)``.
    """

    config: ModelConfig
    slots: int
    length: int
    chunk: int
    steps: int
    top_logprobs: int
    page: int
    blocks: tuple[int, ...]
    valid_vocab: int
    rules: Rules = DEFAULT_RULES
    adapters: AdapterSlots | None = None

    @classmethod
    def build(
        cls,
        config: ModelConfig,
        *,
        slots: int,
        length: int,
        chunk: int,
        steps: int,
        top_logprobs: int,
        page: int,
        batch_multiple: int = 1,
        valid_vocab: int | None = None,
        rules: Rules = DEFAULT_RULES,
        adapters: AdapterSlots | None = None,
    ) -> SlotShape:
        """The shape of ``slots`` rows (rounded up to a multiple of ``batch_multiple``, the mesh's
        data-parallel size, as rows and pages are split over it), the pool holding every row's
        whole length."""
        if chunk < 16 or chunk & (chunk - 1):
            raise ValueError(f"the prefill chunk must be a power of two >= 16, got {chunk}")
        if not 1 <= length <= config.max_len:
            raise ValueError(f"the slot length must be in [1, {config.max_len}] (the context), got {length}")
        slots = -(-slots // batch_multiple) * batch_multiple
        per_row = -(-length // page)
        blocks = pool_blocks(slots * per_row, batch_multiple * -(-FIRST_BLOCK // batch_multiple))
        vocab = config.vocab_size if valid_vocab is None else valid_vocab
        return cls(config, slots, length, chunk, steps, top_logprobs, page, blocks, vocab, rules, adapters)

    @property
    def per_row(self) -> int:
        """Pages one row's whole length takes."""
        return -(-self.length // self.page)

    @property
    def pages(self) -> int:
        """Pages in the pool; a page table names this one, past its end, for a page not held."""
        return sum(self.blocks)

    @property
    def short_pages(self) -> int:
        """Pages every prompt prefilled at once is cut into, the longest one's (``chunk`` columns):
        one page-write program then serves every prompt bucket of a count of rows."""
        return -(-min(self.chunk, self.length) // self.page)


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
    adapter: Array  # int32 [S]: the row of the adapter bank each slot applies (0: none)
    sampling: SamplingParams

    @classmethod
    def logical_axes(cls, config) -> SlotState:
        rows = PartitionSpec("batch")
        return cls(cache=PagedKVCache.logical_axes(config), last=rows, want_top=rows, adapter=rows, **per_row_axes())


@flax.struct.dataclass
class NewRows:
    """New sequences: their prompts, left-padded, and each one's settings and slot. Rows past the
    real ones are padding, and a row whose slot is out of range is placed nowhere."""

    tokens: Array  # int32 [b, P]
    lengths: Array  # int32 [b]
    slot: Array  # int32 [b]
    max_new_tokens: Array  # int32 [b]
    eos_id: Array  # int32 [b]; -1: do not stop at EOS
    seeds: Array  # uint32 [b]
    sampling: SamplingParams
    want_top: Array  # bool [b]
    adapter: Array  # int32 [b]: each prompt's row of the adapter bank (0: none)


@flax.struct.dataclass
class Pages:
    """Prefilled prompts' keys and values cut into pages, real tokens first: each buffer of their
    cache (:class:`~gptj_flax.model.KVCache`) as [b·pages, …], its columns a page's, for the pool."""

    k: tuple[Array, ...]
    v: tuple[Array, ...]
    k_scale: tuple[Array, ...]
    v_scale: tuple[Array, ...]


@flax.struct.dataclass
class Tokens:
    """Tokens chosen for some rows over ``steps`` steps; on the host after ``to_host``."""

    tokens: Array  # int32 [R, K] (0 where a row was not running)
    logprobs: Array  # float32 [R, K]
    top_ids: Array  # int32 [R, K, T]: the T most likely ids at each step (where a row asked)
    top_logprobs: Array  # float32 [R, K, T]
    finish: Array  # int32 [R] after the last step
    num_generated: Array  # int32 [R] after the last step


def abstract(shapes: Any, shardings: Any) -> Any:
    """``shapes`` (a tree of shapes and dtypes) with ``shardings`` (a prefix of it) attached."""
    return jax.tree.map(
        lambda sharding, sub: jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), sub),
        shardings,
        shapes,
    )


def abstract_state(shape: SlotShape, mesh: Mesh) -> SlotState:
    """The slot state's shapes, dtypes and shardings on ``mesh``: what a program is lowered against."""
    shardings = jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), state_specs(shape), is_leaf=lambda x: isinstance(x, PartitionSpec)
    )
    return abstract(jax.eval_shape(lambda: empty_state(shape)), shardings)


def empty_state(shape: SlotShape) -> SlotState:
    """Every slot empty: a zero pool, no sequence running."""
    s, cfg = shape.slots, shape.config
    return SlotState(
        cache=PagedKVCache.empty(cfg, shape.blocks, shape.page, s),
        last=jnp.zeros((s,), jnp.int32),
        num_generated=jnp.zeros((s,), jnp.int32),
        max_new_tokens=jnp.zeros((s,), jnp.int32),
        finish=jnp.full((s,), LENGTH, jnp.int32),
        eos_id=jnp.full((s,), -1, jnp.int32),
        seeds=jnp.zeros((s,), jnp.uint32),
        seen=jnp.zeros((s, cfg.vocab_size), bool),
        want_top=jnp.zeros((s,), bool),
        adapter=jnp.zeros((s,), jnp.int32),
        sampling=jax.tree.map(jnp.asarray, SamplingParams.build(s, temperature=0.0)),
    )


def state_specs(shape: SlotShape) -> SlotState:
    """The slot state's mesh axes (a prefix of it: each layer's pool blocks are split alike), for
    whichever mesh the programs run on."""
    logical = SlotState.logical_axes(shape.config)
    return jax.tree.map(
        lambda spec: nn.logical_to_mesh_axes(spec, shape.rules), logical, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


def _apply(shape: SlotShape, weights, *args, **kwargs):
    """``GPTJ.apply`` of the shape's model: ``weights`` is the params, or with an adapter bank
    ``(params, bank arrays)``."""
    if shape.adapters is None:
        variables = {"params": weights}
    else:
        params, bank = weights
        variables = {"params": params, "adapters": bank}
    return GPTJ(shape.config, slots=shape.adapters).apply(variables, *args, **kwargs)


def _choose(shape: SlotShape, logits, sampling, seen, seeds, n, want_top):
    """Each row's next token, its log-probability and (where asked) the ``top_logprobs`` likeliest ids."""
    keys = jax.vmap(lambda seed, i: jax.random.fold_in(jax.random.key(seed), i))(seeds, n)
    token = next_tokens(logits, sampling, seen, keys, shape.valid_vocab)
    logprob = token_log_probs(logits, token)
    rows, top = logits.shape[0], shape.top_logprobs

    def alternatives(logits):
        return top_logprobs(logits, top, shape.valid_vocab)

    def nothing(logits):
        return jnp.zeros((rows, top), jnp.int32), jnp.zeros((rows, top), jnp.float32)

    top_ids, top_values = lax.cond(jnp.any(want_top), alternatives, nothing, logits)
    return token, logprob, top_ids, top_values


def _advance(shape: SlotShape, params, s: SlotState, cache: PagedKVCache, table) -> tuple[SlotState, PagedKVCache, Any]:
    """One decode step of the rows of ``s`` (a state cut to its first rows, ``cache`` apart): the
    new state, cache, and the step's (token, log-prob, top ids, top log-probs) of each row."""
    rows = s.last.shape[0]
    active = s.finish == RUNNING
    logits, cache = _apply(
        shape,
        params,
        s.last[:, None],
        cache.index[:rows, None],
        active,
        cache,
        table,
        s.adapter,
        method=GPTJ.decode_slots,
    )
    token, logprob, top_ids, top_values = _choose(
        shape, logits[:, -1], s.sampling, s.seen, s.seeds, s.num_generated, s.want_top & active
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
    return s, cache, (token, jnp.where(active, logprob, 0.0), top_ids, top_values)


def decode(shape: SlotShape, params, state: SlotState, release, steps, table, *, rows: int) -> tuple[SlotState, Tokens]:
    """Stop the rows in ``release`` [S], then run up to ``steps`` decode steps of the first ``rows``
    slots (every busy one). Each step reads the pool blocks that hold those rows' pages, however
    many: one program serves every occupancy of the pool. Returns the state and those rows' tokens."""
    state = state.replace(finish=jnp.where(release & (state.finish == RUNNING), STOPPED, state.finish))
    cache = state.cache  # whole buffers, each read and written in place
    s = jax.tree.map(lambda x: x[:rows], state.replace(cache=None))
    k, t = shape.steps, shape.top_logprobs
    out = Tokens(
        tokens=jnp.zeros((rows, k), jnp.int32),
        logprobs=jnp.zeros((rows, k), jnp.float32),
        top_ids=jnp.zeros((rows, k, t), jnp.int32),
        top_logprobs=jnp.zeros((rows, k, t), jnp.float32),
        finish=s.finish,
        num_generated=s.num_generated,
    )

    def unfinished(carry):
        s, _, _, i = carry
        return (i < steps) & jnp.any(s.finish == RUNNING)

    def step(carry):
        s, cache, o, i = carry
        s, cache, (token, logprob, top_ids, top_values) = _advance(shape, params, s, cache, table[:rows])
        o = o.replace(
            tokens=o.tokens.at[:, i].set(token),
            logprobs=o.logprobs.at[:, i].set(logprob),
            top_ids=o.top_ids.at[:, i].set(top_ids),
            top_logprobs=o.top_logprobs.at[:, i].set(top_values),
        )
        return s, cache, o, i + 1

    s, cache, out, _ = lax.while_loop(unfinished, step, (s, cache, out, jnp.zeros((), jnp.int32)))
    whole = jax.tree.map(
        lambda full, part: lax.dynamic_update_slice_in_dim(full, part, 0, axis=0), state.replace(cache=None), s
    )
    return whole.replace(cache=cache), out.replace(finish=s.finish, num_generated=s.num_generated)


def _prompt_cache(shape: SlotShape, params, rows: NewRows) -> tuple[KVCache, Array]:
    """Prefill short prompts [b, P] (left-padded) at once: their cache and last logits."""
    tokens = rows.tokens
    empty = KVCache.empty(shape.config, *tokens.shape)
    return _prefill_window(shape, params, empty, tokens, rows.lengths, 0, tokens.shape[1], rows.adapter)


def admit(shape: SlotShape, params, rows: NewRows) -> tuple[Pages, Array, Array]:
    """Prefill short prompts at once: their keys and values cut into pages, the ids each holds and
    their last logits, for :func:`insert_pages` and :func:`first`."""
    cache, logits = _prompt_cache(shape, params, rows)
    return _cut(shape, cache, rows), _prompt_ids(shape, rows), logits


def prefill(shape: SlotShape, params, rows: NewRows) -> tuple[KVCache, Tokens, Array]:
    """Prefill short prompts as :func:`admit` does and choose their first tokens, leaving the slots
    alone (on the prefill devices): their cache, first tokens and seen ids, for :func:`place`."""
    cache, logits = _prompt_cache(shape, params, rows)
    return (cache, *first_tokens(shape, logits, rows))


def new_cache(shape: SlotShape, columns: int) -> KVCache:
    """An empty one-row cache of ``columns`` columns, for a long prompt prefilled chunk by chunk."""
    return KVCache.empty(shape.config, 1, columns)


def chunk(shape: SlotShape, params, cache: KVCache, prompt, length, start, adapter) -> tuple[KVCache, Array]:
    """Prefill the chunk of ``prompt`` [1, P] (left-padded, ``length`` real tokens, adapter
    ``adapter``) that starts at column ``start``: the cache, and the logits of its last column."""
    return _prefill_window(shape, params, cache, prompt, length, start, shape.chunk, jnp.reshape(adapter, (1,)))


def _prefill_window(shape: SlotShape, params, cache: KVCache, prompt, lengths, start, width: int, adapter):
    """Prefill columns ``start … start+width−1`` of prompts [b, P] (left-padded, ``lengths`` real
    tokens each, adapters ``adapter`` [b]) into ``cache``, which holds every real column before
    ``start``: the cache, and the logits of the last column."""
    columns = prompt.shape[1]
    tokens = lax.dynamic_slice_in_dim(prompt, start, width, axis=1)
    index = start + jnp.arange(width)[None, :]
    padding = columns - jnp.reshape(lengths, (-1, 1))
    segments, positions = (index >= padding).astype(jnp.int32), jnp.maximum(index - padding, 0)
    logits, cache = _apply(
        shape,
        params,
        tokens,
        positions,
        segments,
        cache.replace(index=jnp.asarray(start, jnp.int32)),
        last_logits_only=True,
        adapter=adapter,
        method=GPTJ.decode,
    )
    return cache, logits[:, -1]


def _gather_pages(pool: tuple[Array, ...], pages: Array, slots: Array, slot_axis: int) -> Array:
    """The entries at ``slots`` of pool-wide ``pages`` (both [b, C]) of one layer's pool blocks:
    [b, C, …] (the page's other axes, without ``slot_axis``); zero where a page is past the pool."""
    out, start = None, 0
    for block in pool:
        n = block.shape[0]
        local = pages - start
        inside = (local >= 0) & (local < n)
        got = block[(jnp.clip(local, 0, n - 1), *[slice(None)] * (slot_axis - 1), slots)]
        got = jnp.where(inside.reshape(*inside.shape, *[1] * (got.ndim - 2)), got, jnp.zeros((), got.dtype))
        out = got if out is None else out + got
        start += n
    assert out is not None
    return out


def _gather_prefix(shape: SlotShape, pool: PagedKVCache, cache: KVCache, sources, lengths, cached) -> KVCache:
    """``cache`` [b, C] of prompts left-padded to C columns (``lengths`` real tokens) with each
    row's first ``cached`` tokens' keys and values copied from the pool pages ``sources`` [b, n]
    names (in order), and those columns marked as real tokens."""
    b, columns = cache.segment_ids.shape
    token = jnp.arange(columns)[None, :] - (columns - lengths)[:, None]  # the token each column holds
    hit = (token >= 0) & (token < cached[:, None])
    token = jnp.clip(token, 0, sources.shape[1] * shape.page - 1)
    pages = jnp.where(hit, jnp.take_along_axis(sources, token // shape.page, axis=1), shape.pages)
    slots = token % shape.page

    def take(pools, dense, slot_axis):
        def one(layer_pool, layer):
            got = jnp.moveaxis(_gather_pages(layer_pool, pages, slots, slot_axis), 1, slot_axis)
            where = jnp.expand_dims(hit, tuple(a for a in range(1, layer.ndim) if a != slot_axis))
            return jnp.where(where, got.astype(layer.dtype), layer)

        return tuple(one(p, d) for p, d in zip(pools, dense, strict=True))

    return cache.replace(
        k=take(pool.k, cache.k, 3),
        v=take(pool.v, cache.v, 2),
        k_scale=take(pool.k_scale, cache.k_scale, 2),
        v_scale=take(pool.v_scale, cache.v_scale, 2),
        segment_ids=jnp.where(hit, 1, cache.segment_ids),
    )


def cached_prompt(shape: SlotShape, pool: PagedKVCache, sources, length, cached, *, columns: int) -> KVCache:
    """A one-row cache of ``columns`` columns for a long prompt of ``length`` tokens (left-padded),
    its first ``cached`` tokens' keys and values copied from the pool pages ``sources`` [1, n] names:
    :func:`chunk` then prefills the rest."""
    cache = KVCache.empty(shape.config, 1, columns)
    return _gather_prefix(shape, pool, cache, sources, jnp.reshape(length, (1,)), jnp.reshape(cached, (1,)))


def admit_cached(
    shape: SlotShape, params, pool: PagedKVCache, rows: NewRows, sources, cached, *, window: int
) -> tuple[Pages, Array, Array]:
    """:func:`admit` of prompts whose first ``cached`` [b] tokens are in the pool pages ``sources``
    [b, n] names: those are copied, and only the last ``window`` columns (which hold every token
    past them) are prefilled."""
    b, columns = rows.tokens.shape
    cache = _gather_prefix(shape, pool, KVCache.empty(shape.config, b, columns), sources, rows.lengths, cached)
    cache, logits = _prefill_window(
        shape, params, cache, rows.tokens, rows.lengths, columns - window, window, rows.adapter
    )
    return _cut(shape, cache, rows), _prompt_ids(shape, rows), logits


def insert_pages(shape: SlotShape, state: SlotState, pages: Pages, rows: NewRows, seen, table) -> SlotState:
    """Write prompts cut into ``pages`` into their slots, with their settings and ``seen`` ids;
    :func:`first` then chooses their first tokens. A program of its own, compiled once per count of
    rows (every short prompt is cut into :attr:`SlotShape.short_pages` pages), rather than a part of
    every prefill's (``rows.tokens`` may be None: the prompts themselves are not needed)."""
    return _write(shape, state, pages, rows, seen, table)


def insert(shape: SlotShape, state: SlotState, cache: KVCache, rows: NewRows, table) -> SlotState:
    """Move a prefilled prompt's cache into its slot, as :func:`insert_pages` does (for prompts
    prefilled chunk by chunk, whose cache holds every column of the slot)."""
    return _write(shape, state, _cut(shape, cache, rows), rows, _prompt_ids(shape, rows), table)


def first(shape: SlotShape, state: SlotState, logits, slot) -> tuple[SlotState, Tokens]:
    """Choose the first tokens of the prompts just inserted into ``slot`` [b], from their last logits
    [b, V], with the settings the slots hold for them. A program of its own, compiled once per count
    of rows, rather than a part of every prefill's: sampling costs as much to compile as a prefill
    of the model (a row whose slot is out of range reads another's settings and changes nothing).
    ``state`` comes without its cache, which this program has no need to pass through."""
    row = jax.tree.map(lambda x: x[jnp.clip(slot, 0, shape.slots - 1)], state)
    tokens, seen = _first(
        shape, logits, row.sampling, row.seen, row.seeds, row.want_top, row.max_new_tokens, row.eos_id
    )
    return _put_first(state, slot, tokens).replace(seen=_put_rows(slot, state.seen, seen)), tokens


def first_tokens(shape: SlotShape, logits, rows: NewRows) -> tuple[Tokens, Array]:
    """The first tokens of prefilled prompts, and the ids each row has seen (on a prefill decoder,
    for :func:`place`)."""
    r = rows
    return _first(shape, logits, r.sampling, _prompt_ids(shape, r), r.seeds, r.want_top, r.max_new_tokens, r.eos_id)


def _prompt_ids(shape: SlotShape, rows: NewRows) -> Array:
    """The ids each prompt holds [b, V], for the repetition penalty."""
    b, columns = rows.tokens.shape
    real = jnp.arange(columns)[None, :] >= (columns - rows.lengths)[:, None]
    return jnp.zeros((b, shape.config.vocab_size), bool).at[jnp.arange(b)[:, None], rows.tokens].max(real)


def _first(shape: SlotShape, logits, sampling, seen, seeds, want_top, max_new_tokens, eos_id) -> tuple[Tokens, Array]:
    """Each row's first token from its last logits, given the ids it has seen; and those ids with it."""
    b = logits.shape[0]
    token, logprob, top_ids, top_values = _choose(
        shape, logits, sampling, seen, seeds, jnp.zeros((b,), jnp.int32), want_top
    )
    seen = seen.at[jnp.arange(b), token].set(True)
    running = jnp.where(max_new_tokens <= 1, LENGTH, RUNNING)
    tokens = Tokens(
        tokens=token[:, None],
        logprobs=logprob[:, None],
        top_ids=top_ids[:, None],
        top_logprobs=top_values[:, None],
        finish=jnp.where(token == eos_id, EOS, running).astype(jnp.int32),
        num_generated=jnp.ones((b,), jnp.int32),
    )
    return tokens, seen


def _paged(new: Array, source: Array, pages: int, page: int, axis: int) -> Array:
    """The rows of ``new`` (a prompt cache's buffer, its columns at ``axis``) rotated by ``source``
    [b, kept] (real tokens first) and cut into pages: [b·pages, …] with the page's columns at ``axis``."""
    b, kept = source.shape
    shape = [1] * new.ndim
    shape[0], shape[axis] = b, kept
    new = jnp.take_along_axis(new, source.reshape(shape), axis=axis)
    padding = [(0, 0)] * new.ndim
    padding[axis] = (0, pages * page - kept)
    new = jnp.pad(new, padding)
    new = jnp.moveaxis(new.reshape(*new.shape[:axis], pages, page, *new.shape[axis + 1 :]), axis, 1)
    return new.reshape(b * pages, *new.shape[2:])


def place(shape: SlotShape, state: SlotState, cache: KVCache, rows: NewRows, first: Tokens, seen, table) -> SlotState:
    """Write prompts prefilled on a prefill decoder (real tokens first) and their first tokens into
    their slots, as :func:`insert` and :func:`first` do on the slots' own devices."""
    return _put_first(_write(shape, state, _cut(shape, cache, rows), rows, seen, table), rows.slot, first)


def _put_rows(slot, big: Array, new: Array) -> Array:
    """``new`` [b, …] written into the rows ``slot`` [b] of ``big``; a slot out of range writes nothing."""
    return big.at[slot].set(new.astype(big.dtype), mode="drop")


def _put_first(state: SlotState, slot, first: Tokens) -> SlotState:
    """The sequences in ``slot`` [b] given their first tokens ``first``."""
    return state.replace(
        last=_put_rows(slot, state.last, first.tokens[:, 0]),
        num_generated=_put_rows(slot, state.num_generated, first.num_generated),
        finish=_put_rows(slot, state.finish, first.finish),
    )


def _cut(shape: SlotShape, cache: KVCache, rows: NewRows) -> Pages:
    """A prompt cache (``rows``' prompts left-padded) cut into pages, real tokens first."""
    columns = rows.tokens.shape[1]
    kept = min(columns, shape.length)  # a prompt never needs more columns than a row has
    # A padding page lies past the pages its row holds, where the page table names the pool's end:
    # writing it writes nothing.
    pages = max(-(-kept // shape.page), shape.short_pages)
    # row j's real tokens sit in its last lengths[j] columns: rotate them to the front
    source = (jnp.arange(kept)[None, :] + (columns - rows.lengths)[:, None]) % columns

    def cut(buffers, axis):
        return tuple(_paged(x, source, pages, shape.page, axis) for x in buffers)

    # an int8 cache's scales, [rows, heads, columns], move with the keys and values they scale
    return Pages(k=cut(cache.k, 3), v=cut(cache.v, 2), k_scale=cut(cache.k_scale, 2), v_scale=cut(cache.v_scale, 2))


def _write(shape: SlotShape, state: SlotState, new: Pages, rows: NewRows, seen, table) -> SlotState:
    """Write prompts cut into pages into their slots with their settings and ``seen`` ids, the
    pages into those ``table`` names for those slots. Rows whose slot is out of range (batch
    padding, or a row not to be placed) change nothing."""
    pages = new.k[0].shape[0] // rows.slot.shape[0]
    inside = (rows.slot >= 0) & (rows.slot < shape.slots)
    targets = jnp.where(inside[:, None], table[jnp.where(inside, rows.slot, 0), :pages], shape.pages).reshape(-1)

    def put(pools, new):
        return tuple(write_pool(pool, targets, None, x, 0) for pool, x in zip(pools, new, strict=True))

    put_rows = functools.partial(_put_rows, rows.slot)
    old = state.cache
    paged = PagedKVCache(
        k=put(old.k, new.k),
        v=put(old.v, new.v),
        index=put_rows(old.index, rows.lengths),
        k_scale=put(old.k_scale, new.k_scale),
        v_scale=put(old.v_scale, new.v_scale),
    )
    row_values = {
        "max_new_tokens": rows.max_new_tokens,
        "eos_id": rows.eos_id,
        "seeds": rows.seeds,
        "seen": seen,
        "want_top": rows.want_top,
        "adapter": rows.adapter,
    }
    return state.replace(
        cache=paged,
        sampling=jax.tree.map(put_rows, state.sampling, rows.sampling),
        **{name: put_rows(getattr(state, name), value) for name, value in row_values.items()},
    )


def _jit(fn: Callable, shape: SlotShape, *, static: tuple[str, ...] = (), donate: tuple[str, ...] = (), **jit) -> Any:
    """``jax.jit`` of ``fn`` with ``shape`` bound (``static`` static, ``donate`` donated; ``jit``: more
    of its options), the shape's logical rules in force while it is traced (they are no part of
    JAX's cache key)."""
    bound = functools.partial(fn, shape)

    @functools.wraps(fn)
    def under_rules(*args, **kwargs):
        with nn.logical_axis_rules(shape.rules):
            return bound(*args, **kwargs)

    under_rules.__signature__ = inspect.signature(bound)  # what jit reads argument names from
    return jax.jit(under_rules, static_argnames=static, donate_argnames=donate, **jit)


class SlotPrograms:
    """The slot programs for one shape, each the ``jax.jit`` of the function of its name with the
    shape bound. Compiled programs live as long as this object: a :class:`~gptj_flax.sampling.slots.Slots`
    keeps its on its decoder, so that every Slots of one decoder and shape shares them and none is
    freed while the decoder lives (XLA:CPU maps each compiled kernel into memory, and a process
    may hold only so many maps: a cache for the process's life would keep every model's)."""

    def __init__(self, shape: SlotShape):
        self.shape = shape
        # Every program that hands back the state hands it back as the state's specs lay it out (the
        # tokens replicated), so each program sees the state alike whichever ran before it: the
        # compiler's own choice differs from program to program, and so would the programs' cache keys.
        state, rest = state_specs(shape), state_specs(shape).replace(cache=None)
        self.empty_state = _jit(empty_state, shape, out_shardings=state)
        self.decode = _jit(decode, shape, static=("rows",), donate=("state",), out_shardings=(state, None))
        self.admit = _jit(admit, shape)
        self.prefill = _jit(prefill, shape)
        # a long prompt's cache is replicated, whether it starts empty or with cached pages
        self.new_cache = _jit(new_cache, shape, static=("columns",), out_shardings=PartitionSpec())
        self.chunk = _jit(chunk, shape, donate=("cache",), out_shardings=PartitionSpec())
        self.insert = _jit(insert, shape, donate=("state",), out_shardings=state)
        self.insert_pages = _jit(insert_pages, shape, donate=("state",), out_shardings=state)
        self.first = _jit(first, shape, donate=("state",), out_shardings=(rest, None))
        self.first_tokens = _jit(first_tokens, shape)
        self.place = _jit(place, shape, donate=("state",), out_shardings=state)
        self.cached_prompt = _jit(cached_prompt, shape, static=("columns",), out_shardings=PartitionSpec())
        self.admit_cached = _jit(admit_cached, shape, static=("window",))

    def compilations(self) -> int:
        """Programs compiled so far, for checking that nothing recompiles as requests come and go."""
        programs = (self.empty_state, self.decode, self.admit, self.prefill, self.new_cache, self.chunk)
        more = (
            self.insert,
            self.insert_pages,
            self.first,
            self.first_tokens,
            self.place,
            self.cached_prompt,
            self.admit_cached,
        )
        return sum(f._cache_size() for f in (*programs, *more))
