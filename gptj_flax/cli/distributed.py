"""Start-up shared by the commands that run on every host of a slice (gptj-sample, gptj-eval)."""

import jax

from gptj_flax import partitioning
from gptj_flax.cli import keep_stdout_for_results


def start_processes() -> None:
    """Join the other processes of a multi-host run (none elsewhere), then keep stdout for results."""
    partitioning.initialize_distributed()
    if jax.process_count() > 1:
        keep_stdout_for_results()
