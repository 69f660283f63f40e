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

With the *prefix cache* (:mod:`gptj_flax.sampling.prefix_cache`), the full pages of prompts stay in
the pool after their sequences end, and a new prompt that starts with cached pages copies them into
its own and prefills only the rest: the last columns of a short prompt (:meth:`Slots._window`), or
the chunks of a long one past the cached pages.

With a *prefill decoder* (the same parameters on a mesh of other devices), new prompts are
prefilled there, beside the decode step running here, and their first tokens chosen there
(:meth:`Slots.dispatch_prefill`); :meth:`Slots.place` then moves the prefilled rows into free slots
between two steps, which costs a copy, not a prefill.

The device programs are in :mod:`gptj_flax.sampling.slot_programs`, pure functions of a
:class:`~gptj_flax.sampling.slot_programs.SlotShape`; this module is their host side: the page
table, what is dispatched when, and the warm-up.

Draws are those of :meth:`Decoder.start`: a row's ``n``-th token uses ``fold_in(key(seed), n)``,
so a sequence comes out the same in a slot as in a batch of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from gptj_flax import partitioning
from gptj_flax.model import KVCache
from gptj_flax.sampling.adapter_bank import AdapterBank
from gptj_flax.sampling.decoding import Decoder, bucket
from gptj_flax.sampling.memory_maps import MapBudget
from gptj_flax.sampling.multihost import to_device, to_host
from gptj_flax.sampling.prefix_cache import PrefixCache, PromptCounts
from gptj_flax.sampling.samplers import SamplingParams
from gptj_flax.sampling.slot_programs import NewRows, SlotPrograms, SlotShape, SlotState, Tokens

Array = jax.Array

MAX_PREFILL_ROWS = 8  # prompts prefilled together; more would stall decoding for longer


@dataclasses.dataclass
class Request:
    """One sequence to insert: its prompt (token ids) and settings."""

    tokens: list[int]
    max_new_tokens: int
    eos_id: int  # -1: do not stop at EOS
    seed: int
    sampling: SamplingParams  # host settings of one row
    want_top: bool = False
    adapter: int = 0  # the row of the slots' adapter bank it applies (0: none, the base)


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
    rows: NewRows  # on the host: the prompts, left-padded (rows past the requests are padding), and settings
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

    def __init__(self, rows: int, per_row: int, page: int, prefix: PrefixCache | None = None):
        self.page, self.per_row, self.pages = page, per_row, rows * per_row
        self.prefix = prefix
        self.ids = np.full((rows, per_row), self.pages, np.int32)
        self.held = np.zeros(rows, np.int64)
        self.reach = np.zeros(rows, np.int64)
        self._free = list(range(self.pages))  # a heap: the lowest free page first

    def start(self, row: int, length: int, keys: Sequence[bytes] = ()) -> None:
        """Row ``row`` now holds a new sequence of ``length`` slots (its old pages return to the pool).
        ``keys``: the prefix-cache keys of its prompt's full pages, which its first pages will hold."""
        self.free(row)
        self.grow(row, length)
        if self.prefix is not None:
            for i, key in enumerate(keys):
                self.prefix.add(key, int(self.ids[row, i]))

    def grow(self, row: int, slots: int) -> None:
        """Let row ``row``'s sequence reach ``slots`` more slots (never past its last page)."""
        self.reach[row] = min(self.reach[row] + slots, self.per_row * self.page)
        while self.held[row] * self.page < self.reach[row]:
            self.ids[row, self.held[row]] = self._take()
            self.held[row] += 1

    def _take(self) -> int:
        """The lowest free page, or else the least recently used cached page that no row holds."""
        if self._free:
            return heapq.heappop(self._free)
        page = None if self.prefix is None else self.prefix.evict()
        if page is None:  # the pool holds every row's whole length: it cannot run out
            raise RuntimeError("the page pool is exhausted")
        return page

    def free(self, row: int) -> None:
        """Row ``row``'s sequence has ended: its pages return to the pool, its cached ones stay cached."""
        for page in self.ids[row, : self.held[row]]:
            if self.prefix is None or not self.prefix.release(int(page)):
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
    """Decode slots over one slot cache, for a :class:`Decoder`'s model and parameters: the host side
    of :mod:`~gptj_flax.sampling.slot_programs` (the page table, what is dispatched when, the warm-up).

    Args:
      decoder: gives the model, its placed parameters, the mesh and the valid vocabulary.
      slots: rows of the cache (rounded up to a multiple of the mesh's data-parallel size).
      length: columns per row: the longest prompt + completion one sequence may have.
      chunk: prompts longer than this are prefilled in chunks of this many tokens (a power of two).
      steps: the most decode steps one :meth:`decode` call runs.
      top_logprobs: how many alternatives a row that asks for them gets for each token.
      prefill: the same model on other devices, to prefill new prompts on beside the decode steps
        (:meth:`dispatch_prefill`, :meth:`place`); without one, :meth:`admit` prefills between them.
      prefix_cache: keep the full pages of prompts in the pool, and copy them into the rows of new
        prompts that start with them instead of prefilling those tokens again
        (:mod:`~gptj_flax.sampling.prefix_cache`); not with a prefill decoder, whose devices do not
        hold the pool.
      adapters: a bank of served adapters (:mod:`~gptj_flax.sampling.adapter_bank`) on the decoder's
        mesh: each request applies the one its ``adapter`` names, in the same batch as any other;
        not with a prefill decoder.
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
        prefix_cache: bool = False,
        adapters: AdapterBank | None = None,
    ):
        if prefill is not None and set(prefill.mesh.devices.flat) & set(decoder.mesh.devices.flat):
            raise ValueError("the prefill decoder's devices must be other than the decode slots'")
        if prefill is not None and prefix_cache:
            raise ValueError("the prefix cache lives in the decode slots' pool: it cannot serve a prefill decoder")
        if prefill is not None and adapters is not None:
            raise ValueError("the adapter bank lives on the decode slots' devices: it cannot serve a prefill decoder")
        self.prefix_cache, self.adapters = prefix_cache, adapters
        self.counts = PromptCounts()  # prompt tokens admitted, and those prefilled
        self.decoder, self.config, self.prefill = decoder, decoder.config, prefill
        self._prefiller = decoder if prefill is None else prefill  # where prompts are prefilled
        self.shape = SlotShape.build(
            decoder.config,
            slots=slots,
            length=length,
            chunk=chunk,
            steps=steps,
            top_logprobs=top_logprobs,
            page=decoder.page_columns,
            batch_multiple=decoder.batch_multiple,
            valid_vocab=decoder.valid_vocab,
            rules=decoder.rules,
            adapters=None if adapters is None else adapters.slots,
        )
        shape = self.shape
        # The programs depend on the shape alone (the parameters and state are arguments), so every
        # Slots of one decoder and shape shares them, as its Decoder's programs are shared: a new
        # server on a loaded model compiles nothing new, and no compiled program is freed while one
        # compiles (servers that each freed their own crashed XLA compiles).
        if shape not in decoder.slot_programs:
            decoder.slot_programs[shape] = SlotPrograms(shape)
        self.programs: SlotPrograms = decoder.slot_programs[shape]
        self.slots, self.length, self.chunk, self.steps = shape.slots, shape.length, shape.chunk, shape.steps
        self.page, self.blocks = shape.page, shape.blocks
        self._rows = partitioning.named_sharding(decoder.mesh, ("batch",), decoder.rules)
        self.reset()

    def _on(self, decoder: Decoder) -> contextlib.AbstractContextManager:
        """The scope in which a program runs on ``decoder``'s devices."""
        return partitioning.sharding_scope(decoder.mesh, decoder.rules)

    def _weights(self, decoder: Decoder) -> Any:
        """What the programs take as parameters: ``decoder``'s, with the bank's arrays if there is one."""
        return decoder.params if self.adapters is None else (decoder.params, self.adapters.arrays)

    def _keys(self, request: Request, tokens: Sequence[int]) -> list[bytes]:
        """The prefix-cache keys of ``tokens`` (of ``request``'s prompt): its adapter's are its own."""
        assert self.prefix is not None
        salt = b"" if self.adapters is None else self.adapters.salt(request.adapter)
        return self.prefix.keys(tokens, salt)

    def reset(self) -> None:
        """Empty every slot (a fresh cache and state)."""
        self.prefix = PrefixCache(self.page) if self.prefix_cache else None
        self.table = PageTable(self.slots, self.shape.per_row, self.page, self.prefix)
        with self._on(self.decoder):
            self.state: SlotState = self.programs.empty_state()

    # -- new sequences -----------------------------------------------------------------------
    def prompt_columns(self, n: int) -> int:
        """Columns a prompt of ``n`` tokens is prefilled in: a power of two (at least 16)."""
        return bucket(n)

    def _new_rows(self, requests: list[Request], tokens: np.ndarray, lengths: np.ndarray, slots) -> NewRows:
        """``requests`` as rows: their prompts ``tokens`` [b, P] (left-padded; rows past the requests
        are padding) of ``lengths``, their settings, and the ``slots`` they go to (None or past the
        last: none)."""
        rows, n = len(tokens), len(requests)

        def pad(values, dtype, fill=0):
            out = np.full(rows, fill, dtype)
            out[:n] = values
            return out

        sampling = jax.tree.map(lambda *xs: np.concatenate(xs), *(r.sampling for r in requests))
        return NewRows(
            tokens=tokens,
            lengths=lengths,
            slot=pad([self.slots if s is None else s for s in slots], np.int32, self.slots),
            max_new_tokens=pad([r.max_new_tokens for r in requests], np.int32),
            eos_id=pad([r.eos_id for r in requests], np.int32, -1),
            seeds=pad([r.seed for r in requests], np.uint32),
            sampling=sampling.pad_to(rows),
            want_top=pad([r.want_top for r in requests], bool, False),
            adapter=pad([r.adapter for r in requests], np.int32),
        )

    def _prompts(self, requests: list[Request], slots) -> NewRows:
        """Short prompts left-padded into [rows, columns] (rows a power of two), bound for ``slots``."""
        rows = bucket(len(requests), 1)
        columns = max(self.prompt_columns(len(r.tokens)) for r in requests)
        tokens = np.zeros((rows, columns), np.int32)
        lengths = np.zeros(rows, np.int32)
        for i, r in enumerate(requests):
            tokens[i, columns - len(r.tokens) :] = r.tokens
            lengths[i] = len(r.tokens)
        return self._new_rows(requests, tokens, lengths, slots)

    def _start(self, requests: list[Request], slots: list[int | None]) -> np.ndarray:
        """Give each of ``slots`` (None or past the last: none) pages for its new request's prompt;
        the page table, for the call that writes them."""
        for request, slot in zip(requests, slots, strict=True):
            if slot is not None and 0 <= slot < self.slots:
                keys = self._keys(request, request.tokens) if self.prefix is not None else ()
                self.table.start(slot, len(request.tokens), keys)
        return self.table.ids.copy()  # the call may read it after the host has moved on

    def _hits(self, request: Request) -> list[int]:
        """The cached pages that hold the first full pages of ``request``'s prompt (never its last
        token: its logits are needed)."""
        if self.prefix is None:
            return []
        n = len(request.tokens)
        return self.prefix.match(self._keys(request, request.tokens[: (n - 1) // self.page * self.page]))

    def _sources(self, hits: list[list[int]], rows: int) -> tuple[np.ndarray, np.ndarray]:
        """``hits`` as program arguments: each row's cached pages [rows, per_row] (the pool's end
        past them) and how many of its tokens they hold [rows]."""
        sources = np.full((rows, self.shape.per_row), self.shape.pages, np.int32)
        cached = np.zeros(rows, np.int32)
        for i, pages in enumerate(hits):
            sources[i, : len(pages)] = pages
            cached[i] = len(pages) * self.page
        return sources, cached

    def _window(self, rows: NewRows, hits: list[list[int]]) -> int:
        """The last columns of ``rows``' prompts that :meth:`dispatch_admit` prefills: every column
        when nothing is cached, else a power of two that holds every token past the cached ones
        (at least a quarter of the columns, to compile few programs)."""
        columns = rows.tokens.shape[1]
        uncached = max(int(n) - len(pages) * self.page for n, pages in zip(rows.lengths, hits, strict=False))
        return min(columns, max(bucket(uncached), columns // 4))

    def _count(self, lengths, prefilled) -> None:
        self.counts.prompt += int(sum(lengths))
        self.counts.prefilled += int(sum(prefilled))

    def free(self, slots: list[int]) -> None:
        """The sequences in ``slots`` have ended: their pages return to the pool. A row that may still
        be running must be in the ``release`` of the next decode call, which stops it before its
        step writes anything (so a later call may already have given its pages to another row)."""
        for slot in slots:
            self.table.free(slot)

    def admit(self, requests: list[Request], slots: list[int]) -> Tokens:
        """Prefill short prompts (at most ``chunk`` columns) together and insert them into ``slots``."""
        return self.dispatch_admit(requests, slots).result()

    def dispatch_admit(self, requests: list[Request], slots: list[int]) -> Pending:
        """:meth:`admit`, returning as soon as the call is queued on the device."""
        rows = self._prompts(requests, slots)
        hits = [self._hits(r) for r in requests]  # before _start, which may evict idle cached pages
        window = self._window(rows, hits)
        table = self._start(requests, slots)
        lengths = [len(r.tokens) for r in requests]
        self._count(lengths, [min(n, window) for n in lengths])
        with self._on(self.decoder):
            if window == rows.tokens.shape[1]:
                prefilled = self.programs.admit(self._weights(self.decoder), rows)
            else:
                sources, cached = self._sources(hits, len(rows.tokens))
                prefilled = self.programs.admit_cached(
                    self._weights(self.decoder), self.state.cache, rows, sources, cached, window=window
                )
        return self._insert(prefilled, rows, table, len(requests))

    def _insert(self, prefilled: tuple, rows: NewRows, table: np.ndarray, n: int) -> Pending:
        """Write short prompts, ``prefilled`` as :func:`~gptj_flax.sampling.slot_programs.admit`
        returns them, into their slots and choose their first tokens."""
        pages, seen, logits = prefilled
        with self._on(self.decoder):
            self.state = self.programs.insert_pages(self.state, pages, rows.replace(tokens=None), seen, table)
        return self._first(logits, rows, n)

    def _first(self, logits, rows: NewRows, n: int) -> Pending:
        """Choose the first tokens of ``rows``, just inserted, from their last ``logits``."""
        with self._on(self.decoder):
            rest, first = self.programs.first(self.state.replace(cache=None), logits, rows.slot)
        self.state = rest.replace(cache=self.state.cache)
        return Pending(first, n)

    def dispatch_prefill(self, requests: list[Request]) -> Prefilled:
        """Prefill short prompts together on the prefill decoder and choose their first tokens
        (``.pending``), leaving the slots as they are: :meth:`place` puts them in."""
        if self.prefill is None:
            raise ValueError("these slots have no prefill decoder: admit() prefills between decode steps")
        rows = self._prompts(requests, [None] * len(requests))
        lengths = [len(r.tokens) for r in requests]
        self._count(lengths, lengths)
        with self._on(self.prefill):
            cache, first, seen = self.programs.prefill(self._weights(self.prefill), rows)
        return Prefilled(requests, rows, cache, first, seen)

    def dispatch_first(self, prefill: Prefill) -> Prefilled:
        """A long prompt prefilled chunk by chunk on the prefill decoder: its first token, to :meth:`place`."""
        if self.prefill is None:
            raise ValueError("these slots have no prefill decoder: insert() finishes a prefill between decode steps")
        rows = self._long_prompt(prefill, None)
        with self._on(self.prefill):
            first, seen = self.programs.first_tokens(prefill.logits, rows)
        return Prefilled([prefill.request], rows, prefill.cache, first, seen)

    def place(self, prefilled: Prefilled, slots: list[int | None]) -> None:
        """Put prefilled prompts into ``slots`` (one per request; None: not placed, as for a row that
        ended at its first token or whose client left), queued behind the decode step in flight."""
        moved = jax.device_put(
            (prefilled.cache, prefilled.first, prefilled.seen), NamedSharding(self.decoder.mesh, PartitionSpec())
        )
        cache, first, seen = moved
        old = prefilled.rows
        rows = self._new_rows(prefilled.requests, old.tokens, old.lengths, slots)
        table = self._start(prefilled.requests, slots)
        with self._on(self.decoder):
            self.state = self.programs.place(self.state, cache, rows, first, seen, table)

    def _long_prompt(self, prefill: Prefill, slot: int | None) -> NewRows:
        lengths = np.array([len(prefill.request.tokens)], np.int32)
        return self._new_rows([prefill.request], prefill.tokens, lengths, [slot])

    def start_prefill(self, request: Request) -> Prefill:
        """A long prompt's prefill, to be advanced with :meth:`prefill_chunk` until done."""
        n = len(request.tokens)
        columns = self.prompt_columns(n)
        tokens = np.zeros((1, columns), np.int32)
        tokens[0, columns - n :] = request.tokens
        hits = self._hits(request)
        # chunks of padding only, or of cached tokens only, are skipped
        first = (columns - n + len(hits) * self.page) // self.chunk * self.chunk
        self._count([n], [min(n, columns - first)])
        with self._on(self._prefiller):
            if hits:
                sources, cached = self._sources([hits], 1)
                cache = self.programs.cached_prompt(self.state.cache, sources, np.int32(n), cached[0], columns=columns)
            else:
                cache = self.programs.new_cache(columns)
        return Prefill(request, tokens, first, cache)

    def prefill_chunk(self, prefill: Prefill) -> None:
        with self._on(self._prefiller):
            prefill.cache, prefill.logits = self.programs.chunk(
                self._weights(self._prefiller),
                prefill.cache,
                prefill.tokens,
                np.int32(len(prefill.request.tokens)),
                np.int32(prefill.next_column),
                np.int32(prefill.request.adapter),
            )
        prefill.next_column += self.chunk

    def insert(self, prefill: Prefill, slot: int) -> Tokens:
        """Insert a finished :class:`Prefill` into ``slot`` and choose its first token."""
        return self.dispatch_insert(prefill, slot).result()

    def dispatch_insert(self, prefill: Prefill, slot: int) -> Pending:
        """:meth:`insert`, returning as soon as the call is queued on the device."""
        rows = self._long_prompt(prefill, slot)
        table = self._start([prefill.request], [slot])
        with self._on(self.decoder):
            self.state = self.programs.insert(self.state, prefill.cache, rows, table)
        return self._first(prefill.logits, rows, 1)

    # -- decode steps ------------------------------------------------------------------------
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
        return self._run(release, steps, self.busy_rows(highest))

    def wait(self) -> None:
        """Block until every call dispatched so far has finished."""
        self.state.finish.block_until_ready()

    def _run(self, release: list[int], steps: int, rows: int) -> Pending:
        stop = np.zeros(self.slots, bool)
        stop[release] = True
        with self._on(self.decoder):
            self.state, out = self.programs.decode(
                self._weights(self.decoder),
                self.state,
                to_device(stop, self._rows),
                np.int32(steps),
                self.table.ids.copy(),
                rows=rows,
            )
        return Pending(out, rows)

    # -- warm-up -----------------------------------------------------------------------------
    def warm_up(self, stop: Callable[[], bool] = lambda: False) -> bool:
        """Compile every program a request can need: nothing compiles once requests come. ``stop`` is
        asked before each program (a compile cannot be cut short); False if it said stop. Raises
        :class:`~gptj_flax.sampling.memory_maps.MemoryMapLimit` before a program that could take
        the process past the kernel's limit on memory maps."""
        budget = MapBudget.of_this_process()
        done = True
        for _ in self._compile_each():
            budget.check("the warm-up stopped")
            if stop():
                done = False
                break
        self.counts = PromptCounts()  # the warm-up's prompts are no requests'
        return done

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
                    if self.prefix is not None and columns > self.page:
                        yield from self._compile_cached([request] * rows, nowhere[:rows])
            else:
                yield
                if self.prefix is not None:
                    sources, cached = self._sources([[]], 1)
                    with self._on(self.decoder):
                        self.programs.cached_prompt(self.state.cache, sources, np.int32(1), cached[0], columns=columns)
                prefill = self.start_prefill(request)
                self.prefill_chunk(prefill)
                if self.prefill is None:
                    self.insert(prefill, self.slots)
                else:
                    self.place(self.dispatch_first(prefill), [None])
            self.wait()
        for rows in sorted({self.busy_rows(s) for s in range(self.slots)}):
            yield
            self._run([], 1, rows).result()

    def _compile_cached(self, requests: list[Request], nowhere: list[int]) -> Iterator[None]:
        """Compiles :meth:`dispatch_admit`'s programs for prompts with cached pages: one for each
        window it may prefill of ``requests``' columns (placed ``nowhere``, they change nothing)."""
        rows = self._prompts(requests, nowhere)
        columns = rows.tokens.shape[1]
        sources, cached = self._sources([], len(rows.tokens))
        for window in sorted({w for w in (max(bucket(1), columns // 4), columns // 2) if bucket(1) <= w < columns}):
            yield
            with self._on(self.decoder):
                prefilled = self.programs.admit_cached(
                    self._weights(self.decoder), self.state.cache, rows, sources, cached, window=window
                )
            self._insert(prefilled, rows, self.table.ids.copy(), len(requests)).result()

    def compilations(self) -> int:
        """Programs compiled so far (for this decoder and shape, and the adapter bank's), for
        checking that nothing recompiles as requests come and go."""
        return self.programs.compilations() + (0 if self.adapters is None else self.adapters.compilations())
