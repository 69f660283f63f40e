"""The int8 KV cache (``model.kv_cache="int8"``): the quantiser's error bound, the model's logits
against the float cache's over a prefill and decode steps, greedy generation through ``load`` on
one device and 8-way tensor parallel, the serving slots against ``generate``, the cache's bytes and
the refusals of a bad value."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gptj_flax
from gptj_flax import partitioning
from gptj_flax.config import Config, ConfigError, ModelConfig
from gptj_flax.model import GPTJ, KVCache, dequantize_kv, quantize_kv
from gptj_flax.sampling import SamplingError
from gptj_flax.sampling.samplers import SamplingParams
from gptj_flax.sampling.serving_fit import serving_fit
from gptj_flax.sampling.slots import Request
from tests.helpers import tiny_config
from tests.test_quantize import random_params, save
from tests.test_sampling_api import make_tokenizer

# head_dim 16; 8 heads, so an 8-way model axis splits them one per device
CFG = tiny_config(n_layers=2, d_model=128, n_heads=8, rotary_dim=8, vocab_size=320, max_len=64, scan_layers=False)
INT8 = dataclasses.replace(CFG, kv_cache="int8")
# Measured: the largest logit difference of this random model, int8 cache against float, is 0.011
# (logits up to ~4); the bound leaves about 3x room for other platforms' rounding.
LOGIT_TOLERANCE = 0.03


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, seed=3)


@pytest.fixture(scope="module")
def checkpoint_path(tmp_path_factory, params):
    path = save(tmp_path_factory.mktemp("float"), CFG, params)
    make_tokenizer().save_pretrained(os.path.join(path, "tokenizer"))
    return path


def cached_logits(config: ModelConfig, params, tokens, prompt_len: int) -> tuple[np.ndarray, KVCache]:
    """float32 logits [B, T, V] of a prefill of ``tokens[:, :prompt_len]`` and then one decode step
    per remaining token (teacher-forced, so both caches see the same tokens), and the final cache."""
    apply = jax.jit(functools.partial(GPTJ(config).apply, method=GPTJ.decode))
    batch, length = tokens.shape
    logits, cache = apply({"params": params}, tokens[:, :prompt_len], None, None, KVCache.empty(config, batch, length))
    steps = [logits]
    for t in range(prompt_len, length):
        positions = jnp.full((batch, 1), t, jnp.int32)
        logits, cache = apply({"params": params}, tokens[:, t : t + 1], positions, None, cache)
        steps.append(logits)
    return np.asarray(jnp.concatenate(steps, axis=1)), cache


def test_quantise_round_trip_is_within_half_a_step_of_each_vector():
    # vectors of very different sizes along head_dim (axis 2), and one all-zero vector
    x = jax.random.normal(jax.random.key(0), (2, 3, 16, 5)) * jnp.logspace(-3, 2, 5)
    x = x.at[1, 2, :, 4].set(0.0)
    q, scale = quantize_kv(x, axis=2)
    assert q.dtype == jnp.int8 and scale.dtype == jnp.float32 and scale.shape == (2, 3, 5)
    assert int(jnp.max(jnp.abs(q))) == 127 and int(jnp.min(q)) >= -127
    np.testing.assert_array_equal(jnp.max(jnp.abs(q), axis=2)[scale > 0], 127)  # every vector uses the range
    np.testing.assert_allclose(scale, jnp.max(jnp.abs(x), axis=2) / 127, rtol=1e-6)
    error = jnp.abs(dequantize_kv(q, scale, axis=2) - x)
    assert bool(jnp.all(error <= scale[:, :, None, :] * (0.5 + 1e-5)))
    assert float(scale[1, 2, 4]) == 0.0 and not bool(jnp.any(dequantize_kv(q, scale, axis=2)[1, 2, :, 4]))


def test_int8_cache_logits_follow_the_float_caches_over_a_prefill_and_decode_steps(params):
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, CFG.vocab_size)
    floats, float_cache = cached_logits(CFG, params, tokens, prompt_len=12)
    int8, int8_cache = cached_logits(INT8, params, tokens, prompt_len=12)
    assert float_cache.k_scale == () and float_cache.k[0].dtype == jnp.float32  # the default is unchanged
    np.testing.assert_allclose(floats, GPTJ(CFG).apply({"params": params}, tokens), atol=1e-4)
    assert int8_cache.k[0].dtype == int8_cache.v[0].dtype == jnp.int8
    assert int8_cache.k_scale[0].shape == int8_cache.v_scale[0].shape == (2, CFG.n_heads, 24)
    diff = np.abs(int8 - floats)
    print(
        f"\nrandom model, 12 prompt + 12 decode positions: logits max |int8 - float| {diff.max():.4f} "
        f"(mean {diff.mean():.5f}, logits up to {np.abs(floats).max():.2f}); greedy choice equal at "
        f"{100 * np.mean(int8.argmax(-1) == floats.argmax(-1)):.0f}% of positions"
    )
    assert 0 < diff.max() < LOGIT_TOLERANCE


@pytest.fixture(scope="module")
def int8_one_device(checkpoint_path):
    lm = gptj_flax.load(checkpoint_path, kv_cache="int8")
    return lm, greedy(lm)


PROMPTS = [[5, 17, 3, 99, 42], [7, 7, 1]]  # token ids: generation without the tokenizer's stop
NEW_TOKENS = 16
AGREE_FIRST = 4  # tokens that must equal the float cache's (measured: all 16 do on this model)


def greedy(lm) -> list[list[int]]:
    completions = lm.generate(PROMPTS, NEW_TOKENS, temperature=0.0, ignore_eos=True, return_tokens=True)
    return [c.tokens for c in completions]


@pytest.mark.parametrize("mesh", [(1, 1, 1), (1, 1, 8)])
def test_greedy_generation_with_an_int8_cache_agrees_with_the_float_cache(checkpoint_path, int8_one_device, mesh):
    int8 = gptj_flax.load(checkpoint_path, mesh=mesh, kv_cache="int8")
    assert int8.config.kv_cache == "int8" and "KV cache int8" in repr(int8)
    # the scales are split over heads like the cache they scale
    axes = KVCache.logical_axes(int8.decoder.config)
    shardings = partitioning.logical_to_sharding(axes, int8.mesh, int8.decoder.rules)
    assert shardings.k_scale[0].spec[1] == shardings.k[0].spec[1] == "model"
    got = greedy(int8)
    floats = greedy(gptj_flax.load(checkpoint_path, mesh=mesh))
    assert got == int8_one_device[1]  # the same tokens on every mesh
    assert all(len(t) == NEW_TOKENS for t in got)
    assert all(g[:AGREE_FIRST] == f[:AGREE_FIRST] for g, f in zip(got, floats))
    agree = np.mean([a == b for g, f in zip(got, floats) for a, b in zip(g, f)])
    print(f"\nmesh {mesh}: greedy tokens with the int8 cache equal the float cache's at {100 * agree:.0f}% of 32")


def test_decode_slots_with_an_int8_cache_give_generates_tokens(int8_one_device):
    """Short prompts admitted together and a long one prefilled chunk by chunk, each then decoded in
    its slot, come out as ``generate`` with the int8 cache gives each prompt alone."""
    lm, _ = int8_one_device
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 300, n).tolist() for n in (3, 7, 5, 40)]
    n = 12
    slots = lm.slots(slots=4, length=64, chunk=16)
    requests = [Request(p, n, -1, 0, SamplingParams.build(1, temperature=0.0)) for p in prompts]
    first = slots.admit(requests[:3], [0, 1, 2])
    got = {r: [int(first.tokens[r, 0])] for r in range(3)}
    prefill = slots.start_prefill(requests[3])
    chunks = 0
    while not prefill.done:
        slots.prefill_chunk(prefill)
        chunks += 1
    assert chunks >= 2  # the long prompt really was prefilled in chunks
    got[3] = [int(slots.insert(prefill, 3).tokens[0, 0])]
    for _ in range(n - 1):
        out = slots.decode([], 1)
        for r in range(4):
            got[r].append(int(out.tokens[r, 0]))
    for r, prompt in enumerate(prompts):
        want = lm.generate(prompt, n, temperature=0.0, ignore_eos=True, return_tokens=True).tokens
        assert got[r] == want, r


def cache_bytes(cache: KVCache) -> int:
    return sum(x.nbytes for x in (*cache.k, *cache.v, *cache.k_scale, *cache.v_scale))


def test_an_int8_cache_takes_about_half_a_bf16_caches_bytes():
    # head_dim 256, as GPT-J's: one float32 scale per 256 int8 entries
    bf16 = ModelConfig(n_layers=2, d_model=512, n_heads=2, rotary_dim=64, vocab_size=128, dtype="bfloat16")
    int8 = dataclasses.replace(bf16, kv_cache="int8")
    full, half = KVCache.empty(bf16, 2, 128), KVCache.empty(int8, 2, 128)
    ratio = cache_bytes(half) / cache_bytes(full)
    assert ratio == (256 + 4) / (2 * 256)
    print(f"\nhead_dim 256: int8 cache bytes / bf16's = {ratio:.4f}")
    with_segments = [sum(x.nbytes for x in jax.tree.leaves(c)) for c in (half, full)]
    assert with_segments[0] / with_segments[1] < 0.52


def test_serving_fit_counts_the_int8_cache_and_its_scales():
    config = Config(model=INT8)
    float_fit = serving_fit(Config(model=CFG), "v5e:1x1", batch=4, cache_len=32, chunk=16)
    fit = serving_fit(config, "v5e:1x1", batch=4, cache_len=32, chunk=16)
    layers, d, h = CFG.n_layers, CFG.d_model, CFG.n_heads
    # the 4 slots hold whole pages, 256 columns each on a TPU, and the chunked prompt's own row 32
    columns = 4 * 256 + 32
    index_and_segments = 32 * 4 + (4 + 1) * 4  # the prompt row's segment ids; every row's index
    assert float_fit.cache_bytes == 2 * layers * columns * d * 4 + index_and_segments
    assert fit.cache_bytes == layers * columns * (2 * d + 2 * h * 4) + index_and_segments
    assert fit.kv_cache == "int8" and "(int8 KV cache)" in fit.format()


def test_a_bad_kv_cache_value_is_named(checkpoint_path):
    with pytest.raises(ConfigError, match=r"model.kv_cache='int4' is not one of \['int8'\]"):
        dataclasses.replace(CFG, kv_cache="int4")
    with pytest.raises(SamplingError, match=r"kv_cache='fp8' is not one of \['int8'\]"):
        gptj_flax.load(checkpoint_path, kv_cache="fp8")


def test_the_config_omits_an_unset_kv_cache():
    assert "kv_cache" not in Config(model=CFG).to_dict()["model"]  # old readers and checkpoints unchanged
    assert Config(model=INT8).to_dict()["model"]["kv_cache"] == "int8"
