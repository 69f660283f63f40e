"""What the training loop does between steps: validation, the harness hook, checkpoints, and
each step's metrics, as small periodic actions gathered in :class:`Hooks`."""

from __future__ import annotations

import abc
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import jax
from tqdm import tqdm

from gptj_flax import checkpoint, data
from gptj_flax.config import Config
from gptj_flax.errors import GptjFlaxError
from gptj_flax.training import steps
from gptj_flax.training.metrics import GradientNoiseScale, MetricsWriter, peak_flops_per_device
from gptj_flax.training.setup import TrainSetup
from gptj_flax.training.start import LoraBase, RunData

log = logging.getLogger(__name__)

# Where a checkpoint's meta keeps the gradient-noise statistics' moving averages.
NOISE_META_KEY = "noise_scale"


class TrainingDiverged(GptjFlaxError, RuntimeError):
    """The loss became NaN or infinite; the run stops without saving the broken state."""


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
    noise: GradientNoiseScale | None = None  # its averages are saved with every step

    def should_run(self, step: int, last: int, stopping: bool) -> bool:
        return super().should_run(step, last, stopping) or stopping

    def run(self, step: int, state: steps.TrainState) -> None:
        meta = {"data": self.train_batches.state(), "seed": self.config.train.seed, **self.meta}
        if self.noise is not None:
            meta[NOISE_META_KEY] = self.noise.state()
        self.ckpt.save(step, params=state.params, opt_state=state.opt_state, config=self.config, meta=meta, force=True)
        self.saved_step = step


class MetricsLog:
    """Each step's loss, gradient norm, learning rate and speed (and with ``noise``, the
    gradient-noise statistics), fetched one step late so the host never waits for the devices; a
    non-finite loss stops the run (:class:`TrainingDiverged`)."""

    def __init__(
        self,
        writer: MetricsWriter,
        ckpt: checkpoint.Checkpointer,
        run_dir: str,
        tokens_per_step: int,
        flops_per_step: float,
        peak_flops: float | None,
        bar: tqdm,
        noise: GradientNoiseScale | None = None,
    ):
        self.writer, self.ckpt, self.run_dir, self.bar, self.noise = writer, ckpt, run_dir, bar, noise
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
        if self.noise is not None:
            row.update(self.noise.update(metrics["grad_norm_replica"], metrics["grad_norm_micro"]))
        self.writer.write(step, row)
        self.bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{row['perf/tokens_per_s']:,.0f}")


def _noise_scale(setup: TrainSetup, meta: dict) -> GradientNoiseScale | None:
    """The run's gradient-noise statistics, continuing the averages ``meta`` recorded; None when
    its steps do not compute them (setup.noise_replicas)."""
    tc = setup.config.train
    if setup.noise_replicas is None or tc.noise_scale_alpha is None:
        return None
    noise = GradientNoiseScale(tc.grad_accum_steps, tc.noise_scale_alpha)
    noise.restore(meta.get(NOISE_META_KEY))
    return noise


@dataclasses.dataclass
class Hooks:
    """What the loop does around its steps: each step's metrics and progress, the baseline at
    step 0, and the periodic actions."""

    writer: MetricsWriter
    bar: tqdm
    metrics: MetricsLog
    validation: Validation
    harness: HarnessAction | None
    saving: Checkpointing

    @classmethod
    def create(
        cls,
        setup: TrainSetup,
        ckpt: checkpoint.Checkpointer,
        run_data: RunData,
        lora: LoraBase | None,
        eval_step: Callable,
        harness: Callable[..., dict[str, float]] | None,
        *,
        first: int,
        end: int,
        peak_flops: float | None,
        progress: bool,
        meta: dict | None = None,
    ) -> Hooks:
        """The hooks of a call that runs steps ``first`` + 1 … ``end``, after the checkpoint whose
        ``meta`` was restored (None: a new run)."""
        config, tc = setup.config, setup.config.train
        # Rows past the restored step were written by a run that died before its next checkpoint; the
        # step-0 baseline is recomputed when there is no checkpoint at all.
        writer = MetricsWriter(
            tc.run_dir,
            wandb_project=tc.wandb_project,
            run_name=tc.name,
            config=config.to_dict(),
            drop_from_step=first + 1 if first else 0,
        )
        disable = not progress or jax.process_index() != 0
        bar = tqdm(total=end, initial=first, desc="train", unit="step", dynamic_ncols=True, disable=disable)
        flops_per_step = config.model.flops_per_token(setup.seq_len) * setup.tokens_per_step
        noise = _noise_scale(setup, meta or {})
        metrics = MetricsLog(
            writer,
            ckpt,
            tc.run_dir,
            setup.tokens_per_step,
            flops_per_step,
            peak_flops_per_device(peak_flops),
            bar,
            noise,
        )
        validation = Validation(tc.val_every, eval_step, run_data.val_sets, setup.eval_sharding, writer)
        hook = None
        if harness is not None:
            model_config = config.model if lora is None else lora.merged_model_config
            hook_args = {"model_config": model_config, "mesh": setup.mesh, "tokenizer": run_data.tokenizer}
            model_params = (lambda params: params) if lora is None else lora.merged  # LoRA: merged into the base
            hook = HarnessAction(tc.val_every, harness, writer, hook_args, model_params=model_params)
        saving = Checkpointing(
            tc.ckpt_every, ckpt, config, run_data.train_batches, meta={} if lora is None else lora.meta, noise=noise
        )
        return cls(writer, bar, metrics, validation, hook, saving)

    @property
    def baseline(self) -> list[PeriodicAction]:
        """What step 0 runs: the validation (when there are sets) and the harness the run improves on."""
        return [a for a in (self.validation if self.validation.val_sets else None, self.harness) if a is not None]

    def after_step(self, step: int, end: int, state: steps.TrainState, metrics, started: float, stopping: bool):
        """Step ``step`` was dispatched at ``started``: record the one before it, and run what is due."""
        self.metrics.step_started(step, metrics, started)
        self.bar.update(1)
        due = [a for a in (*self.baseline, self.saving) if a.should_run(step, end, stopping)]
        if due:
            self.metrics.flush()
        for action in due:
            action.run(step, state)
