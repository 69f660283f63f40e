"""Starting a training run from existing weights: ``--init-from hf:DIR | legacy:DIR | CKPT``.

The weights go straight from their files onto the shards of the run's mesh, one tensor at a time,
so a 6B import never holds a second copy of the model in host memory. Any source restores onto any
mesh and host count: nothing about the mesh it was saved from is needed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from gptj_flax import checkpoint
from gptj_flax.config import Config, ModelConfig
from gptj_flax.convert.common import ConversionError, require_float
from gptj_flax.convert.hf import HFCheckpoint
from gptj_flax.convert.layout import place_on_mesh, streamed_params
from gptj_flax.convert.legacy import LegacyCheckpoint, load_legacy_opt_state
from gptj_flax.convert.orbax_io import OrbaxParams
from gptj_flax.convert.quantize import orbax_streamed, quantize_streamed
from gptj_flax.model import stack_layers, unstack_layers

# The fields that decide parameter shapes and numerics; a source must agree on all of them.
ARCHITECTURE_FIELDS = ("n_layers", "d_model", "n_heads", "rotary_dim", "vocab_size", "d_ff", "layer_norm_eps")


def parse_init_spec(spec: str) -> tuple[str, str]:
    """``hf:DIR`` → ("hf", DIR), ``legacy:DIR`` → ("legacy", DIR), anything else → ("orbax", spec)."""
    for kind in ("hf", "legacy"):
        if spec.startswith(f"{kind}:"):
            location = spec[len(kind) + 1 :]
            if not location:
                raise ConversionError(f"--init-from {spec!r}: give a directory after '{kind}:'")
            return kind, location
    return "orbax", spec


def check_architecture(source: ModelConfig, wanted: ModelConfig, where: str) -> None:
    """Refuse a source whose shapes differ from the run's config, naming every difference."""

    def value(config: ModelConfig, name: str):  # an unset d_ff is 4 * d_model, spelt out or not
        return config.ff_dim if name == "d_ff" else getattr(config, name)

    diffs = [
        f"{name}: {value(source, name)} there, {value(wanted, name)} in the config"
        for name in ARCHITECTURE_FIELDS
        if value(source, name) != value(wanted, name)
    ]
    if diffs:
        raise ConversionError(f"{where} does not fit the model config: " + "; ".join(diffs))


def load_init_params(spec: str, config: Config, mesh: Mesh, legacy_shards: int | None = None) -> dict:
    """Initial params for ``config`` on ``mesh`` from ``spec`` (``hf:DIR``, ``legacy:DIR`` or an Orbax path).

    Returns our params tree (scanned or unrolled per ``config.model.scan_layers``) of ``jax.Array``s
    in ``config.model.param_dtype``, sharded as the partitioning rules place them on ``mesh``. With
    ``config.model.quantize`` (a QLoRA base) the block projections are quantised as they load, from
    the source's float values, exactly as ``load(spec, quantize=…)`` and ``gptj-convert quantize``
    quantise them. ``legacy_shards``, if known (the legacy config's ``cores_per_replica``), is
    checked against the checkpoint's shard directories.
    """
    kind, location = parse_init_spec(spec)
    mc = config.model
    float_model = dataclasses.replace(mc, quantize=None)
    # Quantising reads the source in float32, so the int8 kernels do not depend on param_dtype.
    read_dtype = None if mc.quantize is None else np.float32

    def place(streamed: dict, layout: ModelConfig, desc: str) -> dict:
        if mc.quantize is not None:
            _, streamed = quantize_streamed(streamed, dataclasses.replace(layout, quantize=None))
            desc += f", quantising to {mc.quantize}"
        target, _ = checkpoint.param_targets(dataclasses.replace(mc, scan_layers=layout.scan_layers), mesh)
        return place_on_mesh(streamed, target, desc=desc)

    if kind == "hf":
        source = HFCheckpoint.open(location)
        check_architecture(source.model_config, mc, f"{location}/config.json")
        return place(streamed_params(source.get, float_model, read_dtype), mc, "loading hf weights")
    if kind == "legacy":
        with LegacyCheckpoint(location, mc, legacy_shards) as legacy:
            return place(streamed_params(legacy.get, float_model, read_dtype), mc, "loading legacy weights")

    stored = OrbaxParams.open(location)
    require_float(stored.config.model, location, "training")
    check_architecture(stored.config.model, mc, location)
    if mc.quantize is None:
        _, params, _ = checkpoint.load_params(location, mesh, step=stored.step, dtype=mc.weight_dtype)
    else:  # in the stored layer layout; restacked below like a float checkpoint
        params = place(orbax_streamed(stored), stored.config.model, "loading orbax weights")
    if stored.config.model.scan_layers != mc.scan_layers:
        _, shardings = checkpoint.param_targets(mc, mesh)
        params = stack_layers(params, mc.n_layers) if mc.scan_layers else unstack_layers(params)
        params = jax.device_put(params, shardings)
    return params


def load_init_opt_state(spec: str, config: Config, mesh: Mesh, target, legacy_shards: int | None = None):
    """The optimiser state to fine-tune with from ``spec``, or None when the source carries none.

    ``target`` is the run's optimiser state as a tree of ``jax.ShapeDtypeStruct`` with shardings
    (e.g. ``jax.eval_shape(tx.init, params)`` with the state's shardings). HF directories and slim
    checkpoints have no optimiser state: None. A full legacy checkpoint gives Adam's count and
    moments, placed into a fresh state of ``target``'s structure (every other leaf — schedule and
    other counters — starts at zero, as a fresh optax state does). An Orbax checkpoint with an
    ``opt_state`` item is restored onto ``target`` as saved; it must come from the same optimiser
    and layer layout.
    """
    kind, location = parse_init_spec(spec)
    if kind == "hf":
        return None
    if kind == "legacy":
        with LegacyCheckpoint(location, config.model, legacy_shards) as legacy:
            if not legacy.full:
                return None
        adam = load_legacy_opt_state(location, config, mesh, legacy_shards)
        fresh = jax.tree.map(_zeros, target, is_leaf=_is_adam)
        return insert_adam_moments(fresh, adam.mu, adam.nu, adam.count)

    stored = OrbaxParams.open(location)
    if not stored.has_opt_state:
        return None
    if stored.config.model.scan_layers != config.model.scan_layers:
        raise ConversionError(
            f"{location}: its optimiser state was saved with scan_layers={stored.config.model.scan_layers}; "
            f"set model.scan_layers={stored.config.model.scan_layers} to carry it, or start a fresh optimiser"
        )
    ckpt = checkpoint.Checkpointer(stored.directory, read_only=True)
    try:
        return ckpt.restore_item(stored.step, "opt_state", target)
    except checkpoint.CheckpointCorrupted:
        raise
    except checkpoint.CheckpointError as e:
        raise ConversionError(
            f"{location}: its optimiser state does not fit this run's optimiser "
            f"(a different optimiser or frozen parameters?), or start a fresh one: {e}"
        ) from None
    finally:
        ckpt.close()


def _is_adam(node) -> bool:
    return isinstance(node, optax.ScaleByAdamState)


def _zeros(node):
    """A zero leaf for an abstract leaf (a whole Adam node is kept, to be filled in)."""
    if _is_adam(node) or not isinstance(node, jax.ShapeDtypeStruct):
        return node
    return jax.device_put(np.zeros(node.shape, node.dtype), node.sharding)


def insert_adam_moments(opt_state, mu, nu, count):
    """Replace the ``optax.ScaleByAdamState`` inside any optax state tree by ``(count, mu, nu)``.

    Works on any chain or wrapper (``chain``, ``masked``, ``multi_transform``, ``MultiSteps`` …):
    the one Adam node is found by type. ``mu`` and ``nu`` are params-shaped trees; parameters the
    optimiser masks out (``optax.MaskedNode``, e.g. frozen ones) stay masked. Values are cast to the
    state's dtypes and put on its shardings (its leaves may be arrays or ``ShapeDtypeStruct``s), so
    the result goes straight into the jitted train step. Other states (e.g. the schedule's count)
    are kept — the original fine-tuning likewise loaded Adam's moments and restarted the schedule.
    """
    found = []

    def replace(node):
        if not _is_adam(node):
            return node
        found.append(node)
        return optax.ScaleByAdamState(
            count=_like(jnp.asarray(count), node.count), mu=_fill(node.mu, mu, "mu"), nu=_fill(node.nu, nu, "nu")
        )

    new_state = jax.tree.map(replace, opt_state, is_leaf=_is_adam)
    if len(found) != 1:
        raise ValueError(
            f"insert_adam_moments: the optimiser state holds {len(found)} ScaleByAdamState nodes; expected exactly one"
        )
    return new_state


def _fill(old, new, name: str):
    """``old``'s tree with each unmasked leaf replaced by ``new``'s leaf at the same path."""
    values = dict(jax.tree_util.tree_flatten_with_path(new)[0])

    def take(path, leaf):
        if isinstance(leaf, optax.MaskedNode):
            return leaf
        if path not in values:
            raise ValueError(
                f"insert_adam_moments: {name} has no {jax.tree_util.keystr(path)} (scanned vs unrolled layers?)"
            )
        return _like(values[path], leaf)

    return jax.tree_util.tree_map_with_path(take, old, is_leaf=lambda x: isinstance(x, optax.MaskedNode))


def _like(new, old):
    """``new`` with ``old``'s shape checked, and its dtype and — if ``old`` is placed — its sharding."""
    if tuple(new.shape) != tuple(old.shape):
        raise ValueError(f"insert_adam_moments: shape {tuple(new.shape)} does not match the state's {tuple(old.shape)}")
    new = jnp.asarray(new, dtype=old.dtype)
    # An uncommitted array (e.g. optax's count from a plain init) may go wherever jit puts it.
    placed = isinstance(old, jax.ShapeDtypeStruct) or (isinstance(old, jax.Array) and old.committed)
    sharding = getattr(old, "sharding", None)
    return jax.device_put(new, sharding) if placed and sharding is not None else new
