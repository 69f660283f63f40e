"""Starting a training run from existing weights: ``--init-from hf:DIR | legacy:DIR | CKPT``.

The weights go straight from their files onto the shards of the run's mesh, one tensor at a time,
so a 6B import never holds a second copy of the model in host memory. Any source restores onto any
mesh and host count: nothing about the mesh it was saved from is needed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from gptj_flax import checkpoint, partitioning
from gptj_flax.config import Config, ModelConfig
from gptj_flax.convert.common import ConversionError
from gptj_flax.convert.hf import HFCheckpoint
from gptj_flax.convert.layout import place_on_mesh, streamed_params
from gptj_flax.convert.legacy import LegacyCheckpoint
from gptj_flax.convert.orbax_io import OrbaxParams
from gptj_flax.model import stack_layers, unstack_layers

# The fields that decide parameter shapes and numerics; a source must agree on all of them.
ARCHITECTURE_FIELDS = ("n_layers", "d_model", "n_heads", "rotary_dim", "vocab_size", "d_ff", "layer_norm_eps")


def parse_init_spec(spec: str) -> tuple[str, str]:
    """``hf:DIR`` → ("hf", DIR), ``legacy:DIR`` → ("legacy", DIR), anything else → ("orbax", spec)."""
    for kind in ("hf", "legacy"):
        if spec.startswith(f"{kind}:"):
            location = spec[len(kind) + 1:]
            if not location:
                raise ConversionError(f"--init-from {spec!r}: give a directory after '{kind}:'")
            return kind, location
    return "orbax", spec


def check_architecture(source: ModelConfig, wanted: ModelConfig, where: str) -> None:
    """Refuse a source whose shapes differ from the run's config, naming every difference."""
    diffs = [f"{name}: {getattr(source, name)} there, {getattr(wanted, name)} in the config"
             for name in ARCHITECTURE_FIELDS if getattr(source, name) != getattr(wanted, name)]
    if diffs:
        raise ConversionError(f"{where} does not fit the model config: " + "; ".join(diffs))


def load_init_params(spec: str, config: Config, mesh: Mesh, legacy_shards: int | None = None) -> dict:
    """Initial params for ``config`` on ``mesh`` from ``spec`` (``hf:DIR``, ``legacy:DIR`` or an Orbax path).

    Returns our params tree (scanned or unrolled per ``config.model.scan_layers``) of ``jax.Array``s
    in ``config.model.param_dtype``, sharded as the partitioning rules place them on ``mesh``.
    ``legacy_shards``, if known (the legacy config's ``cores_per_replica``), is checked against the
    checkpoint's shard directories.
    """
    kind, location = parse_init_spec(spec)
    config.model.validate_for_mesh(partitioning.mesh_shape(mesh))
    target, shardings = checkpoint.abstract_params(config, mesh)
    if kind == "hf":
        source = HFCheckpoint.open(location)
        check_architecture(source.model_config, config.model, f"{location}/config.json")
        return place_on_mesh(streamed_params(source.get, config.model), target, desc="loading hf weights")
    if kind == "legacy":
        with LegacyCheckpoint(location, config.model, legacy_shards) as legacy:
            return place_on_mesh(streamed_params(legacy.get, config.model), target, desc="loading legacy weights")

    stored = OrbaxParams.open(location)
    check_architecture(stored.config.model, config.model, location)
    _, params, _ = checkpoint.load_params(location, mesh, step=stored.step, dtype=config.model.weight_dtype)
    if stored.config.model.scan_layers != config.model.scan_layers:
        params = stack_layers(params, config.model.n_layers) if config.model.scan_layers else unstack_layers(params)
        params = jax.device_put(params, shardings)
    return params


def insert_adam_moments(opt_state, mu, nu, count) -> object:
    """Replace the ``optax.ScaleByAdamState`` inside any optax state tree by ``(count, mu, nu)``.

    Works on any chain or wrapper (``chain``, ``masked``, ``MultiSteps``, ``inject_hyperparams`` …):
    the one Adam node is found by type. ``mu`` and ``nu`` must match the existing moments' tree and
    shapes; they are cast to the existing dtypes and put on the existing shardings, so the state can
    go straight into the jitted train step. Other states (e.g. the schedule's count) are kept —
    the original fine-tuning likewise loaded Adam's moments and restarted the schedule.
    """
    found = []

    def replace(node):
        if not isinstance(node, optax.ScaleByAdamState):
            return node
        found.append(node)
        if jax.tree.structure(node.mu) != jax.tree.structure(mu) or jax.tree.structure(node.nu) != jax.tree.structure(nu):
            raise ValueError("insert_adam_moments: mu/nu trees differ from the optimiser's params tree "
                             "(scanned vs unrolled layers?)")
        return optax.ScaleByAdamState(
            count=_like(jnp.asarray(count), node.count), mu=jax.tree.map(_like, mu, node.mu),
            nu=jax.tree.map(_like, nu, node.nu))

    new_state = jax.tree.map(replace, opt_state, is_leaf=lambda n: isinstance(n, optax.ScaleByAdamState))
    if len(found) != 1:
        raise ValueError(f"insert_adam_moments: the optimiser state holds {len(found)} ScaleByAdamState nodes; "
                         "expected exactly one")
    return new_state


def _like(new, old):
    """``new`` with ``old``'s shape checked, and its dtype and — if ``old`` is placed — its sharding."""
    if tuple(new.shape) != tuple(old.shape):
        raise ValueError(f"insert_adam_moments: shape {tuple(new.shape)} does not match the state's {tuple(old.shape)}")
    new = jnp.asarray(new, dtype=old.dtype)
    # An uncommitted leaf (e.g. optax's count from a plain init) may go wherever jit puts it.
    return jax.device_put(new, old.sharding) if isinstance(old, jax.Array) and old.committed else new
