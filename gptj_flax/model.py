"""GPT-J as Flax linen modules.

Read top to bottom: rotary embedding, masks, the KV cache, attention, MLP, the parallel block, the
causal LM, the loss.

Every parameter carries logical axis names (``nn.with_logical_partitioning``) and activations are
constrained at block boundaries (``nn.with_logical_constraint``); where those names live on the
device mesh is decided by the rules table in :mod:`gptj_flax.partitioning`, never here.

GPT-J quirks reproduced (they decide numerical parity with HuggingFace ``GPTJForCausalLM``):
one LayerNorm feeds attention and MLP in parallel; rotary is "rotate every two" (interleaved
pairs) on the first ``rotary_dim`` dims of each head; attention projections have no bias;
scores are divided by sqrt(head_dim); the LM head has a bias and is not tied to the embedding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gptj_flax.config import ModelConfig

Array = jax.Array

# Logical shape of the residual stream between blocks.
RESIDUAL_AXES = ("batch", "length", "activation_embed")

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


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer for ``length`` slots, filled left to right.

    Fields:
      k: keys (after rotary) [batch, heads, head_dim, length] per layer, in the compute dtype.
      v: values [batch, heads, length, head_dim] per layer.
        Both laid out like the layers: with ``scan_layers`` one array stacked on a leading
        [layers] axis, which ``nn.scan`` carries; unrolled, a tuple of one array per layer, so each
        layer reads its cache in place (slicing one layer out of a stacked array costs a copy of
        it per step on the CPU).
      segment_ids: int32 [batch, length]; 0 marks padding and slots not yet written.
      index: int32 scalar, the next slot to write (shared by the batch: prompts are left-padded
        so every row's newest token sits in the same slot).

    Each step writes only its new slot, in place.
    """

    k: Array | tuple[Array, ...]
    v: Array | tuple[Array, ...]
    segment_ids: Array
    index: Array

    @classmethod
    def empty(cls, config: ModelConfig, batch: int, length: int) -> "KVCache":
        def zeros(*layer_shape):
            if config.scan_layers:
                return jnp.zeros((config.n_layers, *layer_shape), config.compute_dtype)
            return tuple(jnp.zeros(layer_shape, config.compute_dtype) for _ in range(config.n_layers))

        heads, head_dim = config.n_heads, config.head_dim
        return cls(k=zeros(batch, heads, head_dim, length), v=zeros(batch, heads, length, head_dim),
                   segment_ids=jnp.zeros((batch, length), jnp.int32), index=jnp.zeros((), jnp.int32))

    @classmethod
    def logical_axes(cls, config: ModelConfig) -> "KVCache":
        """The same tree with a logical PartitionSpec per leaf (for ``logical_to_sharding``)."""
        P = jax.sharding.PartitionSpec

        def per_layer(axes):
            return P("layers", *axes) if config.scan_layers else (P(*axes),) * config.n_layers

        return cls(k=per_layer(KEY_AXES), v=per_layer(VALUE_AXES), segment_ids=P("batch", "length"), index=P())


class LayerKV(NamedTuple):
    """What one block needs to use the cache: the arrays, the layer (``None``: the arrays are
    this layer's own; else an index into stacked arrays) and the slot to write."""

    k: Array
    v: Array
    layer: Array | None
    index: Array


def write_layer_kv(kv: LayerKV, k: Array, v: Array) -> tuple[LayerKV, Array, Array]:
    """Store new keys [B, heads, head_dim, T] and values [B, heads, T, head_dim] at slot ``kv.index``.

    Returns the updated cache and this layer's keys and values for every slot, in the same layouts.
    """
    k_start, v_start = (0, 0, 0, kv.index), (0, 0, kv.index, 0)
    k_axes, v_axes = KEY_AXES, VALUE_AXES
    if kv.layer is not None:  # stacked: one more leading axis
        k_start, v_start = (kv.layer, *k_start), (kv.layer, *v_start)
        k_axes, v_axes = ("layers", *k_axes), ("layers", *v_axes)
        k, v = k[None], v[None]
    cache_k = nn.with_logical_constraint(lax.dynamic_update_slice(kv.k, k.astype(kv.k.dtype), k_start), k_axes)
    cache_v = nn.with_logical_constraint(lax.dynamic_update_slice(kv.v, v.astype(kv.v.dtype), v_start), v_axes)
    kv = kv._replace(k=cache_k, v=cache_v)
    if kv.layer is None:
        return kv, cache_k, cache_v
    return kv, cache_k[kv.layer], cache_v[kv.layer]


def _decode_attention(cfg: ModelConfig, q: Array, k: Array, v: Array, mask: Array,
                      kv: LayerKV) -> tuple[Array, LayerKV]:
    """One new token's attention: to the cache as it was, plus the token's own key and value,
    then the new key and value written into the cache.

    Equal to writing first and attending to the updated cache, but the matmuls read the cache
    buffers that came into the step and the in-place writes come after them. Attending to the
    *updated* cache made XLA fuse the cache update into the matmul's operand as well as into the
    loop carry at batch 1, which cost copies of every layer's cache at every step (~40% of a
    batch-1 decode step on the CPU).
    """
    past_k, past_v = (kv.k, kv.v) if kv.layer is None else (kv.k[kv.layer], kv.v[kv.layer])
    scale = np.sqrt(cfg.head_dim).astype(np.float32)
    past = jnp.einsum("bqhd,bhdk->bhqk", q, past_k, preferred_element_type=jnp.float32) / scale
    # the token's own slot (index) holds nothing yet: its score comes from the new key instead
    slots = jnp.arange(past.shape[-1])
    past = jnp.where(mask & (slots != kv.index), past, jnp.finfo(jnp.float32).min)
    own = jnp.einsum("bqhd,bhdq->bhq", q, k, preferred_element_type=jnp.float32)[..., None] / scale
    probs = jax.nn.softmax(jnp.concatenate([past, own], axis=-1), axis=-1).astype(cfg.compute_dtype)
    out = (jnp.einsum("bhqk,bhkd->bqhd", probs[..., :-1], past_v)
           + probs[..., -1:].transpose(0, 2, 1, 3) * v.transpose(0, 2, 1, 3))
    # The writes must follow the matmuls that read the old cache, or XLA copies each cache buffer
    # at every step to keep the old one readable. An optimization barrier is expanded too early in
    # XLA's CPU pipeline to order them, so the written values depend on the attention's result
    # instead: 0 * out is zero wherever out is finite, and XLA does not fold float x * 0 (NaN).
    # It is elementwise between arrays split alike, so it adds no communication on any mesh.
    zero = 0.0 * out  # [B, 1, H, D]
    k = k + zero.transpose(0, 2, 3, 1).astype(k.dtype)
    v = v + zero.transpose(0, 2, 1, 3).astype(v.dtype)
    kv, _, _ = write_layer_kv(kv, k, v)
    return out, kv


# --------------------------------------------------------------------------------------------
# Layers


class Attention(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array, sin: Array, cos: Array, mask: Array,
                 kv: LayerKV | None = None) -> tuple[Array, LayerKV | None]:
        """Self-attention of ``x``; with ``kv`` the new keys/values are cached and the queries
        attend to every cached slot ``mask`` allows. Returns (output, updated ``kv``)."""
        cfg = self.config
        # Kernels stay 3-D ([embed, heads, kv] and [heads, kv, embed]) so each dim has its own name.
        def kernel(name, shape, stddev, axes):
            return self.param(name, _init(stddev, axes), shape, cfg.weight_dtype).astype(cfg.compute_dtype)

        qkv_shape, qkv_axes = (cfg.d_model, cfg.n_heads, cfg.head_dim), ("embed", "heads", "kv")
        x = x.astype(cfg.compute_dtype)
        q, k, v = (
            jnp.einsum("btd,dhk->bthk", x, kernel(name, qkv_shape, cfg.d_model**-0.5, qkv_axes))
            for name in ("q_proj", "k_proj", "v_proj")
        )
        q = nn.with_logical_constraint(apply_rotary(q, sin, cos), ("batch", "length", "heads", "kv"))
        # keys and values in the cache's layouts
        k = nn.with_logical_constraint(apply_rotary(k, sin, cos).transpose(0, 2, 3, 1), KEY_AXES)
        v = nn.with_logical_constraint(v.transpose(0, 2, 1, 3), VALUE_AXES)
        if kv is not None and x.shape[1] == 1:
            out, kv = _decode_attention(cfg, q, k, v, mask, kv)
        else:
            if kv is not None:
                kv, k, v = write_layer_kv(kv, k, v)
            scores = jnp.einsum("bqhd,bhdk->bhqk", q, k, preferred_element_type=jnp.float32)
            scores = scores / np.sqrt(cfg.head_dim).astype(np.float32)
            scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
            probs = jax.nn.softmax(scores, axis=-1).astype(cfg.compute_dtype)
            out = jnp.einsum("bhqk,bhkd->bqhd", probs, v)

        w_out = kernel("out_proj", (cfg.n_heads, cfg.head_dim, cfg.d_model),
                       2.0 / cfg.n_layers / np.sqrt(cfg.d_model), ("heads", "kv", "embed"))
        return jnp.einsum("bthk,hkd->btd", out, w_out), kv


class MLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        h = nn.Dense(
            cfg.d_ff,
            dtype=cfg.compute_dtype,
            param_dtype=cfg.weight_dtype,
            kernel_init=_init(cfg.d_model**-0.5, ("embed", "mlp")),
            bias_init=_zeros(("mlp",)),
            name="fc_in",
        )(x)
        h = nn.with_logical_constraint(nn.gelu(h, approximate=True), ("batch", "length", "mlp"))
        return nn.Dense(
            cfg.d_model,
            dtype=cfg.compute_dtype,
            param_dtype=cfg.weight_dtype,
            kernel_init=_init(2.0 / cfg.n_layers / np.sqrt(cfg.d_model), ("mlp", "embed")),
            bias_init=_zeros(("embed",)),
            name="fc_out",
        )(h)


def layer_norm(config: ModelConfig, name: str) -> nn.LayerNorm:
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

    @nn.compact
    def __call__(self, h: Array, sin: Array, cos: Array, mask: Array,
                 kv: LayerKV | None = None) -> tuple[Array, LayerKV | None]:
        h = nn.with_logical_constraint(h, RESIDUAL_AXES)
        x = layer_norm(self.config, "ln_1")(h)
        attn, kv = Attention(self.config, name="attn")(x, sin, cos, mask, kv)
        h = h + attn + MLP(self.config, name="mlp")(x)
        return nn.with_logical_constraint(h, RESIDUAL_AXES), kv


class ScannedBlock(Block):
    """A :class:`Block` with the (carry, xs) signature that ``nn.scan`` expects.

    The carry is the residual stream and the stacked cache arrays (``None`` without a cache); the
    scanned input is the layer number, which picks this layer's slice of the cache.
    """

    def __call__(self, carry, layer, sin, cos, mask, index):
        h, caches = carry
        kv = None if caches is None else LayerKV(*caches, layer, index)
        h, kv = super().__call__(h, sin, cos, mask, kv)
        return (h, None if kv is None else (kv.k, kv.v)), None


def project_to_vocab(h: Array, kernel: Array, bias: Array) -> Array:
    """The LM head: ``h @ kernel + bias`` in h's dtype, returned as float32 logits [..., vocab]."""
    logits = jnp.einsum("...d,dv->...v", h, kernel.astype(h.dtype)) + bias.astype(h.dtype)
    return nn.with_logical_constraint(logits.astype(jnp.float32), ("batch", "length", "vocab"))


class LMHead(nn.Module):
    """Untied projection to the vocabulary, with a bias (GPT-J's ``lm_head``)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, h: Array) -> Array:
        cfg = self.config
        kernel = self.param("kernel", _init(cfg.d_model**-0.5, ("embed", "vocab")), (cfg.d_model, cfg.vocab_size),
                            cfg.weight_dtype)
        bias = self.param("bias", _zeros(("vocab",)), (cfg.vocab_size,), cfg.weight_dtype)
        return project_to_vocab(h.astype(cfg.compute_dtype), kernel, bias)


class GPTJ(nn.Module):
    """GPT-J causal language model: tokens [B, T] → float32 logits [B, T, vocab]."""

    config: ModelConfig

    @nn.compact
    def __call__(self, tokens: Array, positions: Array | None = None, segment_ids: Array | None = None,
                 cache: KVCache | None = None, *, last_logits_only: bool = False, return_hidden: bool = False):
        """
        Args:
          tokens: int [B, T].
          positions: int [B, T] rotary positions; default 0..T-1. For a left-padded batch count
            from each sequence's first real token (rotary is relative, so any per-sequence shift
            gives the same logits).
          segment_ids: int [B, T]; tokens attend only within their segment; 0 marks padding.
            Default: one segment for the whole row.
          cache: a :class:`KVCache`. The tokens are written at slots ``cache.index …`` and attend
            to everything cached before them (prefill: the whole prompt at once; decoding: one
            token per call). Without it, a plain full forward pass.
          last_logits_only: project only the last position to the vocabulary (logits [B, 1, V]):
            all that generation needs, and it skips most of the LM head's work in a prefill.
          return_hidden: return the final-LayerNorm output [B, T, d_model] instead of logits (no
            cache): the training loss applies the LM head itself, a chunk of positions at a time.

        Returns:
          logits; with a ``cache``, ``(logits, updated cache)``.
        """
        cfg = self.config
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        if segment_ids is None:
            segment_ids = jnp.ones(tokens.shape, jnp.int32)
        sin, cos = rotary_tables(positions, cfg.rotary_dim)
        if cache is None:
            mask, caches = attention_mask(segment_ids), None
        else:
            key_segments = lax.dynamic_update_slice(cache.segment_ids, segment_ids.astype(jnp.int32), (0, cache.index))
            mask, caches = cache_attention_mask(segment_ids, key_segments, cache.index), (cache.k, cache.v)

        table = self.param(
            "wte", _init(cfg.vocab_size**-0.5, ("vocab", "embed")), (cfg.vocab_size, cfg.d_model), cfg.weight_dtype
        )
        # Gather the (vocab-sharded) table before the lookup: a row gather from a sharded table
        # would make XLA replicate the activations instead, which is far larger.
        table = nn.with_logical_constraint(table.astype(cfg.compute_dtype), (None, None))
        h = nn.with_logical_constraint(jnp.take(table, tokens, axis=0), RESIDUAL_AXES)

        if cfg.scan_layers:
            block = ScannedBlock
            if cfg.remat_policy != "none":
                block = nn.remat(block, policy=REMAT_POLICIES[cfg.remat_policy], prevent_cse=False)
            (h, caches), _ = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
                length=cfg.n_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )(cfg, name="layers")((h, caches), jnp.arange(cfg.n_layers), sin, cos, mask,
                                  None if cache is None else cache.index)
        else:
            block = Block
            if cfg.remat_policy != "none":
                block = nn.remat(block, policy=REMAT_POLICIES[cfg.remat_policy])
            new_k, new_v = [], []
            for i in range(cfg.n_layers):
                kv = None if cache is None else LayerKV(cache.k[i], cache.v[i], None, cache.index)
                h, kv = block(cfg, name=f"layer_{i}")(h, sin, cos, mask, kv)
                if kv is not None:
                    new_k.append(kv.k)
                    new_v.append(kv.v)
            caches = None if cache is None else (tuple(new_k), tuple(new_v))

        if last_logits_only:
            h = h[:, -1:]
        h = layer_norm(cfg, "ln_f")(h)
        if return_hidden:
            return h
        logits = LMHead(cfg, name="lm_head")(h)
        if cache is None:
            return logits
        new_cache = KVCache(k=caches[0], v=caches[1], segment_ids=key_segments,
                            index=cache.index + tokens.shape[1])
        return logits, new_cache


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


# --------------------------------------------------------------------------------------------
# Loss


def loss_sums(logits: Array, targets: Array, weights: Array, z_loss: float = 0.0) -> tuple[Array, Array, Array]:
    """Weighted sums over tokens, in float32: (cross-entropy + z_loss · logsumexp², cross-entropy, weight)."""
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    nll = log_z - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    weights = weights.astype(jnp.float32)
    objective = nll + z_loss * jnp.square(log_z) if z_loss else nll
    return jnp.sum(objective * weights), jnp.sum(nll * weights), jnp.sum(weights)


def cross_entropy(
    logits: Array, targets: Array, weights: Array | None = None, z_loss: float = 0.0
) -> tuple[Array, Array]:
    """Token-weighted mean cross-entropy in float32, plus ``z_loss · mean(logsumexp²)``.

    Returns ``(loss, total_weight)``; ``weights`` (default 1) zero out padding and masked tokens.
    """
    weights = jnp.ones(targets.shape, jnp.float32) if weights is None else weights
    objective, _, total = loss_sums(logits, targets, weights, z_loss)
    return objective / jnp.maximum(total, 1.0), total


def chunked_loss_sums(hidden: Array, head: dict, targets: Array, weights: Array, z_loss: float = 0.0,
                      chunk: int = 256) -> tuple[Array, Array, Array]:
    """:func:`loss_sums` of ``LMHead(hidden)``, computed ``chunk`` positions at a time.

    The full float32 logits of a training batch (batch × length × vocab: 0.8 GiB for two 2048-token
    rows of GPT-J's 50400 ids) never exist at once: each chunk's logits are made, reduced to three
    sums and dropped, and the backward pass makes them again (``jax.checkpoint``).
    """
    length = hidden.shape[1]
    chunk = min(chunk, length)
    n_chunks = -(-length // chunk)
    pad = n_chunks * chunk - length
    if pad:  # padded positions carry weight 0
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
        weights = jnp.pad(weights, ((0, 0), (0, pad)))

    def split(x):  # [B, n·c, …] → [n, B, c, …]
        return jnp.swapaxes(x.reshape(x.shape[0], n_chunks, chunk, *x.shape[2:]), 0, 1)

    @jax.checkpoint
    def sums(h, t, w):
        return loss_sums(project_to_vocab(h, head["kernel"], head["bias"]), t, w, z_loss)

    def body(totals, xs):
        return jax.tree.map(jnp.add, totals, sums(*xs)), None

    zero = jnp.zeros((), jnp.float32)
    totals, _ = jax.lax.scan(body, (zero, zero, zero), (split(hidden), split(targets), split(weights)))
    return totals
