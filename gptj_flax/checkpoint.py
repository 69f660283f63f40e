"""Orbax checkpoints: one format for training runs, converted weights and everything that loads them.

A run directory holds one sub-directory per step (``params``, ``opt_state``, ``meta``, ``config``)
and the run's ``tokenizer/``. Saves are asynchronous and atomic, restores always go into sharded
``ShapeDtypeStruct`` targets (so any mesh loads any checkpoint), and every stored chunk carries a
crc32c checksum that each read verifies (see :func:`_checksum_every_chunk`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import logging
import os
import re
import shutil
import sys
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from orbax.checkpoint._src.serialization import tensorstore_utils

from gptj_flax import model, partitioning
from gptj_flax.config import Config, ConfigError, ModelConfig, from_dict
from gptj_flax.errors import GptjFlaxError, debug_requested

log = logging.getLogger(__name__)

TOKENIZER_DIR = "tokenizer"
ABANDONED_DIR = "abandoned"  # later steps set aside when a run resumes from an earlier one
ARRAY_ITEMS = ("params", "opt_state")
JSON_ITEMS = ("meta", "config")
# Stored in every step's meta by the writers that checksum their chunks.
INTEGRITY_KEY = "integrity"
CHUNK_CHECKSUMS = "crc32c"
LORA_BASE_KEY = "lora_base"  # a LoRA checkpoint's meta: the base its adapters were trained on


class CheckpointError(GptjFlaxError, ValueError):
    """A checkpoint is missing, incomplete, or does not fit the model it is loaded into."""


class CheckpointCorrupted(CheckpointError):
    """A step's stored data fails its checksums (or cannot be decoded); nothing of it was loaded.

    ``directory`` and ``step`` name the step, ``item`` is ``"params"`` or ``"opt_state"``,
    ``previous_step`` the newest earlier step of the directory (None if there is none).
    """

    def __init__(self, message: str, *, directory: epath.Path, step: int, item: str, previous_step: int | None):
        super().__init__(message)
        self.directory, self.step, self.item, self.previous_step = directory, step, item, previous_step


class CheckpointDiskFull(CheckpointError):
    """A save ran out of space; the step was not written and earlier steps are untouched."""

    def __init__(self, message: str, *, directory: epath.Path, step: int | None, free_bytes: int | None):
        super().__init__(message)
        self.directory, self.step, self.free_bytes = directory, step, free_bytes


@dataclasses.dataclass
class Restored:
    step: int
    config: Config
    params: Any
    opt_state: Any | None
    meta: dict


# --------------------------------------------------------------------------------------------
# Paths and the chunk checksums


def absolute_path(path: str | os.PathLike) -> epath.Path:
    """``path`` as an absolute path (Orbax refuses relative ones); URLs such as ``gs://…`` are kept."""
    text = os.fspath(path)
    return epath.Path(text if "://" in text else os.path.abspath(os.path.expanduser(text)))


def _checksum_every_chunk() -> None:
    """Give every zarr v3 chunk Orbax writes a ``crc32c`` codec, which TensorStore checks on read.

    Each process checksums the chunks it writes and every reader verifies the chunks it reads, on
    any mesh, with no extra pass over the data; a chunk that fails refuses the whole step
    (:class:`CheckpointCorrupted`). Orbax 0.12 has no option for chunk codecs, hence this patch of
    the metadata it builds. Steps written without checksums (zarr v2) still load, with a notice.

    The codec goes last inside Orbax's ``sharding_indexed`` codec (after ``bytes`` and any
    compression), as zarr v3 wants for a checksum; any zarr v3 reader verifies it. It applies to
    every zarr v3 array Orbax writes in this process (Orbax's default, zarr v2, is untouched).
    Should a new Orbax build its metadata differently, saves stop here rather than write
    unchecksummed data (orbax-checkpoint is pinned; the tests read the codecs back).
    """
    build = tensorstore_utils._build_zarr3_metadata
    if getattr(build, "adds_crc32c", False):
        return

    @functools.wraps(build)
    def with_crc32c(*args, **kwargs):
        metadata = build(*args, **kwargs)
        outer = metadata["codecs"]
        if len(outer) != 1 or outer[0].get("name") != "sharding_indexed":
            raise RuntimeError(f"unexpected zarr v3 codecs from orbax-checkpoint: {outer}; cannot add chunk checksums")
        inner = outer[0]["configuration"]["codecs"]
        if not any(codec.get("name") == "crc32c" for codec in inner):
            inner.append({"name": "crc32c"})
        return metadata

    with_crc32c.adds_crc32c = True  # type: ignore[attr-defined]  # marks the patch as applied
    tensorstore_utils._build_zarr3_metadata = with_crc32c


_checksum_every_chunk()


def array_tree_handler(**kwargs) -> ocp.PyTreeCheckpointHandler:
    """The handler every array tree is saved with: zarr v3, so each chunk carries its checksum."""
    return ocp.PyTreeCheckpointHandler(use_zarr3=True, **kwargs)


def restore_args_for(target: Any) -> ocp.args.PyTreeRestore:
    """Restore ``target`` (a tree of ``jax.ShapeDtypeStruct`` with shardings) exactly as shaped."""
    return ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))


_UNVERIFIED_NOTICES: set[str] = set()


def notice_if_unverified(step_dir: epath.Path, meta: Mapping[str, Any]) -> None:
    """Say once per step directory that a step written without chunk checksums cannot be verified."""
    if meta.get(INTEGRITY_KEY) == CHUNK_CHECKSUMS or str(step_dir) in _UNVERIFIED_NOTICES:
        return
    _UNVERIFIED_NOTICES.add(str(step_dir))
    log.warning(
        "%s was written without chunk checksums (by an older gptj_flax): its data cannot be verified "
        "as it loads. A step saved from it now (by training, or convert.py slim) has them.",
        step_dir,
    )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _causes(error: BaseException | None) -> Iterator[BaseException]:
    """``error`` and the exceptions it was raised from (Orbax wraps TensorStore's errors)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


# How TensorStore reports damaged stored bytes: a failed checksum, a chunk that no longer decodes
# (zstd reads a chunk as it streams, so it may fail on damaged bytes before the checksum is checked),
# or a data file cut short (a chunk's byte range runs past the file's end).
_DATA_LOSS = re.compile(
    r"DATA_LOSS|Digest mismatch|Error decoding|decompress|Requested byte range .* is not valid", re.IGNORECASE
)


def _data_loss(error: BaseException) -> BaseException | None:
    """The TensorStore error in ``error``'s chain saying stored bytes are damaged, if any."""
    for cause in _causes(error):
        if _DATA_LOSS.search(str(cause)):
            return cause
    return None


def corrupted(
    directory: epath.Path, step: int, item: str, error: BaseException, steps: list[int]
) -> CheckpointCorrupted | None:
    """The :class:`CheckpointCorrupted` for a read of ``item`` that failed with ``error``, else None."""
    loss = _data_loss(error)
    if loss is None:
        return None
    text = _first_line(loss)
    array = re.search(r'in "([^"]+?)/c[/"]', text)  # TensorStore names the chunk key, e.g. "lm_head.kernel/c/0/0"
    what = f"array {array.group(1).replace('.', '/')}" if array else "an array"
    detail = re.sub(r"\s*\[tensorstore_spec.*", "", text.rsplit('": ', 1)[-1])  # what TensorStore found
    earlier = [s for s in steps if s < step]
    previous = max(earlier) if earlier else None
    advice = (
        f"The previous step is {previous}: load {directory / str(previous)} (or step={previous}) instead."
        if previous is not None
        else "There is no earlier step in this directory."
    )
    return CheckpointCorrupted(
        f"checkpoint step {step} in {directory} is corrupted: the stored data of {what} of its {item} is damaged "
        f"({detail[:160]}); the step was not loaded. {advice}",
        directory=directory,
        step=step,
        item=item,
        previous_step=previous,
    )


def _is_out_of_space(error: BaseException | None) -> bool:
    return any(
        (isinstance(cause, OSError) and cause.errno == errno.ENOSPC)
        or "No space left on device" in str(cause)
        or "os_error_code='28'" in str(cause)
        for cause in _causes(error)
    )


class _QuietOrbax(logging.Filter):
    """Drops Orbax log lines this module reports better itself, or that say nothing to a user.

    Out-of-space tracebacks from Orbax's save threads (and from asyncio, about the writes Orbax
    left unawaited) become one :class:`CheckpointDiskFull`; the warning that a directory opened
    read-only is read-only is what every load asks for.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if debug_requested():
            return True
        from_orbax = "orbax" in record.pathname
        if record.exc_info and _is_out_of_space(record.exc_info[1]) and (from_orbax or record.name == "asyncio"):
            return False
        return not (from_orbax and record.getMessage().startswith("Given directory is read only"))


def _install_log_filter() -> None:
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _QuietOrbax) for f in logger.filters):
            logger.addFilter(_QuietOrbax())


def _ignore_callbacks_into_closed_loops() -> None:
    """Silence TensorStore's completions of reads a failed restore left behind.

    When one read of a restore fails, Orbax closes its event loop while TensorStore still finishes
    the others; each completion then reports ``RuntimeError: Event loop is closed`` as an
    unraisable exception, dozens of tracebacks after the one error that matters. Nothing can
    act on them, so exactly those are dropped; every other unraisable exception is shown.
    """
    previous = sys.unraisablehook
    if getattr(previous, "ignores_closed_loops", False):
        return

    def hook(unraisable):
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            return
        previous(unraisable)

    hook.ignores_closed_loops = True  # type: ignore[attr-defined]  # marks the hook as installed
    sys.unraisablehook = hook


def _format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def split_step_path(path: str | os.PathLike) -> tuple[epath.Path, int | None]:
    """``RUN_DIR`` → (RUN_DIR, None); ``RUN_DIR/123`` → (RUN_DIR, 123); both made absolute."""
    directory = absolute_path(path)
    if directory.name.isdigit() and (directory / "config").exists():
        return directory.parent, int(directory.name)
    return directory, None


# --------------------------------------------------------------------------------------------
# The Checkpointer


class Checkpointer:
    """Save and restore training state in ``directory`` (local path or ``gs://``)."""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep_last: int = 2,
        keep_every: int | None = None,
        async_save: bool = True,
        read_only: bool = False,
    ):
        self.directory = absolute_path(directory)
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
        _install_log_filter()
        _ignore_callbacks_into_closed_loops()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                "params": array_tree_handler(),
                "opt_state": array_tree_handler(),
                "meta": ocp.JsonCheckpointHandler(),
                "config": ocp.JsonCheckpointHandler(),
            },
        )
        self._saving: int | None = None  # the step of the save that may still be in flight
        self._failed_save_reported = False
        if not read_only and jax.process_index() == 0:
            for leftover in self.directory.glob(f"{TOKENIZER_DIR}.tmp-*"):  # an interrupted tokenizer save
                leftover.rmtree(missing_ok=True)

    # -- queries ---------------------------------------------------------------------------
    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def resolve_step(self, step: int | None) -> int:
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        if step is None:
            return max(steps)
        if step not in steps:
            raise CheckpointError(f"step {step} not in {self.directory} (available: {sorted(steps)})")
        return step

    def read_json(self, step: int | None, item: str) -> dict:
        """The ``meta`` or ``config`` item of ``step``; a damaged or missing one is named."""
        step = self.resolve_step(step)
        where = self.directory / str(step) / item
        if not where.exists():
            raise CheckpointError(
                f"{where} is missing: step {step} is incomplete; use another step "
                f"(available: {sorted(self.all_steps())})"
            )
        try:
            raw = self._manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))[item]
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(
                f"{where}/metadata is not valid JSON ({e}): step {step} is damaged; use another "
                f"step (available: {sorted(self.all_steps())})"
            ) from None
        except (FileNotFoundError, ValueError, KeyError) as e:
            raise CheckpointError(
                f"{where} cannot be read ({_first_line(e)}): step {step} is incomplete; use "
                f"another step (available: {sorted(self.all_steps())})"
            ) from None
        if not isinstance(raw, dict):
            raise CheckpointError(
                f"{where}/metadata holds {type(raw).__name__}, not a JSON object: step {step} is damaged"
            )
        return raw

    def read_config(self, step: int | None = None) -> Config:
        step = self.resolve_step(step)
        raw = self.read_json(step, "config")
        try:
            return from_dict(raw)
        except ConfigError as e:
            raise CheckpointError(f"{self.directory}/{step}/config: {e}") from None

    def has_opt_state(self, step: int | None = None) -> bool:
        return (self.directory / str(self.resolve_step(step)) / "opt_state").exists()

    def has_checksums(self, step: int | None = None) -> bool:
        """Whether ``step``'s arrays carry chunk checksums (every restore of them verifies them)."""
        return self.read_json(step, "meta").get(INTEGRITY_KEY) == CHUNK_CHECKSUMS

    # -- save ------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        *,
        params: Any,
        config: Config,
        opt_state: Any = None,
        meta: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Start an (async) save of ``step``; returns whether a save was started.

        An earlier save's failure surfaces here, in :meth:`wait` or :meth:`close`; running out of
        space is a :class:`CheckpointDiskFull`.
        """
        items = {
            "params": ocp.args.PyTreeSave(params),
            "meta": ocp.args.JsonSave({"step": int(step), **(meta or {}), INTEGRITY_KEY: CHUNK_CHECKSUMS}),
            "config": ocp.args.JsonSave(config.to_dict()),
        }
        if opt_state is not None:
            items["opt_state"] = ocp.args.PyTreeSave(opt_state)
        with self._save_errors():  # an earlier save's failure is reported with that save's step
            self._manager.wait_until_finished()
        self._saving = int(step)
        with self._save_errors():
            return self._manager.save(int(step), args=ocp.args.Composite(**items), force=force)

    def save_tokenizer(self, tokenizer) -> None:
        """Store the tokenizer beside the steps (process 0 writes), replacing a damaged copy.

        It is written into a temporary directory renamed into place, so a crash or a full disk never
        leaves a partial ``tokenizer/`` behind.
        """
        if jax.process_index() != 0 or tokenizer is None:
            return
        final = self.directory / TOKENIZER_DIR
        tmp = self.directory / f"{TOKENIZER_DIR}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            tokenizer.save_pretrained(str(tmp))
            if final.exists():
                damaged = self.directory / f"{TOKENIZER_DIR}.tmp-{uuid.uuid4().hex[:8]}"
                final.rename(damaged)
                tmp.rename(final)
                damaged.rmtree(missing_ok=True)
            else:
                tmp.rename(final)
        except BaseException:
            tmp.rmtree(missing_ok=True)
            raise

    def wait(self) -> None:
        with self._save_errors():
            self._manager.wait_until_finished()

    def close(self) -> None:
        try:
            with self._save_errors():
                self._manager.wait_until_finished()
        except CheckpointError:
            if not self._failed_save_reported:
                raise
        finally:
            self._manager.close()

    @contextlib.contextmanager
    def _save_errors(self) -> Iterator[None]:
        """Turn a save's out-of-space failure (from Orbax's background threads) into one line."""
        try:
            yield
        except Exception as e:
            if not _is_out_of_space(e):
                raise
            if self._failed_save_reported:  # the same failure, surfacing again on close
                raise CheckpointError(f"an earlier save into {self.directory} failed") from None
            self._failed_save_reported = True
            self._manager.reload()  # the failed step never became a checkpoint
            free = None if "://" in str(self.directory) else shutil.disk_usage(self.directory).free
            latest = self.latest_step()
            raise CheckpointDiskFull(
                f"no space left on the device writing checkpoint step {self._saving} into {self.directory} "
                f"({'unknown' if free is None else _format_bytes(free)} free there): the step was not saved; "
                + (f"step {latest} stays the latest complete checkpoint. " if latest is not None else "")
                + "Free some space, or keep fewer checkpoints (train.keep_last), then resume.",
                directory=self.directory,
                step=self._saving,
                free_bytes=free,
            ) from None

    # -- restore ---------------------------------------------------------------------------
    def restore(self, step: int | None = None, *, params_target: Any, opt_state_target: Any = None) -> Restored:
        """Restore onto the shardings in the targets (trees of ``jax.ShapeDtypeStruct``).

        Every chunk read is checked against its checksum: a step that fails raises
        :class:`CheckpointCorrupted` naming it and the previous step.
        """
        step = self.resolve_step(step)
        meta = self.read_json(step, "meta")
        config = self.read_config(step)
        if opt_state_target is not None and not self.has_opt_state(step):
            raise CheckpointError(f"{self.directory}/{step} has no optimiser state (a slim checkpoint)")
        notice_if_unverified(self.directory / str(step), meta)
        params = self.restore_item(step, "params", params_target)
        opt_state = None if opt_state_target is None else self.restore_item(step, "opt_state", opt_state_target)
        return Restored(step=step, config=config, params=params, opt_state=opt_state, meta=meta)

    def restore_item(self, step: int, item: str, target: Any) -> Any:
        """One array item (``params`` or ``opt_state``) of ``step`` onto ``target``, verified as it reads."""
        step = self.resolve_step(step)
        self._check_shapes(step, item, target)
        try:
            return self._manager.restore(step, args=ocp.args.Composite(**{item: restore_args_for(target)}))[item]
        except Exception as e:  # Orbax re-raises TensorStore's read errors as a bare Exception
            damaged = corrupted(self.directory, step, item, e, self.all_steps())
            if damaged is not None:
                raise damaged from None
            if not isinstance(e, (ValueError, KeyError, FileNotFoundError)):
                raise
            raise CheckpointError(
                f"{self.directory}/{step}/{item} does not match the model being restored: {_first_line(e)}"
            ) from None

    def _check_shapes(self, step: int, item: str, target: Any) -> None:
        """Refuse, by parameter path, an array whose stored shape differs from the target's."""
        try:
            stored = ocp.tree.to_flat_dict(self._manager.item_metadata(step)[item])
        except Exception as e:  # noqa: BLE001 - unreadable metadata: the restore itself reports it
            log.debug("no metadata for %s/%d/%s: %s", self.directory, step, item, e)
            return
        for path, want in ocp.tree.to_flat_dict(target).items():
            have = stored.get(path)
            if have is not None and hasattr(have, "shape") and tuple(have.shape) != tuple(want.shape):
                raise CheckpointError(
                    f"{self.directory}/{step}: {item} {'/'.join(map(str, path))} was saved with shape "
                    f"{tuple(have.shape)} but the model being restored expects {tuple(want.shape)} "
                    "(the model config differs from the one this checkpoint was trained with)"
                )

    def set_aside_steps_after(self, step: int) -> list[int]:
        """Move the steps after ``step`` into ``RUN_DIR/abandoned/`` so a run can continue from ``step``.

        Returns the steps moved. Nothing is deleted: they are kept for inspection.
        """
        later = sorted(s for s in self.all_steps() if s > step)
        if later and jax.process_index() == 0:
            (self.directory / ABANDONED_DIR).mkdir(parents=True, exist_ok=True)
            for s in later:
                destination = self.directory / ABANDONED_DIR / str(s)
                if destination.exists():
                    destination = self.directory / ABANDONED_DIR / f"{s}-{uuid.uuid4().hex[:8]}"
                (self.directory / str(s)).rename(destination)
        if later:
            if jax.process_count() > 1:
                multihost_utils.sync_global_devices(f"gptj_flax set aside steps after {step}")
            self._manager.reload()
        return later


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


def load_params(
    path: str | os.PathLike,
    mesh: Mesh | None = None,
    *,
    step: int | None = None,
    dtype: Any = None,
    rules: partitioning.Rules = partitioning.DEFAULT_RULES,
) -> tuple[Config, Any, int]:
    """Load only the parameters of the checkpoint at ``path`` (run dir or step dir) onto ``mesh``.

    Returns ``(config, params, step)``; ``params`` leaves are sharded ``jax.Array``s of ``dtype``
    (default: as stored), verified against their checksums as they are read.
    """
    directory, path_step = split_step_path(path)
    ckpt = Checkpointer(directory, read_only=True)
    try:
        step = ckpt.resolve_step(path_step if step is None else step)
        config = ckpt.read_config(step)
        refuse_lora_checkpoint(directory, step, config, ckpt.read_json(step, "meta"))
        mesh = mesh or partitioning.make_mesh(config.mesh)
        target, _ = param_targets(config.model, mesh, rules, dtype)
        restored = ckpt.restore(step, params_target=target)
    finally:
        ckpt.close()
    return config, restored.params, step


def refuse_lora_checkpoint(path: str | os.PathLike, step: int, config: Config, meta: Mapping[str, Any]) -> None:
    """Refuse a LoRA checkpoint where full weights are expected: its params are only the adapters,
    so it must go with its base (or be merged into it) to be a model."""
    if config.train.lora is None:
        return
    recorded = meta.get(LORA_BASE_KEY)
    base = recorded.get("path") if isinstance(recorded, Mapping) else None
    directory, _ = split_step_path(path)
    where = directory / str(step)
    raise CheckpointError(
        f"{where} is a LoRA checkpoint: adapters for the base {base or '(its meta names none)'}, not a full model. "
        f"Load that base with --adapter {where} (adapter= in Python), or merge them into it with "
        f"`gptj-convert merge-lora {where} OUT`"
    )


def tokenizer_dir(path: str | os.PathLike) -> epath.Path | None:
    """Where the tokenizer of the checkpoint at ``path`` lives, if it has one."""
    directory, _ = split_step_path(path)
    candidate = directory / TOKENIZER_DIR
    return candidate if candidate.exists() else None
