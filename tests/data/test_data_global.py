"""Local shares → global jax.Arrays in one process over 8 CPU devices; and the pipeline benchmark."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from gptj_flax.data import benchmark_pipeline, make_train_iterator, process_share, to_global_batch


def test_global_batch_on_eight_devices(legacy_dataset):
    index, _ = legacy_dataset(n_rows=64)
    mesh = jax.make_mesh((8,), ("batch",), axis_types=(AxisType.Auto,))
    sharding = NamedSharding(mesh, PartitionSpec(None, "batch"))
    assert process_share(sharding, (2, 16, 17), batch_axis=1) == (0, 1)
    local = next(make_train_iterator(index, seq_len=16, batch_size=16, grad_accum=2, process_index=0, process_count=1,
                                     progress=False))
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


def test_benchmark_returns_throughputs(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 3000)
    results = benchmark_pipeline(seq_len=64, batch_size=4, n_batches=6, n_files=2, text_files=[str(text)],
                                 workdir=str(tmp_path))
    for key in ("tfrecord_tokens_per_s", "text_tokens_per_s", "text_tokenize_tokens_per_s"):
        assert results[key] > 0
    assert results["text_corpus_tokens"] > 0


@pytest.mark.slow
def test_pretokenised_pipeline_is_fast(tmp_path):
    """The target: well over 1M tokens/s from pre-tokenised records, at GPT-J's sequence length."""
    results = benchmark_pipeline(seq_len=2048, batch_size=16, n_batches=256, text_bytes=1 << 20,
                                 workdir=str(tmp_path))
    assert results["tfrecord_tokens_per_s"] > 1e6, results
