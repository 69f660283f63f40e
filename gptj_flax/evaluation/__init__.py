"""Evaluation: lm-evaluation-harness on gptj_flax (``harness``, scored by ``scoring``), perplexity
over a dataset as validation computes it (``perplexity``), GPT-4chan's comparison of two results
files (``compare``) and the harness hook of a training run (``during_training``).

Import from the modules themselves (``from gptj_flax.evaluation.harness import GPTJFlaxLM``): each
brings in only what it needs (lm-eval, JAX, matplotlib). ``scripts/eval.py`` is the command line.
"""
