"""Serve a checkpoint over HTTP: GPT-4chan's /complete, OpenAI-style /v1/completions, /health, /metrics.

A checkout's spelling of the ``gptj-serve`` command (gptj_flax/cli/serve.py).
"""

import sys

from gptj_flax_entry import finish, quit_on_interrupt

with quit_on_interrupt():  # Ctrl-C during the package's seconds of imports: one line, status 130
    from gptj_flax.cli.serve import main

if __name__ == "__main__":
    sys.exit(finish(main()))
