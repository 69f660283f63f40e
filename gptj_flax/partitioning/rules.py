"""Logical axis names and the one table that places them on the mesh.

Model code names what each tensor dimension means; this table says where each meaning lives on the
mesh axes ``("data", "fsdp", "model")``. A mesh axis of size 1 shards nothing, so this one table
expresses every layout: pure data parallel is mesh (N, 1, 1), FSDP (1, N, 1), tensor parallel
(1, 1, N), and any product of the three mixes them (see :data:`LAYOUTS`).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence

import flax.linen as nn
from jax.sharding import PartitionSpec

from gptj_flax.config import ConfigError, MeshConfig

# The mesh axes are MeshConfig's fields, in order: the config that sizes them also names them.
MESH_AXES: tuple[str, ...] = tuple(field.name for field in dataclasses.fields(MeshConfig))

# Linen resolves rules in order and takes the first entry whose mesh axes are still free for the
# tensor at hand, so a fallback is a second entry for the same name.
Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),  # activations: batch over every data-parallel axis
    ("length", None),
    ("activation_embed", None),
    ("embed", "fsdp"),  # weights: d_model dim split over fsdp (ZeRO-3 style)
    ("heads", "model"),  # tensor parallel over heads …
    ("kv", None),
    ("mlp", "model"),  # … over the MLP's hidden dim
    ("vocab", "model"),  # … and over the vocabulary
    ("layers", None),  # the stacked-layer dim of nn.scan is never split
    ("lora_rank", None),  # a LoRA adapter's rank: small, never split
    ("adapters", None),  # the stacked adapters of a served bank: each row is gathered per sequence
)

# Named mesh shapes: (data, fsdp, model); -1 takes the remaining devices.
LAYOUTS: dict[str, tuple[int, int, int]] = {
    "dp": (-1, 1, 1),  # pure data parallel: every device holds a full replica
    "fsdp": (1, -1, 1),  # fully sharded data parallel: params, grads, optimiser state split on d_model
    "tp": (1, 1, -1),  # tensor parallel (the original's cores_per_replica = all devices)
    "fsdp_tp8": (1, -1, 8),  # FSDP across hosts, 8-way tensor parallel within a TPU host
    "dp_tp8": (-1, 1, 8),  # the original mesh-transformer-jax layout with cores_per_replica=8
}


def unknown_axes(logical: Sequence[str | None] | PartitionSpec, rules: Rules) -> list[str]:
    """The logical axis names in ``logical`` that ``rules`` has no entry for."""
    known = {name for name, _ in rules}
    return [name for name in logical if isinstance(name, str) and name not in known]


def check_axes(logical: Sequence[str | None] | PartitionSpec, rules: Rules, where: str) -> None:
    """Refuse a logical axis name that ``rules`` has no entry for, naming it and ``where`` it is used.

    Linen would keep such a dimension whole on every device without a word, so a misspelt name
    would replicate a tensor that was meant to be split.
    """
    unknown = unknown_axes(logical, rules)
    if unknown:
        known = sorted({name for name, _ in rules})
        close = difflib.get_close_matches(unknown[0], known, n=1)
        raise ConfigError(
            f"{where} names the logical axis {unknown[0]!r}, which the logical axis rules have no entry "
            f"for{f' (did you mean {close[0]!r}?)' if close else ''}; they have {', '.join(known)}. Correct "
            f"the name, or add a rule for it (('{unknown[0]}', None) keeps that dimension whole)"
        )


def mesh_axes(
    logical: Sequence[str | None] | PartitionSpec, rules: Rules = DEFAULT_RULES, where: str | None = None
) -> PartitionSpec:
    """The mesh axes of a tensor whose dims are named ``logical``, as ``rules`` place them; a name
    without a rule is refused (:func:`check_axes`), ``where`` saying what the tensor is."""
    check_axes(logical, rules, where or f"the array of logical axes {tuple(logical)}")
    spec = nn.logical_to_mesh_axes(tuple(logical), rules)
    assert spec is not None  # Linen answers None only when given None
    return spec


def replica_axes(rules: Rules | None = None) -> tuple[str, ...]:
    """The mesh axes a batch is split over (where ``rules``, default the active ones, place ``batch``):
    each combination of their indices is one data-parallel replica, holding its own rows."""
    axes = mesh_axes(("batch",), tuple(nn.get_logical_axis_rules()) if rules is None else rules)[0]
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
