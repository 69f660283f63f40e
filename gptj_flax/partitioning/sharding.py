"""From logical names to ``NamedSharding``s: the sharding scope, restore targets, the divisibility
check, sharded init and the sharding table."""

from __future__ import annotations

import contextlib
import math
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gptj_flax.config import ConfigError
from gptj_flax.partitioning.rules import DEFAULT_RULES, MESH_AXES, Rules, check_axes, mesh_axes, unknown_axes


@contextlib.contextmanager
def sharding_scope(mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """Enter the scope in which linen's logical constraints resolve against ``mesh`` and ``rules``."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """``nn.with_logical_constraint(x, axes)`` that refuses an axis name the rules in scope have no
    entry for (see :func:`check_axes`). Outside a :func:`sharding_scope` it constrains nothing, as
    linen's does."""
    rules = tuple(nn.get_logical_axis_rules())
    if rules and unknown_axes(axes, rules):
        caller = traceback.extract_stack(limit=2)[0]  # the model code that asked
        check_axes(
            axes, rules, f"the activation constraint {tuple(axes)} at {Path(caller.filename).name}:{caller.lineno}"
        )
    return nn.with_logical_constraint(x, axes)


def check_tree_axes(logical: Any, rules: Rules = DEFAULT_RULES) -> None:
    """:func:`check_axes` for every PartitionSpec of a tree, each named by its path in the tree."""
    specs = jax.tree_util.tree_flatten_with_path(logical, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]
    for path, spec in specs:
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        check_axes(spec, rules, f"the array at {name}" if name else "an array")


@contextlib.contextmanager
def within_replica():
    """The active rules with ``batch`` unsplit, for code that runs once per data-parallel replica
    (``jax.vmap`` over a replica axis with ``spmd_axis_name=replica_axes()``): a replica's share of a
    batch lives whole on its own devices, while the other placements (model parallelism) stay."""
    with nn.logical_axis_rules((("batch", None), *nn.get_logical_axis_rules())):
        yield


def logical_to_sharding(logical: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
    """A tree of logical PartitionSpecs (or one) → the same tree of NamedShardings. Every name needs
    a rule (:func:`check_tree_axes`): parameters, caches and decode states all come this way."""
    check_tree_axes(logical, rules)
    return nn.logical_to_mesh_sharding(logical, mesh, rules)


def named_sharding(mesh: Mesh, axes: Sequence[str | None], rules: Rules = DEFAULT_RULES) -> NamedSharding:
    """The NamedSharding of one array whose dims have logical names ``axes``."""
    return NamedSharding(mesh, mesh_axes(axes, rules))


def _flat(abstract: Any) -> list[tuple[str, Any, PartitionSpec]]:
    """(path name, unboxed leaf, logical spec) of every leaf of a boxed abstract tree."""
    logical = nn.get_partition_spec(abstract)
    leaves = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(abstract))[0]
    specs = jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return [(_path_name(path), leaf, spec) for (path, leaf), spec in zip(leaves, specs, strict=True)]


def check_divisible(
    abstract: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES, axis_fields: Mapping[str, str] | None = None
) -> None:
    """Refuse a mesh that cannot split ``abstract`` (a boxed tree) as the rules say.

    Every dimension is resolved through the rules to the mesh axes it is split over; their sizes
    must divide it. The error names the parameter, the logical axis, the config field that sets it
    (``axis_fields``: logical axis → field name) and the mesh axis.
    """
    desc = "(" + ", ".join(f"{a}={mesh.shape[a]}" for a in MESH_AXES) + ")"
    for name, leaf, spec in _flat(abstract):
        mesh_spec = mesh_axes(spec, rules, f"parameter {name}")
        for size, logical, placed in zip(leaf.shape, spec, mesh_spec):
            if placed is None:
                continue
            axes = (placed,) if isinstance(placed, str) else tuple(placed)
            ways = math.prod(int(mesh.shape[a]) for a in axes)
            if size % ways:
                field = (axis_fields or {}).get(logical, f"the {logical!r} dimension")
                where = "+".join(f"'{a}'" for a in axes)
                raise ConfigError(
                    f"{field}={size} is not divisible by the {where} mesh axis of size {ways} in mesh {desc}: "
                    f"parameter {name} splits its {logical!r} axis over it. Pick a {where} size that divides "
                    f"{size}" + (" or pad the vocabulary to a multiple of it" if logical == "vocab" else "")
                )


def restore_targets(abstract: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES, dtype: Any = None) -> tuple[Any, Any]:
    """``(targets, shardings)`` for a boxed abstract tree on ``mesh``: every leaf a
    ``jax.ShapeDtypeStruct`` carrying its ``NamedSharding`` (floating leaves in ``dtype``, default
    the leaf's own; integer leaves, such as int8 weights, always their own), what Orbax restores
    into and what ``jit`` lowers against."""
    shardings = logical_to_sharding(nn.get_partition_spec(abstract), mesh, rules)

    def target(x, sharding):
        cast = dtype is not None and jnp.issubdtype(x.dtype, jnp.floating)
        return jax.ShapeDtypeStruct(x.shape, dtype if cast else x.dtype, sharding=sharding)

    return jax.tree.map(target, nn.meta.unbox(abstract), shardings), shardings


def sharded_init(init_fn: Callable, mesh: Mesh, *args, rules: Rules = DEFAULT_RULES):
    """Run ``init_fn(*args)`` (a linen ``init``) with every leaf born sharded as the rules say.

    ``jax.eval_shape`` gives the boxed abstract tree → logical specs → NamedShardings →
    ``jax.jit(init, out_shardings=…)``: XLA creates each shard on its own device and no device
    ever holds a replicated copy of a sharded parameter.

    Returns ``(variables, shardings)`` with ``variables`` unboxed (plain ``jax.Array`` leaves).
    """
    abstract = jax.eval_shape(init_fn, *args)
    shardings = logical_to_sharding(nn.get_partition_spec(abstract), mesh, rules)

    def init_unboxed(*a):
        return nn.meta.unbox(init_fn(*a))

    with sharding_scope(mesh, rules):
        variables = jax.jit(init_unboxed, out_shardings=shardings)(*args)
    return variables, shardings


def _path_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def sharding_rows(abstract: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> list[dict]:
    """One row per parameter: logical axes, mesh axes, global and per-device shape, bytes."""
    shardings = logical_to_sharding(nn.get_partition_spec(abstract), mesh, rules)
    sharding_leaves = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    rows = []
    for (name, leaf, spec), sharding in zip(_flat(abstract), sharding_leaves, strict=True):
        local = sharding.shard_shape(leaf.shape)
        itemsize = np.dtype(leaf.dtype).itemsize
        rows.append(
            {
                "name": name,
                "logical": tuple(spec),
                "mesh": tuple(sharding.spec),
                "shape": tuple(leaf.shape),
                "local_shape": tuple(local),
                "dtype": str(np.dtype(leaf.dtype)),
                "bytes": math.prod(leaf.shape) * itemsize,
                "local_bytes": math.prod(local) * itemsize,
            }
        )
    return rows


def bytes_per_device(abstract: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> int:
    return sum(r["local_bytes"] for r in sharding_rows(abstract, mesh, rules))


def _axes(t) -> str:
    return "(" + ", ".join("-" if a is None else "+".join(a) if isinstance(a, tuple) else str(a) for a in t) + ")"


def _format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def sharding_table(abstract: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> str:
    """A printable table of where every parameter lives, with totals per device."""
    rows = sharding_rows(abstract, mesh, rules)
    header = ("parameter", "logical axes", "mesh axes", "global shape", "per-device shape", "dtype", "per-device")
    body = [
        (
            r["name"],
            _axes(r["logical"]),
            _axes(r["mesh"]),
            str(r["shape"]),
            str(r["local_shape"]),
            r["dtype"],
            _format_bytes(r["local_bytes"]),
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    n_params = sum(math.prod(r["shape"]) for r in rows)
    total = sum(r["bytes"] for r in rows)
    local = sum(r["local_bytes"] for r in rows)
    mesh_desc = ", ".join(f"{k}={v}" for k, v in mesh.shape.items())
    by_dtype: dict[str, int] = {}
    for r in rows:
        by_dtype[r["dtype"]] = by_dtype.get(r["dtype"], 0) + r["local_bytes"]
    # a quantised model mixes dtypes: say how much of each a device holds
    split = " (" + ", ".join(f"{d} {_format_bytes(b)}" for d, b in by_dtype.items()) + ")" if len(by_dtype) > 1 else ""
    return "\n".join(
        [
            line(header),
            line(["-" * w for w in widths]),
            *map(line, body),
            "",
            f"{n_params:,} parameters, {_format_bytes(total)} in all; {_format_bytes(local)} per device{split} "
            f"on mesh ({mesh_desc})",
        ]
    )
