"""benchmarks/bounds.py: the decode and train bounds follow from the model's real parameter tree,
and the measured limits are sane numbers."""

import dataclasses
import math

import jax
import numpy as np
import pytest
from flax import traverse_util

from benchmarks import bounds
from gptj_flax.model import abstract_params
from tests.helpers import tiny_config

CFG = tiny_config(n_layers=3, d_model=64, n_heads=4, vocab_size=200)


def _leaf_sizes() -> dict[tuple[str, ...], int]:
    tree = jax.tree.map(
        lambda x: x.value if hasattr(x, "value") else x, abstract_params(CFG), is_leaf=lambda x: hasattr(x, "value")
    )
    return {path: math.prod(leaf.shape) for path, leaf in traverse_util.flatten_dict(tree).items()}


def test_weight_bytes_are_the_parameter_trees_bytes():
    assert bounds.weight_bytes(CFG) == 4 * sum(_leaf_sizes().values())


def test_a_batch_one_decode_step_is_bound_by_reading_its_weights_once():
    sizes = _leaf_sizes()
    embedding = sizes[("wte",)]
    assert embedding == CFG.vocab_size * CFG.d_model, sizes.keys()
    weights, context = sum(sizes.values()) - embedding, 10
    kv = 2 * CFG.n_layers * context * CFG.d_model
    expected_bytes = 4 * (weights + CFG.d_model + kv)  # matmul weights, one embedding row, one row's K/V cache
    bound = bounds.decode_bound(CFG, 1, context, bandwidth=1e9, flops=1e15)
    assert bound.limit == "memory"
    assert bound.bytes_per_step == expected_bytes
    assert bound.tokens_per_s == pytest.approx(1e9 / expected_bytes)


def test_an_int8_kv_cache_is_read_at_a_byte_per_entry_and_a_scale_per_head():
    int8 = dataclasses.replace(CFG, kv_cache="int8")
    context = 10
    float_kv = 2 * CFG.n_layers * context * CFG.d_model * 4
    int8_kv = 2 * CFG.n_layers * context * (CFG.d_model + 4 * CFG.n_heads)
    step = bounds.decode_bound(CFG, 1, context, bandwidth=1e9, flops=1e15).bytes_per_step
    assert bounds.decode_bound(int8, 1, context, bandwidth=1e9, flops=1e15).bytes_per_step == step - float_kv + int8_kv


def test_a_large_batch_decode_step_is_bound_by_arithmetic_when_flops_are_scarce():
    batch, context = 64, 10
    bound = bounds.decode_bound(CFG, batch, context, bandwidth=1e12, flops=1e9)
    weights = CFG.param_count() - CFG.vocab_size * CFG.d_model
    flops = batch * (2 * weights + 4 * CFG.n_layers * CFG.d_model * context)
    assert bound.limit == "compute"
    assert bound.tokens_per_s == pytest.approx(batch * 1e9 / flops)
    assert bound.reached(bound.tokens_per_s / 2) == pytest.approx(0.5)


def test_the_train_bound_is_the_ceiling_over_the_flops_per_token():
    bound = bounds.train_bound(CFG, 32, flops=1e11)
    assert bound.tokens_per_s == pytest.approx(1e11 / CFG.flops_per_token(32))


def test_measured_limits_are_finite_and_positive():
    read = bounds.decode_read_speed(CFG, repeats=2)
    assert np.isfinite(read.bytes_per_s) and read.bytes_per_s > 1e6
    assert read.weight_bytes == 4 * (CFG.param_count() - CFG.vocab_size * CFG.d_model - _norms_and_biases())
    assert np.isfinite(peak := bounds.matmul_ceiling("float32", n=64, repeats=2)) and peak > 1e6
    assert bounds.matmul_ceiling("bf16", n=64, repeats=1) > 0


def _norms_and_biases() -> int:
    """The parameters a decode step reads beside its weight matrices (layer norms, biases)."""
    return sum(size for path, size in _leaf_sizes().items() if path[-1] in ("bias", "scale"))


def test_the_read_speed_says_cache_where_the_weights_fit_the_last_level_cache_and_memory_where_not():
    matrices = bounds.decode_read_speed(CFG, repeats=1).weight_bytes
    assert bounds.decode_read_speed(CFG, repeats=1, cache_bytes=matrices).where == "cache"
    assert bounds.decode_read_speed(CFG, repeats=1, cache_bytes=matrices - 1).where == "memory"
    assert bounds.decode_read_speed(CFG, repeats=1, cache_bytes=None).where == "memory"  # unknown: never assumed
    bound = bounds.decode_bound(CFG, 1, 10, bandwidth=1e9, flops=1e15, reads="cache")
    assert bound.limit == "cache" and "a cache bound" in bounds.decode_read_speed(CFG, 1, matrices).describe()


def _fake_caches(root, levels: dict[int, str]) -> str:
    for i, (level, size) in enumerate(levels.items()):
        entry = root / f"index{i}"
        entry.mkdir()
        (entry / "level").write_text(f"{level}\n")
        (entry / "size").write_text(f"{size}\n")
    return str(root)


def test_the_last_level_cache_is_sysfs_highest_level(tmp_path):
    assert bounds.last_level_cache_bytes(_fake_caches(tmp_path, {1: "48K", 2: "1024K", 3: "32768K"})) == 32 * 2**20


def test_lscpu_gives_the_last_level_cache_of_one_instance():
    listing = "L1d cache: 96 KiB (2 instances)\nL2 cache: 2 MiB (2 instances)\nL3 cache: 300 MiB (2 instances)\n"
    assert bounds._lscpu_last_level(listing) == 150 * 2**20
    assert bounds._lscpu_last_level("L3 cache: 32 MiB\n") == 32 * 2**20
    assert bounds._lscpu_last_level("Model name: AMD EPYC\n") is None


def test_a_figure_over_its_bound_is_a_failed_measurement_not_a_share():
    bound = bounds.decode_bound(CFG, 1, 10, bandwidth=1e9, flops=1e15)
    assert bounds.share(bound.tokens_per_s * 0.5, bound) == "50%"
    assert bounds.share(bound.tokens_per_s, bound) == "100%"
    assert bounds.share(bound.tokens_per_s * 1.21, bound) == bounds.FAILED
