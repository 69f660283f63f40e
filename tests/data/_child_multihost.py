"""One process of the two-process test: 4 CPU devices each, one 8-device mesh over both.

Reads its own share, assembles global arrays, and checks them against the single-process batches
(which every process can compute for itself). Writes its local shares for the parent to compare.
"""

import sys

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from gptj_flax.data import make_train_iterator, process_share, to_global_batch

# Before any backend starts (importing the package starts none; jax.distributed.initialize must come first).
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 4)


def main(process_id: int, port: int, index: str, out_path: str) -> None:
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, process_id)
    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
    grad_accum, batch_size, seq_len = 2, 8, 32
    mesh = jax.make_mesh((8,), ("batch",), axis_types=(AxisType.Auto,))
    sharding = NamedSharding(mesh, PartitionSpec(None, "batch"))
    share = process_share(sharding, (grad_accum, batch_size, seq_len + 1), batch_axis=1)
    assert share == (jax.process_index(), 2), share

    settings = dict(
        seq_len=seq_len, batch_size=batch_size, grad_accum=grad_accum, seed=7, shuffle_buffer=3, progress=False
    )
    local_it = make_train_iterator(index, process_index=share[0], process_count=share[1], **settings)
    whole_it = make_train_iterator(index, process_index=0, process_count=1, **settings)
    saved = {}
    for step in range(5):
        local, whole = next(local_it), next(whole_it)
        assert local.tokens.shape == (grad_accum, batch_size // 2, seq_len + 1)
        global_batch = to_global_batch(local, sharding)
        for field in ("tokens", "segment_ids", "loss_mask"):
            array = getattr(global_batch, field)
            assert array.shape == getattr(whole, field).shape and array.sharding == sharding
            gathered = multihost_utils.process_allgather(array, tiled=True)
            np.testing.assert_array_equal(gathered, getattr(whole, field))
            for shard in array.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), getattr(whole, field)[shard.index])
            saved[f"{field}_{step}"] = getattr(local, field)
    np.savez(out_path, **saved)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
