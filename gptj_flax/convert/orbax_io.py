"""Orbax checkpoints written and read one parameter at a time.

The layout is :mod:`gptj_flax.checkpoint`'s (``RUN_DIR/STEP/{params,meta,config}``, the tokenizer in
``RUN_DIR/tokenizer``), so :func:`gptj_flax.checkpoint.load_params` restores what we write onto any
mesh. What differs is memory: ``Checkpointer.save`` takes a tree of arrays already in memory, which
for a converter would be the whole model. Here the params are :class:`~layout.StreamedArray`s and a
type handler materialises, writes and drops them one by one, so writing holds one leaf at a time.
Reading likewise restores one leaf per call (Orbax partial restore) as a host numpy array.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import future, type_handlers

from gptj_flax import checkpoint
from gptj_flax.config import Config
from gptj_flax.convert.common import progress
from gptj_flax.convert.layout import Path, StreamedArray, leaves_with_paths, param_shapes


class _StreamedArrayHandler(type_handlers.NumpyHandler):
    """Writes :class:`StreamedArray` leaves sequentially, each exactly as Orbax writes a numpy array.

    The stock handler writes every leaf of a save concurrently from arrays already in memory; this
    one materialises a leaf only when its turn comes and lets it go once written. On disk the leaf
    is an ordinary ``np.ndarray`` entry, so any Orbax restore (into sharded ``jax.Array`` targets or
    numpy) reads it.
    """

    def __init__(self, desc: str):
        super().__init__(deepcopy_host_arrays=False)  # the materialised array is ours alone
        self._desc = desc

    async def serialize(self, values: Sequence[StreamedArray], infos, args=None):
        args = args or [ocp.SaveArgs()] * len(values)

        async def write_one_by_one():
            with progress(sum(v.nbytes for v in values), self._desc) as bar:
                for value, info, arg in zip(values, infos, args):
                    array = value.materialize()
                    # NumpyHandler's own write of one array (orbax-checkpoint is pinned; the tests
                    # restore what this writes, so an upstream change shows at once).
                    await self._background_serialize([array], [info], [arg])
                    del array
                    bar.update(value.nbytes)

        return [future.CommitFutureAwaitingContractedSignals(write_one_by_one(), name="streamed_array_writer")]


def _tree_handler(desc: str) -> ocp.PyTreeCheckpointHandler:
    # A private registry: the process-wide one stays untouched for training's own saves.
    registry = type_handlers.create_type_handler_registry(
        (StreamedArray, _StreamedArrayHandler(desc)), (jax.Array, type_handlers.get_type_handler(jax.Array)))
    # No zstd: it buffers a compressed copy of each array (measured: +1× the leaf, and memory kept
    # after the save) to gain a few percent on weights, which are close to incompressible noise.
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry, use_compression=False)


def write_checkpoint(directory: str | os.PathLike, step: int, *, params: dict, config: Config,
                     meta: Mapping[str, Any] | None = None, opt_state: Any = None) -> None:
    """Write one checkpoint step in :mod:`gptj_flax.checkpoint`'s layout from streamed trees.

    ``params`` (and ``opt_state``, if given) have :class:`StreamedArray` leaves.
    """
    handlers = {"params": _tree_handler("params"), "meta": ocp.JsonCheckpointHandler(),
                "config": ocp.JsonCheckpointHandler()}
    items = {
        "params": ocp.args.PyTreeSave(params),
        "meta": ocp.args.JsonSave({"step": int(step), **(meta or {})}),
        "config": ocp.args.JsonSave(config.to_dict()),
    }
    if opt_state is not None:
        handlers["opt_state"] = _tree_handler("optimiser state")
        items["opt_state"] = ocp.args.PyTreeSave(opt_state)
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True)
    manager = ocp.CheckpointManager(epath.Path(directory), options=options, item_handlers=handlers)
    try:
        manager.save(int(step), args=ocp.args.Composite(**items))
        manager.wait_until_finished()
    finally:
        manager.close()


@dataclasses.dataclass
class OrbaxParams:
    """The params of one checkpoint step, readable one leaf at a time without a device mesh."""

    directory: epath.Path  # the run directory
    step: int
    config: Config
    meta: dict
    has_opt_state: bool

    @classmethod
    def open(cls, path: str | os.PathLike, step: int | None = None) -> "OrbaxParams":
        """``path`` is a run directory (latest step unless ``step``) or a step directory."""
        directory, path_step = checkpoint.split_step_path(path)
        ckpt = checkpoint.Checkpointer(directory, read_only=True)
        try:
            steps = ckpt.all_steps()
            step = path_step if step is None else step
            if not steps:
                raise checkpoint.CheckpointError(f"no complete checkpoint in {directory}")
            if step is None:
                step = max(steps)
            elif step not in steps:
                raise checkpoint.CheckpointError(f"step {step} not in {directory} (available: {sorted(steps)})")
            config = ckpt.read_config(step)
            has_opt_state = ckpt.has_opt_state(step)
        finally:
            ckpt.close()
        meta = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(
            directory / str(step) / "meta", args=ocp.args.JsonRestore())
        return cls(directory, step, config, dict(meta), has_opt_state)

    @property
    def params_dir(self) -> epath.Path:
        return self.directory / str(self.step) / "params"

    @property
    def tokenizer_dir(self) -> epath.Path | None:
        return checkpoint.tokenizer_dir(self.directory)

    def leaf_shapes(self) -> dict[Path, tuple[int, ...]]:
        return param_shapes(self.config.model)

    def stored_dtypes(self) -> dict[Path, np.dtype]:
        """The dtype each leaf was saved in (float32 masters, or bf16/fp16 for slim checkpoints)."""
        metadata = ocp.PyTreeCheckpointer().metadata(self.params_dir).item_metadata
        return {path: np.dtype(leaf.dtype) for path, leaf in leaves_with_paths(dict(metadata.tree))}

    def read(self, path: Path) -> np.ndarray:
        """One leaf as a host numpy array in its stored dtype."""
        item: dict = {}
        restore_args: dict = {}
        node, args_node = item, restore_args
        for key in path[:-1]:
            node, args_node = node.setdefault(key, {}), args_node.setdefault(key, {})
        node[path[-1]] = 0  # a placeholder: partial_restore reads only the leaves named in the item
        args_node[path[-1]] = ocp.RestoreArgs(restore_type=np.ndarray)
        out = ocp.PyTreeCheckpointer().restore(
            self.params_dir, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True))
        for key in path:
            out = out[key]
        return out
