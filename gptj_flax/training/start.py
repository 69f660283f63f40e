"""Where a training run starts: its checkpoint (resumed), the weights it was told to start from, or a
fresh initialisation; a LoRA run's frozen base; the run's tokenizer and data, from the position the
checkpoint recorded."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from gptj_flax import checkpoint, convert, data
from gptj_flax.config import Config, ConfigError, LoraConfig, ModelConfig
from gptj_flax.convert import lora as lora_lib
from gptj_flax.convert.quantize import dequantize_params
from gptj_flax.training import optimizer, steps
from gptj_flax.training.setup import TrainSetup

log = logging.getLogger(__name__)


def start_run(
    setup: TrainSetup,
    ckpt: checkpoint.Checkpointer,
    init_from: str | None,
    fresh_opt: bool,
    resume_step: int | None = None,
) -> tuple[steps.TrainState, dict, LoraBase | None]:
    """``(state, meta, LoRA base)``: the run directory's latest checkpoint (or ``resume_step``)
    resumed, else ``init_from``, else a fresh state. ``meta`` is what the checkpoint recorded beside
    the state (the data position, a LoRA run's base), ``{}`` for a new run.

    Resuming from an earlier step sets the later ones aside (``RUN_DIR/abandoned/``), so the run
    continues from it and a later start resumes where this one got to.
    """
    config = setup.config
    latest = ckpt.latest_step()
    if config.train.lora is not None and init_from is None and latest is None:
        ckpt.close()
        raise ConfigError(
            f"train.lora is set but {config.train.run_dir} holds no checkpoint and no base was given: start a "
            "LoRA run with --init-from BASE (hf:DIR, legacy:DIR or an Orbax checkpoint)"
        )
    if latest is not None:
        state, meta = _resume(setup, ckpt, latest, init_from, resume_step)
    elif resume_step is not None:
        raise checkpoint.CheckpointError(f"resume_step={resume_step}, but {ckpt.directory} holds no checkpoint")
    else:
        state, meta = _initialise(setup, init_from, fresh_opt), {}
    lora = None if config.train.lora is None else LoraBase.start(config, setup.mesh, meta, init_from)
    return state, meta, lora


def _resume(
    setup: TrainSetup, ckpt: checkpoint.Checkpointer, latest: int, init_from: str | None, resume_step: int | None
) -> tuple[steps.TrainState, dict]:
    if init_from is not None:
        log.warning(
            "%s holds checkpoints (latest step %d): the run resumes from them and init_from=%s is "
            "not used (it only starts a run directory without checkpoints)",
            ckpt.directory,
            latest,
            init_from,
        )
    step = latest if resume_step is None else ckpt.resolve_step(resume_step)
    _check_same_trained(ckpt, step, setup.config)
    try:
        restored = ckpt.restore(step, params_target=setup.targets.params, opt_state_target=setup.targets.opt_state)
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
        step=jax.device_put(np.int32(step), setup.shardings.step),
        params=restored.params,
        opt_state=restored.opt_state,
    )
    log.info("resumed from %s at step %d", ckpt.directory, step)
    return state, restored.meta


def _lora_text(lora: LoraConfig | None) -> str:
    if lora is None:
        return "null (the whole model trains)"
    return json.dumps({"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets)})


def _check_same_trained(ckpt: checkpoint.Checkpointer, step: int, config: Config) -> None:
    """Refuse to resume a checkpoint whose trained parameters this config does not have: the whole
    model against LoRA adapters, or adapters of another rank or on other projections."""
    saved, now = ckpt.read_config(step).train.lora, config.train.lora

    def trained(lora: LoraConfig | None):
        return None if lora is None else (lora.rank, lora.projections)

    if trained(saved) == trained(now):
        return
    run_dir = ckpt.directory
    if saved is not None and now is None:
        other = (
            f"; to train the whole model from it, merge it (gptj-convert merge-lora {run_dir} OUT) and --init-from OUT"
        )
    elif saved is None:
        other = f"; to train adapters on this run's model, --init-from {run_dir}"
    else:
        other = ""
    ckpt.close()  # the run stops here, as when a LoRA run has no base
    raise ConfigError(
        f"cannot resume {run_dir}: its saved config (step {step}) has train.lora={_lora_text(saved)}, but this "
        f"config has train.lora={_lora_text(now)}, so the checkpoint's trained parameters do not fit. Resume it "
        f"with its own train.lora, or start a new run directory (--set train.run_dir=NEW){other}"
    )


def _initialise(setup: TrainSetup, init_from: str | None, fresh_opt: bool) -> steps.TrainState:
    """A new run's state: fresh, or with ``init_from``'s weights (and, unless ``fresh_opt``, its
    optimiser moments with the schedule restarted)."""
    config = setup.config
    if init_from is None:
        return setup.init_state()
    if setup.model.lora is not None:  # the base is loaded by LoraBase; the adapters start fresh, B = 0
        log.info("starting LoRA adapters %s on the base %s", config.train.lora, init_from)
        return setup.init_state()

    state = setup.init_state(convert.load_init_params(init_from, config, setup.mesh))
    if not fresh_opt:
        opt_state = convert.load_init_opt_state(init_from, config, setup.mesh, setup.targets.opt_state)
        if opt_state is not None:
            state = dataclasses.replace(state, opt_state=optimizer.restart_schedule(opt_state))
    log.info("initialised from %s (%s optimiser state)", init_from, "fresh" if fresh_opt else "carried")
    return state


@dataclasses.dataclass
class RunData:
    tokenizer: Any
    train_batches: data.DataIterator  # from the position the checkpoint recorded
    val_sets: dict[str, list[data.Batch]]  # this process's share of every validation set


def open_data(setup: TrainSetup, ckpt: checkpoint.Checkpointer, tokenizer, meta: dict, progress: bool) -> RunData:
    """The run's tokenizer (saved into the run directory once the data has accepted it), its
    training batches from ``meta``'s position, and its validation sets; each process reads only the
    rows its devices hold."""
    tc, mc = setup.config.train, setup.config.model
    tokenizer, save_tokenizer = _run_tokenizer(setup.config, tokenizer)
    # Which rows of each global batch this process's devices hold (any device order).
    batch_shape = (tc.grad_accum_steps, setup.batch_size, setup.seq_len + 1)
    share, n_shares = data.process_share(setup.train_sharding, batch_shape, 1)
    train_batches = data.make_train_iterator(
        tc.train_set,
        seq_len=setup.seq_len,
        batch_size=setup.batch_size,
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
        seq_len=setup.seq_len,
        batch_size=setup.batch_size,
        n_batches=tc.val_batches,
        tokenizer=tokenizer,
        process_index=share,
        process_count=n_shares,
        progress=progress,
        vocab_size=mc.vocab_size,
    )
    if save_tokenizer:  # only once the data has accepted it (one too large for the model is refused above)
        ckpt.save_tokenizer(tokenizer)  # atomic; replaces a damaged copy
    return RunData(tokenizer, train_batches, val_sets)


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


# --------------------------------------------------------------------------------------------
# LoRA runs


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


@dataclasses.dataclass
class LoraBase:
    """A LoRA run's frozen base on the mesh (bfloat16; its block projections int8 for QLoRA, when
    ``model.quantize`` is set), its identity, and how steps take it."""

    config: Config
    identity: lora_lib.BaseIdentity
    base: Any  # placed as the rules place the base's params: the steps take its shardings from it

    @classmethod
    def start(cls, config: Config, mesh: Mesh, meta: dict, init_from: str | None) -> LoraBase:
        """A resumed run's recorded base, verified; else the base ``init_from``, identified now."""
        run_dir = config.train.run_dir
        if meta:
            identity = lora_lib.BaseIdentity.from_meta(meta, run_dir)
            lora_lib.verify_base(identity, run_dir)
        else:
            assert init_from is not None  # start_run refuses a fresh LoRA run without one
            identity = lora_lib.identify_base(init_from)
        base = convert.load_init_params(identity.path, config.replace(model=lora_lib.base_model_config(config)), mesh)
        log.info(
            "LoRA base %s (sha256 %s…, %s on disk), held in bfloat16%s",
            identity.path,
            identity.checksum[:12],
            _mib(identity.bytes),
            "" if config.model.quantize is None else f", block projections {config.model.quantize} (QLoRA)",
        )
        return cls(config, identity, base)

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
