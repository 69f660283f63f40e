"""Orbax checkpoints written and read one parameter at a time.

The layout is :mod:`gptj_flax.checkpoint`'s (``RUN_DIR/STEP/{params,meta,config}``, the tokenizer in
``RUN_DIR/tokenizer``), so :func:`gptj_flax.checkpoint.load_params` restores what we write onto any
mesh. What differs is memory: ``Checkpointer.save`` takes a tree of arrays already in memory, which
for a converter would be the whole model. Here the params are :class:`~layout.StreamedArray`s and a
type handler materialises, writes and drops them one by one, so writing holds one leaf at a time.
Reading likewise restores one leaf per call (Orbax partial restore) as a host numpy array.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
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
from gptj_flax.convert.layout import ParamPath, StreamedArray, leaves_with_paths, param_shapes

log = logging.getLogger(__name__)


class _WriteControl:
    """Lets a failed or interrupted save stop its streamed writers, and wait until none is writing.

    Orbax runs each item's writer in its own thread and reports only the first failure; the
    others would go on writing into a directory about to be removed.
    """

    def __init__(self):
        self.stop = threading.Event()
        self._futures: list[future.Future] = []

    def started(self, commit: future.Future) -> future.Future:
        self._futures.append(commit)
        return commit

    def stop_and_wait(self) -> None:
        """Stop every writer after the tensor it is writing, and wait for all of them to return."""
        self.stop.set()
        for commit in self._futures:
            while True:
                try:
                    commit.result()
                    break
                except KeyboardInterrupt:  # a second Ctrl-C: the writer still has to stop first
                    log.warning("stopping after the tensor being written, then removing the partial output")
                except BaseException:  # noqa: BLE001 - its failure is being reported already
                    break


class _StreamedArrayHandler(type_handlers.NumpyHandler):
    """Writes :class:`StreamedArray` leaves sequentially, each exactly as Orbax writes a numpy array.

    The stock handler writes every leaf of a save concurrently from arrays already in memory; this
    one materialises a leaf only when its turn comes and lets it go once written. On disk the leaf
    is an ordinary ``np.ndarray`` entry, so any Orbax restore (into sharded ``jax.Array`` targets or
    numpy) reads it.
    """

    def __init__(self, desc: str, control: _WriteControl):
        super().__init__(deepcopy_host_arrays=False)  # the materialised array is ours alone
        self._desc = desc
        self._control = control

    async def serialize(self, values: Sequence[StreamedArray], infos, args=None):
        args = args or [ocp.SaveArgs()] * len(values)

        async def write_one_by_one():
            with progress(sum(v.nbytes for v in values), self._desc) as bar:
                for value, info, arg in zip(values, infos, args):
                    if self._control.stop.is_set():
                        raise asyncio.CancelledError  # Orbax logs nothing for a cancelled writer
                    try:
                        array = value.materialize()
                        # NumpyHandler's own write of one array (orbax-checkpoint is pinned; the
                        # tests restore what this writes, so an upstream change shows at once).
                        await self._background_serialize([array], [info], [arg])
                    except BaseException:
                        self._control.stop.set()  # the other items' writers stop too
                        raise
                    del array
                    bar.update(value.nbytes)

        return [
            self._control.started(
                future.CommitFutureAwaitingContractedSignals(write_one_by_one(), name="streamed_array_writer")
            )
        ]


def _tree_handler(desc: str, control: _WriteControl) -> ocp.PyTreeCheckpointHandler:
    # A private registry: the process-wide one stays untouched for training's own saves.
    registry = type_handlers.create_type_handler_registry(
        (StreamedArray, _StreamedArrayHandler(desc, control)), (jax.Array, type_handlers.get_type_handler(jax.Array))
    )
    # No zstd: it buffers a compressed copy of each array (measured: +1× the leaf, and memory kept
    # after the save) to gain a few percent on weights, which are close to incompressible noise.
    return checkpoint.array_tree_handler(type_handler_registry=registry, use_compression=False)


def write_checkpoint(
    directory: str | os.PathLike,
    step: int,
    *,
    params: dict,
    config: Config,
    meta: Mapping[str, Any] | None = None,
    opt_state: Any = None,
) -> None:
    """Write one checkpoint step in :mod:`gptj_flax.checkpoint`'s layout from streamed trees.

    ``params`` (and ``opt_state``, if given) have :class:`StreamedArray` leaves; every chunk gets
    its checksum as in :class:`~gptj_flax.checkpoint.Checkpointer`. On a failure or Ctrl-C, every
    writer has stopped before this returns, so the caller may remove the directory.
    """
    control = _WriteControl()
    handlers = {
        "params": _tree_handler("params", control),
        "meta": ocp.JsonCheckpointHandler(),
        "config": ocp.JsonCheckpointHandler(),
    }
    items = {
        "params": ocp.args.PyTreeSave(params),
        "meta": ocp.args.JsonSave(
            {"step": int(step), **(meta or {}), checkpoint.INTEGRITY_KEY: checkpoint.CHUNK_CHECKSUMS}
        ),
        "config": ocp.args.JsonSave(config.to_dict()),
    }
    if opt_state is not None:
        handlers["opt_state"] = _tree_handler("optimiser state", control)
        items["opt_state"] = ocp.args.PyTreeSave(opt_state)
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True)
    manager = ocp.CheckpointManager(checkpoint.absolute_path(directory), options=options, item_handlers=handlers)
    try:
        manager.save(int(step), args=ocp.args.Composite(**items))
        manager.wait_until_finished()
    except BaseException:
        control.stop_and_wait()
        with contextlib.suppress(Exception):
            manager.close()
        raise
    manager.close()


@dataclasses.dataclass
class OrbaxParams:
    """The params of one checkpoint step, readable one leaf at a time without a device mesh."""

    directory: epath.Path  # the run directory (absolute)
    step: int
    config: Config
    meta: dict
    has_opt_state: bool
    steps: list[int] = dataclasses.field(default_factory=list)  # every step of the run directory

    @classmethod
    def open(cls, path: str | os.PathLike, step: int | None = None) -> OrbaxParams:
        """``path`` is a run directory (latest step unless ``step``) or a step directory."""
        directory, path_step = checkpoint.split_step_path(path)
        ckpt = checkpoint.Checkpointer(directory, read_only=True)
        try:
            step = ckpt.resolve_step(path_step if step is None else step)
            config = ckpt.read_config(step)
            meta = ckpt.read_json(step, "meta")
            has_opt_state = ckpt.has_opt_state(step)
            steps = sorted(ckpt.all_steps())
        finally:
            ckpt.close()
        checkpoint.refuse_lora_checkpoint(directory, step, config, meta)
        checkpoint.notice_if_unverified(directory / str(step), meta)
        return cls(directory, step, config, meta, has_opt_state, steps)

    @property
    def params_dir(self) -> epath.Path:
        return self.directory / str(self.step) / "params"

    @property
    def tokenizer_dir(self) -> epath.Path | None:
        return checkpoint.tokenizer_dir(self.directory)

    def leaf_shapes(self) -> dict[ParamPath, tuple[int, ...]]:
        return param_shapes(self.config.model)

    def stored_dtypes(self) -> dict[ParamPath, np.dtype]:
        """The dtype each leaf was saved in (float32 masters, or bf16/fp16 for slim checkpoints)."""
        metadata = ocp.PyTreeCheckpointer().metadata(self.params_dir).item_metadata
        return {path: np.dtype(leaf.dtype) for path, leaf in leaves_with_paths(dict(metadata.tree))}

    def read(self, path: ParamPath) -> np.ndarray:
        """One leaf as a host numpy array in its stored dtype."""
        item: dict = {}
        restore_args: dict = {}
        node, args_node = item, restore_args
        for key in path[:-1]:
            node, args_node = node.setdefault(key, {}), args_node.setdefault(key, {})
        node[path[-1]] = 0  # a placeholder: partial_restore reads only the leaves named in the item
        args_node[path[-1]] = ocp.RestoreArgs(restore_type=np.ndarray)
        try:
            args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
            out = ocp.PyTreeCheckpointer().restore(self.params_dir, args=args)
        except Exception as e:  # Orbax re-raises TensorStore's read errors as a bare Exception
            damaged = checkpoint.corrupted(self.directory, self.step, "params", e, self.steps)
            if damaged is not None:
                raise damaged from None
            raise
        for key in path:
            out = out[key]
        return out
