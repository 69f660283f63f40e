"""Legacy mesh-transformer-jax checkpoints (1, 2, 4, 8 shards; full and slim) → ours, exactly."""

import dataclasses
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from jax.sharding import NamedSharding, PartitionSpec

from benchmarks.common import write_random_hf
from gptj_flax import checkpoint, convert, partitioning
from gptj_flax.config import Config, from_dict
from gptj_flax.convert import (
    config_for_legacy,
    from_legacy,
    insert_adam_moments,
    load_init_opt_state,
    load_init_params,
    load_legacy_opt_state,
    params_from_hf,
)
from gptj_flax.convert.legacy import LegacyCheckpoint, legacy_params
from gptj_flax.model import GPTJ
from gptj_flax.training import make_optimizer
from gptj_flax.training.steps import abstract_state, state_shardings
from tests.helpers import hf_model, tiny_config
from tests.legacy_writer import dense_model, dense_moments, hf_state_dict, legacy_config_dict, write_legacy_checkpoint

# 12 layers, so the original's string order (0, 1, 10, 11, 2, …) differs from numeric order;
# heads, d_ff and vocab divide 8 shards; rotary_dim < head_dim.
CFG = tiny_config(n_layers=12, d_model=32, n_heads=8, rotary_dim=2, vocab_size=64)
_logits = jax.jit(
    lambda params, tokens: GPTJ(dataclasses.replace(CFG, dtype="float32")).apply({"params": params}, tokens)
)


def _reference_hf(model):
    hf = hf_model(CFG)
    hf.load_state_dict({k: torch.from_numpy(v) for k, v in hf_state_dict(model, CFG).items()}, strict=True)
    return hf


def _config_file(tmp_path, shards):
    path = tmp_path / "legacy.json"
    path.write_text(json.dumps(legacy_config_dict(CFG, shards)))
    return path


def test_the_original_leaf_order_is_string_sorted():
    names = [p.key for p in legacy_params(CFG, 8)]
    layers = [n.split("/~/")[1] for n in names if "/~/layer_" in n and n.endswith("linear/w")]
    assert layers == ["layer_0", "layer_1", "layer_10", "layer_11"] + [f"layer_{i}" for i in range(2, 10)]
    assert names[:2] == [
        "causal_transformer_shard/~/embedding_shard/~/linear/b",
        "causal_transformer_shard/~/embedding_shard/~/linear/w",
    ]
    assert names[2].endswith("layer_0/~/linear/w") and names[-1].endswith(
        "projection_shard/~/replicated_layer_norm/scale"
    )


CASES = (
    [(s, "full") for s in (1, 2, 4, 8)]
    + [(s, "slim_bf16") for s in (1, 2, 4, 8)]
    + [(1, "slim_fp16"), (8, "slim_fp16")]
)


@pytest.mark.parametrize("shards,storage", CASES, ids=[f"{s}shards-{k}" for s, k in CASES])
def test_legacy_import_equals_the_dense_reference(tmp_path, shards, storage):
    model = dense_model(CFG, seed=shards)
    dtype = {"full": np.float32, "slim_bf16": jnp.bfloat16, "slim_fp16": np.float16}[storage]
    moments = (dense_moments(model, 1), dense_moments(model, 2)) if storage == "full" else None
    step_dir = tmp_path / "ckpt" / "step_383500"
    write_legacy_checkpoint(
        step_dir,
        model,
        CFG,
        shards=shards,
        step=383500,
        dtype=dtype,
        moments=moments,
        adam_count=383500,
        schedule_count=17,
    )
    if storage == "slim_bf16":  # the header old numpy wrote for bfloat16
        assert b"'descr': '<V2'" in (step_dir / "shard_0" / "0.npz").read_bytes()[:200]
    n_leaves = sum(len(np.load(step_dir / "shard_0" / f"{i}.npz").files) for i in range(16))
    assert n_leaves == (3 * 126 + 3 if storage == "full" else 127)

    config, file_shards = config_for_legacy(_config_file(tmp_path, shards))
    assert file_shards == shards
    from_legacy(step_dir, tmp_path / "ours", config, file_shards)

    reference = params_from_hf(hf_state_dict(model, CFG), config.model)
    stored_config, params, step = convert.load_params(tmp_path / "ours", partitioning.make_mesh((1, 2, 4)))
    # the compute dtype is the precision the checkpoint stores its parameters in; the rest is the config's
    stored_dtype = {"full": "float32", "slim_bf16": "bfloat16", "slim_fp16": "float16"}[storage]
    assert step == 383500 and stored_config == config.replace(
        model=dataclasses.replace(config.model, dtype=stored_dtype)
    )
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, params), reference)

    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, size=(2, 11))
    with torch.no_grad():
        expected = _reference_hf(model)(torch.from_numpy(tokens)).logits.numpy()
    assert dataclasses.replace(config.model, dtype=CFG.dtype) == CFG  # so the jitted reference applies
    np.testing.assert_allclose(np.asarray(_logits(params, tokens)), expected, rtol=0, atol=1e-4)


def test_init_from_legacy_on_a_different_mesh_and_layout(tmp_path):
    model = dense_model(CFG, seed=5)
    write_legacy_checkpoint(tmp_path / "step_10", model, CFG, shards=4, step=10, dtype=jnp.bfloat16)
    config = Config(model=dataclasses.replace(CFG, scan_layers=False))
    mesh = partitioning.make_mesh((1, 1, 8))  # 8-way tensor parallel from a 4-shard checkpoint
    params = load_init_params(f"legacy:{tmp_path / 'step_10'}", config, mesh, legacy_shards=4)
    reference = params_from_hf(hf_state_dict(model, CFG), config.model)
    target, _ = convert.param_targets(config.model, mesh)
    for leaf, want, value in zip(jax.tree.leaves(params), jax.tree.leaves(target), jax.tree.leaves(reference)):
        assert leaf.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(leaf), value)


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
def test_adam_moments_land_on_the_right_parameters(tmp_path, scan):
    model = dense_model(CFG, seed=3)
    mu, nu = dense_moments(model, 10), dense_moments(model, 20)
    write_legacy_checkpoint(
        tmp_path / "step_7", model, CFG, shards=4, step=7, moments=(mu, nu), adam_count=321, schedule_count=5
    )
    config = Config(model=dataclasses.replace(CFG, scan_layers=scan))
    mesh = partitioning.make_mesh((1, 2, 4))
    state = load_legacy_opt_state(tmp_path / "step_7", config, mesh, shards=4)

    assert int(state.count) == 321
    # The moments of each dense tensor, mapped with the (independently tested) HF name mapping.
    # The embedding table's moments are the embedding weight's; the folded bias has none.
    for got, moments in ((state.mu, mu), (state.nu, nu)):
        want = params_from_hf(
            hf_state_dict({**moments, "embed_b": np.zeros_like(moments["embed_b"])}, CFG), config.model
        )
        target, _ = convert.param_targets(config.model, mesh)
        for leaf, spec, value in zip(jax.tree.leaves(got), jax.tree.leaves(target), jax.tree.leaves(want)):
            assert leaf.sharding == spec.sharding and leaf.dtype == jnp.float32
            np.testing.assert_array_equal(np.asarray(leaf), value)

    # Into an optax chain like training's: the Adam node is replaced, everything else kept.
    params = load_init_params(f"legacy:{tmp_path / 'step_7'}", config, mesh)
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.scale_by_adam(),
        optax.add_decayed_weights(0.1, mask=jax.tree.map(lambda p: p.ndim > 1, params)),
        optax.scale_by_learning_rate(optax.linear_schedule(1e-4, 1e-5, 10)),
    )
    fresh = optimizer.init(params)
    opt_state = insert_adam_moments(fresh, state.mu, state.nu, state.count)
    adam = opt_state[1]
    assert isinstance(adam, optax.ScaleByAdamState) and int(adam.count) == 321
    assert jax.tree.structure(opt_state) == jax.tree.structure(fresh)
    np.testing.assert_array_equal(np.asarray(adam.mu["lm_head"]["kernel"]), np.asarray(state.mu["lm_head"]["kernel"]))
    assert int(opt_state[3].count) == 0  # the schedule restarts, as the original's fine-tuning did

    grads = jax.tree.map(jnp.ones_like, params)
    updates, new_state = jax.jit(optimizer.update)(grads, opt_state, params)
    assert int(new_state[1].count) == 322
    assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))


def test_insert_adam_moments_rejects_a_mismatched_state():
    params = {"w": jnp.zeros((2, 3))}
    with pytest.raises(ValueError, match="ScaleByAdamState"):
        insert_adam_moments(optax.sgd(0.1).init(params), params, params, 1)
    state = optax.adam(1e-3).init(params)
    with pytest.raises(ValueError, match="shape"):
        insert_adam_moments(state, {"w": jnp.zeros((3, 2))}, {"w": jnp.zeros((3, 2))}, 1)
    new = insert_adam_moments(state, {"w": jnp.ones((2, 3))}, {"w": jnp.ones((2, 3))}, 4)
    assert int(new[0].count) == 4 and new[0].count.dtype == state[0].count.dtype

    # A state placed on a mesh (as a jitted init with out_shardings leaves it) keeps its placement.
    mesh = partitioning.make_mesh((1, 2, 4))
    placed = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))
    new = insert_adam_moments(placed, {"w": jnp.ones((2, 3))}, {"w": jnp.ones((2, 3))}, 4)
    for leaf, old in zip(jax.tree.leaves(new), jax.tree.leaves(placed)):
        assert leaf.sharding == old.sharding


def test_the_released_6b_layout_counts(repo_root):
    """The leaf counts docs/reference.md §4 gives for the released 6B checkpoint: 287 slim, 861 full."""
    six_b = from_dict(json.loads((repo_root / "configs" / "6B_roto_256.json").read_text())).model
    n = len(legacy_params(six_b, 8))
    assert (n + 1, 3 * n + 3) == (287, 861)


def test_a_slim_checkpoint_has_no_moments(tmp_path):
    write_legacy_checkpoint(tmp_path / "step_1", dense_model(CFG, 0), CFG, shards=2, dtype=jnp.bfloat16)
    with LegacyCheckpoint(tmp_path / "step_1", CFG) as legacy:
        assert not legacy.full and legacy.shards == 2 and legacy.step == 1000
    with pytest.raises(ValueError, match="slim"):
        load_legacy_opt_state(tmp_path / "step_1", Config(model=CFG), partitioning.make_mesh((1, 1, 1)))


def _optimizer_target(config, mesh, freeze=()):
    """The run's optimiser and its abstract state with shardings, exactly as the training loop builds them."""
    model = GPTJ(config.model)
    params = nn.meta.unbox(jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"]
    tx = make_optimizer(config.train, params=params, freeze=freeze)
    abstract = nn.meta.unbox(abstract_state(model, tx))
    shardings = state_shardings(model, tx, mesh)
    return tx, jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract.opt_state, shardings.opt_state
    )


@pytest.mark.parametrize("freeze", [(), ("wte", "layers/attn/*")], ids=["all", "frozen"])
def test_init_opt_state_carries_legacy_adam_into_the_training_optimiser(tmp_path, freeze):
    model = dense_model(CFG, seed=4)
    write_legacy_checkpoint(
        tmp_path / "step_9",
        model,
        CFG,
        shards=2,
        step=9,
        moments=(dense_moments(model, 30), dense_moments(model, 40)),
        adam_count=55,
        schedule_count=8,
    )
    config = Config(model=CFG)
    mesh = partitioning.make_mesh((1, 2, 4))
    tx, target = _optimizer_target(config, mesh, freeze)
    spec = f"legacy:{tmp_path / 'step_9'}"
    opt_state = load_init_opt_state(spec, config, mesh, target)
    assert jax.tree.structure(opt_state) == jax.tree.structure(target)
    for leaf, want in zip(jax.tree.leaves(opt_state), jax.tree.leaves(target)):
        assert leaf.shape == want.shape and leaf.dtype == want.dtype and leaf.sharding == want.sharding

    adam = _adam_nodes(opt_state)
    assert len(adam) == 1 and int(adam[0].count) == 55
    expected = load_legacy_opt_state(tmp_path / "step_9", config, mesh)
    np.testing.assert_array_equal(
        np.asarray(adam[0].nu["lm_head"]["kernel"]), np.asarray(expected.nu["lm_head"]["kernel"])
    )
    if freeze:  # frozen parameters have no moments
        assert isinstance(adam[0].mu["wte"], optax.MaskedNode)
        assert isinstance(adam[0].mu["layers"]["attn"]["q_proj"], optax.MaskedNode)
        np.testing.assert_array_equal(
            np.asarray(adam[0].mu["layers"]["mlp"]["fc_in"]["kernel"]),
            np.asarray(expected.mu["layers"]["mlp"]["fc_in"]["kernel"]),
        )
    else:
        np.testing.assert_array_equal(np.asarray(adam[0].mu["wte"]), np.asarray(expected.mu["wte"]))

    params = load_init_params(spec, config, mesh)
    with partitioning.sharding_scope(mesh):
        _, new_state = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), opt_state, params)
    assert int(_adam_nodes(new_state)[0].count) == 56


def _adam_nodes(state):
    is_adam = lambda n: isinstance(n, optax.ScaleByAdamState)  # noqa: E731
    return [n for n in jax.tree.leaves(state, is_leaf=is_adam) if is_adam(n)]


def test_init_opt_state_from_orbax_and_from_sources_without_one(tmp_path):
    model = dense_model(CFG, seed=6)
    write_legacy_checkpoint(
        tmp_path / "full" / "step_3",
        model,
        CFG,
        shards=2,
        step=3,
        moments=(dense_moments(model, 1), dense_moments(model, 2)),
        adam_count=3,
    )
    write_legacy_checkpoint(tmp_path / "slim" / "step_3", model, CFG, shards=2, step=3, dtype=jnp.bfloat16)
    config = Config(model=CFG)
    mesh = partitioning.make_mesh((2, 2, 2))
    _, target = _optimizer_target(config, mesh)
    opt_state = load_init_opt_state(f"legacy:{tmp_path / 'full' / 'step_3'}", config, mesh, target)
    assert load_init_opt_state(f"legacy:{tmp_path / 'slim' / 'step_3'}", config, mesh, target) is None
    write_random_hf(tmp_path / "hf", CFG)
    assert load_init_opt_state(f"hf:{tmp_path / 'hf'}", config, mesh, target) is None

    run = checkpoint.Checkpointer(tmp_path / "run", async_save=False)
    run.save(
        3,
        params=load_init_params(f"legacy:{tmp_path / 'full' / 'step_3'}", config, mesh),
        config=config,
        opt_state=opt_state,
    )
    run.close()
    restored = load_init_opt_state(str(tmp_path / "run"), config, mesh, target)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(opt_state)):
        assert got.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    from_legacy(tmp_path / "slim" / "step_3", tmp_path / "converted", config)  # params only
    assert load_init_opt_state(str(tmp_path / "converted"), config, mesh, target) is None
    unrolled = Config(model=dataclasses.replace(CFG, scan_layers=False))
    with pytest.raises(ValueError, match="saved with scan_layers=True"):
        load_init_opt_state(str(tmp_path / "run"), unrolled, mesh, _optimizer_target(unrolled, mesh)[1])


def test_from_legacy_with_opt_state_resumes_and_fine_tunes(tmp_path):
    model = dense_model(CFG, seed=8)
    write_legacy_checkpoint(
        tmp_path / "step_12",
        model,
        CFG,
        shards=4,
        step=12,
        moments=(dense_moments(model, 5), dense_moments(model, 6)),
        adam_count=12,
        schedule_count=12,
    )
    config_path = _config_file(tmp_path, 4)
    config, shards = config_for_legacy(config_path)
    from_legacy(tmp_path / "step_12", tmp_path / "ours", config, shards, opt_init=make_optimizer(config.train).init)

    mesh = partitioning.make_mesh((1, 2, 4))
    _, target = _optimizer_target(config, mesh)
    carried = load_init_opt_state(str(tmp_path / "ours"), config, mesh, target)
    direct = load_init_opt_state(f"legacy:{tmp_path / 'step_12'}", config, mesh, target)
    for got, want in zip(jax.tree.leaves(carried), jax.tree.leaves(direct)):
        assert got.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert int(_adam_nodes(carried)[0].count) == 12

    # The training loop's resume path reads it too (OUT as a run directory).
    params_target, _ = convert.param_targets(config.model, mesh)
    ckpt = checkpoint.Checkpointer(tmp_path / "ours", read_only=True)
    restored = ckpt.restore(params_target=params_target, opt_state_target=target)
    ckpt.close()
    assert restored.step == 12 and int(_adam_nodes(restored.opt_state)[0].count) == 12

    write_legacy_checkpoint(tmp_path / "slim" / "step_1", model, CFG, shards=4, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="slim checkpoint has no optimiser state"):
        from_legacy(tmp_path / "slim" / "step_1", tmp_path / "out", config, opt_init=make_optimizer(config.train).init)
    assert not (tmp_path / "out").exists()
