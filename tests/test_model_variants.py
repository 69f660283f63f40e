"""Model options change speed and memory, never results: scan vs unrolled, remat policies, dtypes."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gptj_flax.config import REMAT_POLICIES
from gptj_flax.model import GPTJ, stack_layers, unstack_layers
from tests.helpers import mean_loss, tiny_config

CFG = tiny_config(n_layers=3, d_model=64, n_heads=4, rotary_dim=8, vocab_size=96)


@pytest.fixture(scope="module")
def batch():
    return jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, size=(2, 13)), jnp.int32)


def _loss_grads(cfg, variables, tokens):
    def loss_fn(v):
        return mean_loss(GPTJ(cfg).apply(v, tokens[:, :-1]), tokens[:, 1:])[0]

    return jax.jit(jax.value_and_grad(loss_fn))(variables)


def test_scan_and_unrolled_stacks_give_the_same_outputs(batch):
    scanned_cfg = dataclasses.replace(CFG, scan_layers=True)
    unrolled_cfg = dataclasses.replace(CFG, scan_layers=False)
    scanned = nn.meta.unbox(GPTJ(scanned_cfg).init(jax.random.key(0), batch))
    unrolled = {"params": unstack_layers(scanned["params"])}
    assert set(unrolled["params"]) == {"wte", "ln_f", "lm_head", "layer_0", "layer_1", "layer_2"}

    a = GPTJ(scanned_cfg).apply(scanned, batch)
    b = GPTJ(unrolled_cfg).apply(unrolled, batch)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)

    loss_a, grads_a = _loss_grads(scanned_cfg, scanned, batch)
    loss_b, grads_b = _loss_grads(unrolled_cfg, unrolled, batch)
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
    grads_b = {"params": stack_layers(grads_b["params"], CFG.n_layers)}
    for x, y in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)

    # the two layouts convert into each other exactly
    restacked = stack_layers(unrolled["params"], CFG.n_layers)
    for x, y in zip(jax.tree.leaves(restacked), jax.tree.leaves(scanned["params"]), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
@pytest.mark.parametrize("policy", [p for p in REMAT_POLICIES if p != "none"])
def test_remat_changes_nothing_numerically(batch, policy, scan):
    base = dataclasses.replace(CFG, scan_layers=scan, remat_policy="none")
    variables = nn.meta.unbox(GPTJ(base).init(jax.random.key(1), batch))
    loss_ref, grads_ref = _loss_grads(base, variables, batch)
    loss, grads = _loss_grads(dataclasses.replace(base, remat_policy=policy), variables, batch)
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
    for x, y in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


def test_remat_really_recomputes(batch):
    """With remat 'full' the backward pass re-runs the forward matmuls (more dots in the HLO)."""
    base = dataclasses.replace(CFG, scan_layers=False)
    variables = nn.meta.unbox(GPTJ(base).init(jax.random.key(1), batch))

    def count_dots(cfg):
        fn = jax.value_and_grad(lambda v: mean_loss(GPTJ(cfg).apply(v, batch[:, :-1]), batch[:, 1:])[0])
        return str(jax.jit(fn).lower(variables).as_text()).count("dot_general")

    assert count_dots(dataclasses.replace(base, remat_policy="full")) > count_dots(base)


def test_bf16_compute_keeps_float32_params_and_logits(batch):
    cfg = dataclasses.replace(CFG, dtype="bfloat16", param_dtype="float32")
    variables = nn.meta.unbox(GPTJ(cfg).init(jax.random.key(2), batch))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(variables))
    logits = GPTJ(cfg).apply(variables, batch)
    assert logits.dtype == jnp.float32
    ref = GPTJ(dataclasses.replace(cfg, dtype="float32")).apply(variables, batch)
    assert float(jnp.max(jnp.abs(logits - ref))) < 0.05 * float(jnp.max(jnp.abs(ref)))


def test_initialisation_follows_the_original():
    cfg = tiny_config(n_layers=4, d_model=256, n_heads=4, rotary_dim=16, vocab_size=1024)
    params = nn.meta.unbox(GPTJ(cfg).init(jax.random.key(3), jnp.zeros((1, 4), jnp.int32)))["params"]
    layers = params["layers"]
    # untruncated stddev σ, cut at ±2σ → sample std ≈ 0.88 σ
    trunc = 0.8796
    np.testing.assert_allclose(np.std(layers["attn"]["q_proj"]), trunc * 256**-0.5, rtol=0.03)
    np.testing.assert_allclose(np.std(layers["mlp"]["fc_out"]["kernel"]), trunc * (2 / 4) / 16, rtol=0.03)
    np.testing.assert_allclose(np.std(params["wte"]), trunc * 1024**-0.5, rtol=0.03)
    assert np.all(layers["ln_1"]["scale"] == 1) and np.all(layers["mlp"]["fc_in"]["bias"] == 0)
