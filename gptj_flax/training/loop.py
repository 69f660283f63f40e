"""The training loop: resume or initialise, then step, with the actions of :mod:`gptj_flax.training.hooks`
(validation, the harness, checkpoints, metrics) between steps.

Every process of a multi-host run executes this same function; each reads only its own share of
every batch and the shares are assembled into global arrays. Metrics are fetched one step late so
the host prepares batch n+1 while the devices run step n. One trainer at a time owns a run
directory (``train.lock``); SIGTERM or a first Ctrl-C finishes the step, saves and returns.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import signal
import threading
import time
from collections.abc import Callable

import flax.linen as nn
import jax
from jax.sharding import Mesh
from tqdm import tqdm

from gptj_flax import attention, checkpoint, data, partitioning
from gptj_flax.config import Config, ConfigError
from gptj_flax.model import GPTJ
from gptj_flax.training import optimizer, steps
from gptj_flax.training.hooks import Checkpointing, HarnessAction, MetricsLog, PeriodicAction, Validation
from gptj_flax.training.lock import exclusive_run_dir
from gptj_flax.training.metrics import MetricsWriter, peak_flops_per_device
from gptj_flax.training.start import _LoraRun, _restore_or_init, _run_tokenizer

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


class _StopRequests:
    """SIGTERM (a TPU VM being preempted) or a first Ctrl-C → finish the current step, save, return.

    A second Ctrl-C ends the process at once: the first one hands SIGINT back to the kernel's
    default action, which works even while the main thread waits inside XLA.
    """

    def __init__(self):
        self.requested = False
        self.interrupted = False
        self._previous = {}

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
    tc, mc = config.train, config.model
    if mc.quantize is not None and tc.lora is None:
        raise ConfigError(
            f"model.quantize={mc.quantize!r} without train.lora: int8 weights take no gradient, so an int8 "
            "base trains only LoRA adapters (QLoRA: set train.lora); for a full fine-tune unset model.quantize"
        )
    if stop_after is not None and stop_after < 0:
        raise ValueError(f"stop_after must be >= 0, got {stop_after}")
    mesh = mesh or partitioning.make_mesh(config.mesh)
    checkpoint.check_mesh(mc, mesh)
    data_parallel = partitioning.data_parallel_size(mesh)
    batch_size = tc.global_batch_size(data_parallel)
    if batch_size % data_parallel:
        raise ConfigError(
            f"train.batch_size={batch_size} is not divisible by the {data_parallel} data-parallel "
            f"shards (data x fsdp) of mesh {partitioning.mesh_shape(mesh)}: use a multiple of "
            f"{data_parallel}"
        )
    seq_len = tc.seq_len or mc.max_len
    if tc.train_set is None:
        raise ConfigError("train.train_set is not set: give an .index file, a text/jsonl path or tfds:NAME")
    if tc.eval_harness_tasks and harness is None:
        log.warning(
            "train.eval_harness_tasks=%s but no harness hook was passed to train(); the tasks do not run",
            list(tc.eval_harness_tasks),
        )

    model = GPTJ(mc, tc.lora)
    log.info("attention: %s", attention.choose(mc, seq_len, mesh.devices.flat[0]).describe())
    tx = optimizer.make_optimizer(tc, nn.meta.unbox(steps.abstract_trained(model)), tc.freeze)
    targets, shardings = steps.state_targets(model, tx, mesh)
    ckpt = checkpoint.Checkpointer(tc.run_dir, keep_last=tc.keep_last, keep_every=tc.keep_every)
    if tc.lora is not None and init_from is None and ckpt.latest_step() is None:
        ckpt.close()
        raise ConfigError(
            f"train.lora is set but {tc.run_dir} holds no checkpoint and no base was given: start a LoRA "
            "run with --init-from BASE (hf:DIR, legacy:DIR or an Orbax checkpoint)"
        )
    state, meta = _restore_or_init(config, model, tx, mesh, targets, shardings, ckpt, init_from, fresh_opt, resume_step)
    start = int(state.step)
    lora_run = None if tc.lora is None else _LoraRun.start(config, mesh, meta, init_from, tc.run_dir)

    tokenizer, save_tokenizer = _run_tokenizer(config, tokenizer)
    train_sharding = steps.batch_sharding(mesh, accumulated=True)
    eval_sharding = steps.batch_sharding(mesh, accumulated=False)
    # Which rows of each global batch this process's devices hold (any device order).
    share, n_shares = data.process_share(train_sharding, (tc.grad_accum_steps, batch_size, seq_len + 1), 1)
    train_batches = data.make_train_iterator(
        tc.train_set,
        seq_len=seq_len,
        batch_size=batch_size,
        grad_accum=tc.grad_accum_steps,
        seed=tc.seed,
        tokenizer=tokenizer,
        process_index=share,
        process_count=n_shares,
        state=meta.get("data"),
        progress=progress,
        vocab_size=mc.vocab_size,
    )
    val_sets = data.make_eval_sets(
        tc.val_set,
        seq_len=seq_len,
        batch_size=batch_size,
        n_batches=tc.val_batches,
        tokenizer=tokenizer,
        process_index=share,
        process_count=n_shares,
        progress=progress,
        vocab_size=mc.vocab_size,
    )
    if save_tokenizer:  # only once the data has accepted it (one too large for the model is refused above)
        ckpt.save_tokenizer(tokenizer)  # atomic; replaces a damaged copy

    base_shardings = None if lora_run is None else lora_run.shardings
    train_step = steps.compile_train_step(
        model, tx, mesh, shardings, optimizer.schedule(tc), tc.z_loss, accumulated=True, base_shardings=base_shardings
    )
    eval_step = steps.compile_eval_step(model, mesh, shardings.params, accumulated=False, base_shardings=base_shardings)
    if lora_run is not None:  # the frozen base goes into every step beside the adapters
        train_step, eval_step = lora_run.bind(train_step), lora_run.bind(eval_step)

    # Rows past the restored step were written by a run that died before its next checkpoint; the
    # step-0 baseline is recomputed when there is no checkpoint at all.
    writer = MetricsWriter(
        tc.run_dir,
        wandb_project=tc.wandb_project,
        run_name=tc.name,
        config=config.to_dict(),
        drop_from_step=start + 1 if start else 0,
    )
    end = tc.total_steps if stop_after is None else min(tc.total_steps, start + stop_after)
    bar = tqdm(
        total=end,
        initial=start,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        disable=not progress or jax.process_index() != 0,
    )
    tokens_per_step = tc.grad_accum_steps * batch_size * seq_len
    metrics_log = MetricsLog(
        writer,
        ckpt,
        tc.run_dir,
        tokens_per_step,
        mc.flops_per_token(seq_len) * tokens_per_step,
        peak_flops_per_device(peak_flops),
        bar,
    )
    validation = Validation(tc.val_every, eval_step, val_sets, eval_sharding, writer)
    hook = (
        None
        if harness is None
        else HarnessAction(
            tc.val_every,
            harness,
            writer,
            {
                "model_config": mc if lora_run is None else lora_run.merged_model_config,
                "mesh": mesh,
                "tokenizer": tokenizer,
            },
            model_params=(lambda p: p) if lora_run is None else lora_run.merged,
        )
    )
    saving = Checkpointing(tc.ckpt_every, ckpt, config, train_batches, meta={} if lora_run is None else lora_run.meta)
    baseline: list[PeriodicAction] = [a for a in (validation if val_sets else None, hook) if a is not None]
    actions = [*baseline, saving]

    preempted = False
    # Installed until the final save has finished: a first Ctrl-C never abandons a save.
    with _StopRequests() as stop:
        try:
            with partitioning.sharding_scope(mesh):
                step = start
                if start == 0:  # the baseline the run improves on
                    for action in baseline:
                        action.run(0, state)
                while step < end:
                    batch = data.to_global_batch(next(train_batches), train_sharding)
                    started = time.perf_counter()
                    state, metrics = train_step(state, batch)
                    step += 1
                    metrics_log.step_started(step, metrics, started)
                    bar.update(1)
                    due = [a for a in actions if a.should_run(step, end, stop.requested)]
                    if due:
                        metrics_log.flush()
                    for action in due:
                        action.run(step, state)
                    if stop.requested:
                        preempted = True
                        break
                metrics_log.flush()
        finally:
            bar.close()
            ckpt.close()
            writer.flush()
    writer.plot()
    writer.close()
    checkpoint_bytes = None
    if lora_run is not None and saving.saved_step is not None:
        checkpoint_bytes = lora_run.report_sizes(ckpt.directory / str(saving.saved_step))
    return TrainResult(
        step=step,
        losses=metrics_log.losses,
        val=validation.results,
        harness={} if hook is None else hook.results,
        preempted=preempted,
        run_dir=tc.run_dir,
        interrupted=preempted and stop.interrupted,
        saved_step=saving.saved_step,
        checkpoint_bytes=checkpoint_bytes,
        base_bytes=None if lora_run is None else lora_run.identity.bytes,
    )
