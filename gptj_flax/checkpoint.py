"""Orbax checkpoints: one format for training runs, converted weights and everything that loads them.

A checkpoint directory holds one sub-directory per step (Orbax ``CheckpointManager`` layout)::

    RUN_DIR/
      tokenizer/            tokenizer files (saved once; travels with the weights)
      100/params            float32 parameters (or bf16/fp16 when slimmed)
      100/opt_state         optimiser state (absent in slim checkpoints)
      100/meta              JSON: step, data-iterator state, RNG key, anything else small
      100/config            JSON: the full Config (model, mesh, train)

Saves are asynchronous and atomic: Orbax writes into a temporary directory and renames it only when
every process has finished, so an interrupted save never becomes the latest step. Restores always
pass ``jax.ShapeDtypeStruct(…, sharding=…)`` targets, so a checkpoint written on any mesh and host
count loads onto any other.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh

from gptj_flax import partitioning
from gptj_flax.config import Config, ConfigError, from_dict
from gptj_flax.errors import GptjFlaxError
from gptj_flax.model import GPTJ

log = logging.getLogger(__name__)

TOKENIZER_DIR = "tokenizer"


class CheckpointError(GptjFlaxError, ValueError):
    """A checkpoint is missing, incomplete, or does not fit the model it is loaded into."""


@dataclasses.dataclass
class Restored:
    step: int
    config: Config
    params: Any
    opt_state: Any | None
    meta: dict


def split_step_path(path: str | os.PathLike) -> tuple[epath.Path, int | None]:
    """``RUN_DIR`` → (RUN_DIR, None); ``RUN_DIR/123`` → (RUN_DIR, 123)."""
    path = epath.Path(path)
    if path.name.isdigit() and (path / "config").exists():
        return path.parent, int(path.name)
    return path, None


class Checkpointer:
    """Save and restore training state in ``directory`` (local path or ``gs://``)."""

    def __init__(self, directory: str | os.PathLike, *, keep_last: int = 2, keep_every: int | None = None,
                 async_save: bool = True, read_only: bool = False):
        directory = os.fspath(directory)
        # Orbax needs absolute paths; URLs (gs://…) already are.
        self.directory = epath.Path(directory if "://" in directory else os.path.abspath(directory))
        policies = [ocp.checkpoint_managers.LatestN(keep_last)]
        if keep_every:
            policies.append(ocp.checkpoint_managers.EveryNSteps(keep_every))
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=not read_only,  # leftovers of interrupted saves
            read_only=read_only,
            save_interval_steps=0 if read_only else 1,
            create=not read_only,
        )
        if read_only and not self.directory.exists():
            raise CheckpointError(f"checkpoint directory not found: {self.directory}")
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("params", "opt_state", "meta", "config"))

    # -- queries ---------------------------------------------------------------------------
    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def _resolve(self, step: int | None) -> int:
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        if step is None:
            return max(steps)
        if step not in steps:
            raise CheckpointError(f"step {step} not in {self.directory} (available: {sorted(steps)})")
        return step

    def read_config(self, step: int | None = None) -> Config:
        step = self._resolve(step)
        raw = self._manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
        try:
            return from_dict(raw)
        except ConfigError as e:
            raise CheckpointError(f"{self.directory}/{step}/config: {e}") from None

    def has_opt_state(self, step: int | None = None) -> bool:
        return (self.directory / str(self._resolve(step)) / "opt_state").exists()

    # -- save ------------------------------------------------------------------------------
    def save(self, step: int, *, params: Any, config: Config, opt_state: Any = None,
             meta: Mapping[str, Any] | None = None, force: bool = False) -> bool:
        """Start an (async) save of ``step``; returns whether a save was started."""
        items = {
            "params": ocp.args.StandardSave(params),
            "meta": ocp.args.JsonSave({"step": int(step), **(meta or {})}),
            "config": ocp.args.JsonSave(config.to_dict()),
        }
        if opt_state is not None:
            items["opt_state"] = ocp.args.StandardSave(opt_state)
        return self._manager.save(int(step), args=ocp.args.Composite(**items), force=force)

    def save_tokenizer(self, tokenizer) -> None:
        """Store the tokenizer beside the steps (once per run; process 0 writes)."""
        if jax.process_index() == 0 and tokenizer is not None:
            tokenizer.save_pretrained(str(self.directory / TOKENIZER_DIR))

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    # -- restore ---------------------------------------------------------------------------
    def restore(self, step: int | None = None, *, params_target: Any, opt_state_target: Any = None) -> Restored:
        """Restore onto the shardings in the targets (trees of ``jax.ShapeDtypeStruct``)."""
        step = self._resolve(step)
        items = {
            "params": ocp.args.StandardRestore(params_target),
            "meta": ocp.args.JsonRestore(),
            "config": ocp.args.JsonRestore(),
        }
        if opt_state_target is not None:
            if not self.has_opt_state(step):
                raise CheckpointError(f"{self.directory}/{step} has no optimiser state (a slim checkpoint)")
            items["opt_state"] = ocp.args.StandardRestore(opt_state_target)
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(**items))
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{self.directory}/{step} does not match the model being restored: {e}") from e
        return Restored(step=step, config=from_dict(out["config"]), params=out["params"],
                        opt_state=out.get("opt_state") if opt_state_target is not None else None,
                        meta=dict(out["meta"]))


def abstract_params(config: Config, mesh: Mesh, rules: partitioning.Rules = partitioning.DEFAULT_RULES,
                    dtype: Any = None) -> tuple[Any, Any]:
    """Restore targets for the model's params: (tree of ShapeDtypeStruct with shardings, shardings)."""
    model = GPTJ(config.model)
    abstract = partitioning.abstract_init(model.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
    shardings = partitioning.logical_to_sharding(nn.get_partition_spec(abstract), mesh, rules)
    unboxed = nn.meta.unbox(abstract)
    target = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=s), unboxed, shardings)
    return target["params"], shardings["params"]


def load_params(path: str | os.PathLike, mesh: Mesh | None = None, *, step: int | None = None,
                dtype: Any = None, rules: partitioning.Rules = partitioning.DEFAULT_RULES) -> tuple[Config, Any, int]:
    """Load only the parameters of the checkpoint at ``path`` (run dir or step dir) onto ``mesh``.

    Returns ``(config, params, step)``; ``params`` leaves are sharded ``jax.Array``s of ``dtype``
    (default: as stored).
    """
    directory, path_step = split_step_path(path)
    ckpt = Checkpointer(directory, read_only=True)
    step = ckpt._resolve(path_step if step is None else step)
    config = ckpt.read_config(step)
    mesh = mesh or partitioning.make_mesh(config.mesh)
    config.model.validate_for_mesh(partitioning.mesh_shape(mesh))
    target, _ = abstract_params(config, mesh, rules, dtype)
    restored = ckpt.restore(step, params_target=target)
    ckpt.close()
    return config, restored.params, step


def tokenizer_dir(path: str | os.PathLike) -> epath.Path | None:
    """Where the tokenizer of the checkpoint at ``path`` lives, if it has one."""
    directory, _ = split_step_path(path)
    candidate = directory / TOKENIZER_DIR
    return candidate if candidate.exists() else None
