"""Weight-only int8: the block projections as int8 with a float32 scale per output channel.

Symmetric per-output-channel quantisation: each output channel ``c`` of a kernel gets
``scale[c] = max|w[..., c]| / 127`` (over the kernel's input dims), and ``round(w / scale)``
clipped to ±127 is stored; :func:`gptj_flax.model.project` multiplies the matmul's output by the
scale. Which kernels are quantised, and their output dims, is read from the int8 model's own
parameter tree (every ``NAME`` with a ``NAME_scale`` beside it): q/k/v/out_proj, fc_in, fc_out.
The embedding and the LM head stay in float: they are 7% of GPT-J-6B's weights, and the head's
rounding would move every logit of every sampled token directly.

Works on :class:`~layout.StreamedArray` trees, so converting or loading holds one tensor at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from gptj_flax import model
from gptj_flax.config import ModelConfig
from gptj_flax.convert.common import ConversionError
from gptj_flax.convert.layout import ParamPath, ParamTree, StreamedArray
from gptj_flax.convert.orbax_io import OrbaxParams, write_converted

INT8_MAX = 127  # symmetric: -128 is never used, so negating a weight never overflows


def quantize_kernel(w: np.ndarray, n_out: int, lead: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(int8 kernel, float32 scale)`` of float ``w``: its first ``lead`` dims are stacked layers
    (each layer's channels get their own scales), its last ``n_out`` the output channels, and the
    dims between them the inputs a scale is taken over. ``scale * kernel`` is within ``scale / 2``
    of ``w`` everywhere."""
    w = np.asarray(w, np.float32)
    inputs = tuple(range(lead, w.ndim - n_out))
    amax = np.max(np.abs(w), axis=inputs, keepdims=True)
    # an all-zero channel gets scale 1 (and zeros), not a division by zero
    scale = np.where(amax > 0, amax / INT8_MAX, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q, np.squeeze(scale, axis=inputs)


def dequantize_kernel(q: np.ndarray, scale: np.ndarray, n_out: int, lead: int = 0) -> np.ndarray:
    """The float32 kernel that int8 ``q`` and its ``scale`` stand for (:func:`quantize_kernel`'s inverse)."""
    return q.astype(np.float32) * np.expand_dims(scale, tuple(range(lead, q.ndim - n_out)))


def dequantize_params(params: dict, dtype) -> dict:
    """The float tree that int8 ``params`` stand for: each kernel with a ``NAME_scale`` beside it
    becomes ``scale * kernel`` in ``dtype`` and its scale goes; the other leaves pass through as
    they are. Takes numpy or jax leaves (a jax kernel keeps its sharding)."""
    flat = traverse_util.flatten_dict(params)
    out = {}
    for path, leaf in flat.items():
        scale = flat.get((*path[:-1], path[-1] + model.SCALE_SUFFIX))
        if path[-1].endswith(model.SCALE_SUFFIX):
            continue
        if scale is None:
            out[path] = leaf
            continue
        lead = int(path[0] == "layers")
        inputs = tuple(range(lead, leaf.ndim - (scale.ndim - lead)))
        xp = np if isinstance(leaf, np.ndarray) else jnp
        out[path] = (leaf.astype(np.float32) * xp.expand_dims(scale, inputs)).astype(dtype)
    return traverse_util.unflatten_dict(out)


def round_trip(params: dict, config: ModelConfig) -> dict:
    """Float ``params`` of ``config`` with each block projection replaced by the value its int8
    quantisation stands for, in the kernel's own dtype and sharding: the base a QLoRA adapter was
    trained on, as a float tree an adapter can be merged into."""
    kernels = quantized_kernels(quantized_config(config))
    flat = traverse_util.flatten_dict(params)
    for path, (lead, n_out) in kernels.items():
        flat[path] = _round_trip_kernel(flat[path], n_out, lead)
    return traverse_util.unflatten_dict(flat)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _round_trip_kernel(w, n_out: int, lead: int):
    """:func:`quantize_kernel` then :func:`dequantize_kernel`, on device (same float32 arithmetic)."""
    w32 = w.astype(jnp.float32)
    inputs = tuple(range(lead, w.ndim - n_out))
    amax = jnp.max(jnp.abs(w32), axis=inputs, keepdims=True)
    scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
    return (jnp.clip(jnp.rint(w32 / scale), -INT8_MAX, INT8_MAX) * scale).astype(w.dtype)


def quantized_config(config: ModelConfig) -> ModelConfig:
    """``config`` as an int8 model; refuses one that is quantised already."""
    if config.quantize is not None:
        raise ConversionError(
            f"the model is already quantised (model.quantize={config.quantize!r}): quantise its float "
            "checkpoint instead, or load this one as it is"
        )
    return dataclasses.replace(config, quantize="int8")


def quantized_kernels(config: ModelConfig) -> dict[ParamPath, tuple[int, int]]:
    """Every quantised kernel's path in an int8 ``config``'s tree, with its number of leading
    stacked-layer dims and of output dims (its scale's shape is the kernel's at those dims)."""
    return ParamTree.of(config).quantized_kernels()


def quantize_streamed(
    params: dict, config: ModelConfig, kernels: dict[ParamPath, tuple[int, int]] | None = None
) -> tuple[ModelConfig, dict]:
    """``(int8 config, int8 params)`` from float ``params`` (StreamedArray leaves) of ``config``.

    Each quantised kernel becomes two streamed leaves, the int8 kernel and its scale, computed from
    one read of the float kernel when both are materialised one after the other (as the writers
    and :func:`~layout.place_on_mesh` do, in sorted order); the other leaves pass through.
    ``kernels``: :func:`quantized_kernels` of the int8 config, where the caller has them.
    """
    int8_config = quantized_config(config)
    kernels = quantized_kernels(int8_config) if kernels is None else kernels
    flat: dict[ParamPath, StreamedArray] = traverse_util.flatten_dict(params)
    missing = sorted(set(kernels) - set(flat))
    if missing:
        raise ConversionError(f"params lack the projection kernels to quantise, e.g. {'/'.join(missing[0])}")
    out = {}
    for path, leaf in flat.items():
        if path not in kernels:
            out[path] = leaf
            continue
        lead, n_out = kernels[path]
        pair = _OneAtATime(leaf, n_out, lead)
        out[path] = StreamedArray(leaf.shape, np.int8, functools.partial(pair.get, 0), name="/".join(path))
        scale_path = (*path[:-1], path[-1] + model.SCALE_SUFFIX)
        scale_shape = (*leaf.shape[:lead], *leaf.shape[leaf.ndim - n_out :])
        out[scale_path] = StreamedArray(
            scale_shape, np.float32, functools.partial(pair.get, 1), name="/".join(scale_path)
        )
    return int8_config, traverse_util.unflatten_dict(out)


class _OneAtATime:
    """One kernel's quantisation, kept only until both its int8 kernel and scale have been taken."""

    def __init__(self, leaf: StreamedArray, n_out: int, lead: int):
        self._leaf, self._n_out, self._lead = leaf, n_out, lead
        self._pair: tuple[np.ndarray, np.ndarray] | None = None
        self._taken: set[int] = set()

    def get(self, which: int) -> np.ndarray:
        if self._pair is None:
            self._pair = quantize_kernel(self._leaf.materialize(), self._n_out, self._lead)
            self._taken = set()
        value = self._pair[which]
        self._taken.add(which)
        if self._taken == {0, 1}:
            self._pair = None  # both written or placed: free the copy
        return value


def quantize_params(params: dict, config: ModelConfig) -> tuple[ModelConfig, dict]:
    """``(int8 config, int8 params)`` of an in-memory float params tree (numpy or jax leaves), as
    host numpy arrays."""
    streamed = {
        path: StreamedArray(np.shape(leaf), np.asarray(leaf).dtype, functools.partial(np.asarray, leaf), "/".join(path))
        for path, leaf in traverse_util.flatten_dict(params).items()
    }
    int8_config, quantized = quantize_streamed(traverse_util.unflatten_dict(streamed), config)
    flat = traverse_util.flatten_dict(quantized)
    return int8_config, traverse_util.unflatten_dict({path: leaf.materialize() for path, leaf in flat.items()})


def orbax_streamed(source: OrbaxParams, shapes: dict[ParamPath, tuple[int, ...]] | None = None) -> dict:
    """A stored checkpoint's params as StreamedArrays in their stored dtypes, read on demand.
    ``shapes``: its leaves, where the caller has them (default :meth:`OrbaxParams.leaf_shapes`)."""
    dtypes = source.stored_dtypes()
    return traverse_util.unflatten_dict(
        {
            path: StreamedArray(shape, dtypes[path], functools.partial(source.read, path), name="/".join(path))
            for path, shape in (source.leaf_shapes() if shapes is None else shapes).items()
        }
    )


def quantize(ckpt: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Orbax checkpoint ``ckpt`` (run or step directory) → ``out``: the same step, params only, the
    block projections int8. Its config records ``model.quantize="int8"``, so ``load(out)`` reads it
    as int8 with no argument."""
    source = OrbaxParams.open(ckpt)
    tree = ParamTree.of(quantized_config(source.config.model))
    streamed = orbax_streamed(source, tree.shapes(scales=False))
    int8_config, params = quantize_streamed(streamed, source.config.model, tree.quantized_kernels())
    meta = {k: v for k, v in source.meta.items() if k != "step"}
    return write_converted(
        out,
        source.step,
        params=params,
        config=source.config.replace(model=int8_config),
        meta={**meta, "quantized_from": str(Path(str(source.directory)).resolve()), "quantize": "int8"},
        tokenizer=source.tokenizer_dir,
    )
