"""GPT-J as Flax linen modules, read top to bottom: rotary embedding, masks, the KV cache, attention,
the MLP, the parallel block, the causal LM and its two parameter layouts (per-token scores and the
loss are in :mod:`gptj_flax.losses`).

Parameters and activations carry logical axis names; where those live on the mesh is decided by
the rules table in :mod:`gptj_flax.partitioning`, never here. The GPT-J quirks that decide parity
with HuggingFace ``GPTJForCausalLM`` are reproduced: one LayerNorm feeding attention and MLP in
parallel, "rotate every two" rotary on the first ``rotary_dim`` dims of each head, attention
without biases, and an untied LM head with a bias.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gptj_flax import attention, partitioning
from gptj_flax.config import LoraConfig, ModelConfig

Array = jax.Array

# Logical shape of the residual stream between blocks.
RESIDUAL_AXES = ("batch", "length", "activation_embed")

# Which config field sets the size of each logical axis a parameter is split along (for errors).
AXIS_FIELDS = {"embed": "model.d_model", "heads": "model.n_heads", "mlp": "model.d_ff", "vocab": "model.vocab_size"}

REMAT_POLICIES: dict[str, Callable | None] = {
    "full": jax.checkpoint_policies.nothing_saveable,  # recompute everything in the backward pass
    "dots": jax.checkpoint_policies.checkpoint_dots,  # keep matmul outputs, recompute the rest
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep weight matmuls only
}


def _init(stddev: float, axes: tuple[str, ...]):
    # Haiku's TruncatedNormal(stddev) as the original used: stddev of the untruncated normal, cut at ±2σ.
    return nn.with_logical_partitioning(nn.initializers.truncated_normal(stddev), axes)


def _zeros(axes):
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), axes)


def _ones(axes):
    return nn.with_logical_partitioning(nn.initializers.ones_init(), axes)


# An int8 model's projection kernel ``NAME`` has its per-output-channel scale beside it, ``NAME_scale``.
SCALE_SUFFIX = "_scale"


def project(
    module: nn.Module, name: str, x: Array, spec: str, shape: tuple[int, ...], stddev: float, axes: tuple[str, ...]
) -> Array:
    """``einsum(spec, x, kernel)`` in the compute dtype, declaring the kernel ``name`` on ``module``.

    With ``config.quantize == "int8"`` the kernel is stored int8 with a scale per output channel (the
    kernel's dims after those ``x`` contracts): the convert to the compute dtype is fused by XLA into
    the matmul's operand read, and the scale multiplies the much smaller output. Such a model is
    made by quantising a float one (:mod:`gptj_flax.convert.quantize`), so its init values are
    placeholders.
    """
    cfg = module.config
    if cfg.quantize is None:
        kernel = module.param(name, _init(stddev, axes), shape, cfg.weight_dtype)
        return jnp.einsum(spec, x, kernel.astype(cfg.compute_dtype))
    operands, output = spec.split("->")
    n_in = sum(dim not in output for dim in operands.split(",")[1])  # the contracted dims lead the kernel
    kernel = module.param(name, _zeros(axes), shape, jnp.int8)
    scale = module.param(name + SCALE_SUFFIX, _ones(axes[n_in:]), shape[n_in:], jnp.float32)
    return jnp.einsum(spec, x, kernel.astype(cfg.compute_dtype)) * scale.astype(cfg.compute_dtype)


# --------------------------------------------------------------------------------------------
# Rotary position embedding ("rotate every two")


def rotary_tables(positions: Array, rotary_dim: int) -> tuple[Array, Array]:
    """sin, cos of shape [batch, length, rotary_dim], each frequency repeated for its pair."""
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / rotary_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, rotary_dim/2]
    return jnp.repeat(jnp.sin(angles), 2, axis=-1), jnp.repeat(jnp.cos(angles), 2, axis=-1)


def apply_rotary(x: Array, sin: Array, cos: Array) -> Array:
    """Rotate the first ``rotary_dim`` dims of every head of ``x`` [B, T, heads, head_dim]."""
    rotary_dim = sin.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim].astype(jnp.float32), x[..., rotary_dim:]
    pairs = x_rot.reshape(*x_rot.shape[:-1], rotary_dim // 2, 2)
    # rot(x)[2i] = -x[2i+1], rot(x)[2i+1] = x[2i]
    rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x_rot.shape)
    sin, cos = sin[:, :, None, :], cos[:, :, None, :]  # broadcast over heads
    out = x_rot * cos + rotated * sin
    return jnp.concatenate([out.astype(x.dtype), x_pass], axis=-1)


# --------------------------------------------------------------------------------------------
# Masks


def attention_mask(segment_ids: Array) -> Array:
    """Boolean [B, 1, T, T]: causal, within one segment, never onto padding (segment id 0).

    Packed documents get distinct segment ids, so none attends across a document boundary;
    left padding gets segment 0.
    """
    length = segment_ids.shape[-1]
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    real_key = (segment_ids != 0)[:, None, :]
    return (causal[None] & same & real_key)[:, None]


def cache_attention_mask(query_segments: Array, key_segments: Array, index: Array) -> Array:
    """Boolean [B, 1, T, S] for T new tokens written at cache slots ``index … index+T-1``.

    A query sees the cache slots up to its own (causal by slot), in its own segment, never padding
    or slots not yet written (both segment 0).
    """
    length, slots = query_segments.shape[1], key_segments.shape[1]
    query_slot = index + jnp.arange(length)
    causal = jnp.arange(slots)[None, :] <= query_slot[:, None]
    same = query_segments[:, :, None] == key_segments[:, None, :]
    real_key = (key_segments != 0)[:, None, :]
    return (causal[None] & same & real_key)[:, None]


# --------------------------------------------------------------------------------------------
# KV cache: explicit arrays passed in and returned, no hidden module state

# Logical axes of one layer's cached keys and values: heads split over "model" like the attention
# weights, batch over the data-parallel axes like the activations. Each is laid out the way its
# attention matmul reads it — keys [head_dim, length] (q·kᵀ contracts head_dim), values
# [length, head_dim] — since any other layout makes XLA transpose the whole cache at every step.
KEY_AXES = ("batch", "heads", "kv", "length")
VALUE_AXES = ("batch", "heads", "length", "kv")
# An int8 cache's scales, one per cached key (or value) vector: split like the cache beside them.
SCALE_AXES = ("batch", "heads", "length")


def quantize_kv(x: Array, axis: int) -> tuple[Array, Array]:
    """Symmetric int8 of keys or values ``x`` with one float32 scale per vector along ``axis`` (head_dim).

    ``scale = max|x| / 127``, so every vector's largest entry maps to ±127 and an entry's error is
    at most ``scale / 2``; the scale keeps ``x``'s shape less ``axis``. An all-zero vector gets scale 0.
    """
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=axis) / 127.0
    safe = jnp.expand_dims(jnp.where(scale > 0, scale, 1.0), axis)
    return jnp.clip(jnp.round(x / safe), -127, 127).astype(jnp.int8), scale


def dequantize_kv(q: Array, scale: Array, axis: int, dtype=jnp.float32) -> Array:
    """The values :func:`quantize_kv` stands for, in ``dtype``."""
    return (q.astype(jnp.float32) * jnp.expand_dims(scale, axis)).astype(dtype)


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer for ``length`` slots, filled left to right.

    Fields:
      k: one array per layer of keys (after rotary) [batch, heads, head_dim, length], in the
        compute dtype, or int8 with ``config.kv_cache == "int8"``. One buffer per layer, so each
        layer reads and writes its own in place.
      v: one array per layer of values [batch, heads, length, head_dim], stored as ``k`` is.
      segment_ids: int32 [batch, length]; 0 marks padding and slots not yet written.
      index: int32, the next slot to write: a scalar shared by the batch (prompts are left-padded
        so every row's newest token sits in the same slot), or [batch] for decode slots, where
        each row holds a sequence of its own (``GPTJ.decode_slots``).
      k_scale, v_scale: for an int8 cache, one float32 array per layer [batch, heads, length]: the
        scale of each cached key and value vector (:func:`quantize_kv`); empty for a float cache.
    """

    k: tuple[Array, ...]
    v: tuple[Array, ...]
    segment_ids: Array
    index: Array
    k_scale: tuple[Array, ...] = ()
    v_scale: tuple[Array, ...] = ()

    @classmethod
    def empty(cls, config: ModelConfig, batch: int, length: int) -> KVCache:
        def zeros(*shape, dtype=config.compute_dtype):
            return tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layers))

        heads, head_dim = config.n_heads, config.head_dim
        if config.kv_cache is None:
            return cls(
                k=zeros(batch, heads, head_dim, length),
                v=zeros(batch, heads, length, head_dim),
                segment_ids=jnp.zeros((batch, length), jnp.int32),
                index=jnp.zeros((), jnp.int32),
            )
        return cls(
            k=zeros(batch, heads, head_dim, length, dtype=jnp.int8),
            v=zeros(batch, heads, length, head_dim, dtype=jnp.int8),
            segment_ids=jnp.zeros((batch, length), jnp.int32),
            index=jnp.zeros((), jnp.int32),
            k_scale=zeros(batch, heads, length, dtype=jnp.float32),
            v_scale=zeros(batch, heads, length, dtype=jnp.float32),
        )

    @classmethod
    def logical_axes(cls, config: ModelConfig) -> KVCache:
        """The same tree with a logical PartitionSpec per leaf (for ``logical_to_sharding``)."""
        P = jax.sharding.PartitionSpec
        scales = (P(*SCALE_AXES),) * config.n_layers if config.kv_cache is not None else ()
        return cls(
            k=(P(*KEY_AXES),) * config.n_layers,
            v=(P(*VALUE_AXES),) * config.n_layers,
            segment_ids=P("batch", "length"),
            index=P(),
            k_scale=scales,
            v_scale=scales,
        )

    def layer(self, i: int, index: Array) -> LayerKV:
        """Layer ``i``'s buffers, to be written at ``index``."""
        if not self.k_scale:
            return LayerKV(self.k[i], self.v[i], index)
        return LayerKV(self.k[i], self.v[i], index, self.k_scale[i], self.v_scale[i])

    @classmethod
    def from_layers(cls, layers: list[LayerKV], segment_ids: Array, index: Array) -> KVCache:
        """The cache of ``layers``' buffers (as :meth:`layer` handed them out, updated)."""
        return cls(**_layer_fields(layers), segment_ids=segment_ids, index=index)


def _layer_fields(layers) -> dict:
    """A cache's per-layer fields from its layers (``LayerKV`` or ``PagedLayerKV``)."""
    return {
        "k": tuple(kv.k for kv in layers),
        "v": tuple(kv.v for kv in layers),
        "k_scale": tuple(kv.k_scale for kv in layers if kv.k_scale is not None),
        "v_scale": tuple(kv.v_scale for kv in layers if kv.v_scale is not None),
    }


class LayerKV(NamedTuple):
    """One layer's cached keys and values and the slot the new tokens are written at: a scalar
    (every row at the same slot) or int32 [B], one slot per row (decode slots, one token each).
    An int8 layer has its scales [B, heads, length] besides; a float one has None."""

    k: Array
    v: Array
    index: Array
    k_scale: Array | None = None
    v_scale: Array | None = None


def write_layer_kv(kv: LayerKV, k: Array, v: Array) -> LayerKV:
    """Store new keys [B, heads, head_dim, T] and values [B, heads, T, head_dim] at slot ``kv.index``
    (quantised first, with their scales, if the cache is int8)."""

    def put(buffer: Array, new: Array, slot_axis: int) -> Array:
        new = new.astype(buffer.dtype)
        if kv.index.ndim == 0:
            start = [0] * buffer.ndim
            start[slot_axis] = kv.index
            return lax.dynamic_update_slice(buffer, new, start)
        # one token per row, each at its own slot; the new entries may be for the first rows only
        rows = jnp.arange(new.shape[0])
        return buffer.at[(rows, *[slice(None)] * (slot_axis - 1), kv.index)].set(jnp.take(new, 0, axis=slot_axis))

    scales = {}
    if kv.k_scale is not None and kv.v_scale is not None:
        (k, k_scale), (v, v_scale) = quantize_kv(k, axis=2), quantize_kv(v, axis=3)
        scales = {
            "k_scale": partitioning.constrain(put(kv.k_scale, k_scale, 2), SCALE_AXES),
            "v_scale": partitioning.constrain(put(kv.v_scale, v_scale, 2), SCALE_AXES),
        }
    return kv._replace(
        k=partitioning.constrain(put(kv.k, k, 3), KEY_AXES),
        v=partitioning.constrain(put(kv.v, v, 2), VALUE_AXES),
        **scales,
    )


# One layer's pages of a paged cache, in pool blocks: a tuple of buffers [pages, …] (see PagedKVCache).
Pool = tuple[Array, ...]


def pool_blocks(pages: int, first: int) -> tuple[int, ...]:
    """Pool blocks covering ``pages`` pages: ``first, first, 2·first, 4·first, …``, doubling up to
    the largest such size within a quarter of the pool, then blocks of that size (the last cut
    short). The first ``k`` blocks hold ``first · 2^(k-1)`` pages while they double, so a step that
    reads the fewest blocks holding its pages reads less than twice as many pages as it needs (or
    ``first``), in a handful of blocks whatever the pool's size."""
    largest = first
    while largest * 2 <= pages // 4:
        largest *= 2
    sizes, covered = [], 0
    while covered < pages:
        size = min(max(first, covered), largest, pages - covered)
        sizes.append(size)
        covered += size
    return tuple(sizes)


@flax.struct.dataclass
class PagedKVCache:
    """The decode slots' cache: every sequence's keys and values in pages of ``page`` slots, drawn
    from one pool that all rows share, so a step reads the pages that sequences hold and no more.

    Row ``r``'s sequence lies in the pages a page table names (``table[r, i]`` holds its slots
    ``i·page … (i+1)·page − 1``; the table is the caller's, passed to each step), and ``index[r]`` is
    its length. Each layer's pool is a tuple of buffers (pool blocks) of pages: a step reads only the
    first blocks, those that hold its rows' pages, each a whole buffer read and written in place
    (slicing a window out of one large buffer makes XLA:CPU copy it at every step).

    Fields, per layer, shaped as :class:`KVCache`'s are with the page in the batch axis:
      k: pool blocks of keys [pages, heads, head_dim, page].
      v: pool blocks of values [pages, heads, page, head_dim].
      index: int32 [rows]: each row's length, the slot its next token is written at.
      k_scale, v_scale: an int8 cache's scales, pool blocks [pages, heads, page]; empty for a float cache.
    """

    k: tuple[Pool, ...]
    v: tuple[Pool, ...]
    index: Array
    k_scale: tuple[Pool, ...] = ()
    v_scale: tuple[Pool, ...] = ()

    @classmethod
    def empty(cls, config: ModelConfig, blocks: tuple[int, ...], page: int, rows: int) -> PagedKVCache:
        """A zero pool of blocks of ``blocks`` pages (sizes) of ``page`` slots, for ``rows`` sequences."""
        heads, head_dim = config.n_heads, config.head_dim
        int8 = config.kv_cache is not None
        dtype = jnp.int8 if int8 else config.compute_dtype

        def pool(shape, dtype):
            return tuple(tuple(jnp.zeros(shape(n), dtype) for n in blocks) for _ in range(config.n_layers))

        scales = {}
        if int8:
            scales = {
                "k_scale": pool(lambda n: (n, heads, page), jnp.float32),
                "v_scale": pool(lambda n: (n, heads, page), jnp.float32),
            }
        return cls(
            k=pool(lambda n: (n, heads, head_dim, page), dtype),
            v=pool(lambda n: (n, heads, page, head_dim), dtype),
            index=jnp.zeros((rows,), jnp.int32),
            **scales,
        )

    @classmethod
    def logical_axes(cls, config: ModelConfig) -> PagedKVCache:
        """:meth:`KVCache.logical_axes`'s specs, each layer's a prefix of that layer's pool (every
        block split alike: pages over the data-parallel axes, as rows are; heads over ``model``)."""
        axes = KVCache.logical_axes(config)
        return cls(axes.k, axes.v, jax.sharding.PartitionSpec("batch"), axes.k_scale, axes.v_scale)

    @property
    def page(self) -> int:
        return self.k[0][0].shape[-1]

    @property
    def blocks(self) -> tuple[int, ...]:
        """The pool blocks' sizes, in pages."""
        return tuple(block.shape[0] for block in self.k[0])

    @property
    def pages(self) -> int:
        return sum(self.blocks)

    def layer(self, i: int, layout: PageLayout) -> PagedLayerKV:
        scales = (self.k_scale[i], self.v_scale[i]) if self.k_scale else (None, None)
        return PagedLayerKV(self.k[i], self.v[i], layout, *scales)

    @classmethod
    def from_layers(cls, layers: list[PagedLayerKV], index: Array) -> PagedKVCache:
        return cls(**_layer_fields(layers), index=index)


class PageLayout(NamedTuple):
    """What one decode step over a paged cache needs to know of its page table, worked out once
    for all layers (:func:`page_layout`)."""

    write_page: Array  # int32 [B]: the page each row writes its new token into (out of range: none)
    write_slot: Array  # int32 [B]: the slot in that page
    owner: Array  # int32 [P]: the row each page belongs to (-1: none)
    visible: Array  # bool [P, page]: the slots of each page its row attends to, the new token's included
    reads: Array  # int32 []: the pool blocks a step reads, the first ones, which hold every active row's pages


def page_layout(table: Array, index: Array, active: Array, blocks: tuple[int, ...], page: int) -> PageLayout:
    """The :class:`PageLayout` of rows ``table`` [B, per_row] (page ids; ids past the pool name no
    page) of lengths ``index`` [B] for a step over a pool of ``blocks`` (sizes) of ``page`` slots.

    Inactive rows write nothing and see nothing.
    """
    rows, per_row = table.shape
    pages = sum(blocks)
    nowhere = jnp.int32(pages)
    which = jnp.minimum(index // page, per_row - 1)
    target = jnp.take_along_axis(table, which[:, None], axis=1)[:, 0]
    write_page = jnp.where(active & (index < per_row * page), target, nowhere)
    ids = table.reshape(-1)
    owner = (
        jnp.full((pages,), -1, jnp.int32)
        .at[ids]
        .set(jnp.repeat(jnp.arange(rows, dtype=jnp.int32), per_row), mode="drop")
    )
    position = (
        jnp.zeros((pages,), jnp.int32).at[ids].set(jnp.tile(jnp.arange(per_row, dtype=jnp.int32), rows), mode="drop")
    )
    mine = jnp.maximum(owner, 0)
    slot = position[:, None] * page + jnp.arange(page)[None, :]
    visible = (owner >= 0)[:, None] & active[mine][:, None] & (slot <= index[mine][:, None])
    highest = jnp.max(jnp.where(active[:, None] & (table < pages), table, -1))  # -1: no active row holds a page
    reads = 1 + jnp.sum(highest >= np.cumsum(blocks)[:-1]).astype(jnp.int32)
    return PageLayout(write_page, index % page, owner, visible, reads)


class PagedLayerKV(NamedTuple):
    """One layer's :class:`PagedKVCache` pools and the step's :class:`PageLayout`; an int8 layer's
    scale pools besides."""

    k: Pool
    v: Pool
    layout: PageLayout
    k_scale: Pool | None = None
    v_scale: Pool | None = None


# --------------------------------------------------------------------------------------------
# Attention


def attention_scores(q: Array, k: Array, head_dim: int) -> Array:
    """float32 scores [B, heads, T, S] of queries [B, T, heads, head_dim] against keys [B, heads, head_dim, S]."""
    scores = jnp.einsum("bqhd,bhdk->bhqk", q, k, preferred_element_type=jnp.float32)
    return scores / np.sqrt(head_dim).astype(np.float32)


def attention_probs(scores: Array, mask: Array, dtype) -> Array:
    """Softmax over the keys ``mask`` allows, computed in float32 and returned in ``dtype``."""
    return jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(jnp.float32).min), axis=-1).astype(dtype)


def cached_scores(q: Array, kv: LayerKV, head_dim: int, rows: int, window: int) -> Array:
    """:func:`attention_scores` of ``q`` against the first ``rows`` rows and ``window`` slots of the cache.

    An int8 cache is dequantised inside the matmul: it reads the int8 keys converted to q's dtype and
    each score is multiplied by its key's scale, ``(q·k_int8)·scale``, which is exact since the scale
    is constant along head_dim. (XLA:CPU materialises the convert, one layer's keys at a time.)
    """
    k = kv.k[:rows, :, :, :window]
    scores = attention_scores(q, k.astype(q.dtype), head_dim)
    if kv.k_scale is None:
        return scores
    return scores * kv.k_scale[:rows, :, None, :window]


def cached_values(probs: Array, kv: LayerKV, rows: int, dtype) -> Array:
    """``probs`` [B, heads, T, W] times the cached values of the first B rows and W slots, [B, T, heads, head_dim].

    For an int8 cache each value's scale is folded into its probability, ``(p·scale)·v_int8``, so
    the matmul reads the int8 values converted to ``dtype`` and nothing multiplies the values themselves.
    """
    window = probs.shape[-1]
    v = kv.v[:rows, :, :window]
    if kv.v_scale is not None:
        probs = (probs * kv.v_scale[:rows, :, None, :window]).astype(dtype)
    return jnp.einsum("bhqk,bhkd->bqhd", probs, v.astype(dtype))


def _decode_attention(
    cfg: ModelConfig, q: Array, k: Array, v: Array, mask: Array, kv: LayerKV
) -> tuple[Array, LayerKV]:
    """One new token's attention: to the cache as it was, plus the token's own key and value,
    then the new key and value written into the cache.

    Equal to writing first and attending to the updated cache, but the matmuls read the cache
    buffers that came into the step and the in-place writes come after them: attending to the
    updated cache lets XLA fuse the update into the matmul's operand as well as into the loop
    carry, which costs a copy of every layer's cache at every step.
    """
    # ``mask`` may cover only the first W slots, and ``q`` only the first B rows of the cache (decode
    # slots attend to a window that holds every busy row's sequence), so the matmuls read that much
    # of the cache and no more.
    rows, window = q.shape[0], mask.shape[-1]
    past = cached_scores(q, kv, cfg.head_dim, rows, window)  # [B, H, 1, W]
    # With an int8 cache the token attends to its own key and value as the cache will hold them,
    # so the result equals writing first and attending to the updated cache here too.
    own_k, own_v = k, v
    if kv.k_scale is not None:
        own_k = dequantize_kv(*quantize_kv(k, axis=2), axis=2, dtype=k.dtype)
        own_v = dequantize_kv(*quantize_kv(v, axis=3), axis=3, dtype=v.dtype)
    own = attention_scores(q, own_k, cfg.head_dim)  # [B, H, 1, 1]: the new key, not yet in the cache
    slots = jnp.arange(window)
    index = kv.index if kv.index.ndim == 0 else kv.index[:, None, None, None]
    # the token's own slot (index) holds nothing yet: its score comes from the new key instead
    allowed = jnp.concatenate([mask & (slots != index), jnp.ones((*mask.shape[:-1], 1), bool)], axis=-1)
    probs = attention_probs(jnp.concatenate([past, own], axis=-1), allowed, cfg.compute_dtype)
    out = cached_values(probs[..., :-1], kv, rows, cfg.compute_dtype) + probs[..., -1:].transpose(
        0, 2, 1, 3
    ) * own_v.transpose(0, 2, 1, 3)
    # The writes must follow the matmuls that read the old cache, or XLA copies each cache buffer
    # at every step to keep the old one readable. An optimization barrier is expanded too early in
    # XLA's CPU pipeline to order them, so the written values depend on the attention's result
    # instead: 0 * out is zero wherever out is finite, and XLA does not fold float x * 0 (NaN).
    # It is elementwise between arrays split alike, so it adds no communication on any mesh.
    zero = 0.0 * out  # [B, 1, H, D]
    k = k + zero.transpose(0, 2, 3, 1).astype(k.dtype)
    v = v + zero.transpose(0, 2, 1, 3).astype(v.dtype)
    return out, write_layer_kv(kv, k, v)


def _put_slots(buffer: Array, pages: Array, slots: Array | None, new: Array, slot_axis: int) -> Array:
    """Write ``new[i]`` into page ``pages[i]`` of ``buffer`` [pages, …]: at slot ``slots[i]`` along
    ``slot_axis`` (``new`` without that axis), or as the whole page where ``slots`` is None. A page
    id past the buffer's end writes nothing."""
    new = new.astype(buffer.dtype)
    if new.shape[0] == 1:
        # XLA rewrites a scatter of one update into a dynamic-update-slice, which makes it copy the
        # buffer at every step; a second update that is always dropped keeps it a scatter, in place.
        new = jnp.concatenate([new, new])
        pages = jnp.append(pages, buffer.shape[0])
        slots = None if slots is None else jnp.append(slots, 0)
    if slots is None:
        return buffer.at[pages].set(new, mode="drop")
    return buffer.at[(pages, *[slice(None)] * (slot_axis - 1), slots)].set(new, mode="drop")


def write_pool(pool: Pool, pages: Array, slots: Array | None, new: Array, slot_axis: int) -> Pool:
    """:func:`_put_slots` into the pool blocks that hold ``pages`` (pool-wide page ids)."""
    written, start = [], 0
    for block in pool:
        n = block.shape[0]
        local = jnp.where((pages >= start) & (pages < start + n), pages - start, n)  # else: dropped
        written.append(_put_slots(block, local, slots, new, slot_axis))
        start += n
    return tuple(written)


def _paged_decode_attention(
    cfg: ModelConfig, q: Array, k: Array, v: Array, kv: PagedLayerKV
) -> tuple[Array, PagedLayerKV]:
    """One new token per row over a :class:`PagedKVCache` layer: each row writes its new key and
    value into its page, then attends to its pages.

    The writes come first: a scatter into a page is done in place before the matmuls read it. Then
    the pool blocks that hold the rows' pages (the layout's ``reads``, a value of the step, not of
    its program) are read one after another, each under a ``lax.cond``: one compiled step serves
    every occupancy of the pool, and a block no row holds a page in is never read. Each block's
    pages are scored against their rows' queries (gathered by ``owner``), and the softmax over each
    row's pages is carried from block to block as a running maximum, total and weighted sum of
    values; the sums per row are products with the one-hot [pages, rows], small beside the pages.
    """
    layout, rows = kv.layout, q.shape[0]
    q = q[:, 0] / np.sqrt(cfg.head_dim).astype(q.dtype)  # [B, heads, head_dim], scaled once
    new_k, new_v = k[..., 0], v[:, :, 0]  # [B, heads, head_dim] each
    int8 = kv.k_scale is not None
    k_scales: tuple = (None,) * len(kv.k)
    v_scales: tuple = (None,) * len(kv.v)
    scales = {}
    if int8:
        assert kv.k_scale is not None and kv.v_scale is not None
        (new_k, new_k_scale), (new_v, new_v_scale) = quantize_kv(new_k, axis=2), quantize_kv(new_v, axis=2)
        k_scales = write_pool(kv.k_scale, layout.write_page, layout.write_slot, new_k_scale, 2)
        v_scales = write_pool(kv.v_scale, layout.write_page, layout.write_slot, new_v_scale, 2)
        scales = {"k_scale": k_scales, "v_scale": v_scales}
    k_pool = write_pool(kv.k, layout.write_page, layout.write_slot, new_k, 3)
    v_pool = write_pool(kv.v, layout.write_page, layout.write_slot, new_v, 2)

    heads, head_dim = q.shape[1:]
    running = (
        jnp.full((rows, heads), -jnp.inf, jnp.float32),  # each row's highest score so far
        jnp.zeros((rows, heads), jnp.float32),  # its sum of exp(score - highest)
        jnp.zeros((rows, heads, head_dim), jnp.float32),  # its sum of exp(score - highest) * value
    )
    start = 0
    for i, block in enumerate(zip(k_pool, v_pool, k_scales, v_scales, strict=True)):
        n = block[0].shape[0]
        pages = slice(start, start + n)
        part = (q, layout.owner[pages], layout.visible[pages], *block)
        if i == 0:  # the first block is always read
            running = _attend_block(cfg, running, *part)
        else:
            running = lax.cond(
                i < layout.reads, lambda r, *p: _attend_block(cfg, r, *p), lambda r, *p: r, running, *part
            )
        start += n
    _, total, weighted = running
    out = weighted / jnp.where(total > 0, total, 1.0)[..., None]  # a row without pages sees nothing
    return out.astype(cfg.compute_dtype)[:, None], kv._replace(k=k_pool, v=v_pool, **scales)


def _attend_block(cfg: ModelConfig, running, q, owner, visible, k, v, k_scale, v_scale):
    """:func:`_paged_decode_attention`'s running softmax (highest, total, weighted [B, heads(, head_dim)])
    taken on over one pool block's pages: keys ``k`` [n, heads, head_dim, page] and values ``v``
    [n, heads, page, head_dim] (an int8 block's scales besides) of rows ``owner`` [n], whose queries
    ``q`` [B, heads, head_dim] see the slots ``visible`` [n, page]."""
    highest, total, weighted = running
    rows = q.shape[0]
    mine = jnp.maximum(owner, 0)
    scores = jnp.einsum("phd,phdc->phc", q[mine], k.astype(q.dtype), preferred_element_type=jnp.float32)
    if k_scale is not None:
        scores = scores * k_scale
    seen = visible[:, None, :]
    belongs = owner[:, None] == jnp.arange(rows)[None, :]  # [n, B]
    page_max = jnp.max(jnp.where(seen, scores, -jnp.inf), axis=-1)  # [n, heads]
    block_max = jnp.max(jnp.where(belongs[:, :, None], page_max[:, None, :], -jnp.inf), axis=0)  # [B, heads]
    new = jnp.maximum(highest, block_max)
    base = jnp.where(jnp.isfinite(new), new, 0.0)  # a row that has seen nothing yet subtracts nothing
    weights = jnp.where(seen, jnp.exp(scores - base[mine][:, :, None]), 0.0)  # [n, heads, page]
    kept = jnp.exp(highest - base)  # what the sums so far are worth now (0 while they are empty)
    total = total * kept + jnp.einsum("ph,pb->bh", weights.sum(axis=-1), belongs.astype(jnp.float32))
    if v_scale is not None:
        weights = weights * v_scale  # each value's scale folded into its weight
    values = jnp.einsum("phc,phcd->phd", weights.astype(cfg.compute_dtype), v.astype(cfg.compute_dtype))
    per_row = jnp.einsum("phd,pb->bhd", values, belongs.astype(values.dtype), preferred_element_type=jnp.float32)
    return new, total, weighted * kept[..., None] + per_row


# --------------------------------------------------------------------------------------------
# Layers


class LoRA(nn.Module):
    """The low-rank update ``(alpha / rank) * (x @ A) @ B`` of one projection, added to its output.

    ``A`` [*in, rank] and ``B`` [rank, *out] live in the ``lora`` collection, apart from the base
    ``params``, so training differentiates and checkpoints them alone, in float32 whatever the base's
    dtype (or quantisation) is. ``A`` starts as PEFT's default does (kaiming-uniform with a=√5, i.e.
    uniform in ±1/√fan_in), ``B`` at zero, so a fresh adapter leaves the model unchanged. The rank
    axis has a logical name of its own that no rule splits.
    """

    lora: LoraConfig
    in_axes: tuple[str, ...]
    out_shape: tuple[int, ...]
    out_axes: tuple[str, ...]
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: Array) -> Array:
        in_shape, rank = x.shape[x.ndim - len(self.in_axes) :], self.lora.rank
        bound = 1.0 / np.sqrt(np.prod(in_shape))
        init_a = nn.with_logical_partitioning(
            lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound), (*self.in_axes, "lora_rank")
        )
        a = self.variable("lora", "a", lambda: init_a(self.make_rng("params"), (*in_shape, rank), jnp.float32))
        b = self.variable("lora", "b", lambda: _zeros(("lora_rank", *self.out_axes))(None, (rank, *self.out_shape)))
        # In the compute dtype, as the base kernels are: a float32 delta would promote the residual
        # stream, which nn.scan's carry refuses.
        xa = jnp.tensordot(x.astype(self.dtype), a.value.astype(self.dtype), axes=len(in_shape))
        xa = partitioning.constrain(xa, ("batch", "length", "lora_rank"))
        return (self.lora.scale * jnp.tensordot(xa, b.value.astype(self.dtype), axes=1)).astype(self.dtype)


@dataclasses.dataclass(frozen=True)
class AdapterSlots:
    """The shape of a bank of served adapters (:class:`StackedLoRA`): ``capacity`` rows stacked
    (row 0 is "no adapter", all zeros), each of rank ``rank`` (smaller ranks padded with zeros), on
    the projections ``projections``. Static: it is part of what a program is compiled for."""

    capacity: int
    rank: int
    projections: tuple[str, ...]


class StackedLoRA(nn.Module):
    """Many adapters of one projection, one chosen per sequence: row ``i`` of the batch gets
    ``scale[j] * (x @ A[j]) @ B[j]`` with ``j = adapter[i]``.

    ``A`` [capacity, *in, rank], ``B`` [capacity, rank, *out] and ``scale`` [capacity] live in the
    ``adapters`` collection, filled by the serving side's adapter bank; row 0 stays zero, so a
    sequence without an adapter runs the same program and gets exactly the base's output.
    """

    slots: AdapterSlots
    in_axes: tuple[str, ...]
    out_shape: tuple[int, ...]
    out_axes: tuple[str, ...]
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: Array, adapter: Array) -> Array:
        n, rank = self.slots.capacity, self.slots.rank
        in_shape = x.shape[x.ndim - len(self.in_axes) :]

        def zeros(shape, axes, dtype=self.dtype):
            return _zeros(axes)(None, shape, dtype)

        a = self.variable("adapters", "a", zeros, (n, *in_shape, rank), ("adapters", *self.in_axes, "lora_rank"))
        b = self.variable("adapters", "b", zeros, (n, rank, *self.out_shape), ("adapters", "lora_rank", *self.out_axes))
        scale = self.variable("adapters", "scale", zeros, (n,), ("adapters",), jnp.float32)
        rows, length = x.shape[0], x.shape[1]
        a_rows = jnp.take(a.value, adapter, axis=0).reshape(rows, -1, rank)  # [B, in, rank]
        b_rows = jnp.take(b.value, adapter, axis=0).reshape(rows, rank, -1)  # [B, rank, out]
        xa = jnp.einsum("btd,bdr->btr", x.astype(self.dtype).reshape(rows, length, -1), a_rows.astype(self.dtype))
        delta = jnp.einsum("btr,bro->bto", xa, b_rows.astype(self.dtype))
        delta = delta * jnp.take(scale.value, adapter)[:, None, None].astype(self.dtype)
        return delta.reshape(rows, length, *self.out_shape)


def lora_delta(
    lora: LoraConfig | None,
    name: str,
    x: Array,
    in_axes,
    out_shape,
    out_axes,
    dtype,
    out: Array,
    slots: AdapterSlots | None = None,
    adapter: Array | None = None,
) -> Array:
    """``out`` (projection ``name``'s output for input ``x``) plus its adapter's update, if it has one:
    the trained adapter of ``lora``, and with ``slots`` each row's served adapter ``adapter`` [B]."""
    shapes = (tuple(in_axes), tuple(out_shape), tuple(out_axes), dtype)
    if lora is not None and name in lora.projections:
        out = out + LoRA(lora, *shapes, name=f"{name}_lora")(x)
    if slots is not None and adapter is not None and name in slots.projections:
        out = out + StackedLoRA(slots, *shapes, name=f"{name}_adapters")(x, adapter)
    return out


class Attention(nn.Module):
    config: ModelConfig
    lora: LoraConfig | None = None
    slots: AdapterSlots | None = None

    @nn.compact
    def __call__(
        self,
        x: Array,
        sin: Array,
        cos: Array,
        mask: Array | attention.SegmentMask | None,
        kv: LayerKV | PagedLayerKV | None = None,
        adapter: Array | None = None,
    ) -> tuple[Array, LayerKV | PagedLayerKV | None]:
        """Self-attention of ``x``: ``mask`` is a boolean mask (the XLA path) or the segment ids a
        fused kernel takes; with ``kv`` the new keys/values are cached and the queries attend to
        every cached slot ``mask`` allows (a paged layer's own layout says which; it takes no mask).
        ``adapter`` [B]: each row's served adapter (with ``slots``). Returns (output, updated ``kv``)."""
        cfg = self.config

        # Kernels stay 3-D ([embed, heads, kv] and [heads, kv, embed]) so each dim has its own name.
        qkv_shape, qkv_axes = (cfg.d_model, cfg.n_heads, cfg.head_dim), ("embed", "heads", "kv")
        x = x.astype(cfg.compute_dtype)
        q, k, v = (
            lora_delta(
                self.lora,
                name,
                x,
                ("embed",),
                qkv_shape[1:],
                qkv_axes[1:],
                cfg.compute_dtype,
                project(self, name, x, "btd,dhk->bthk", qkv_shape, cfg.d_model**-0.5, qkv_axes),
                self.slots,
                adapter,
            )
            for name in ("q_proj", "k_proj", "v_proj")
        )
        q = partitioning.constrain(apply_rotary(q, sin, cos), ("batch", "length", "heads", "kv"))
        # keys and values in the cache's layouts
        k = partitioning.constrain(apply_rotary(k, sin, cos).transpose(0, 2, 3, 1), KEY_AXES)
        v = partitioning.constrain(v.transpose(0, 2, 1, 3), VALUE_AXES)
        # Cached calls (the prefill and each decode step) always take the XLA path: a decode step's
        # scores are only [B, heads, 1, S], nothing a fused kernel saves, and a prefill writes into
        # the cache at a slot known only at run time, which the kernels' static masks cannot express.
        if isinstance(kv, PagedLayerKV):
            out, kv = _paged_decode_attention(cfg, q, k, v, kv)
        elif kv is not None and x.shape[1] == 1:
            out, kv = _decode_attention(cfg, q, k, v, mask, kv)
        elif isinstance(mask, attention.SegmentMask):
            out = attention.kernel_attention(
                mask.backend, q.transpose(0, 2, 1, 3), k.transpose(0, 1, 3, 2), v, mask.segment_ids
            ).transpose(0, 2, 1, 3)
        else:
            if kv is None:
                probs = attention_probs(attention_scores(q, k, cfg.head_dim), mask, cfg.compute_dtype)
                out = jnp.einsum("bhqk,bhkd->bqhd", probs, v)
            else:  # a prefill attends to the whole cache, its own tokens written (and quantised) first
                kv = write_layer_kv(kv, k, v)
                rows, slots = kv.k.shape[0], kv.k.shape[3]
                probs = attention_probs(cached_scores(q, kv, cfg.head_dim, rows, slots), mask, cfg.compute_dtype)
                out = cached_values(probs, kv, rows, cfg.compute_dtype)

        out_shape, out_axes = (cfg.n_heads, cfg.head_dim, cfg.d_model), ("heads", "kv", "embed")
        stddev = 2.0 / cfg.n_layers / np.sqrt(cfg.d_model)
        projected = project(self, "out_proj", out, "bthk,hkd->btd", out_shape, stddev, out_axes)
        delta_args = (out_axes[:2], (cfg.d_model,), ("embed",), cfg.compute_dtype, projected, self.slots, adapter)
        return lora_delta(self.lora, "out_proj", out, *delta_args), kv


class Dense(nn.Module):
    """``x @ kernel + bias`` over the last dim, with ``nn.Dense``'s parameter names (``kernel``,
    ``bias``) and numerics, its kernel declared by :func:`project` (so it may be int8)."""

    config: ModelConfig
    features: int
    stddev: float
    axes: tuple[str, str]

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        shape = (x.shape[-1], self.features)
        y = project(self, "kernel", x.astype(cfg.compute_dtype), "...d,df->...f", shape, self.stddev, self.axes)
        bias = self.param("bias", _zeros(self.axes[1:]), (self.features,), cfg.weight_dtype)
        return y + bias.astype(cfg.compute_dtype)


class MLP(nn.Module):
    config: ModelConfig
    lora: LoraConfig | None = None
    slots: AdapterSlots | None = None

    @nn.compact
    def __call__(self, x: Array, adapter: Array | None = None) -> Array:
        cfg = self.config
        served = (self.slots, adapter)
        h = Dense(cfg, cfg.ff_dim, cfg.d_model**-0.5, ("embed", "mlp"), name="fc_in")(x)
        h = lora_delta(self.lora, "fc_in", x, ("embed",), (cfg.ff_dim,), ("mlp",), cfg.compute_dtype, h, *served)
        h = partitioning.constrain(nn.gelu(h, approximate=True), ("batch", "length", "mlp"))
        out = Dense(cfg, cfg.d_model, 2.0 / cfg.n_layers / np.sqrt(cfg.d_model), ("mlp", "embed"), name="fc_out")(h)
        return lora_delta(self.lora, "fc_out", h, ("mlp",), (cfg.d_model,), ("embed",), cfg.compute_dtype, out, *served)


def layer_norm(config: ModelConfig, name: str | None = None) -> nn.LayerNorm:
    return nn.LayerNorm(
        epsilon=config.layer_norm_eps,
        dtype=config.compute_dtype,
        param_dtype=config.weight_dtype,
        use_fast_variance=False,  # two-pass variance in float32, as torch
        scale_init=_ones(("embed",)),
        bias_init=_zeros(("embed",)),
        name=name,
    )


class Block(nn.Module):
    """``h + attn(LN(h)) + mlp(LN(h))`` — one LayerNorm, attention and MLP in parallel."""

    config: ModelConfig
    lora: LoraConfig | None = None
    slots: AdapterSlots | None = None

    @nn.compact
    def __call__(
        self,
        h: Array,
        sin: Array,
        cos: Array,
        mask: Array | attention.SegmentMask | None,
        kv: LayerKV | PagedLayerKV | None = None,
        adapter: Array | None = None,
    ) -> tuple[Array, LayerKV | PagedLayerKV | None]:
        h = partitioning.constrain(h, RESIDUAL_AXES)
        x = layer_norm(self.config, "ln_1")(h)
        attn, kv = Attention(self.config, self.lora, self.slots, name="attn")(x, sin, cos, mask, kv, adapter)
        h = h + attn + MLP(self.config, self.lora, self.slots, name="mlp")(x, adapter)
        return partitioning.constrain(h, RESIDUAL_AXES), kv


class ScannedBlock(Block):
    """A :class:`Block` with the ``(carry, inputs) -> (carry, outputs)`` signature ``nn.scan`` expects;
    the carry is the residual stream. It takes no cache: cached decoding runs the unrolled layers."""

    def __call__(self, h, sin, cos, mask):
        h, _ = super().__call__(h, sin, cos, mask)
        return h, None


def project_to_vocab(h: Array, kernel: Array, bias: Array) -> Array:
    """The LM head: ``h @ kernel + bias`` in h's dtype, returned as float32 logits [..., vocab]."""
    with jax.named_scope("lm_head"):  # the chunked loss calls it outside the module: keep profiles' name
        logits = jnp.einsum("...d,dv->...v", h, kernel.astype(h.dtype)) + bias.astype(h.dtype)
    return partitioning.constrain(logits.astype(jnp.float32), ("batch", "length", "vocab"))


class LMHead(nn.Module):
    """Untied projection to the vocabulary, with a bias (GPT-J's ``lm_head``)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, h: Array) -> Array:
        cfg = self.config
        kernel = self.param(
            "kernel", _init(cfg.d_model**-0.5, ("embed", "vocab")), (cfg.d_model, cfg.vocab_size), cfg.weight_dtype
        )
        bias = self.param("bias", _zeros(("vocab",)), (cfg.vocab_size,), cfg.weight_dtype)
        return project_to_vocab(h.astype(cfg.compute_dtype), kernel, bias)


class GPTJ(nn.Module):
    """GPT-J causal language model, with one entry point per result:

    * ``model.apply(variables, tokens)``: float32 logits [B, T, vocab];
    * ``method=GPTJ.hidden_states``: the final LayerNorm's output [B, T, d_model] (the training
      loss applies the LM head itself, a chunk of positions at a time);
    * ``method=GPTJ.decode``: ``(logits, updated KVCache)`` for a prefill or a decode step.

    Arguments shared by all three: ``tokens`` int [B, T]; ``positions`` int [B, T], the rotary
    positions (default 0..T-1; for a left-padded row count from its first real token, since rotary
    is relative); ``segment_ids`` int [B, T]: tokens attend only within their segment, 0 marks
    padding (default: one segment per row).

    With ``lora``, the projections it names also apply adapters, read from the ``lora`` collection
    (``model.apply({"params": base, "lora": adapters}, …)``; see :class:`LoRA`). With ``slots``,
    every entry point but the scanned layers' takes ``adapter`` [B], each row's adapter in the
    ``adapters`` collection (a bank of served adapters; see :class:`StackedLoRA`).
    """

    config: ModelConfig
    lora: LoraConfig | None = None
    slots: AdapterSlots | None = None

    def setup(self):
        cfg = self.config
        self.wte = self.param(
            "wte", _init(cfg.vocab_size**-0.5, ("vocab", "embed")), (cfg.vocab_size, cfg.d_model), cfg.weight_dtype
        )
        if cfg.scan_layers:
            block = ScannedBlock
            if cfg.remat_policy != "none":
                block = nn.remat(block, policy=REMAT_POLICIES[cfg.remat_policy], prevent_cse=False)
            self.layers = nn.scan(
                block,
                variable_axes={"params": 0, "lora": 0},
                split_rngs={"params": True},
                in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
                length=cfg.n_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )(cfg, self.lora)
        else:
            block = Block
            if cfg.remat_policy != "none":
                block = nn.remat(block, policy=REMAT_POLICIES[cfg.remat_policy])
            for i in range(cfg.n_layers):  # named layer_0 …: the unrolled parameter layout
                setattr(self, f"layer_{i}", block(cfg, self.lora, self.slots))
        self.ln_f = layer_norm(cfg)
        self.lm_head = LMHead(cfg)

    def __call__(
        self,
        tokens: Array,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        adapter: Array | None = None,
    ) -> Array:
        """float32 logits [B, T, vocab]."""
        return self.lm_head(self.hidden_states(tokens, positions, segment_ids, adapter))

    def hidden_states(
        self,
        tokens: Array,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        adapter: Array | None = None,
    ) -> Array:
        """The final LayerNorm's output [B, T, d_model], before the LM head. ``adapter`` [B]: each
        row's served adapter (with ``slots``; the unrolled layers only)."""
        if adapter is not None and self.config.scan_layers:
            raise ValueError(
                "served adapters run the unrolled layers: use scan_layers=False and unstack_layers(params)"
            )
        positions, segment_ids = self._defaults(tokens, positions, segment_ids)
        sin, cos = rotary_tables(positions, self.config.rotary_dim)
        backend = attention.choose(self.config, tokens.shape[1])
        if backend.name == "xla":
            mask = attention_mask(segment_ids)
        else:
            mask = attention.SegmentMask(segment_ids.astype(jnp.int32), backend)
        h = self._embed(tokens)
        if self.config.scan_layers:
            h, _ = self.layers(h, sin, cos, mask)
        else:
            for i in range(self.config.n_layers):
                h, _ = getattr(self, f"layer_{i}")(h, sin, cos, mask, None, adapter)
        return self.ln_f(h)

    def decode(
        self,
        tokens: Array,
        positions: Array | None,
        segment_ids: Array | None,
        cache: KVCache,
        *,
        last_logits_only: bool = False,
        adapter: Array | None = None,
    ) -> tuple[Array, KVCache]:
        """Write ``tokens`` into ``cache`` at slots ``cache.index …`` and attend to everything cached
        before them (a prefill: the whole prompt at once; decoding: one token per call).

        Returns ``(logits, updated cache)``; with ``last_logits_only`` only the last position is
        projected to the vocabulary (logits [B, 1, V]), all that generation needs.
        """
        cfg = self.config
        if cfg.scan_layers:
            raise ValueError(
                "cached decoding runs the unrolled layers: use a config with scan_layers=False "
                "and unstack_layers(params)"
            )
        positions, segment_ids = self._defaults(tokens, positions, segment_ids)
        sin, cos = rotary_tables(positions, cfg.rotary_dim)
        key_segments = lax.dynamic_update_slice(cache.segment_ids, segment_ids.astype(jnp.int32), (0, cache.index))
        mask = cache_attention_mask(segment_ids, key_segments, cache.index)
        h = self._embed(tokens)
        layers = []
        for i in range(cfg.n_layers):
            h, kv = getattr(self, f"layer_{i}")(h, sin, cos, mask, cache.layer(i, cache.index), adapter)
            layers.append(kv)
        if last_logits_only:
            h = h[:, -1:]
        logits = self.lm_head(self.ln_f(h))
        return logits, KVCache.from_layers(layers, key_segments, cache.index + tokens.shape[1])

    def decode_slots(
        self,
        tokens: Array,
        positions: Array,
        active: Array,
        cache: PagedKVCache,
        table: Array,
        adapter: Array | None = None,
    ) -> tuple[Array, PagedKVCache]:
        """One decode step of independent sequences, one per row of ``cache.index`` (a decode slot):
        row ``r`` takes ``tokens[r]`` [B, 1], writes it at slot ``cache.index[r]`` of the pages that
        ``table[r]`` names, and attends to the slots of its sequence, reading only the pool blocks
        that hold the active rows' pages; rows where ``active`` [B] is False write and read nothing.

        Returns ``(logits [B, 1, V], updated cache)``; each active row's index moves on by one.
        """
        cfg = self.config
        if cfg.scan_layers:
            raise ValueError("decode slots run the unrolled layers: use scan_layers=False and unstack_layers(params)")
        sin, cos = rotary_tables(positions, cfg.rotary_dim)
        rows = tokens.shape[0]
        if rows > cache.index.shape[0]:
            raise ValueError(f"{rows} tokens for a cache of {cache.index.shape[0]} rows")
        layout = page_layout(table, cache.index[:rows], active, cache.blocks, cache.page)
        h = self._embed(tokens)
        layers = []
        for i in range(cfg.n_layers):
            h, kv = getattr(self, f"layer_{i}")(h, sin, cos, None, cache.layer(i, layout), adapter)
            layers.append(kv)
        logits = self.lm_head(self.ln_f(h))
        return logits, PagedKVCache.from_layers(layers, cache.index.at[:rows].add(active.astype(jnp.int32)))

    def _defaults(self, tokens, positions, segment_ids):
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        if segment_ids is None:
            segment_ids = jnp.ones(tokens.shape, jnp.int32)
        return positions, segment_ids

    def _embed(self, tokens: Array) -> Array:
        # Gather the (vocab-sharded) table before the lookup: a row gather from a sharded table
        # would make XLA replicate the activations instead, which is far larger.
        table = partitioning.constrain(self.wte.astype(self.config.compute_dtype), (None, None))
        return partitioning.constrain(jnp.take(table, tokens, axis=0), RESIDUAL_AXES)


def abstract_params(config: ModelConfig) -> dict:
    """The model's ``params`` collection as boxed ``ShapeDtypeStruct``s (shapes, dtypes and logical
    axes; nothing allocated): the one description every sharding and restore target is built from."""
    return jax.eval_shape(GPTJ(config).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]


def abstract_adapter_slots(config: ModelConfig, slots: AdapterSlots) -> dict:
    """The ``adapters`` collection of ``GPTJ(config, slots=slots)`` (unrolled layers) as boxed
    ``ShapeDtypeStruct``s: the stacked arrays of a bank of served adapters."""
    model = GPTJ(dataclasses.replace(config, scan_layers=False), slots=slots)
    tokens = jnp.zeros((1, 1), jnp.int32)
    cache = KVCache.empty(model.config, 1, 1)

    def init(key):
        return model.init(key, tokens, None, None, cache, adapter=jnp.zeros((1,), jnp.int32), method=GPTJ.decode)

    return jax.eval_shape(init, jax.random.key(0))["adapters"]


def abstract_adapters(config: ModelConfig, lora: LoraConfig) -> dict:
    """The ``lora`` collection of ``GPTJ(config, lora)`` as boxed ``ShapeDtypeStruct``s (float32,
    in the layer layout ``config.scan_layers`` names)."""
    return jax.eval_shape(GPTJ(config, lora).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["lora"]


# --------------------------------------------------------------------------------------------
# Scanned <-> unrolled parameter layouts


def stack_layers(params: dict, n_layers: int) -> dict:
    """Unrolled params (``layer_0`` … ``layer_{n-1}``) → scanned params (``layers``, stacked on axis 0)."""
    params = dict(params)
    per_layer = [params.pop(f"layer_{i}") for i in range(n_layers)]
    # numpy stays numpy (host memory, e.g. during conversion); jax arrays stay on their devices.
    stack = lambda *xs: np.stack(xs) if isinstance(xs[0], np.ndarray) else jnp.stack(xs)  # noqa: E731
    params["layers"] = jax.tree.map(stack, *per_layer)
    return params


def unstack_layers(params: dict) -> dict:
    """Scanned params (``layers``) → unrolled params (``layer_0`` …)."""
    params = dict(params)
    stacked = params.pop("layers")
    n_layers = jax.tree.leaves(stacked)[0].shape[0]
    for i in range(n_layers):
        params[f"layer_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
    return params
