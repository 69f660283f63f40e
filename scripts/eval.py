"""Evaluate checkpoints: lm-evaluation-harness tasks, perplexity over a dataset, comparing two results.

A checkout's spelling of the ``gptj-eval`` command (gptj_flax/cli/eval.py).
"""

import sys

from gptj_flax_entry import finish, quit_on_interrupt

with quit_on_interrupt():  # Ctrl-C during the package's seconds of imports: one line, status 130
    from gptj_flax.cli.eval import main

if __name__ == "__main__":
    sys.exit(finish(main()))
