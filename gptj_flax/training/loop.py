"""The training loop: resume or initialise, then step, with validation, the harness, checkpoints and
metrics as small periodic actions.

Every process of a multi-host run executes this same function; each reads only its own share of
every batch and the shares are assembled into global arrays. Metrics are fetched one step late so
the host prepares batch n+1 while the devices run step n. One trainer at a time owns a run
directory (``train.lock``); SIGTERM or a first Ctrl-C finishes the step, saves and returns.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

from gptj_flax import attention, checkpoint, convert, data, partitioning
from gptj_flax.config import Config, ConfigError, ModelConfig
from gptj_flax.convert import lora as lora_lib
from gptj_flax.convert.quantize import dequantize_params
from gptj_flax.errors import GptjFlaxError
from gptj_flax.model import GPTJ
from gptj_flax.training import optimizer, steps
from gptj_flax.training.lock import exclusive_run_dir
from gptj_flax.training.metrics import MetricsWriter, peak_flops_per_device

log = logging.getLogger(__name__)


class TrainingDiverged(GptjFlaxError, RuntimeError):
    """The loss became NaN or infinite; the run stops without saving the broken state."""


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


def _restore_or_init(
    config: Config,
    model: GPTJ,
    tx,
    mesh: Mesh,
    targets: steps.TrainState,
    shardings: steps.TrainState,
    ckpt: checkpoint.Checkpointer,
    init_from: str | None,
    fresh_opt: bool,
    resume_step: int | None = None,
) -> tuple[steps.TrainState, dict]:
    """Resume from the run directory's latest checkpoint (or ``resume_step``), else start from
    ``init_from``, else fresh.

    Resuming from an earlier step sets the later ones aside (``RUN_DIR/abandoned/``), so the run
    continues from it and a later start resumes where this one got to.
    """
    latest = ckpt.latest_step()
    if latest is not None:
        if init_from is not None:
            log.warning(
                "%s holds checkpoints (latest step %d): the run resumes from them and init_from=%s is "
                "not used (it only starts a run directory without checkpoints)",
                ckpt.directory,
                latest,
                init_from,
            )
        step = latest if resume_step is None else ckpt.resolve_step(resume_step)
        try:
            restored = ckpt.restore(step, params_target=targets.params, opt_state_target=targets.opt_state)
        except checkpoint.CheckpointCorrupted as e:
            if e.previous_step is None:
                raise
            raise checkpoint.CheckpointCorrupted(
                f"{e} To resume from step {e.previous_step}, rerun with --resume-step {e.previous_step} "
                f"(train(…, resume_step={e.previous_step})); the steps after it are then set aside.",
                directory=e.directory,
                step=e.step,
                item=e.item,
                previous_step=e.previous_step,
            ) from None
        set_aside = ckpt.set_aside_steps_after(step)
        if set_aside:
            log.warning(
                "resuming from step %d: the later step(s) %s were moved to %s",
                step,
                set_aside,
                ckpt.directory / checkpoint.ABANDONED_DIR,
            )
        state = steps.TrainState(
            step=jax.device_put(np.int32(step), shardings.step), params=restored.params, opt_state=restored.opt_state
        )
        log.info("resumed from %s at step %d", ckpt.directory, step)
        return state, restored.meta
    if resume_step is not None:
        raise checkpoint.CheckpointError(f"resume_step={resume_step}, but {ckpt.directory} holds no checkpoint")
    if init_from is None:
        return steps.create_state(model, tx, mesh, jax.random.key(config.train.seed)), {}
    if model.lora is not None:  # the base is loaded by the caller; the adapters start fresh, B = 0
        log.info("starting LoRA adapters %s on the base %s", config.train.lora, init_from)
        return steps.create_state(model, tx, mesh, jax.random.key(config.train.seed)), {}

    params = convert.load_init_params(init_from, config, mesh)
    state = steps.create_state(model, tx, mesh, jax.random.key(config.train.seed), params=params)
    if not fresh_opt:
        opt_state = convert.load_init_opt_state(init_from, config, mesh, targets.opt_state)
        if opt_state is not None:
            state = dataclasses.replace(state, opt_state=optimizer.restart_schedule(opt_state))
    log.info("initialised from %s (%s optimiser state)", init_from, "fresh" if fresh_opt else "carried")
    return state, {}


def evaluate(eval_step: Callable, params: Any, val_sets: dict[str, list[data.Batch]], sharding) -> dict[str, float]:
    """Token-weighted loss and perplexity on every validation set."""
    out = {}
    for name, batches in val_sets.items():
        loss_sum = tokens = 0.0
        for local in batches:
            result = jax.device_get(eval_step(params, data.to_global_batch(local, sharding)))
            loss_sum += float(result["loss_sum"])
            tokens += float(result["tokens"])
        loss = loss_sum / max(tokens, 1.0)
        out[f"loss_{name}"] = loss
        out[f"ppl_{name}"] = math.exp(min(loss, 50.0))
    return out


# --------------------------------------------------------------------------------------------
# What the loop does between steps


class PeriodicAction(abc.ABC):
    """Work done after every ``every``-th step and after the last step of the call."""

    every: int

    def should_run(self, step: int, last: int, stopping: bool) -> bool:
        return step % self.every == 0 or step == last

    @abc.abstractmethod
    def run(self, step: int, state: steps.TrainState) -> None: ...


@dataclasses.dataclass
class Validation(PeriodicAction):
    """Loss and perplexity on the validation sets, logged and kept by step."""

    every: int
    eval_step: Callable
    val_sets: dict[str, list[data.Batch]]
    sharding: Any
    writer: MetricsWriter
    results: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)

    def run(self, step: int, state: steps.TrainState) -> None:
        self.results[step] = evaluate(self.eval_step, state.params, self.val_sets, self.sharding)
        self.writer.write(step, {f"val/{k}": v for k, v in self.results[step].items()})
        log.info("step %d: %s", step, ", ".join(f"{k} {v:.4f}" for k, v in self.results[step].items()))


@dataclasses.dataclass
class HarnessAction(PeriodicAction):
    """The caller's harness hook on the live parameters, at the validation steps."""

    every: int
    harness: Callable[..., dict[str, float]]
    writer: MetricsWriter
    hook_args: dict
    results: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    model_params: Callable[[Any], Any] = lambda params: params  # the whole model's params (LoRA: merged)

    def run(self, step: int, state: steps.TrainState) -> None:
        self.results[step] = self.harness(step, self.model_params(state.params), **self.hook_args)
        self.writer.write(step, self.results[step])


@dataclasses.dataclass
class Checkpointing(PeriodicAction):
    """Save the state with the data position; also when a stop is requested."""

    every: int
    ckpt: checkpoint.Checkpointer
    config: Config
    train_batches: data.DataIterator
    saved_step: int | None = None  # the last step this call saved
    meta: dict = dataclasses.field(default_factory=dict)  # saved with every step (a LoRA run: its base)

    def should_run(self, step: int, last: int, stopping: bool) -> bool:
        return super().should_run(step, last, stopping) or stopping

    def run(self, step: int, state: steps.TrainState) -> None:
        self.ckpt.save(
            step,
            params=state.params,
            opt_state=state.opt_state,
            config=self.config,
            meta={"data": self.train_batches.state(), "seed": self.config.train.seed, **self.meta},
            force=True,
        )
        self.saved_step = step


class MetricsLog:
    """Each step's loss, gradient norm, learning rate and speed, fetched one step late so the host
    never waits for the devices; a non-finite loss stops the run (:class:`TrainingDiverged`)."""

    def __init__(
        self,
        writer: MetricsWriter,
        ckpt: checkpoint.Checkpointer,
        run_dir: str,
        tokens_per_step: int,
        flops_per_step: float,
        peak_flops: float | None,
        bar: tqdm,
    ):
        self.writer, self.ckpt, self.run_dir, self.bar = writer, ckpt, run_dir, bar
        self.tokens_per_step, self.flops_per_step, self.peak_flops = tokens_per_step, flops_per_step, peak_flops
        self.losses: dict[int, float] = {}
        self._pending: tuple[int, Any, float] | None = None  # (step, metrics, start time) not fetched yet

    def step_started(self, step: int, metrics, started: float) -> None:
        """Step ``step`` was dispatched at ``started``: the previous step's metrics are ready now."""
        if self._pending is not None:
            self._record(*self._pending[:2], started - self._pending[2])
        self._pending = (step, metrics, started)

    def flush(self) -> None:
        """Wait for the last dispatched step and record it (before an action or at the end)."""
        if self._pending is not None:
            step, metrics, started = self._pending
            jax.block_until_ready(metrics)
            self._record(step, metrics, time.perf_counter() - started)
            self._pending = None

    def _record(self, step: int, metrics, seconds: float) -> None:
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        if not math.isfinite(metrics["loss"]):
            self.ckpt.wait()  # a save still in flight is part of what the run keeps
            latest = self.ckpt.latest_step()
            kept = (
                f"the last checkpoint saved (step {latest})" if latest is not None else "no checkpoint (none was saved)"
            )
            raise TrainingDiverged(
                f"loss became {metrics['loss']} at step {step} (grad norm {metrics['grad_norm']}); the run stops "
                f"here, without saving, and {self.run_dir} keeps {kept}. "
                "Lower train.lr, raise train.warmup_steps or check the data."
            )
        self.losses[step] = metrics["loss"]
        row = {
            "train/loss": metrics["loss"],
            "train/grad_norm": metrics["grad_norm"],
            "train/lr": metrics["lr"],
            "perf/step_time_s": seconds,
            "perf/tokens_per_s": self.tokens_per_step / seconds,
        }
        if self.peak_flops:
            row["perf/mfu"] = self.flops_per_step / seconds / (self.peak_flops * jax.device_count())
        self.writer.write(step, row)
        self.bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{row['perf/tokens_per_s']:,.0f}")


# --------------------------------------------------------------------------------------------
# LoRA runs


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


@dataclasses.dataclass
class _LoraRun:
    """A LoRA run's frozen base on the mesh (bfloat16; its block projections int8 for QLoRA, when
    ``model.quantize`` is set), its identity, and how steps take it."""

    config: Config
    identity: lora_lib.BaseIdentity
    base: Any
    shardings: Any

    @classmethod
    def start(cls, config: Config, mesh: Mesh, meta: dict, init_from: str | None, run_dir: str) -> _LoraRun:
        """A resumed run's recorded base, verified; else the base ``init_from``, identified now."""
        if meta:
            identity = lora_lib.BaseIdentity.from_meta(meta, run_dir)
            lora_lib.verify_base(identity, run_dir)
        else:
            assert init_from is not None  # train() refuses a fresh LoRA run without one
            identity = lora_lib.identify_base(init_from)
        base_config = config.replace(model=lora_lib.base_model_config(config))
        base = convert.load_init_params(identity.path, base_config, mesh)
        _, shardings = convert.param_targets(base_config.model, mesh)
        log.info(
            "LoRA base %s (sha256 %s…, %s on disk), held in bfloat16%s",
            identity.path,
            identity.checksum[:12],
            _mib(identity.bytes),
            "" if config.model.quantize is None else f", block projections {config.model.quantize} (QLoRA)",
        )
        return cls(config, identity, base, shardings)

    @property
    def meta(self) -> dict:
        return {lora_lib.BASE_KEY: self.identity.to_json()}

    def bind(self, step: Callable) -> Callable:
        return lambda state_or_params, batch: step(state_or_params, batch, self.base)

    @property
    def merged_model_config(self) -> ModelConfig:
        """The model :meth:`merged` params are for: a QLoRA base is merged dequantised, in float."""
        return dataclasses.replace(self.config.model, quantize=None)

    def merged(self, adapters: Any) -> Any:
        assert self.config.train.lora is not None
        dtype = self.config.model.weight_dtype
        base = self.base if self.config.model.quantize is None else dequantize_params(self.base, dtype)
        return lora_lib.merge_adapters(base, adapters, self.config.train.lora, dtype=dtype)

    def report_sizes(self, step_dir) -> int:
        """Log (and return) the saved step's size on disk next to the base's, which it does not hold."""
        size = lora_lib.disk_bytes(step_dir)
        log.info(
            "LoRA checkpoint %s: %s on disk (adapters and their optimiser state); the base %s: %s on disk (%.1fx)",
            step_dir,
            _mib(size),
            self.identity.path,
            _mib(self.identity.bytes),
            self.identity.bytes / max(size, 1),
        )
        return size


# --------------------------------------------------------------------------------------------
# The loop


def _holding_run_dir(train_fn):
    """Run ``train_fn(config, …)`` while holding ``config.train.run_dir``'s lock."""

    @functools.wraps(train_fn)
    def locked(config: Config, *args, **kwargs):
        with exclusive_run_dir(config.train.run_dir):
            return train_fn(config, *args, **kwargs)

    return locked


def _run_tokenizer(config: Config, tokenizer):
    """``(tokenizer, whether it still has to be saved)``: the one passed in, else the run's saved
    one, else ``train.tokenizer``; a damaged saved copy is rebuilt from one of the others."""
    tc = config.train
    saved, saved_tokenizer = checkpoint.tokenizer_dir(tc.run_dir), None
    if saved is not None:
        try:
            saved_tokenizer = data.load_tokenizer(str(saved))
        except Exception as e:  # noqa: BLE001 - transformers and tokenizers raise bare Exceptions for bad files
            if tokenizer is None and not tc.tokenizer:
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise data.DataError(
                    f"{saved} is incomplete or damaged ({reason}); set train.tokenizer to rebuild "
                    "it from the tokenizer the run was started with"
                ) from None
            log.warning(
                "%s is incomplete or damaged; writing it again from %s",
                saved,
                "the tokenizer passed in" if tokenizer is not None else f"train.tokenizer={tc.tokenizer}",
            )
    if tokenizer is None:
        tokenizer = saved_tokenizer if saved_tokenizer is not None else data.resolve_tokenizer(tc.tokenizer)
    return tokenizer, tokenizer is not None and saved_tokenizer is None


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
    convert.check_mesh(mc, mesh)
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
