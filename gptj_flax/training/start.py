"""Where a training run starts: its checkpoint (resumed), the weights it was told to start from, or a
fresh initialisation; a LoRA run's frozen base; the run's tokenizer."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from gptj_flax import checkpoint, convert, data
from gptj_flax.config import Config, ModelConfig
from gptj_flax.convert import lora as lora_lib
from gptj_flax.convert.quantize import dequantize_params
from gptj_flax.model import GPTJ
from gptj_flax.training import optimizer, steps

log = logging.getLogger(__name__)


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
        _, shardings = checkpoint.param_targets(base_config.model, mesh)
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
