"""The paged decoding cache (``model.PagedKVCache``) and its host page table (``slots.PageTable``):
pool blocks, the table's lowest-first pages, each
step's page layout against numpy, and decode steps over pages scattered through the pool against
the same steps over one plain ``KVCache`` (itself checked against the full forward pass and
HuggingFace in ``test_sampling_generate``), float32 and int8, with idle rows and a view of fewer
blocks than the pool."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gptj_flax import partitioning
from gptj_flax.model import GPTJ, KVCache, PagedKVCache, page_layout, pool_blocks
from gptj_flax.sampling import LanguageModel
from gptj_flax.sampling.samplers import SamplingParams
from gptj_flax.sampling.slots import PageTable, Request
from tests.helpers import tiny_config

CFG = tiny_config(n_layers=2, d_model=64, n_heads=4, rotary_dim=8, vocab_size=96, max_len=64, scan_layers=False)
PROMPT, STEPS, COLUMNS = 5, 6, 40


def test_pool_blocks_double_up_to_a_quarter_of_the_pool():
    assert pool_blocks(256, 4) == (4, 4, 8, 16, 32, 64, 64, 64)
    assert pool_blocks(1024, 4) == (4, 4, 8, 16, 32, 64, 128, 256, 256, 256)
    assert pool_blocks(40, 4) == (4, 4, 8, 8, 8, 8)  # the largest within a quarter: 8
    assert pool_blocks(50, 4) == (4, 4, 8, 8, 8, 8, 8, 2)  # the last cut short
    assert pool_blocks(3, 4) == (3,)
    assert pool_blocks(96, 16) == (16,) * 6  # a quarter is below twice the first
    for pages in range(1, 600, 7):
        blocks = pool_blocks(pages, 4)
        assert sum(blocks) == pages and len(blocks) <= 12
        ends = np.cumsum(blocks)
        # the fewest blocks that hold the first n pages hold fewer than 2n (or 4) pages
        for n in range(1, pages + 1):
            assert ends[np.searchsorted(ends, n)] < max(2 * n, 5)


def test_the_page_table_hands_out_the_lowest_free_pages_and_takes_them_back():
    table = PageTable(rows=3, per_row=4, page=8)
    table.start(0, 10)  # 10 slots: two pages
    table.start(2, 1)
    assert table.ids[0, :2].tolist() == [0, 1] and table.ids[2, 0] == 2
    assert (table.ids[1] == table.pages).all() and table.end() == 3 and table.in_use == 3
    table.grow(2, 8)  # 9 slots: a second page
    assert table.ids[2, :2].tolist() == [2, 3]
    table.free(0)
    assert table.in_use == 2 and (table.ids[0] == table.pages).all()
    table.start(1, 17)  # three pages: the two row 0 gave back, then the next one
    assert table.ids[1, :3].tolist() == [0, 1, 4] and table.end() == 5
    table.grow(1, 100)  # never past the row's last page
    assert table.held[1] == 4 and table.reach[1] == 32
    table.start(1, 3)  # a new sequence in the slot gives back the old one's pages first
    assert table.ids[1, 0] == 0 and table.in_use == 3


def test_the_page_layout_says_which_row_owns_each_page_and_what_it_sees():
    page, blocks = 4, (4, 4, 2)
    pages = sum(blocks)
    table = jnp.array([[3, 7, pages], [1, pages, pages], [8, 0, 5]], jnp.int32)
    index = jnp.array([5, 2, 11], jnp.int32)  # the slot each row writes now
    active = jnp.array([True, True, False])
    layout = page_layout(table, index, active, blocks, page)
    assert int(layout.reads) == 2  # pages 0 … 7 hold the active rows' pages; the idle row's 8 is not read
    assert np.asarray(layout.write_page).tolist() == [7, 1, pages]  # the idle row writes nowhere
    assert np.asarray(layout.write_slot).tolist()[:2] == [1, 2]
    owner = np.full(pages, -1)
    owner[[3, 7]], owner[1], owner[[8, 0, 5]] = 0, 1, 2
    np.testing.assert_array_equal(layout.owner, owner)
    visible = np.zeros((pages, page), bool)
    visible[3], visible[7, :2] = True, True  # row 0: slots 0 … 5
    visible[1, :3] = True  # row 1: slots 0 … 2
    np.testing.assert_array_equal(layout.visible, visible)  # the idle row sees nothing


def to_pages(
    cache: KVCache, table: np.ndarray, page: int, blocks: tuple[int, ...], unread: int | None = None
) -> PagedKVCache:
    """``cache``'s rows cut into pages of ``page`` slots placed where ``table`` [rows, per_row] says,
    in a pool of ``blocks`` (other pages random: nothing may read them; NaN from block ``unread`` on,
    where a step must not even read them)."""
    rng = np.random.default_rng(7)
    starts = np.cumsum((0, *blocks))

    def pool(x, axis: int):
        rows, columns = x.shape[0], x.shape[axis]
        pages = np.asarray(rng.standard_normal((sum(blocks), *x.shape[1:axis], page, *x.shape[axis + 1 :])), x.dtype)
        if unread is not None and np.issubdtype(x.dtype, np.floating):
            pages[starts[unread] :] = np.nan
        x = np.asarray(x)
        for r in range(rows):
            for i, p in enumerate(table[r]):
                if p < sum(blocks) and i * page < columns:
                    piece = np.take(x[r], range(i * page, min(columns, (i + 1) * page)), axis=axis - 1)
                    target = [p, *[slice(None)] * (axis - 1), slice(0, piece.shape[axis - 1])]
                    pages[tuple(target)] = piece
        return tuple(jnp.asarray(pages[a:b]) for a, b in zip(starts[:-1], starts[1:], strict=True))

    return PagedKVCache(
        k=tuple(pool(x, 3) for x in cache.k),
        v=tuple(pool(x, 2) for x in cache.v),
        index=jnp.broadcast_to(cache.index, (cache.k[0].shape[0],)).astype(jnp.int32),
        k_scale=tuple(pool(x, 2) for x in cache.k_scale),
        v_scale=tuple(pool(x, 2) for x in cache.v_scale),
    )


def from_pages(pool, table: np.ndarray, axis: int, columns: int) -> np.ndarray:
    """Each row's slots ``0 … columns-1`` gathered from its pages (``axis``: the slot axis)."""
    pages = np.concatenate([np.asarray(b) for b in pool])
    rows = [np.concatenate([pages[p] for p in row], axis=axis - 1) for row in table]
    return np.take(np.stack(rows), range(columns), axis=axis)


@pytest.mark.parametrize("kv_cache", [None, "int8"])
@pytest.mark.parametrize("page, blocks", [(8, (6, 6, 6, 6)), (16, (4, 4, 4, 4)), (40, (3, 2))])
def test_decode_slot_steps_over_a_paged_cache_equal_the_plain_caches_steps(kv_cache, page, blocks):
    """Prefill into a plain cache, then STEPS one-token steps: GPTJ.decode over the plain cache, and
    GPTJ.decode_slots over a copy in pages scattered through the pool (in no order, and viewing
    only the blocks that hold them): equal logits and, gathered back, an equal cache. The blocks
    past those hold NaN, which any read of them would spread into the logits."""
    config = dataclasses.replace(CFG, kv_cache=kv_cache)
    model = GPTJ(config)
    params = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    batch, per_row = 3, -(-COLUMNS // page)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (batch, PROMPT + STEPS)), jnp.int32)
    plain_step = jax.jit(lambda t, pos, cache: model.apply({"params": params}, t, pos, None, cache, method=GPTJ.decode))
    slot_step = jax.jit(
        lambda t, pos, cache, table: model.apply(
            {"params": params}, t, pos, jnp.ones(batch, bool), cache, table, method=GPTJ.decode_slots
        )
    )
    prompt_positions = jnp.broadcast_to(jnp.arange(PROMPT), (batch, PROMPT))
    _, plain = plain_step(tokens[:, :PROMPT], prompt_positions, KVCache.empty(config, batch, COLUMNS))
    used = batch * per_row
    assert used <= sum(blocks)
    table = np.random.default_rng(3).permutation(used).reshape(batch, per_row).astype(np.int32)
    held = int(np.searchsorted(np.cumsum(blocks), used)) + 1  # the blocks that hold every page in use
    assert held < len(blocks)
    paged = to_pages(plain, table, page, blocks, unread=held)
    for step in range(STEPS):
        token, position = tokens[:, PROMPT + step : PROMPT + step + 1], jnp.full((batch, 1), PROMPT + step)
        want, plain = plain_step(token, position, plain)
        got, paged = slot_step(token, position, paged, jnp.asarray(table))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    end = PROMPT + STEPS
    for layer in range(CFG.n_layers):
        np.testing.assert_allclose(from_pages(paged.k[layer], table, 3, end), plain.k[layer][..., :end], atol=1e-5)
        np.testing.assert_allclose(from_pages(paged.v[layer], table, 2, end), plain.v[layer][:, :, :end], atol=1e-5)
        if kv_cache:
            np.testing.assert_allclose(
                from_pages(paged.k_scale[layer], table, 2, end), plain.k_scale[layer][..., :end], rtol=1e-6
            )
    assert np.asarray(paged.index).tolist() == [end] * batch == [int(plain.index)] * batch


def test_idle_rows_write_nothing_and_a_lone_row_sees_only_its_pages():
    """decode_slots with one active row of four: its logits are those of the step run with the other
    rows' pages gone from the table, and no page but the one it writes changes."""
    model = GPTJ(CFG)
    params = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    page, pages = 8, 8
    rng = np.random.default_rng(1)
    plain = KVCache.empty(CFG, 4, 16)
    plain = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype) if x.ndim > 1 else x, plain)
    table = np.array([[5, 2], [0, 1], [3, 4], [6, 7]], np.int32)
    cache = to_pages(plain, table, page, (4, 4)).replace(index=jnp.array([9, 5, 7, 3], jnp.int32))
    step = jax.jit(
        lambda t, pos, active, c, table: model.apply(
            {"params": params}, t, pos, active, c, table, method=GPTJ.decode_slots
        )
    )
    token, positions = jnp.array([[7], [1], [2], [3]]), cache.index[:, None]
    active = jnp.array([True, False, False, False])
    got, after = step(token, positions, active, cache, jnp.asarray(table))
    alone = np.full_like(table, pages)
    alone[0] = table[0]
    want, _ = step(token, positions, active, cache, jnp.asarray(alone))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    for layer in range(CFG.n_layers):
        before, now = np.concatenate(cache.k[layer]), np.concatenate(after.k[layer])
        changed = np.flatnonzero((before != now).any(axis=(1, 2, 3)))
        assert changed.tolist() == [2], changed  # row 0 writes slot 9: slot 1 of its second page, 2
        np.testing.assert_array_equal(np.delete(now, 2, 0), np.delete(before, 2, 0))
    assert np.asarray(after.index).tolist() == [10, 5, 7, 3]


def _slots(page: int, **kwargs):
    lm = LanguageModel(CFG, GPTJ(CFG).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    lm.decoder.page_columns = page
    return lm, lm.slots(**kwargs)


def _request(n_prompt: int, n_new: int) -> Request:
    return Request(list(range(1, n_prompt + 1)), n_new, -1, 0, SamplingParams.build(1, temperature=0.0))


def test_the_slots_decode_step_never_copies_a_pool_block():
    """Each step writes its new slot into the pages in place and reads them where they lie."""
    lm, slots = _slots(16, slots=8, length=48, chunk=16)  # 24 pages: blocks of 16 and 8
    slots.admit([_request(3, 4)], [2])
    decoder = lm.decoder
    with partitioning.sharding_scope(decoder.mesh, decoder.rules):
        args = (decoder.params, slots.state, np.zeros(8, bool), np.int32(1), slots.table.ids)
        hlo = slots.programs.decode.lower(*args, rows=8).compile().as_text()
    shapes = {
        f"f32[{','.join(map(str, a.shape))}]" for a in jax.tree.leaves((slots.state.cache.k, slots.state.cache.v))
    }
    copies = [
        line
        for line in hlo.splitlines()
        if re.search(r"= f32\[[0-9,]+\]\S* copy\(", line) and line.split("=")[1].split()[0].split("{")[0] in shapes
    ]
    assert not copies, "\n".join(copies[:4])


def test_sequences_take_pages_as_they_grow_and_give_them_back_when_they_end():
    lm, slots = _slots(8, slots=8, length=64, chunk=16)  # 64 pages of 8 slots
    assert slots.blocks == (4, 4, 8, 16, 16, 16)
    slots.admit([_request(10, 30), _request(3, 30)], [0, 1])
    assert slots.table.held[:2].tolist() == [2, 1] and slots.table.in_use == 3  # 10 and 3 slots
    for _ in range(7):  # 17 and 10 slots: a third page and a second
        slots.decode([], 1)
    assert slots.table.held[:2].tolist() == [3, 2]
    assert slots.table.end() == 5  # pages 0 … 4: a step reads the first two blocks
    for ids, reads in ((slots.table.ids, 2), ([[3, 64, 64]], 1), ([[16, 64]], 4), ([[31, 32]], 5)):
        ids = jnp.asarray(ids, jnp.int32)
        layout = page_layout(ids, jnp.zeros(len(ids), jnp.int32), jnp.ones(len(ids), bool), slots.blocks, 8)
        assert int(layout.reads) == reads, (ids, reads)
    slots.decode([1], 1)  # released: its pages go back at once
    assert slots.table.held[1] == 0 and slots.table.in_use == 3
    slots.free([0])
    assert slots.table.in_use == 0 and slots.table.end() == 0
    # a row's tokens still come out right on the pages another row gave back
    first = slots.admit([_request(7, 5)], [3])
    got = [int(first.tokens[0, 0])]
    for _ in range(4):
        got.append(int(slots.decode([], 1).tokens[3, 0]))
    want = lm.generate(list(range(1, 8)), 5, temperature=0.0, ignore_eos=True, return_tokens=True).tokens
    assert got == want
