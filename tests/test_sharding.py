"""Sharded execution equals unsharded execution, and tensors really are split across devices."""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from gptj_flax import model as model_lib
from gptj_flax import partitioning
from gptj_flax.config import LORA_PROJECTIONS, ConfigError, LoraConfig
from gptj_flax.model import (
    GPTJ,
    AdapterSlots,
    KVCache,
    PagedKVCache,
    abstract_adapter_slots,
    abstract_adapters,
    abstract_params,
)
from gptj_flax.sampling import LanguageModel
from gptj_flax.sampling.decoding import DecodeState
from gptj_flax.sampling.slots import SlotState
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


# --------------------------------------------------------------------------------------------
# Every logical axis name needs a rule

UNROLLED = dataclasses.replace(CFG, scan_layers=False)
LORA = LoraConfig(rank=4, targets=("*",))


def _logical_trees() -> dict:
    """Every tree of logical names the package turns into shardings: the parameters of each
    variant, the adapters (trained, and a server's stacked bank), the caches and the decode states."""
    trees = {}
    for name, config in {
        "scanned": CFG,
        "unrolled": UNROLLED,
        "int8": dataclasses.replace(UNROLLED, quantize="int8"),
        "int8 scanned": dataclasses.replace(CFG, quantize="int8"),
    }.items():
        trees[f"{name} params"] = nn.get_partition_spec(abstract_params(config))
    for config in (CFG, UNROLLED):
        trees[f"adapters, scan_layers={config.scan_layers}"] = nn.get_partition_spec(abstract_adapters(config, LORA))
        served = abstract_adapter_slots(config, AdapterSlots(3, 4, LORA_PROJECTIONS))
        trees[f"served adapter bank, scan_layers={config.scan_layers}"] = nn.get_partition_spec(served)
    for kv_cache in (None, "int8"):
        config = dataclasses.replace(UNROLLED, kv_cache=kv_cache)
        trees[f"KV cache {kv_cache}"] = KVCache.logical_axes(config)
        trees[f"paged cache {kv_cache}"] = PagedKVCache.logical_axes(config)
        trees[f"decode state {kv_cache}"] = DecodeState.logical_axes(config)
        trees[f"slot state {kv_cache}"] = SlotState.logical_axes(config)
    return trees


def _trace_every_program(mesh, rules) -> None:
    """Trace (never run) the forward pass of each variant, cached decoding and the decode slots'
    step under ``rules``: every activation constraint the model makes resolves against them."""

    def placed(abstract):  # outside the scope: unboxing there would constrain the abstract leaves
        return partitioning.restore_targets(abstract, mesh, rules)[0]

    def tokens(length):
        return jax.ShapeDtypeStruct((8, length), jnp.int32, sharding=partitioning.named_sharding(mesh, ("batch", None)))

    forward = {c: placed(abstract_params(c)) for c in (CFG, UNROLLED, dataclasses.replace(CFG, quantize="int8"))}
    lora = {"params": forward[CFG], "lora": placed(abstract_adapters(CFG, LORA))}
    cached = [dataclasses.replace(UNROLLED, kv_cache=kv_cache) for kv_cache in (None, "int8")]
    cached_params = [placed(abstract_params(c)) for c in cached]

    def decode(p, t, c):
        return GPTJ(c).apply({"params": p}, t, None, None, KVCache.empty(c, 8, 32), method=GPTJ.decode)

    def decode_slots(p, t, c):
        cache, table = PagedKVCache.empty(c, (8,), 8, 8), jnp.arange(8, dtype=jnp.int32)[:, None]
        active, positions = jnp.ones(8, bool), jnp.zeros((8, 1), jnp.int32)
        return GPTJ(c).apply({"params": p}, t, positions, active, cache, table, method=GPTJ.decode_slots)

    with partitioning.sharding_scope(mesh, rules):
        for config, params in forward.items():
            jax.eval_shape(lambda p, t, c=config: GPTJ(c).apply({"params": p}, t), params, tokens(16))
        jax.eval_shape(lambda v, t: GPTJ(CFG, LORA).apply(v, t), lora, tokens(16))
        for config, params in zip(cached, cached_params):
            jax.eval_shape(lambda p, t, c=config: decode(p, t, c), params, tokens(16))
            jax.eval_shape(lambda p, t, c=config: decode_slots(p, t, c), params, tokens(1))


def test_every_logical_axis_name_the_model_uses_has_a_rule():
    for name, tree in _logical_trees().items():
        partitioning.check_tree_axes(tree)  # raises on a name without a rule
        assert jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, PartitionSpec)), name
    _trace_every_program(partitioning.make_mesh((2, 2, 2)), partitioning.DEFAULT_RULES)


@pytest.mark.parametrize("missing", [name for name, _ in partitioning.DEFAULT_RULES])
def test_a_logical_axis_name_without_a_rule_is_refused_by_name(missing):
    """Each rule is needed by some parameter, cache, state or activation, and without it the check
    names the axis and where it is used, where linen would have replicated that dimension."""
    rules = tuple(rule for rule in partitioning.DEFAULT_RULES if rule[0] != missing)
    with pytest.raises(
        ConfigError, match=f"names the logical axis '{missing}', which the logical axis rules have no entry for"
    ):
        for tree in _logical_trees().values():
            partitioning.check_tree_axes(tree, rules)
        _trace_every_program(partitioning.make_mesh((2, 2, 2)), rules)


def test_a_misspelt_cache_axis_stops_the_model_at_start_up(monkeypatch):
    params = nn.meta.unbox(jax.jit(GPTJ(UNROLLED).init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))["params"]
    monkeypatch.setattr(model_lib, "KEY_AXES", ("batch", "heads", "kv", "lenght"))
    with pytest.raises(
        ConfigError,
        match=r"the array at cache/k/0 names the logical axis 'lenght'.* \(did you mean 'length'\?\).*add a rule",
    ):
        LanguageModel(UNROLLED, params)


def test_a_misspelt_activation_axis_is_refused_naming_the_constraint(monkeypatch):
    monkeypatch.setattr(model_lib, "RESIDUAL_AXES", ("batch", "length", "activation_embd"))
    mesh = partitioning.make_mesh((2, 2, 2))
    params = partitioning.restore_targets(abstract_params(CFG), mesh)[0]
    tokens = jax.ShapeDtypeStruct((8, 16), jnp.int32, sharding=partitioning.named_sharding(mesh, ("batch", None)))
    expected = r"the activation constraint \('batch', 'length', 'activation_embd'\) at model\.py:\d+ names the logical"
    with partitioning.sharding_scope(mesh), pytest.raises(ConfigError, match=expected):
        jax.eval_shape(lambda p, t: GPTJ(CFG).apply({"params": p}, t), params, tokens)


def test_a_misspelt_parameter_axis_is_refused_by_the_divisibility_check_and_the_targets():
    rules = tuple(rule for rule in partitioning.DEFAULT_RULES if rule[0] != "mlp")
    abstract, mesh = abstract_params(UNROLLED), partitioning.make_mesh((1, 1, 8))
    with pytest.raises(ConfigError, match=r"parameter layer_0/mlp/fc_in/bias names the logical axis 'mlp'"):
        partitioning.check_divisible(abstract, mesh, rules)
    with pytest.raises(ConfigError, match=r"the array at layer_0/mlp/fc_in/bias names the logical axis 'mlp'"):
        partitioning.restore_targets(abstract, mesh, rules)
