"""Optimiser, train/eval steps and the training loop."""

from gptj_flax.training.hooks import TrainingDiverged, evaluate
from gptj_flax.training.lock import RunDirLocked
from gptj_flax.training.loop import TrainResult, train
from gptj_flax.training.optimizer import make_optimizer, restart_schedule, schedule
from gptj_flax.training.setup import TrainSetup
from gptj_flax.training.steps import TrainState, compile_eval_step, compile_train_step, create_state, state_shardings

__all__ = [
    "RunDirLocked",
    "TrainResult",
    "TrainSetup",
    "TrainState",
    "TrainingDiverged",
    "compile_eval_step",
    "compile_train_step",
    "create_state",
    "evaluate",
    "make_optimizer",
    "restart_schedule",
    "schedule",
    "state_shardings",
    "train",
]
