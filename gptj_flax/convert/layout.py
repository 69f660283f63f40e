"""Our parameter tree as a plan of tensors, each produced only when it is written or placed.

A converter describes its source as one function, ``get(path) -> np.ndarray``, answering for any
parameter of the *unrolled* layout (``("layer_3", "mlp", "fc_in", "kernel")``) in our orientation.
:func:`streamed_params` turns that into the tree the model expects — scanned (``layers`` stacked on
axis 0) or unrolled, per ``ModelConfig.scan_layers`` — whose leaves are :class:`StreamedArray`s:
shape and dtype now, data later. Writers materialise one leaf, write it and drop it, so memory holds
one leaf at a time, never the model. Which leaves there are, and where they go on a mesh, comes
from one trace of the model's parameters, :class:`ParamTree`.
"""

from __future__ import annotations

import dataclasses
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


class Source:
    """What every weight source (HuggingFace, legacy, Orbax) shares besides ``model_config``,
    ``step`` and ``tokenizer_dir``: it is closed after use (a legacy checkpoint holds files open)."""

    def close(self) -> None:
        """Release what the source holds open (by default, nothing)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


def _boxed(leaf) -> bool:
    return isinstance(leaf, nn.Partitioned)


def _stacked(n_layers: int, leaf: nn.Partitioned) -> nn.Partitioned:
    """One layer's boxed leaf as ``nn.scan`` stacks it: a leading axis of ``n_layers``, named ``layers``."""
    value = jax.ShapeDtypeStruct((n_layers, *leaf.value.shape), leaf.value.dtype)
    return leaf.add_axis(0, {nn.PARTITION_NAME: "layers"}).replace_boxed(value)


def _unstacked(leaf: nn.Partitioned) -> nn.Partitioned:
    value = jax.ShapeDtypeStruct(leaf.value.shape[1:], leaf.value.dtype)
    return leaf.remove_axis(0, {nn.PARTITION_NAME: "layers"}).replace_boxed(value)


@dataclasses.dataclass(frozen=True, eq=False)
class ParamTree:
    """A model's parameters as traced once by :func:`gptj_flax.model.abstract_params`: each one's
    path, shape, dtype and logical axes.

    The mesh check, the restore targets and shardings, the leaves a source is streamed into and the
    int8 kernels all derive from it, in either layer layout (:meth:`in_layout`), with no second
    trace of the whole model.
    """

    config: ModelConfig
    abstract: Any  # boxed (nn.Partitioned) ShapeDtypeStructs

    @classmethod
    def of(cls, config: ModelConfig) -> ParamTree:
        return cls(config, model.abstract_params(config))

    def shapes(self, scales: bool = True) -> dict[ParamPath, tuple[int, ...]]:
        """Every parameter path and its shape, in tree order; without the int8 scales when not
        ``scales`` (the leaves a float source provides)."""
        flat = traverse_util.flatten_dict(nn.meta.unbox(self.abstract))
        return {
            path: tuple(leaf.shape)
            for path, leaf in flat.items()
            if scales or not path[-1].endswith(model.SCALE_SUFFIX)
        }

    def quantized_kernels(self) -> dict[ParamPath, tuple[int, int]]:
        """Every int8 kernel's path (each has a ``NAME_scale`` beside it), with its number of
        leading stacked-layer dims and of output dims (its scale's shape is the kernel's at those)."""
        kernels = {}
        for path, shape in self.shapes().items():
            if path[-1].endswith(model.SCALE_SUFFIX):
                lead = int(path[0] == "layers")
                kernels[(*path[:-1], path[-1].removesuffix(model.SCALE_SUFFIX))] = (lead, len(shape) - lead)
        return kernels

    def check_mesh(self, mesh: Mesh, rules: partitioning.Rules = partitioning.DEFAULT_RULES) -> None:
        """Refuse a mesh that does not divide every dimension the rules split, naming the config field."""
        partitioning.check_divisible(self.abstract, mesh, rules, model.AXIS_FIELDS)

    def shardings(self, mesh: Mesh, rules: partitioning.Rules = partitioning.DEFAULT_RULES) -> Any:
        return partitioning.logical_to_sharding(nn.get_partition_spec(self.abstract), mesh, rules)

    def targets(
        self, mesh: Mesh, rules: partitioning.Rules = partitioning.DEFAULT_RULES, dtype: Any = None
    ) -> tuple[Any, Any]:
        """``(targets, shardings)`` on ``mesh`` after :meth:`check_mesh` (see
        :func:`gptj_flax.partitioning.restore_targets`)."""
        self.check_mesh(mesh, rules)
        return partitioning.restore_targets(self.abstract, mesh, rules, dtype)

    def in_layout(self, scan_layers: bool) -> ParamTree:
        """The same parameters with the layers stacked (``layers``, as ``nn.scan`` stacks them) or
        one by one (``layer_0`` …)."""
        if scan_layers == self.config.scan_layers:
            return self
        tree = dict(self.abstract)
        n_layers = self.config.n_layers
        if scan_layers:  # every layer has layer_0's parameters
            first = [tree.pop(f"layer_{i}") for i in range(n_layers)][0]
            tree["layers"] = jax.tree.map(functools.partial(_stacked, n_layers), first, is_leaf=_boxed)
        else:
            layer = jax.tree.map(_unstacked, tree.pop("layers"), is_leaf=_boxed)
            tree.update({f"layer_{i}": layer for i in range(n_layers)})
        return ParamTree(dataclasses.replace(self.config, scan_layers=scan_layers), tree)


def param_shapes(config: ModelConfig) -> dict[ParamPath, tuple[int, ...]]:
    """Every parameter path of ``config``'s layout (scanned or unrolled) and its shape, in tree order."""
    return ParamTree.of(config).shapes()


def check_mesh(model_config: ModelConfig, mesh: Mesh, rules: partitioning.Rules = partitioning.DEFAULT_RULES) -> None:
    """Refuse a mesh that does not divide every parameter dimension the rules split, naming the
    config field to change."""
    ParamTree.of(model_config).check_mesh(mesh, rules)


def param_targets(
    model_config: ModelConfig, mesh: Mesh, rules: partitioning.Rules = partitioning.DEFAULT_RULES, dtype: Any = None
) -> tuple[Any, Any]:
    """Restore targets for a model's params on ``mesh``: (tree of ShapeDtypeStruct with shardings,
    shardings), after :func:`check_mesh`."""
    return ParamTree.of(model_config).targets(mesh, rules, dtype)


def layer_paths(path: ParamPath, n_layers: int) -> list[ParamPath] | None:
    """The unrolled paths a scanned leaf stacks (``layers/…`` → ``layer_i/…``), or None if unstacked."""
    if path[0] != "layers":
        return None
    return [(f"layer_{i}", *path[1:]) for i in range(n_layers)]


def streamed_params(
    get: Getter, config: ModelConfig, dtype=None, *, shapes: dict[ParamPath, tuple[int, ...]] | None = None
) -> dict:
    """The params tree of ``config``'s layout with :class:`StreamedArray` leaves drawn from ``get``.

    Leaves are cast to ``dtype`` (default: the config's ``param_dtype``). A scanned leaf stacks
    ``get`` over the layers into one preallocated array, so building it holds that leaf plus one
    layer's tensor. ``shapes``: the leaves to stream (default :func:`param_shapes` of ``config``).
    """
    dtype = np.dtype(dtype or config.weight_dtype)
    flat = {}
    for path, shape in (param_shapes(config) if shapes is None else shapes).items():
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
