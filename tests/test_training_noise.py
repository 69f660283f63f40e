"""The gradient-noise statistics (``train.noise_scale_alpha``): one step's logged values against numpy
from that step's micro-batch gradients taken apart on one device, ``B_simple`` against the known
noise scale of synthetic gradients, their averages across a resume, and accumulation 1 (a warning)."""

import dataclasses
import json
import logging
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gptj_flax import checkpoint, partitioning
from gptj_flax.config import Config, ConfigError, MeshConfig, ModelConfig, TrainConfig, from_dict
from gptj_flax.data import Batch
from gptj_flax.training import TrainSetup, start, train
from gptj_flax.training.metrics import GradientNoiseScale
from tests.training_helpers import make_config

GA = 3
# 32 sequences a micro-batch keep the replicas' gradients small enough (|G_big|² < 2) for the averages.
NOISE = dict(noise_scale_alpha=0.5, grad_accum_steps=GA, batch_size=32, val_set={}, warmup_steps=1)
NAMES = ("noise/G_noise", "noise/S_noise", "noise/G_noise_avg", "noise/S_noise_avg", "noise/B_simple")


@pytest.fixture(scope="module")
def corpus(stdlib_corpus):
    return stdlib_corpus(max_bytes=100_000)


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """Four steps on a mesh with data parallelism (2 x 2 data-parallel replicas, 2-way model parallel)."""
    run = tmp_path_factory.mktemp("straight") / "run"
    train(make_config(corpus, run, total_steps=4, **NOISE), mesh=partitioning.make_mesh((2, 2, 2)), progress=False)
    return run


def _rows(run_dir) -> dict[int, dict]:
    lines = (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row for row in map(json.loads, lines) if "train/loss" in row}


def _mean_token_loss(model, params, tokens, segments, mask):
    """Cross-entropy averaged over the rows' target tokens (documents packed in a row attend only
    within themselves), written out with log_softmax."""
    logits = model.apply({"params": params}, tokens[:, :-1], segment_ids=segments[:, :-1]).astype(jnp.float32)
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1)[..., 0]
    return -jnp.sum(picked * mask) / jnp.sum(mask)


def _expected_first_step(config, mesh, scratch) -> dict[str, float]:
    """Step 1's statistics from its micro-batches' gradients, each replica's share taken on its own on
    one device, and device_train.py's formulas in numpy."""
    setup = TrainSetup.build(config, mesh)
    params = jax.tree.map(np.asarray, setup.init_state().params)
    ckpt = checkpoint.Checkpointer(scratch)
    batch = next(start.open_data(setup, ckpt, None, {}, progress=False).train_batches)
    ckpt.close()
    assert batch.tokens.shape[0] == GA and np.all(batch.loss_mask == 1)  # packed rows: every token counts
    replicas = partitioning.data_parallel_size(mesh)
    rows = batch.tokens.shape[1] // replicas
    grad = jax.jit(jax.grad(lambda p, *rows: _mean_token_loss(setup.model, p, *rows)))  # one device: plain arrays
    flat = [  # [GA][replica] → each share's gradient, one vector
        [
            np.concatenate(
                [
                    np.ravel(g)
                    for g in jax.tree.leaves(
                        grad(params, batch.tokens[i, s], batch.segment_ids[i, s], batch.loss_mask[i, s])
                    )
                ]
            ).astype(np.float64)
            for s in (slice(r * rows, (r + 1) * rows) for r in range(replicas))
        ]
        for i in range(GA)
    ]
    g = np.array(flat)  # [GA, R, params]
    norm_micro = np.mean(np.linalg.norm(g, axis=-1))  # each micro-batch's own norm, over replicas and micro-batches
    norm_big = np.mean(np.linalg.norm(g.mean(axis=0), axis=-1))  # each replica's accumulated gradient, over replicas
    small, big = norm_micro**2, norm_big**2
    out = {"noise/G_noise": (GA * big - small) / (GA - 1), "noise/S_noise": (small - big) / (1 - 1 / GA)}
    if big < 2:  # the first step entering the averages initialises them
        out.update({"noise/G_noise_avg": out["noise/G_noise"], "noise/S_noise_avg": out["noise/S_noise"]})
        out["noise/B_simple"] = out["noise/S_noise"] / out["noise/G_noise"]
    return out, small


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1), (2, 2, 2)])
def test_one_steps_statistics_equal_numpy_from_its_micro_batch_gradients(corpus, straight, tmp_path, mesh_shape):
    mesh = partitioning.make_mesh(mesh_shape)
    config = make_config(corpus, straight if mesh_shape == (2, 2, 2) else tmp_path / "run", total_steps=1, **NOISE)
    if mesh_shape != (2, 2, 2):
        train(config, mesh=mesh, progress=False)
    logged = _rows(config.train.run_dir)[1]
    expected, scale = _expected_first_step(config, mesh, tmp_path / "scratch")
    assert set(NAMES) == set(expected) == {k for k in logged if k.startswith("noise/")}
    for name, value in expected.items():
        # G and S are differences of squared norms: float32 gradients fix them to a part in 10^5 of those
        assert abs(logged[name] - value) <= 1e-5 * scale * max(1.0, abs(value)), (name, logged[name], value)


def test_a_resumed_run_continues_the_averages(corpus, straight, tmp_path):
    resumed = make_config(corpus, tmp_path / "resumed", total_steps=4, ckpt_every=2, **NOISE)
    mesh = partitioning.make_mesh((2, 2, 2))
    train(resumed, mesh=mesh, stop_after=2, progress=False)
    train(resumed, mesh=mesh, progress=False)
    a, b = _rows(straight), _rows(tmp_path / "resumed")
    assert sorted(b) == [1, 2, 3, 4]
    for step in (3, 4):
        assert {k for k in a[step] if k.startswith("noise/")} == set(NAMES), a[step]
        for name in NAMES:
            assert abs(a[step][name] - b[step][name]) <= 1e-5 * abs(a[step][name]), (step, name)


def _b_simple(rng, grad, noise_variances, steps=2500, alpha=0.01):
    """Drive the host-side estimator with micro-batch gradients ``grad + noise`` (independent noise of
    the given per-coordinate variances), as a step with one replica reports them."""
    noise = GradientNoiseScale(accum_steps=16, alpha=alpha)
    stats = {}
    for _ in range(steps):
        micro = grad + rng.normal(size=(16, grad.size)) * np.sqrt(noise_variances)
        stats = noise.update(float(np.linalg.norm(micro.mean(axis=0))), float(np.mean(np.linalg.norm(micro, axis=1))))
    return stats["noise/B_simple"]


@pytest.mark.parametrize(
    "grad_sq, variances",
    [
        (0.01, lambda d, rng: np.full(d, 1.0 / d)),  # isotropic noise, trace 1: B = 100
        (0.1, lambda d, rng: (v := rng.uniform(0.1, 1.9, d)) * (0.8 / v.sum())),  # uneven variances, trace 0.8: B = 8
    ],
)
def test_b_simple_recovers_a_known_noise_scale(grad_sq, variances):
    rng = np.random.default_rng(0)
    d = 2000
    direction = rng.normal(size=d)
    grad = direction * np.sqrt(grad_sq) / np.linalg.norm(direction)
    var = variances(d, rng)
    truth = var.sum() / grad_sq  # B_simple = tr(Σ) / |G|²
    assert abs(_b_simple(rng, grad, var) - truth) <= 0.1 * truth


def test_the_averages_take_only_steps_with_small_gradients_and_the_first_initialises():
    noise = GradientNoiseScale(accum_steps=4, alpha=0.25)
    early = noise.update(norm_big=2.0, norm_micro=3.0)  # |G_big|² = 4 >= 2: not averaged
    assert early == {"noise/G_noise": (4 * 4 - 9) / 3, "noise/S_noise": (9 - 4) / 0.75}
    first = noise.update(norm_big=1.0, norm_micro=2.0)
    g1, s1 = (4 - 4) / 3 + 0.0, (4 - 1) / 0.75
    assert first["noise/G_noise_avg"] == g1 and first["noise/S_noise_avg"] == s1
    assert np.isnan(first["noise/B_simple"])  # G_noise_avg 0: no ratio
    second = noise.update(norm_big=1.0, norm_micro=1.5)
    g2, s2 = (4 - 2.25) / 3, (2.25 - 1) / 0.75
    assert second["noise/G_noise_avg"] == pytest.approx(0.75 * g1 + 0.25 * g2)
    assert second["noise/S_noise_avg"] == pytest.approx(0.75 * s1 + 0.25 * s2)
    assert second["noise/B_simple"] == pytest.approx(second["noise/S_noise_avg"] / second["noise/G_noise_avg"])
    restored = GradientNoiseScale(accum_steps=4, alpha=0.25)
    restored.restore(noise.state())
    assert restored.update(1.0, 1.2) == noise.update(1.0, 1.2)


def test_with_accumulation_1_a_warning_names_the_key_and_the_step_compiles_nothing_more(corpus, tmp_path, caplog):
    config = make_config(corpus, tmp_path / "run", total_steps=2, grad_accum_steps=1, noise_scale_alpha=0.01)
    with caplog.at_level(logging.WARNING, logger="gptj_flax.training"):
        train(config, progress=False)
    warnings = [r.getMessage() for r in caplog.records if "noise_scale_alpha" in r.getMessage()]
    assert len(warnings) == 1 and "train.grad_accum_steps=1" in warnings[0], warnings
    assert not [k for row in _rows(tmp_path / "run").values() for k in row if k.startswith("noise/")]

    def lowered(cfg):
        setup = TrainSetup.build(cfg)
        with partitioning.sharding_scope(setup.mesh):
            return setup.compile()[0].lower(setup.targets, setup.abstract_batch()).as_text()

    plain = make_config(corpus, tmp_path / "run", total_steps=2, grad_accum_steps=1)
    assert lowered(config) == lowered(plain)


def test_the_key_is_read_from_legacy_configs_and_checked():
    legacy = json.loads(open("configs/6B_roto_256.json").read())
    assert from_dict({**legacy, "noise_scale_alpha": 0.01}).train.noise_scale_alpha == 0.01
    assert from_dict(legacy).train.noise_scale_alpha is None  # off unless set
    for bad in (0, 1.5, -0.1, "0.01", True, float("nan")):
        with pytest.raises(ConfigError, match=r"train.noise_scale_alpha must be a number in \(0, 1\]"):
            from_dict({**legacy, "noise_scale_alpha": bad})


@pytest.mark.slow  # Splash in Pallas' interpreter compiles slowly on CPU (about a minute on 2 loaded cores)
def test_the_replica_split_composes_with_the_splash_kernel():
    """Splash runs under its own shard_map, here vmapped over the replicas (Pallas' interpreter on CPU)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (2, 4, 129)).astype(np.int32)
    batch = Batch(tokens, np.ones_like(tokens), np.ones((2, 4, 128), np.float32))
    metrics = {}
    for attention in ("xla", "splash"):
        model = ModelConfig(
            n_layers=1, d_model=256, n_heads=2, rotary_dim=64, vocab_size=256, max_len=128, dtype="float32"
        )
        train_config = TrainConfig(batch_size=4, grad_accum_steps=2, noise_scale_alpha=0.01, warmup_steps=1)
        config = Config(dataclasses.replace(model, attention=attention), MeshConfig(2, 2, 2), train_config)
        setup = TrainSetup.build(config)
        assert setup.attention.name == attention and setup.noise_replicas == 4
        with partitioning.sharding_scope(setup.mesh):
            _, out = setup.compile()[0](setup.init_state(), jax.device_put(batch, setup.train_sharding))
        metrics[attention] = {k: float(v) for k, v in jax.device_get(out).items()}
    assert metrics["xla"].keys() == metrics["splash"].keys() >= {"grad_norm_micro", "grad_norm_replica"}
    for name, value in metrics["xla"].items():
        assert metrics["splash"][name] == pytest.approx(value, rel=1e-5), name
