"""lm-eval tasks on the live parameters of a training run (the legacy ``eval_harness_tasks`` key).

The training package sits above this one and never imports it; whoever starts a run builds the
hook here and hands it to the loop, which calls it at every validation step::

    harness = HarnessDuringTraining(config.train.eval_harness_tasks, results_dir=run_dir / "harness")
    train(config, harness=harness)
    # in the loop, at validation steps:  writer.write(step, harness(step, state.params, model_config=…,
    #                                                                  mesh=mesh, tokenizer=tokenizer))

The adapter, its compiled scoring programs and lm-eval's task index are built at the first call
and reused: later calls only hand over the new parameters, so scoring tasks (all the original ran)
cost no recompilation and no copy of the weights. Generation tasks build a sampler per call,
which compiles and lays out a copy of the weights, released when the call returns.

On a multi-host slice every process calls the hook (the training loop does) and runs every
request; process 0 writes the results.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from gptj_flax.config import ModelConfig
from gptj_flax.evaluation.harness import (
    DEFAULT_BATCH_SIZE,
    GPTJFlaxLM,
    flat_metrics,
    run_tasks,
    task_manager,
    write_results,
)


class HarnessDuringTraining:
    """``hook(step, params, model_config=…, mesh=…, tokenizer=…) -> {"harness/TASK/METRIC": value}``."""

    def __init__(
        self,
        tasks: Sequence[str],
        *,
        num_fewshot: int | None = None,
        limit: float | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        include_path: str | os.PathLike | None = None,
        builtin_tasks: bool = True,
        bootstrap_iters: int = 1000,
        results_dir: str | os.PathLike | None = None,
    ):
        """
        Args:
          tasks: lm-eval task names (the original ran lambada, piqa, hellaswag, winogrande, mathqa,
            pubmedqa).
          num_fewshot, limit, include_path: as for ``lm_eval`` (``limit`` keeps validation short).
          builtin_tasks: index lm-eval's own tasks too (about 10 s, once); off when every task
            comes from ``include_path``.
          batch_size: requests per compiled call.
          bootstrap_iters: resamples for perplexity stderrs, done in this process (no fork inside
            a JAX program); fewer than lm-eval's 100000 so that validation stays quick.
          results_dir: where each step's full results go, as ``harness_STEP.json`` (process 0).
        """
        if not tasks:
            raise ValueError("no harness tasks given")
        self.tasks = list(tasks)
        self.num_fewshot, self.limit = num_fewshot, limit
        self.include_path, self.builtin_tasks = include_path, builtin_tasks
        self.batch_size, self.bootstrap_iters = batch_size, bootstrap_iters
        self.results_dir = None if results_dir is None else os.fspath(results_dir)
        self._adapter: GPTJFlaxLM | None = None
        self._tasks_index = None

    def _adapter_for(self, params: Any, model_config: ModelConfig, mesh: Mesh, tokenizer, step: int) -> GPTJFlaxLM:
        adapter = self._adapter
        if adapter is None or adapter.mesh is not mesh or adapter.config != model_config:
            adapter = self._adapter = GPTJFlaxLM(
                model_config, params, tokenizer, mesh, step=step, batch_size=self.batch_size
            )
        else:
            adapter.set_params(params, step)
        return adapter

    def __call__(self, step: int, params: Any, *, model_config: ModelConfig, mesh: Mesh, tokenizer) -> dict[str, float]:
        """Run the tasks on ``params``; returns flat metrics for the run's metrics writer."""
        if tokenizer is None:
            raise ValueError("harness tasks need the run's tokenizer (train.tokenizer or one saved in the run)")
        adapter = self._adapter_for(params, model_config, mesh, tokenizer, step)
        if self._tasks_index is None:
            self._tasks_index = task_manager(self.include_path, include_defaults=self.builtin_tasks)
        try:
            results = run_tasks(
                adapter,
                self.tasks,
                num_fewshot=self.num_fewshot,
                limit=self.limit,
                tasks_index=self._tasks_index,
                bootstrap_iters=self.bootstrap_iters,
                seed=None,
                in_process_bootstrap=True,
            )
        finally:
            adapter.set_params(None, None)  # keep no reference (nor the sampler's copy) between evaluations
        if self.results_dir is not None and jax.process_index() == 0:
            os.makedirs(self.results_dir, exist_ok=True)
            write_results(results, os.path.join(self.results_dir, f"harness_{step}.json"))
        return flat_metrics(results)
