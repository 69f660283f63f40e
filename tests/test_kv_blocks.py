"""The blocked decoding cache (``model.BlockedKVCache``): its block and chunk sizes, its cut and
merge, and decode steps over it against the same steps over one plain ``KVCache`` (itself checked
against the full forward pass and HuggingFace in ``test_sampling_generate``), float32 and int8,
for any blocking, with rows that hold no sequence and a window of fewer chunks than the cache."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gptj_flax import partitioning
from gptj_flax.model import GPTJ, BlockedKVCache, KVCache, block_sizes, chunk_sizes
from gptj_flax.sampling import LanguageModel
from gptj_flax.sampling.decoding import chunk_buckets
from gptj_flax.sampling.samplers import SamplingParams
from gptj_flax.sampling.slots import Request
from tests.helpers import tiny_config

CFG = tiny_config(n_layers=2, d_model=64, n_heads=4, rotary_dim=8, vocab_size=96, max_len=64, scan_layers=False)
PROMPT, STEPS, COLUMNS = 5, 6, 40


def test_row_blocks_hold_exactly_each_power_of_two_count_of_rows():
    assert block_sizes(32, 1) == (1, 1, 2, 4, 8, 16)
    assert block_sizes(32, 8) == (8, 8, 16)
    assert block_sizes(24, 8) == (8, 8, 8)  # the last cut short
    assert block_sizes(5, 8) == (5,)
    for total, first in [(32, 1), (64, 8), (48, 4), (7, 1)]:
        ends = np.cumsum(block_sizes(total, first))
        assert ends[-1] == total
        assert all(first * 2**k in ends for k in range(8) if first * 2**k < total)


def test_column_chunks_and_the_chunk_counts_programs_are_compiled_for():
    assert chunk_sizes(512, 64) == (64,) * 8
    assert chunk_sizes(40, 16) == (16, 16, 8)
    assert chunk_buckets(8) == [1, 2, 3, 4, 6, 8]
    assert chunk_buckets(1) == [1]
    assert chunk_buckets(5) == [1, 2, 3, 4, 5]
    for total in range(1, 40):
        counts = chunk_buckets(total)
        # every needed count is served by one less than half as large again
        assert all(min(c for c in counts if c >= n) < 1.5 * n for n in range(2, total + 1))
        assert len(counts) <= 2 * total.bit_length()


def split(cache: KVCache, rows: tuple[int, ...], columns: tuple[int, ...]) -> BlockedKVCache:
    """``cache``'s arrays cut into row blocks ``rows`` and column chunks ``columns`` (sizes)."""
    row_starts, column_starts = np.cumsum((0, *rows)), np.cumsum((0, *columns))

    def cut(x, column_axis: int):
        return tuple(
            tuple(
                jax.lax.slice_in_dim(x[r0 : r0 + r], c0, c0 + c, axis=column_axis)
                for c0, c in zip(column_starts, columns)
            )
            for r0, r in zip(row_starts, rows)
        )

    return BlockedKVCache(
        k=tuple(cut(x, 3) for x in cache.k),
        v=tuple(cut(x, 2) for x in cache.v),
        segment_ids=cache.segment_ids,
        index=cache.index,
        k_scale=tuple(cut(x, 2) for x in cache.k_scale),
        v_scale=tuple(cut(x, 2) for x in cache.v_scale),
    )


def _random_cache(config, rows: int, columns: int) -> KVCache:
    rng = np.random.default_rng(1)
    cache = KVCache.empty(config, rows, columns)
    return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype) if x.ndim > 1 else x, cache)


def test_split_view_and_merge_keep_every_value_in_its_place():
    cache = _random_cache(CFG, 6, COLUMNS)
    blocked = split(cache, (2, 4), (16, 16, 8))
    assert (blocked.rows, blocked.columns) == (6, 40)
    view = blocked.view(1, 2)
    assert (view.rows, view.columns) == (2, 32)
    np.testing.assert_array_equal(view.k[1][0][1], cache.k[1][:2, :, :, 16:32])
    np.testing.assert_array_equal(view.v[0][0][0], cache.v[0][:2, :, :16])
    changed = view.replace(k=jax.tree.map(lambda x: x + 1, view.k))
    merged = blocked.merge(changed)
    assert jax.tree.structure(merged) == jax.tree.structure(blocked)
    np.testing.assert_array_equal(merged.k[0][0][1], cache.k[0][:2, :, :, 16:32] + 1)
    np.testing.assert_array_equal(merged.k[0][0][2], cache.k[0][:2, :, :, 32:])  # outside the view: unchanged
    np.testing.assert_array_equal(merged.k[0][1][0], cache.k[0][2:, :, :, :16])


def _join(grid, axis: int) -> np.ndarray:
    return np.concatenate([np.concatenate([np.asarray(c) for c in row], axis=axis) for row in grid], axis=0)


@pytest.mark.parametrize("kv_cache", [None, "int8"])
@pytest.mark.parametrize("rows, chunk", [((3,), 40), ((1, 2), 16), ((1, 1, 1), 8)])
def test_decode_slot_steps_over_a_blocked_cache_equal_the_plain_caches_steps(kv_cache, rows, chunk):
    """Prefill into a plain cache, then STEPS one-token steps: GPTJ.decode over the plain cache, and
    GPTJ.decode_slots over its blocked copy (viewing only the chunks the steps reach): equal logits
    and, joined back, an equal cache."""
    config = dataclasses.replace(CFG, kv_cache=kv_cache)
    model = GPTJ(config)
    params = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    batch = 3
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (batch, PROMPT + STEPS)), jnp.int32)
    plain_step = jax.jit(lambda t, pos, cache: model.apply({"params": params}, t, pos, None, cache, method=GPTJ.decode))
    slot_step = jax.jit(
        lambda t, pos, cache: model.apply(
            {"params": params}, t, pos, jnp.ones(batch, bool), cache, method=GPTJ.decode_slots
        )
    )
    prompt_positions = jnp.broadcast_to(jnp.arange(PROMPT), (batch, PROMPT))
    _, plain = plain_step(tokens[:, :PROMPT], prompt_positions, KVCache.empty(config, batch, COLUMNS))
    blocked = split(plain, rows, chunk_sizes(COLUMNS, chunk))
    blocked = blocked.replace(index=jnp.full((batch,), PROMPT, jnp.int32))  # one slot per row
    for step in range(STEPS):
        token, position = tokens[:, PROMPT + step : PROMPT + step + 1], jnp.full((batch, 1), PROMPT + step)
        want, plain = plain_step(token, position, plain)
        chunks = -(-(PROMPT + step + 1) // chunk)
        got, view = slot_step(token, position, blocked.view(len(rows), chunks))
        blocked = blocked.merge(view)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for layer in range(CFG.n_layers):
        np.testing.assert_allclose(_join(blocked.k[layer], 3), plain.k[layer], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(_join(blocked.v[layer], 2), plain.v[layer], rtol=1e-5, atol=1e-5)
        if kv_cache:
            np.testing.assert_allclose(_join(blocked.k_scale[layer], 2), plain.k_scale[layer], rtol=1e-6)
    assert np.asarray(blocked.index).tolist() == [PROMPT + STEPS] * batch == [int(plain.index)] * batch


def test_rows_past_the_busy_ones_in_a_block_write_nothing():
    """decode_slots with fewer rows than its view's blocks (a lone request in a block of 4): the
    busy row's logits are those of the same step run alone, and the idle rows' blocks are unchanged."""
    model = GPTJ(CFG)
    params = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    cache = split(_random_cache(CFG, 4, 16), (4,), (16,))
    cache = cache.replace(index=jnp.array([3, 5, 7, 9], jnp.int32), segment_ids=jnp.ones((4, 16), jnp.int32))
    step = jax.jit(
        lambda t, pos, active, c: model.apply({"params": params}, t, pos, active, c, method=GPTJ.decode_slots)
    )
    token, active = jnp.array([[7]]), jnp.array([True])
    lone, after = step(token, cache.index[:1, None], active, cache)
    alone = split(_random_cache(CFG, 4, 16), (1, 3), (16,))
    alone = alone.replace(index=cache.index, segment_ids=cache.segment_ids)
    want, _ = step(token, cache.index[:1, None], active, alone.view(1, 1))
    np.testing.assert_allclose(lone, want, rtol=1e-5, atol=1e-5)
    for layer in range(CFG.n_layers):
        np.testing.assert_array_equal(np.asarray(after.k[layer][0][0])[1:], np.asarray(cache.k[layer][0][0])[1:])
        np.testing.assert_array_equal(np.asarray(after.v[layer][0][0])[1:], np.asarray(cache.v[layer][0][0])[1:])
    assert np.asarray(after.index).tolist() == [4, 5, 7, 9]


def test_the_slots_decode_step_never_copies_a_cache_block():
    """Each step writes its new slot into the blocks in place and reads them where they lie."""
    lm = LanguageModel(CFG, GPTJ(CFG).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    lm.decoder.chunk_columns = 16  # three chunks, of which the step reads one
    slots = lm.slots(slots=8, length=48, chunk=16)
    slots.admit([Request([1, 2, 3], 4, -1, 0, SamplingParams.build(1, temperature=0.0))], [2])
    decoder = lm.decoder
    with partitioning.sharding_scope(decoder.mesh, decoder.rules):
        hlo = slots._decode.lower(decoder.params, slots.state, np.zeros(8, bool), np.int32(1), 1, 4).compile().as_text()
    shapes = {
        f"f32[{','.join(map(str, a.shape))}]" for a in jax.tree.leaves((slots.state.cache.k, slots.state.cache.v))
    }
    copies = [
        line
        for line in hlo.splitlines()
        if re.search(r"= f32\[[0-9,]+\]\S* copy\(", line) and line.split("=")[1].split()[0].split("{")[0] in shapes
    ]
    assert not copies, "\n".join(copies[:4])
