"""Deterministic, resumable, per-process batches: the global order and who reads what.

**Global order** (a function of ``seed`` and the epoch only, never of the process count):

1. Each epoch permutes the source's shards (TFRecord files, or in-memory chunks) with a seeded
   RNG and concatenates them: positions ``0 … N-1``.
2. The global batch has ``B`` rows. Row ``r`` is a *lane*: the contiguous stretch of positions
   ``[r·L, (r+1)·L)`` with ``L = steps_per_epoch · grad_accum`` and
   ``steps_per_epoch = ceil(N / (B · grad_accum))``. Positions past ``N`` wrap to the epoch's start,
   so nothing is dropped and fewer than ``B · grad_accum`` sequences repeat per epoch (a source
   smaller than one batch still works).
3. Each lane is shuffled within consecutive blocks of ``shuffle_buffer`` sequences, each block by
   its own seeded permutation.
4. Step ``t`` takes items ``t·grad_accum … (t+1)·grad_accum - 1`` of every lane: micro-batch ``j``,
   row ``r`` is item ``t·grad_accum + j`` of lane ``r``.

**Sharing**: process ``p`` of ``P`` owns rows ``[p·B/P, (p+1)·B/P)``, i.e. lanes that form one
contiguous stretch of the epoch's files, so each host opens only the files of its own share.

**Resume**: the state is ``(seed, epoch, step in epoch)`` plus the shape it was made with. Restoring
recomputes the permutations and re-reads only the current block of each lane (skipping records
inside at most one file per lane), so the next batch is bit-identical to an uninterrupted run's.

Trade-off: full random access over the whole corpus (a global sequence permutation) would shuffle
better but needs every record addressable, which TFRecord files are not without re-reading them.
File-level permutation plus per-lane block shuffles is the usual streaming compromise: batch rows
come from ``B`` far-apart places in the data, and consecutive batches of a lane are mixed within
``shuffle_buffer`` sequences. Memory is ``B/P · shuffle_buffer · (seq_len + 1)`` int32 per process.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
from collections.abc import Generator, Mapping, Sequence

import numpy as np

from gptj_flax.data.batch import Batch, make_batch
from gptj_flax.data.errors import DataError
from gptj_flax.data.sources import Shard, Source, open_source

STATE_FORMAT = "gptj_flax.data/1"
DEFAULT_SHUFFLE_BUFFER = 256
MAX_READER_THREADS = 16
# Fields of the state that fix the order; a restore must see the same values.
_ORDER_FIELDS = ("seed", "num_sequences", "seq_len", "batch_size", "grad_accum", "shuffle_buffer")


class EpochOrder:
    """The positions of one epoch: the shards in a given order, concatenated."""

    def __init__(self, shards: Sequence[Shard], permutation: Sequence[int] | np.ndarray):
        self.shards = [shards[i] for i in permutation]
        counts = np.array([shard.num_sequences for shard in self.shards], dtype=np.int64)
        self.starts = np.cumsum(counts) - counts
        self.total = int(counts.sum())

    def read(self, position: int, count: int) -> Generator[tuple[np.ndarray, np.ndarray], None, None]:
        """``count`` sequences from ``position`` on, wrapping past the end."""
        position %= self.total
        while count > 0:
            k = int(np.searchsorted(self.starts, position, side="right")) - 1  # skips empty shards
            offset = position - int(self.starts[k])
            n = min(count, self.shards[k].num_sequences - offset)
            yield from self.shards[k].read(offset, n)
            count -= n
            position = (position + n) % self.total


def shard_permutation(num_shards: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, 0]).permutation(num_shards)


class _Lane:
    """One row of every global batch: a contiguous stretch of the epoch order, shuffled in blocks."""

    def __init__(
        self, order: EpochOrder, *, lane: int, length: int, block_size: int, seed: int, epoch: int, first_item: int
    ):
        self._rng_key = (seed, epoch, 1, lane)
        self._length = length
        self._block_size = block_size
        self._next_block = first_item // block_size
        block_start = self._next_block * block_size
        self._chunks = order.read(lane * length + block_start, length - block_start)
        self._pending: tuple[np.ndarray, np.ndarray] | None = None
        self._blocks: collections.deque[tuple[np.ndarray, np.ndarray]] = collections.deque()
        self._cursor = first_item - block_start  # position in the first loaded block

    def _take_rows(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        tokens, lengths = [], []
        while n:
            if self._pending is None or not len(self._pending[0]):
                # A StopIteration escaping here would end training silently; the reads are sized exactly.
                self._pending = next(self._chunks, None)
                if self._pending is None:
                    raise DataError("a shard returned fewer sequences than it declared")
            chunk_tokens, chunk_lengths = self._pending
            k = min(n, len(chunk_tokens))
            tokens.append(chunk_tokens[:k])
            lengths.append(chunk_lengths[:k])
            self._pending = (chunk_tokens[k:], chunk_lengths[k:])
            n -= k
        if len(tokens) == 1:  # the block's permutation copies anyway: skip a second copy
            return tokens[0], lengths[0]
        return np.concatenate(tokens), np.concatenate(lengths)

    def ready(self, count: int) -> bool:
        """Whether the next ``count`` items are in memory."""
        return sum(len(tokens) for tokens, _ in self._blocks) - self._cursor >= count

    def prepare(self, count: int) -> None:
        """Load blocks until the next ``count`` items are in memory (the reading part of a step)."""
        while not self.ready(count):
            start = self._next_block * self._block_size
            n = min(self._block_size, self._length - start)
            tokens, lengths = self._take_rows(n)
            if start + n == self._length:
                self._chunks.close()  # the lane's last block: release its file reader now, not at the epoch's end
            permutation = np.random.default_rng([*self._rng_key, self._next_block]).permutation(n)
            self._blocks.append((tokens[permutation], lengths[permutation]))
            self._next_block += 1

    def fill(self, tokens_out: np.ndarray, lengths_out: np.ndarray) -> None:
        """Move the lane's next ``len(tokens_out)`` items (already prepared) into the given rows."""
        filled, count = 0, len(tokens_out)
        while filled < count:
            tokens, lengths = self._blocks[0]
            k = min(count - filled, len(tokens) - self._cursor)
            tokens_out[filled : filled + k] = tokens[self._cursor : self._cursor + k]
            lengths_out[filled : filled + k] = lengths[self._cursor : self._cursor + k]
            self._cursor += k
            filled += k
            if self._cursor == len(tokens):
                self._blocks.popleft()
                self._cursor = 0


def _prepare_all(lanes: Sequence[_Lane], count: int) -> None:
    """Every lane's next ``count`` items in memory. Lanes read different files independently, so
    they load in parallel threads (TensorFlow's reading and parsing release the GIL); the order of
    the data does not depend on it."""
    loading = [lane for lane in lanes if not lane.ready(count)]
    workers = min(len(loading), os.cpu_count() or 1, MAX_READER_THREADS)
    if workers <= 1:
        for lane in loading:
            lane.prepare(count)
        return
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="gptj-data") as pool:
        for _ in pool.map(lambda lane: lane.prepare(count), loading):
            pass  # re-raises a lane's DataError here


class DataOrderChanged(DataError):
    """A saved data position was taken under other settings than the iterator's; ``changed`` maps each
    differing setting (``seed``, ``batch_size`` …, or ``num_sequences`` for other data) to (saved, now)."""

    def __init__(self, source: str, changed: Mapping[str, tuple]):
        self.source, self.changed = source, dict(changed)
        differences = "; ".join(f"{k}: saved {saved!r}, now {now!r}" for k, (saved, now) in self.changed.items())
        super().__init__(
            f"cannot resume the data order of {source}: {differences}. The saved position means nothing "
            "under a different order; start the data afresh (state=None)"
        )


class DataIterator:
    """Endless training batches of this process's share; see the module docstring for the order.

    Each ``next()`` returns a :class:`Batch` of shape ``[grad_accum, batch_size / process_count, …]``
    (``[batch_size / process_count, …]`` when ``grad_accum`` is None). :meth:`state` is the JSON-able
    position to store with a checkpoint.
    """

    def __init__(
        self,
        source: Source,
        *,
        batch_size: int,
        grad_accum: int | None = None,
        seed: int = 0,
        shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER,
        process_index: int = 0,
        process_count: int = 1,
        state: Mapping | None = None,
    ):
        for name, value in (
            ("batch_size", batch_size),
            ("shuffle_buffer", shuffle_buffer),
            ("process_count", process_count),
        ):
            if not isinstance(value, int) or value < 1:
                raise DataError(f"{name} must be a positive integer, got {value!r}")
        if grad_accum is not None and (not isinstance(grad_accum, int) or grad_accum < 1):
            raise DataError(f"grad_accum must be a positive integer or None, got {grad_accum!r}")
        if not isinstance(seed, int) or seed < 0:
            raise DataError(f"seed must be a non-negative integer, got {seed!r}")
        if not 0 <= process_index < process_count:
            raise DataError(f"process_index={process_index} is not in [0, process_count={process_count})")
        if batch_size % process_count:
            raise DataError(f"the global batch_size={batch_size} is not divisible by process_count={process_count}")
        self.source = source
        self.batch_size = batch_size
        self.grad_accum = grad_accum
        self.seed = seed
        self.shuffle_buffer = shuffle_buffer
        self.local_batch_size = batch_size // process_count
        self._first_lane = process_index * self.local_batch_size
        self._micro_steps = grad_accum or 1
        self.num_sequences = source.num_sequences
        if self.num_sequences == 0:
            raise DataError(f"dataset {source.name} holds no sequences")
        self.steps_per_epoch = -(-self.num_sequences // (batch_size * self._micro_steps))
        self._lane_length = self.steps_per_epoch * self._micro_steps
        self.epoch, self.step_in_epoch, self.step = 0, 0, 0
        if state is not None:
            self._restore(state)
        self._lanes: list[_Lane] | None = None

    def _order_fields(self) -> dict:
        return {
            "seed": self.seed,
            "num_sequences": self.num_sequences,
            "seq_len": self.source.seq_len,
            "batch_size": self.batch_size,
            "grad_accum": self.grad_accum,
            "shuffle_buffer": self.shuffle_buffer,
        }

    def state(self) -> dict:
        """The position of the next batch, as a small JSON-able dict."""
        return {
            "format": STATE_FORMAT,
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "step": self.step,
            **self._order_fields(),
        }

    def _restore(self, state: Mapping) -> None:
        if state.get("format") != STATE_FORMAT:
            raise DataError(f"not a data iterator state (format {state.get('format')!r}, expected {STATE_FORMAT!r})")
        mine = self._order_fields()
        changed = {k: (state.get(k), mine[k]) for k in _ORDER_FIELDS if state.get(k) != mine[k]}
        if changed:
            raise DataOrderChanged(self.source.name, changed)
        if not 0 <= state["step_in_epoch"] < self.steps_per_epoch:
            raise DataError(f"data state step_in_epoch={state['step_in_epoch']} is outside [0, {self.steps_per_epoch})")
        self.epoch, self.step_in_epoch, self.step = int(state["epoch"]), int(state["step_in_epoch"]), int(state["step"])

    def _open_lanes(self) -> list[_Lane]:
        shards = self.source.shards
        order = EpochOrder(shards, shard_permutation(len(shards), self.seed, self.epoch))
        first_item = self.step_in_epoch * self._micro_steps
        return [
            _Lane(
                order,
                lane=lane,
                length=self._lane_length,
                block_size=self.shuffle_buffer,
                seed=self.seed,
                epoch=self.epoch,
                first_item=first_item,
            )
            for lane in range(self._first_lane, self._first_lane + self.local_batch_size)
        ]

    def __iter__(self) -> DataIterator:
        return self

    def __next__(self) -> Batch:
        if self._lanes is None:
            self._lanes = self._open_lanes()
        width = self.source.seq_len + 1
        tokens = np.empty((self._micro_steps, self.local_batch_size, width), np.int32)
        lengths = np.empty((self._micro_steps, self.local_batch_size), np.int32)
        _prepare_all(self._lanes, self._micro_steps)
        for row, lane in enumerate(self._lanes):
            lane.fill(tokens[:, row], lengths[:, row])
        self.step += 1
        self.step_in_epoch += 1
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch, self.step_in_epoch, self._lanes = self.epoch + 1, 0, None
        if self.grad_accum is None:
            tokens, lengths = tokens[0], lengths[0]
        return make_batch(tokens, lengths, self.source.eos_id)


def _process(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    if process_index is None or process_count is None:
        import jax

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    return process_index, process_count


def make_train_iterator(
    source,
    *,
    seq_len: int,
    batch_size: int,
    grad_accum: int | None = None,
    seed: int = 0,
    tokenizer=None,
    process_index: int | None = None,
    process_count: int | None = None,
    state: Mapping | None = None,
    shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER,
    tfds_data_dir: str | None = None,
    progress: bool = True,
    vocab_size: int | None = None,
) -> DataIterator:
    """Training batches of ``source`` (see :func:`~gptj_flax.data.sources.open_source`) for this process.

    ``batch_size`` is global; this process gets rows ``[p·B/P, (p+1)·B/P)`` with ``p, P`` from
    ``jax.process_index() / jax.process_count()`` unless given (see ``process_share`` to match a
    mesh's device order). ``state`` is a previous :meth:`DataIterator.state` to resume from.
    ``vocab_size``: the model's; token ids outside ``[0, vocab_size)`` raise :class:`DataError`.
    """
    process_index, process_count = _process(process_index, process_count)
    opened = open_source(
        source,
        seq_len=seq_len,
        tokenizer=tokenizer,
        tfds_data_dir=tfds_data_dir,
        progress=progress and process_index == 0,
        vocab_size=vocab_size,
    )
    return DataIterator(
        opened,
        batch_size=batch_size,
        grad_accum=grad_accum,
        seed=seed,
        shuffle_buffer=shuffle_buffer,
        process_index=process_index,
        process_count=process_count,
        state=state,
    )


def make_eval_batches(
    source,
    *,
    seq_len: int,
    batch_size: int,
    n_batches: int | None = None,
    tokenizer=None,
    process_index: int | None = None,
    process_count: int | None = None,
    tfds_data_dir: str | None = None,
    progress: bool = True,
    vocab_size: int | None = None,
) -> list[Batch]:
    """The first ``n_batches · batch_size`` sequences of ``source`` (all of it if None), each exactly once.

    Returns this process's share of every global batch, ``[batch_size / process_count, …]`` each; the
    last batch is completed with padding rows (loss mask 0), so evaluation neither drops nor repeats
    data. The same source gives the same batches every evaluation. Rows are laid out in lanes as in
    training (row ``r`` of batch ``k`` is sequence ``r·T + k`` of ``T`` batches), so a process reads
    only its own contiguous stretch. ``vocab_size`` as in :func:`make_train_iterator`.
    """
    process_index, process_count = _process(process_index, process_count)
    if not isinstance(batch_size, int) or batch_size < 1 or batch_size % process_count:
        raise DataError(f"batch_size={batch_size!r} must be a positive multiple of process_count={process_count}")
    if n_batches is not None and (not isinstance(n_batches, int) or n_batches < 1):
        raise DataError(f"n_batches must be a positive integer or None, got {n_batches!r}")
    opened = open_source(
        source,
        seq_len=seq_len,
        tokenizer=tokenizer,
        tfds_data_dir=tfds_data_dir,
        progress=progress and process_index == 0,
        vocab_size=vocab_size,
    )
    used = opened.num_sequences if n_batches is None else min(opened.num_sequences, n_batches * batch_size)
    n_steps = -(-used // batch_size)
    local = batch_size // process_count
    width = seq_len + 1
    tokens = np.zeros((local * n_steps, width), np.int32)
    lengths = np.zeros(local * n_steps, np.int32)
    start = process_index * local * n_steps
    stop = min(start + local * n_steps, used)
    filled = 0
    if stop > start:
        order = EpochOrder(opened.shards, range(len(opened.shards)))
        for chunk_tokens, chunk_lengths in order.read(start, stop - start):
            tokens[filled : filled + len(chunk_tokens)] = chunk_tokens
            lengths[filled : filled + len(chunk_lengths)] = chunk_lengths
            filled += len(chunk_tokens)
    by_step = tokens.reshape(local, n_steps, width).swapaxes(0, 1)
    lengths_by_step = lengths.reshape(local, n_steps).T
    return [
        make_batch(np.ascontiguousarray(by_step[k]), np.ascontiguousarray(lengths_by_step[k]), opened.eos_id)
        for k in range(n_steps)
    ]


def make_eval_sets(val_set: Mapping[str, object], **kwargs) -> dict[str, list[Batch]]:
    """``make_eval_batches`` for each entry of a ``val_set`` mapping name → source (the legacy key)."""
    return {name: make_eval_batches(spec, **kwargs) for name, spec in val_set.items()}
