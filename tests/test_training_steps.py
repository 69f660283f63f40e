"""Optimiser, schedule and train/eval steps against plain references."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gptj_flax import partitioning
from gptj_flax.config import ConfigError, TrainConfig
from gptj_flax.data import Batch
from gptj_flax.losses import chunked_loss_sums
from gptj_flax.model import GPTJ
from gptj_flax.training import optimizer, steps
from tests.helpers import mean_loss, tiny_config

CFG = tiny_config(n_layers=2, d_model=32, n_heads=4, rotary_dim=4, vocab_size=64)
TRAIN = TrainConfig(
    batch_size=8, lr=3e-3, end_lr=3e-4, warmup_steps=3, anneal_steps=10, total_steps=20, weight_decay=0.1
)


def _batch(rng, ga, b, t, vocab=CFG.vocab_size, packed=False):
    tokens = rng.integers(0, vocab, size=(ga, b, t + 1)).astype(np.int32)
    segments = np.ones_like(tokens)
    loss_mask = np.ones(tokens[..., 1:].shape, np.float32)
    if packed:
        segments[..., t // 2 :] = 2
        segments[:, 0, -3:] = 0  # a padded tail in one row of each micro-batch
        loss_mask[:, 0, -3:] = 0
    return Batch(tokens, segments, loss_mask)


def test_schedule_matches_the_gpt3_shape():
    s = optimizer.schedule(TRAIN)
    assert float(s(0)) == 0.0
    np.testing.assert_allclose(float(s(1)), TRAIN.lr / 3, rtol=1e-6)
    np.testing.assert_allclose(float(s(3)), TRAIN.lr, rtol=1e-6)
    mid = TRAIN.end_lr + 0.5 * (TRAIN.lr - TRAIN.end_lr)  # half-way through the half-cosine
    np.testing.assert_allclose(float(s(3 + 5)), mid, rtol=1e-5)
    np.testing.assert_allclose(float(s(13)), TRAIN.end_lr, rtol=1e-6)
    np.testing.assert_allclose(float(s(1000)), TRAIN.end_lr, rtol=1e-6)


def test_optimizer_matches_a_hand_written_adamw():
    """One update of our chain equals clip → Adam → decay on matrices only → × −lr, written out."""
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=(4,)).astype(np.float32)}
    grads = {"w": 3 * rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=(4,)).astype(np.float32)}
    cfg = dataclasses.replace(TRAIN, warmup_steps=0)
    tx = optimizer.make_optimizer(cfg)
    state = tx.init(params)
    updates, _ = tx.update(grads, state, params)

    norm = np.sqrt(sum(np.sum(g**2) for g in grads.values()))
    scale = min(1.0, 1.0 / norm)
    lr = float(optimizer.schedule(cfg)(0))
    for k in params:
        g = grads[k] * scale
        m, v = 0.1 * g / (1 - 0.9), 0.001 * g**2 / (1 - 0.999)
        u = m / (np.sqrt(v) + 1e-8)
        if params[k].ndim > 1:
            u = u + cfg.weight_decay * params[k]
        np.testing.assert_allclose(updates[k], -lr * u, rtol=1e-5, atol=1e-7)


def test_freezing_by_pattern_and_schedule_restart():
    model = GPTJ(CFG)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    params = nn.meta.unbox(params)
    tx = optimizer.make_optimizer(TRAIN, params, freeze=["wte", "layers/attn/*"])
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    updates, state = tx.update(grads, state, params)
    assert float(jnp.abs(updates["wte"]).max()) == 0.0
    assert float(jnp.abs(updates["layers"]["attn"]["q_proj"]).max()) == 0.0
    assert float(jnp.abs(updates["layers"]["mlp"]["fc_in"]["kernel"]).max()) == 0.0  # lr(0) = 0 in warmup
    _, state = tx.update(grads, state, params)
    counts = [x for x in jax.tree.leaves(state) if x.ndim == 0]
    assert counts and all(int(c) == 2 for c in counts)
    restarted = optimizer.restart_schedule(state)
    sched = [
        s
        for s in jax.tree.leaves(restarted, is_leaf=lambda n: isinstance(n, optax.ScaleByScheduleState))
        if isinstance(s, optax.ScaleByScheduleState)
    ]
    assert sched and all(int(s.count) == 0 for s in sched)
    adam = [
        s
        for s in jax.tree.leaves(restarted, is_leaf=lambda n: isinstance(n, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)
    ]
    assert adam and all(int(s.count) == 2 for s in adam)
    with pytest.raises(ConfigError, match=r"train.freeze patterns \['encoder/\*'\] match no parameter"):
        optimizer.make_optimizer(TRAIN, params, freeze=["encoder/*"])


def _run(mesh_shape, batches, accumulated=True):
    model = GPTJ(CFG)
    mesh = partitioning.make_mesh(mesh_shape)
    tx = optimizer.make_optimizer(TRAIN)
    shardings = steps.state_shardings(model, tx, mesh)
    state = steps.create_state(model, tx, mesh, jax.random.key(0))
    step = steps.compile_train_step(
        model, tx, shardings, data_sharding=steps.batch_sharding(mesh, accumulated), lr_fn=optimizer.schedule(TRAIN)
    )
    out = []
    with partitioning.sharding_scope(mesh):
        for batch in batches:
            state, metrics = step(state, batch)
            out.append({k: float(v) for k, v in metrics.items()})
    return state, out


def test_grad_accumulation_equals_one_larger_batch():
    rng = np.random.default_rng(1)
    big = [_batch(rng, 1, 8, 16, packed=True) for _ in range(3)]
    # the same tokens as 4 micro-batches of 2 rows
    split = [jax.tree.map(lambda x: x.reshape(4, 2, *x.shape[2:]), b) for b in big]
    state_a, metrics_a = _run((2, 2, 2), big)
    state_b, metrics_b = _run((1, 2, 1), split)
    for a, b in zip(metrics_a, metrics_b):
        assert a["tokens"] == b["tokens"]
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)
        np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=1e-5)
    for x, y in zip(jax.tree.leaves(state_a.params), jax.tree.leaves(state_b.params), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_tiny_model_overfits_one_batch():
    batch = _batch(np.random.default_rng(2), 1, 4, 16)
    cfg = dataclasses.replace(TRAIN, lr=1e-2, end_lr=1e-2, warmup_steps=5, anneal_steps=1, weight_decay=0.0)
    model = GPTJ(CFG)
    mesh = partitioning.make_mesh((2, 2, 2))
    tx = optimizer.make_optimizer(cfg)
    state = steps.create_state(model, tx, mesh, jax.random.key(0))
    step = steps.compile_train_step(
        model,
        tx,
        steps.state_shardings(model, tx, mesh),
        data_sharding=steps.batch_sharding(mesh, accumulated=True),
        lr_fn=optimizer.schedule(cfg),
    )
    with partitioning.sharding_scope(mesh):
        losses = []
        for _ in range(150):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
    assert losses[0] > 3.5  # ≈ ln(64) at init
    assert losses[-1] < 0.05, losses[-10:]


def test_eval_step_is_token_weighted():
    rng = np.random.default_rng(3)
    batch = _batch(rng, 1, 4, 12, packed=True)
    model = GPTJ(CFG)
    mesh = partitioning.make_mesh((1, 1, 1))
    params = steps.create_state(model, optimizer.make_optimizer(TRAIN), mesh, jax.random.key(0)).params
    shardings = steps.state_shardings(model, optimizer.make_optimizer(TRAIN), mesh).params
    evaluate = steps.compile_eval_step(model, shardings, data_sharding=steps.batch_sharding(mesh, accumulated=True))
    out = evaluate(params, batch)
    logits = model.apply({"params": params}, batch.tokens[0, :, :-1], segment_ids=batch.segment_ids[0, :, :-1])
    logp = jax.nn.log_softmax(logits)
    nll = -np.take_along_axis(np.asarray(logp), batch.tokens[0, :, 1:, None], -1)[..., 0]
    w = batch.loss_mask[0]
    assert float(out["tokens"]) == w.sum()
    np.testing.assert_allclose(float(out["loss_sum"]), (nll * w).sum(), rtol=1e-5)


def test_chunked_loss_equals_the_full_logits_loss():
    """The LM head applied a chunk at a time gives the loss and gradients of the full logits."""
    model = GPTJ(CFG)
    rng = np.random.default_rng(4)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (3, 23)), jnp.int32)
    weights = jnp.asarray(rng.random((3, 22)) > 0.2, jnp.float32)
    params = nn.meta.unbox(model.init(jax.random.key(0), tokens))["params"]

    def full(p):
        return mean_loss(model.apply({"params": p}, tokens[:, :-1]), tokens[:, 1:], weights, z_loss=1e-4)[0]

    def chunked(p, chunk):
        hidden = model.apply({"params": p}, tokens[:, :-1], method=GPTJ.hidden_states)
        objective, _, total = chunked_loss_sums(hidden, p["lm_head"], tokens[:, 1:], weights, 1e-4, chunk)
        return objective / total

    ref_loss, ref_grads = jax.value_and_grad(full)(params)
    for chunk in (5, 11, 22, 64):  # uneven, two chunks, exact, larger than the sequence
        loss, grads = jax.value_and_grad(chunked)(params, chunk)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
        for x, y in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
