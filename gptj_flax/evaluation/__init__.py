"""Evaluation: lm-evaluation-harness on gptj_flax, perplexity over a dataset, comparing results files.

* :mod:`~gptj_flax.evaluation.harness` — the ``gptj_flax`` lm-eval model (``loglikelihood``,
  ``loglikelihood_rolling``, ``generate_until``; batched, any mesh; GPT-J's EOS prefix) and
  ``run_tasks``. :mod:`~gptj_flax.evaluation.lm_eval_cli` is lm-eval's CLI with it registered.
* :mod:`~gptj_flax.evaluation.scoring` — the compiled, length-bucketed scorer underneath.
* :mod:`~gptj_flax.evaluation.perplexity` — token-weighted loss and perplexity over TFRecords,
  text or TFDS, as validation in training computes it.
* :mod:`~gptj_flax.evaluation.compare` — GPT-4chan's task-by-task table of two results files with
  a significance mark, as markdown and a bar chart.
* :mod:`~gptj_flax.evaluation.during_training` — the hook that runs harness tasks at validation
  steps of a training run.

``scripts/eval.py`` is the command line for all of them.

GPT-J-6B as published (lm-eval, zero-shot): LAMBADA perplexity 3.99 and accuracy 69.7%,
Winogrande 65.3%, HellaSwag 66.1%, PIQA 76.5% — with lm-eval today, tasks ``lambada_openai``,
``winogrande``, ``hellaswag``, ``piqa``. The original also ran ``mathqa`` and ``pubmedqa``.

Import from the modules themselves (``from gptj_flax.evaluation.harness import GPTJFlaxLM``): each
brings in only what it needs (lm-eval, JAX, matplotlib).
"""
