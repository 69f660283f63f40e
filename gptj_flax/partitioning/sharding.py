"""From logical names to ``NamedSharding``s: sharded init, activation scope, the sharding table."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gptj_flax.partitioning.rules import DEFAULT_RULES, Rules


@contextlib.contextmanager
def activate(mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """Scope in which linen's logical constraints resolve against ``mesh`` and ``rules``."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield


def logical_to_sharding(logical: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
    """A tree of logical PartitionSpecs (or one) → the same tree of NamedShardings."""
    return nn.logical_to_mesh_sharding(logical, mesh, rules)


def named_sharding(mesh: Mesh, axes: Sequence[str | None], rules: Rules = DEFAULT_RULES) -> NamedSharding:
    """The NamedSharding of one array whose dims have logical names ``axes``."""
    return NamedSharding(mesh, nn.logical_to_mesh_axes(tuple(axes), rules))


def abstract_init(init_fn: Callable, *args) -> Any:
    """Shapes, dtypes and logical axes of ``init_fn(*args)``'s output, without computing it."""
    return jax.eval_shape(init_fn, *args)


def sharded_init(init_fn: Callable, mesh: Mesh, *args, rules: Rules = DEFAULT_RULES):
    """Run ``init_fn(*args)`` (a linen ``init``) with every leaf born sharded as the rules say.

    ``jax.eval_shape`` gives the boxed abstract tree → logical specs → NamedShardings →
    ``jax.jit(init, out_shardings=…)``: XLA creates each shard on its own device and no device
    ever holds a replicated copy of a sharded parameter.

    Returns ``(variables, shardings)`` with ``variables`` unboxed (plain ``jax.Array`` leaves).
    """
    abstract = abstract_init(init_fn, *args)
    shardings = logical_to_sharding(nn.get_partition_spec(abstract), mesh, rules)

    def init_unboxed(*a):
        return nn.meta.unbox(init_fn(*a))

    with activate(mesh, rules):
        variables = jax.jit(init_unboxed, out_shardings=shardings)(*args)
    return variables, shardings


def _path_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def sharding_rows(abstract: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> list[dict]:
    """One row per parameter: logical axes, mesh axes, global and per-device shape, bytes."""
    logical = nn.get_partition_spec(abstract)
    shardings = logical_to_sharding(logical, mesh, rules)
    leaves = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(abstract))[0]
    spec_leaves = jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, PartitionSpec))
    sharding_leaves = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    rows = []
    for (path, leaf), spec, sharding in zip(leaves, spec_leaves, sharding_leaves, strict=True):
        local = sharding.shard_shape(leaf.shape)
        itemsize = np.dtype(leaf.dtype).itemsize
        rows.append({
            "name": _path_name(path),
            "logical": tuple(spec),
            "mesh": tuple(sharding.spec),
            "shape": tuple(leaf.shape),
            "local_shape": tuple(local),
            "dtype": str(np.dtype(leaf.dtype)),
            "bytes": math.prod(leaf.shape) * itemsize,
            "local_bytes": math.prod(local) * itemsize,
        })
    return rows


def bytes_per_device(abstract: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> int:
    return sum(r["local_bytes"] for r in sharding_rows(abstract, mesh, rules))


def _axes(t) -> str:
    return "(" + ", ".join("-" if a is None else "+".join(a) if isinstance(a, tuple) else str(a) for a in t) + ")"


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def sharding_table(abstract: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> str:
    """A printable table of where every parameter lives, with totals per device."""
    rows = sharding_rows(abstract, mesh, rules)
    header = ("parameter", "logical axes", "mesh axes", "global shape", "per-device shape", "per-device")
    body = [
        (r["name"], _axes(r["logical"]), _axes(r["mesh"]), str(r["shape"]), str(r["local_shape"]),
         format_bytes(r["local_bytes"]))
        for r in rows
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    n_params = sum(math.prod(r["shape"]) for r in rows)
    total = sum(r["bytes"] for r in rows)
    local = sum(r["local_bytes"] for r in rows)
    mesh_desc = ", ".join(f"{k}={v}" for k, v in mesh.shape.items())
    return "\n".join([
        line(header),
        line(["-" * w for w in widths]),
        *map(line, body),
        "",
        f"{n_params:,} parameters, {format_bytes(total)} in all; {format_bytes(local)} per device "
        f"on mesh ({mesh_desc})",
    ])
