"""Our parameter tree as a plan of tensors, each produced only when it is written or placed.

A converter describes its source as one function, ``get(path) -> np.ndarray``, answering for any
parameter of the *unrolled* layout (``("layer_3", "mlp", "fc_in", "kernel")``) in our orientation.
:func:`streamed_params` turns that into the tree the model expects — scanned (``layers`` stacked on
axis 0) or unrolled, per ``ModelConfig.scan_layers`` — whose leaves are :class:`StreamedArray`s:
shape and dtype now, data later. Writers materialise one leaf, write it and drop it, so memory holds
one leaf at a time, never the model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import traverse_util
from jax.sharding import Mesh

from gptj_flax import model, partitioning
from gptj_flax.config import ModelConfig
from gptj_flax.convert.common import progress

ParamPath = tuple[str, ...]  # ("layer_3", "mlp", "fc_in", "kernel")
Getter = Callable[[ParamPath], np.ndarray]


class StreamedArray:
    """A tensor known by shape and dtype whose data is computed only by :meth:`materialize`."""

    def __init__(self, shape: tuple[int, ...], dtype, produce: Callable[[], np.ndarray], name: str = ""):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.name = name
        self._produce = produce

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def materialize(self) -> np.ndarray:
        array = self._produce()
        if tuple(array.shape) != self.shape:
            raise ValueError(f"{self.name}: produced shape {array.shape}, expected {self.shape}")
        return np.asarray(array, dtype=self.dtype)

    def __repr__(self) -> str:
        return f"StreamedArray({self.name!r}, {self.shape}, {self.dtype})"


def param_shapes(config: ModelConfig) -> dict[ParamPath, tuple[int, ...]]:
    """Every parameter path of ``config``'s layout (scanned or unrolled) and its shape, in tree order."""
    flat = traverse_util.flatten_dict(nn.meta.unbox(model.abstract_params(config)))
    return {path: tuple(leaf.shape) for path, leaf in flat.items()}


def check_mesh(model_config: ModelConfig, mesh: Mesh, rules: partitioning.Rules = partitioning.DEFAULT_RULES) -> None:
    """Refuse a mesh that does not divide every parameter dimension the rules split, naming the
    config field to change."""
    partitioning.check_divisible(model.abstract_params(model_config), mesh, rules, model.AXIS_FIELDS)


def param_targets(
    model_config: ModelConfig, mesh: Mesh, rules: partitioning.Rules = partitioning.DEFAULT_RULES, dtype: Any = None
) -> tuple[Any, Any]:
    """Restore targets for a model's params on ``mesh``: (tree of ShapeDtypeStruct with shardings,
    shardings), after :func:`check_mesh`."""
    check_mesh(model_config, mesh, rules)
    return partitioning.restore_targets(model.abstract_params(model_config), mesh, rules, dtype)


def layer_paths(path: ParamPath, n_layers: int) -> list[ParamPath] | None:
    """The unrolled paths a scanned leaf stacks (``layers/…`` → ``layer_i/…``), or None if unstacked."""
    if path[0] != "layers":
        return None
    return [(f"layer_{i}", *path[1:]) for i in range(n_layers)]


def streamed_params(get: Getter, config: ModelConfig, dtype=None) -> dict:
    """The params tree of ``config``'s layout with :class:`StreamedArray` leaves drawn from ``get``.

    Leaves are cast to ``dtype`` (default: the config's ``param_dtype``). A scanned leaf stacks
    ``get`` over the layers into one preallocated array, so building it holds that leaf plus one
    layer's tensor.
    """
    dtype = np.dtype(dtype or config.weight_dtype)
    flat = {}
    for path, shape in param_shapes(config).items():
        parts = layer_paths(path, config.n_layers)
        if parts is None:
            produce = functools.partial(get, path)
        else:
            produce = functools.partial(_stack, get, parts, shape, dtype)
        flat[path] = StreamedArray(shape, dtype, produce, name="/".join(path))
    return traverse_util.unflatten_dict(flat)


def _stack(get: Getter, paths: list[ParamPath], shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    out = np.empty(shape, dtype)
    for i, path in enumerate(paths):
        out[i] = get(path)
    return out


def place_on_mesh(streamed: dict, target: dict, desc: str = "placing params") -> dict:
    """Materialise each streamed leaf and put it straight onto its shards in ``target``'s shardings.

    ``target`` is a matching tree of ``jax.ShapeDtypeStruct`` with shardings. Every process builds
    only its addressable shards from the host copy of one leaf, which is dropped before the next:
    host memory holds one leaf, never a second copy of the model.
    """
    flat_streamed: dict[ParamPath, StreamedArray] = dict(leaves_with_paths(streamed))
    flat_target: dict[ParamPath, jax.ShapeDtypeStruct] = dict(leaves_with_paths(target))
    if flat_streamed.keys() != flat_target.keys():
        raise ValueError(f"parameter trees differ: {sorted(flat_streamed.keys() ^ flat_target.keys())[:4]}")
    placed = {}
    with progress(sum(s.nbytes for s in flat_streamed.values()), desc) as bar:
        for path, leaf in flat_streamed.items():
            spec = flat_target[path]
            array = leaf.materialize().astype(spec.dtype, copy=False)
            placed[path] = jax.make_array_from_callback(spec.shape, spec.sharding, array.__getitem__)
            del array
            bar.update(leaf.nbytes)
    return traverse_util.unflatten_dict(placed)


def leaves_with_paths(tree: dict) -> list[tuple[ParamPath, Any]]:
    """(path, leaf) pairs of a nested dict, in JAX's (sorted-key) tree order."""
    return [(tuple(str(k.key) for k in keys), leaf) for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]
