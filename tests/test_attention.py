"""The fused attention backends equal the XLA path, and each platform gets the backend it should.

Splash runs in Pallas' interpreter on CPU (exact, slow), so the shapes are tiny: 128 tokens, the
smallest sequence Splash tiles.
"""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gptj_flax import attention, partitioning
from gptj_flax.model import GPTJ, attention_mask, attention_probs, attention_scores
from tests.helpers import tiny_config

LENGTH = 128
CFG = tiny_config(n_layers=2, d_model=128, n_heads=4, rotary_dim=8, vocab_size=96, max_len=LENGTH)


def segments_and_positions():
    """Row 0: 20 tokens of left padding, then one document. Row 1: three packed documents."""
    segments = np.ones((2, LENGTH), np.int32)
    segments[0, :20] = 0
    segments[1, 50:90] = 2
    segments[1, 90:] = 3
    positions = np.zeros_like(segments)
    positions[0, 20:] = np.arange(LENGTH - 20)
    for start, end in ((0, 50), (50, 90), (90, LENGTH)):
        positions[1, start:end] = np.arange(end - start)
    return segments, positions


def model_outputs(config, mesh_shape):
    """Logits at the real positions and the gradient of a loss that weighs only them, on a mesh."""
    segments, positions = segments_and_positions()
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, LENGTH + 1)).astype(np.int32)
    weights = jnp.asarray(segments != 0, jnp.float32)
    model = GPTJ(config)
    mesh = partitioning.make_mesh(mesh_shape)
    variables, _ = partitioning.sharded_init(model.init, mesh, jax.random.key(0), tokens[:, :-1])

    def loss(params):
        logits = model.apply({"params": params}, tokens[:, :-1], positions, segments)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1)[..., 0]
        return jnp.sum(nll * weights) / jnp.sum(weights), logits

    with partitioning.sharding_scope(mesh):
        (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(variables["params"])
    return np.asarray(logits)[segments != 0], jax.tree.map(np.asarray, grads)


def assert_close(actual, expected, rtol=1e-5):
    """Equal within ``rtol`` of the largest magnitude of ``expected``."""
    scale = float(np.max(np.abs(expected)))
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


@pytest.mark.slow  # Splash runs in Pallas' interpreter on CPU, which compiles slowly
@pytest.mark.parametrize("mesh_shape", [(1, 1, 1), (2, 1, 4)], ids=["1x1x1", "2x1x4"])
def test_splash_in_the_model_equals_the_xla_path(mesh_shape):
    ref_logits, ref_grads = model_outputs(dataclasses.replace(CFG, attention="xla"), mesh_shape)
    logits, grads = model_outputs(dataclasses.replace(CFG, attention="splash"), mesh_shape)
    assert_close(logits, ref_logits)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads), strict=True):
        assert np.all(np.isfinite(g)), path
        assert_close(g, r)


def xla_attention(q, k, v, segment_ids):
    """The model's own XLA attention, on the kernels' [B, heads, T, head_dim] layout."""
    scores = attention_scores(q.transpose(0, 2, 1, 3), k.transpose(0, 1, 3, 2), q.shape[-1])
    return jnp.einsum("bhqk,bhkd->bhqd", attention_probs(scores, attention_mask(segment_ids), q.dtype), v)


def qkv(heads=4, head_dim=32):
    rng = np.random.default_rng(1)
    return tuple(jnp.asarray(rng.standard_normal((2, heads, LENGTH, head_dim)), jnp.float32) for _ in range(3))


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1), (2, 1, 4)], ids=["1x1x1", "2x1x4"])
def test_jax_dot_product_attention_equals_the_xla_path(mesh_shape):
    """``jax.nn.dot_product_attention`` (the cuDNN backend's call) in its XLA implementation, on the
    same padded and packed rows, sharded over batch and heads."""
    segments = jnp.asarray(segments_and_positions()[0])
    real = np.asarray(segments != 0)
    q, k, v = qkv()
    mesh = partitioning.make_mesh(mesh_shape)

    def both(q, k, v):
        fused = attention.dot_product_attention(q, k, v, segments, implementation="xla")
        return fused, xla_attention(q, k, v, segments)

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.where(real[:, None, :, None], fn(q, k, v), 0.0) ** 2)

    with partitioning.sharding_scope(mesh):
        fused, ref = jax.jit(both)(q, k, v)
        grads = jax.jit(jax.grad(loss(lambda *a: both(*a)[0]), argnums=(0, 1, 2)))(q, k, v)
        ref_grads = jax.jit(jax.grad(loss(lambda *a: both(*a)[1]), argnums=(0, 1, 2)))(q, k, v)
    assert_close(np.asarray(fused).transpose(0, 2, 1, 3)[real], np.asarray(ref).transpose(0, 2, 1, 3)[real])
    for g, r in zip(grads, ref_grads, strict=True):
        assert_close(g, r)


def test_splash_kernel_under_shard_map_sees_per_device_shapes():
    """On mesh (2, 1, 4) the rules put batch over data and heads over model: one row and one head
    per device, and the result still equals the XLA path's."""
    segments = jnp.asarray(segments_and_positions()[0])
    real = np.asarray(segments != 0)
    q, k, v = qkv()
    backend = attention.choose(dataclasses.replace(CFG, attention="splash"), LENGTH)
    seen = []
    original = attention._splash_per_device

    def spy(backend, q, *rest):
        seen.append(q.shape)
        return original(backend, q, *rest)

    mesh = partitioning.make_mesh((2, 1, 4))
    attention._splash_per_device = spy
    try:
        with partitioning.sharding_scope(mesh):
            out = jax.jit(lambda q, k, v: attention.kernel_attention(backend, q, k, v, segments))(q, k, v)
    finally:
        attention._splash_per_device = original
    assert seen == [(1, 1, LENGTH, 32)]
    ref = xla_attention(q, k, v, segments)
    assert_close(np.asarray(out).transpose(0, 2, 1, 3)[real], np.asarray(ref).transpose(0, 2, 1, 3)[real])


GPU = SimpleNamespace(platform="gpu")
TPU = SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")
TPU_V3 = SimpleNamespace(platform="tpu", device_kind="TPU v3")


def test_auto_is_xla_on_cpu_without_a_notice(caplog):
    with caplog.at_level(logging.WARNING, logger="gptj_flax.attention"):
        backend = attention.choose(CFG, LENGTH)
    assert (backend.name, caplog.records) == ("xla", [])
    assert CFG.attention == "auto"  # the default


def test_sequences_shorter_than_a_splash_block_take_xla_silently(caplog):
    with caplog.at_level(logging.WARNING, logger="gptj_flax.attention"):
        backend = attention.choose(dataclasses.replace(CFG, attention="splash"), 1, TPU)
    assert (backend.name, caplog.records) == ("xla", [])


def test_auto_picks_splash_on_tpu_and_cudnn_on_gpu(monkeypatch):
    bf16 = dataclasses.replace(CFG, dtype="bfloat16")
    tpu = attention.choose(bf16, 2048, TPU)
    assert (tpu.name, tpu.interpret, tpu.block) == ("splash", False, 512)
    monkeypatch.setattr(attention, "_compute_capability", lambda: (9, 0))
    assert attention.choose(bf16, 2048, GPU).name == "cudnn"


@pytest.mark.parametrize(
    "changes, length, device, capability, reason",
    [
        ({"attention": "cudnn"}, LENGTH, None, None, "needs an NVIDIA GPU and this is cpu"),
        ({"attention": "splash"}, 200, None, None, "sequence length (200) to be a multiple of 128"),
        ({"attention": "splash"}, LENGTH, GPU, None, "Splash attention is a TPU kernel"),
        ({}, 2048, TPU_V3, None, "Mosaic cannot compile the Splash kernel for TPU v3 (TPU v4 or later needed)"),
        ({"dtype": "float32"}, LENGTH, GPU, (9, 0), "takes bfloat16 or float16, model.dtype is float32"),
        (
            {"dtype": "bfloat16", "d_model": 1024},
            LENGTH,
            GPU,
            (8, 0),
            "takes head_dim <= 128 (a multiple of 8) on this GPU, the model's is 256",
        ),
    ],
)
def test_a_kernel_that_cannot_run_falls_back_to_xla_with_one_notice(
    changes, length, device, capability, reason, monkeypatch, caplog
):
    monkeypatch.setattr(attention, "_notices_given", set())
    monkeypatch.setattr(attention, "_compute_capability", lambda: capability)
    config = dataclasses.replace(CFG, **changes)
    with caplog.at_level(logging.WARNING, logger="gptj_flax.attention"):
        backends = [attention.choose(config, length, device) for _ in range(3)]
    assert {b.name for b in backends} == {"xla"} and reason in backends[0].reason
    assert [r.getMessage() for r in caplog.records] == [f"attention: {backends[0].reason}; using the XLA attention"]


def test_the_head_dim_limit_is_256_from_hopper_on(monkeypatch):
    monkeypatch.setattr(attention, "_compute_capability", lambda: (9, 0))
    config = dataclasses.replace(CFG, dtype="bfloat16", d_model=1024)
    assert (config.head_dim, attention.choose(config, LENGTH, GPU).name) == (256, "cudnn")
