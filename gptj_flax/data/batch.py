"""The batch the trainer consumes, and how process-local shares become global ``jax.Array``s.

A :class:`Batch` holds numpy arrays (local share) or ``jax.Array``s (global), shape ``[..., rows, …]``:

* ``tokens`` int32 ``[..., seq_len + 1]`` — the model reads ``tokens[..., :-1]`` and predicts
  ``tokens[..., 1:]``;
* ``segment_ids`` int32 ``[..., seq_len + 1]`` — 0 on padding; documents numbered 1, 2, … within a
  row (the token after an EOS starts a new document) when the source knows its EOS, else the whole
  row is segment 1. The model masks attention across segments; positions it derives itself;
* ``loss_mask`` float32 ``[..., seq_len]`` — aligned with the targets ``tokens[..., 1:]``: 1 where
  the target is a real token, 0 where it is padding.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Batch:
    tokens: np.ndarray
    segment_ids: np.ndarray
    loss_mask: np.ndarray

    @property
    def inputs(self):
        return self.tokens[..., :-1]

    @property
    def targets(self):
        return self.tokens[..., 1:]

    @property
    def input_segment_ids(self):
        return self.segment_ids[..., :-1]


jax.tree_util.register_dataclass(Batch, data_fields=["tokens", "segment_ids", "loss_mask"], meta_fields=[])


def make_batch(tokens: np.ndarray, lengths: np.ndarray, eos_id: int | None) -> Batch:
    """Segment ids and loss mask for rows of ``tokens`` whose first ``lengths`` ids are real."""
    width = tokens.shape[-1]
    real = np.arange(width, dtype=np.int32) < lengths[..., None]
    if eos_id is None:
        segment_ids = real.astype(np.int32)
    else:
        ends = tokens[..., :-1] == eos_id
        segment_ids = np.ones(tokens.shape, np.int32)
        np.cumsum(ends, axis=-1, dtype=np.int32, out=segment_ids[..., 1:])
        segment_ids[..., 1:] += 1
        segment_ids *= real
    loss_mask = real[..., 1:].astype(np.float32)
    return Batch(tokens, segment_ids, loss_mask)


def to_global_batch(batch: Batch, sharding: jax.sharding.Sharding) -> Batch:
    """Assemble every process's local share into global ``jax.Array``s laid out by ``sharding``.

    ``sharding`` covers the batch dims (e.g. ``NamedSharding(mesh, P(None, batch_axes))`` for
    ``[grad_accum, batch, seq]``); the sequence dim must not be split, since ``loss_mask`` is one
    shorter than ``tokens``. Every process calls this with its own share, in step.
    """
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), batch)


def process_share(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...], batch_axis: int) -> tuple[int, int]:
    """Which share of the rows this process's devices hold under ``sharding``: ``(index, count)``.

    Pass the result as ``process_index`` / ``process_count`` to the iterator and each local share
    lands exactly where the single-process batch has it, on any device order (on TPU pods the mesh
    need not list hosts in ``process_index`` order). Processes that hold the same rows (replicas
    over a model-parallel axis) get the same share.
    """
    rows = global_shape[batch_axis]
    held = sorted(
        {
            index[batch_axis].indices(rows)[:2]
            for index in sharding.addressable_devices_indices_map(global_shape).values()
            if index is not None
        }
    )
    first, end = held[0]
    for start, stop in held[1:]:
        if start > end:
            break
        end = max(end, stop)
    size = end - first
    if end < held[-1][1] or rows % size or first % size:
        raise ValueError(
            f"this process's devices hold rows {held} of {rows}: not one contiguous block that evenly "
            f"divides the batch; order the mesh so that each process holds one block of rows"
        )
    return first // size, rows // size
