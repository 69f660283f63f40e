"""Sharded execution equals unsharded execution, and tensors really are split across devices."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from gptj_flax import partitioning
from gptj_flax.model import GPTJ, abstract_params
from tests.helpers import mean_loss, tiny_config

MESHES = [(1, 1, 1), (8, 1, 1), (1, 8, 1), (1, 1, 8), (2, 2, 2), (2, 1, 4)]
CFG = tiny_config(n_layers=3, d_model=64, n_heads=8, rotary_dim=4, vocab_size=128)


def _loss_and_grads(model, variables, tokens, segments):
    def loss_fn(v):
        logits = model.apply(v, tokens[:, :-1], segment_ids=segments[:, :-1])
        loss, _ = mean_loss(logits, tokens[:, 1:], weights=(segments[:, 1:] > 0))
        return loss, logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(variables)
    return logits, loss, grads


@pytest.fixture(scope="module")
def reference():
    """Unsharded: one device, no mesh, no rules."""
    model = GPTJ(CFG)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, size=(8, 17)), jnp.int32)
    segments = np.ones((8, 17), np.int32)
    segments[:, 9:] = 2  # two packed documents per row
    segments[0, :3] = 0  # and some left padding
    segments = jnp.asarray(segments)
    variables = jax.jit(model.init)(jax.random.key(1), tokens)
    variables = jax.tree.map(np.asarray, nn.meta.unbox(variables))
    logits, loss, grads = jax.jit(lambda v: _loss_and_grads(model, v, tokens, segments))(variables)
    return model, variables, tokens, segments, (np.asarray(logits), float(loss), jax.tree.map(np.asarray, grads))


def _rel_err(a, b):
    """Largest absolute difference relative to the reference's largest magnitude."""
    return float(np.max(np.abs(np.asarray(a) - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_sharded_logits_loss_grads_equal_unsharded(reference, shape):
    model, variables, tokens, segments, (ref_logits, ref_loss, ref_grads) = reference
    mesh = partitioning.make_mesh(shape)
    abstract = {"params": abstract_params(model.config)}
    shardings = partitioning.logical_to_sharding(nn.get_partition_spec(abstract), mesh)
    sharded_vars = jax.device_put(variables, shardings)
    batch_sharding = partitioning.named_sharding(mesh, ("batch", "length"))
    step = jax.jit(
        lambda v, t, s: _loss_and_grads(model, v, t, s),
        in_shardings=(shardings, batch_sharding, batch_sharding),
        out_shardings=(
            partitioning.named_sharding(mesh, ("batch", "length", "vocab")),
            NamedSharding(mesh, PartitionSpec()),
            shardings,
        ),
    )
    with partitioning.sharding_scope(mesh):
        logits, loss, grads = step(sharded_vars, tokens, segments)

    assert _rel_err(logits, ref_logits) <= 1e-5
    assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss)
    flat_ref = jax.tree_util.tree_leaves_with_path(ref_grads)
    for (path, ref), got, want in zip(flat_ref, jax.tree.leaves(grads), jax.tree.leaves(shardings), strict=True):
        assert got.sharding.is_equivalent_to(want, got.ndim), jax.tree_util.keystr(path)
        assert _rel_err(got, ref) <= 1e-5, jax.tree_util.keystr(path)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_sharded_init_really_splits_tensors(shape):
    model = GPTJ(CFG)
    mesh = partitioning.make_mesh(shape)
    tokens = jnp.zeros((8, 16), jnp.int32)
    variables, shardings = partitioning.sharded_init(model.init, mesh, jax.random.key(0), tokens)
    sizes = dict(mesh.shape)
    n_split = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(variables):
        spec = leaf.sharding.spec
        divisor = [
            math.prod(sizes[a] for a in ((s,) if isinstance(s, str) else s)) if s else 1
            for s in tuple(spec) + (None,) * (leaf.ndim - len(spec))
        ]
        expected = tuple(d // k for d, k in zip(leaf.shape, divisor))
        assert len(leaf.addressable_shards) == mesh.size
        for shard in leaf.addressable_shards:
            assert shard.data.shape == expected, jax.tree_util.keystr(path)
        if math.prod(divisor) > 1:
            n_split += 1
            assert all(shard.data.size < leaf.size for shard in leaf.addressable_shards)
    if math.prod(shape[1:]) > 1:  # fsdp or model > 1: every weight matrix is split
        assert n_split >= 8
    # The same values whatever the mesh: init is a function of the key, not of the layout.
    ref = jax.jit(model.init)(jax.random.key(0), tokens)
    for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(nn.meta.unbox(ref)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
