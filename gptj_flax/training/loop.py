"""``train``: the training loop and the stop requests it answers.

A run is put together from four modules, one part each: :mod:`~gptj_flax.training.setup` builds
what the config and mesh decide (model, optimiser, abstract state, shardings, jitted steps);
:mod:`~gptj_flax.training.start` finds where the run starts (its checkpoint, ``init_from`` or a fresh
state; a LoRA run's base; the tokenizer and data); :mod:`~gptj_flax.training.hooks` holds what is
done between steps (metrics, validation, the harness, checkpoints); this module runs the steps.

Every process of a multi-host run executes this same function; each reads only its own share of
every batch and the shares are assembled into global arrays. Metrics are fetched one step late so
the host prepares batch n+1 while the devices run step n. One trainer at a time owns a run
directory (``train.lock``); SIGTERM or a first Ctrl-C finishes the step, saves and returns, on every
process at the same step however many of them were signalled.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gptj_flax import checkpoint, data, partitioning
from gptj_flax.config import Config, ConfigError
from gptj_flax.training import steps
from gptj_flax.training.hooks import Hooks
from gptj_flax.training.lock import exclusive_run_dir
from gptj_flax.training.setup import TrainSetup
from gptj_flax.training.start import open_data, start_run

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainResult:
    step: int  # optimiser steps completed
    losses: dict[int, float]  # step → training loss
    val: dict[int, dict[str, float]]  # step → {"loss_NAME": …, "ppl_NAME": …}
    harness: dict[int, dict[str, float]]  # step → {"harness/TASK/METRIC": …} (with a harness hook)
    preempted: bool  # stopped early by SIGTERM or Ctrl-C, after saving
    run_dir: str
    interrupted: bool = False  # the early stop was a Ctrl-C (SIGINT)
    saved_step: int | None = None  # the last checkpoint this call wrote; None if it wrote none
    checkpoint_bytes: int | None = None  # LoRA runs: the saved step's size on disk (adapters + optimiser state)
    base_bytes: int | None = None  # LoRA runs: the base's size on disk, which no checkpoint holds


# What a process asks for, and what the processes agree on: the largest code asked for wins.
STOP, INTERRUPT = 1, 2


class _StopVote:
    """The largest of the codes every process casts for a step, computed by the devices: a cast
    returns at once, and reading its result waits only for the steps dispatched before it."""

    def __init__(self, mesh: Mesh):
        self._local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
        self._sharding = NamedSharding(mesh, PartitionSpec(mesh.axis_names))  # one element per device
        self._shape = (mesh.devices.size,)
        self._max = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, PartitionSpec()))

    def cast(self, code: int) -> jax.Array:
        shards = [jax.device_put(np.full((1,), code, np.int32), d) for d in self._local]
        return self._max(jax.make_array_from_single_device_arrays(self._shape, self._sharding, shards))


class _StopRequests:
    """SIGTERM (a TPU VM being preempted) or a first Ctrl-C → finish the current step, save, return.

    A second Ctrl-C ends the process at once: the first one hands SIGINT back to the kernel's
    default action, which works even while the main thread waits inside XLA.

    The processes of a multi-host run must stop at the same step: one that saves while another
    waits in the next step's collectives would hang both. With ``mesh`` spanning several
    processes, every step casts each one's request into a :class:`_StopVote`, and the run stops
    after the step that follows a vote that asked for it, on every process alike.
    """

    def __init__(self, mesh: Mesh | None = None):
        self.requested = False
        self.interrupted = False
        self._previous: dict[int, Any] = {}
        self._vote = _StopVote(mesh) if mesh is not None and jax.process_count() > 1 else None
        self._pending: jax.Array | None = None  # the vote cast after the previous step

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def _handle(self, signum, frame):
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            self.interrupted = True
            log.warning(
                "Ctrl-C: finishing this step, then saving and exiting; press Ctrl-C again to quit at once "
                "without saving"
            )
        else:
            log.warning("SIGTERM received: finishing this step, then saving and exiting")
        self.requested = True

    def answer(self, step: int) -> int:
        """After step ``step`` was dispatched: 0 to go on, or :data:`STOP` / :data:`INTERRUPT` to stop
        after it. One process answers its own request at once; several answer the vote of the step
        before, which every process reads alike."""
        asked = INTERRUPT if self.interrupted else STOP if self.requested else 0
        if self._vote is None:
            return asked
        previous, self._pending = self._pending, self._vote.cast(asked)
        agreed = 0 if previous is None else int(previous)
        if agreed and not self.requested:
            log.warning("another process of this run was asked to stop: stopping with it after step %d", step)
        return agreed

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


# The loop


def _holding_run_dir(train_fn):
    """Run ``train_fn(config, …)`` while holding ``config.train.run_dir``'s lock."""

    @functools.wraps(train_fn)
    def locked(config: Config, *args, **kwargs):
        with exclusive_run_dir(config.train.run_dir):
            return train_fn(config, *args, **kwargs)

    return locked


@_holding_run_dir
def train(
    config: Config,
    *,
    mesh: Mesh | None = None,
    init_from: str | None = None,
    fresh_opt: bool = False,
    peak_flops: float | None = None,
    stop_after: int | None = None,
    progress: bool = True,
    tokenizer=None,
    harness: Callable[..., dict[str, float]] | None = None,
    resume_step: int | None = None,
) -> TrainResult:
    """Train ``config`` in ``config.train.run_dir``, resuming there if a checkpoint exists.

    Args:
      mesh: default ``config.mesh`` over all devices.
      init_from: ``hf:DIR``, ``legacy:DIR`` or an Orbax checkpoint to fine-tune from (used only when
        the run directory holds no checkpoint yet; otherwise a warning says the run resumes instead).
      fresh_opt: with ``init_from``, discard its optimiser moments.
      peak_flops: the device's peak FLOP/s for MFU (default: known per device kind).
      stop_after: stop (with a checkpoint) after this many steps in this invocation; 0 runs none.
      tokenizer: a tokenizer object; default ``config.train.tokenizer`` or the run's saved one.
      harness: runs ``train.eval_harness_tasks`` at validation steps, called as
        ``harness(step, params, model_config=…, mesh=…, tokenizer=…)`` and returning metrics to log
        (``gptj_flax.evaluation.during_training.HarnessDuringTraining``, which the caller builds:
        training never imports evaluation).
      resume_step: resume from this step of the run directory instead of its latest (e.g. the one
        before a step refused as corrupted); the later steps are moved to ``RUN_DIR/abandoned/``.

    Raises :class:`~gptj_flax.training.lock.RunDirLocked` if another trainer holds the run directory.
    """
    _check_call(config, stop_after, harness)
    setup = TrainSetup.build(config, mesh)
    _warn_unused_settings(setup)
    log.info("attention: %s", setup.attention.describe())
    tc = config.train
    ckpt = checkpoint.Checkpointer(tc.run_dir, keep_last=tc.keep_last, keep_every=tc.keep_every)
    state, meta, lora = start_run(setup, ckpt, init_from, fresh_opt, resume_step)
    run_data = open_data(setup, ckpt, tokenizer, meta, progress)
    train_step, eval_step = setup.compile(None if lora is None else lora.base)
    if lora is not None:  # the frozen base goes into every step beside the adapters
        train_step, eval_step = lora.bind(train_step), lora.bind(eval_step)
    first = int(state.step)
    end = tc.total_steps if stop_after is None else min(tc.total_steps, first + stop_after)
    hooks = Hooks.create(
        setup,
        ckpt,
        run_data,
        lora,
        eval_step,
        harness,
        first=first,
        end=end,
        peak_flops=peak_flops,
        progress=progress,
        meta=meta,
    )
    step, preempted, interrupted = run_loop(
        state, first, end, run_data.train_batches, train_step, setup.train_sharding, hooks, ckpt
    )
    saved = hooks.saving.saved_step
    return TrainResult(
        step=step,
        losses=hooks.metrics.losses,
        val=hooks.validation.results,
        harness={} if hooks.harness is None else hooks.harness.results,
        preempted=preempted,
        run_dir=tc.run_dir,
        interrupted=interrupted,
        saved_step=saved,
        checkpoint_bytes=None if lora is None or saved is None else lora.report_sizes(ckpt.directory / str(saved)),
        base_bytes=None if lora is None else lora.identity.bytes,
    )


def _check_call(config: Config, stop_after: int | None, harness) -> None:
    tc = config.train
    if stop_after is not None and stop_after < 0:
        raise ValueError(f"stop_after must be >= 0, got {stop_after}")
    if tc.train_set is None:
        raise ConfigError("train.train_set is not set: give an .index file, a text/jsonl path or tfds:NAME")
    if tc.eval_harness_tasks and harness is None:
        log.warning(
            "train.eval_harness_tasks=%s but no harness hook was passed to train(); the tasks do not run",
            list(tc.eval_harness_tasks),
        )


def _warn_unused_settings(setup: TrainSetup) -> None:
    """Say once which settings of the config this run cannot act on, by key."""
    tc = setup.config.train
    if tc.noise_scale_alpha is not None and setup.noise_replicas is None:
        log.warning(
            "train.noise_scale_alpha=%s (legacy noise_scale_alpha) is set, but train.grad_accum_steps=1: the "
            "gradient-noise statistics compare each micro-batch's gradient with their accumulated mean, so "
            "they need gradient accumulation; none are logged. Set train.grad_accum_steps > 1 to get them.",
            tc.noise_scale_alpha,
        )
    if tc.tpu_size is not None and tc.tpu_size != setup.mesh.size:
        # The original's pod launcher made a slice of tpu_size devices; here the devices present decide.
        model_parallel = setup.config.mesh.model if setup.config.mesh.model > 0 else 1
        there = tc.grad_accum_steps * tc.global_batch_size(max(tc.tpu_size // model_parallel, 1))
        log.warning(
            "train.tpu_size=%d (legacy tpu_size) does not size this run: its %d devices do, and a step trains on "
            "%d sequences (%d on %d devices)",
            tc.tpu_size,
            setup.mesh.size,
            tc.grad_accum_steps * setup.batch_size,
            there,
            tc.tpu_size,
        )


def run_loop(
    state: steps.TrainState,
    step: int,
    end: int,
    batches: data.DataIterator,
    train_step: Callable,
    sharding,
    hooks: Hooks,
    ckpt: checkpoint.Checkpointer,
) -> tuple[int, bool, bool]:
    """Run steps ``step`` + 1 … ``end`` (after the baseline, from step 0), with ``hooks`` after each.

    A stop request ends the run after the step in progress and its save. Returns the last step run,
    whether a stop request ended the run and whether that was a Ctrl-C. The checkpointer is closed,
    so every save has finished, before it returns or raises.
    """
    stopping = 0
    # Installed until the final save has finished: a first Ctrl-C never abandons a save.
    with _StopRequests(sharding.mesh) as stop:
        try:
            with partitioning.sharding_scope(sharding.mesh):
                if step == 0:  # the baseline the run improves on
                    for action in hooks.baseline:
                        action.run(0, state)
                while step < end:
                    batch = data.to_global_batch(next(batches), sharding)
                    started = time.perf_counter()
                    state, metrics = train_step(state, batch)
                    step += 1
                    stopping = stop.answer(step)  # read once: a later request is answered after the next step
                    hooks.after_step(step, end, state, metrics, started, stopping=bool(stopping))
                    if stopping:
                        break
                hooks.metrics.flush()
        finally:
            hooks.bar.close()
            ckpt.close()
            hooks.writer.flush()
    hooks.writer.plot()
    hooks.writer.close()
    return step, bool(stopping), stopping == INTERRUPT
