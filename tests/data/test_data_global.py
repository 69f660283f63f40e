"""Local shares → global jax.Arrays in one process over 8 CPU devices."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from gptj_flax.data import make_train_iterator, process_share, to_global_batch


def test_global_batch_on_eight_devices(legacy_dataset):
    index, _ = legacy_dataset(n_rows=64)
    mesh = jax.make_mesh((8,), ("batch",), axis_types=(AxisType.Auto,))
    sharding = NamedSharding(mesh, PartitionSpec(None, "batch"))
    assert process_share(sharding, (2, 16, 17), batch_axis=1) == (0, 1)
    local = next(
        make_train_iterator(
            index, seq_len=16, batch_size=16, grad_accum=2, process_index=0, process_count=1, progress=False
        )
    )
    global_batch = to_global_batch(local, sharding)
    assert isinstance(global_batch.tokens, jax.Array) and global_batch.tokens.sharding == sharding
    assert len(global_batch.tokens.addressable_shards) == 8
    np.testing.assert_array_equal(np.asarray(global_batch.tokens), local.tokens)
    np.testing.assert_array_equal(np.asarray(global_batch.loss_mask), local.loss_mask)
    # The batch is a pytree: it passes through jit whole.
    total = jax.jit(lambda b: (b.loss_mask * (b.input_segment_ids > 0)).sum())(global_batch)
    assert float(total) == local.loss_mask.sum()


class HeldRows:
    """Stands in for a sharding of which this process's devices hold the given row slices."""

    def __init__(self, *row_slices):
        self.row_slices = row_slices

    def addressable_devices_indices_map(self, shape):
        return {device: (slice(None), rows) for device, rows in enumerate(self.row_slices)}


def test_process_share_is_where_this_process_rows_are():
    # On a pod the mesh may put this process's devices anywhere: the share follows them.
    assert process_share(HeldRows(slice(12, 14), slice(14, 16)), (2, 16, 5), batch_axis=1) == (3, 4)
    assert process_share(HeldRows(slice(0, 8), slice(0, 8)), (2, 16, 5), batch_axis=1) == (0, 2)  # replicas
    assert process_share(HeldRows(slice(None)), (2, 16, 5), batch_axis=1) == (0, 1)
    with pytest.raises(ValueError, match="not one contiguous block"):
        process_share(HeldRows(slice(0, 4), slice(8, 12)), (2, 16, 5), batch_axis=1)
