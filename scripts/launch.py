"""Run a command on every host of a slice, on a Ray cluster.

A checkout's spelling of the ``gptj-launch`` command (gptj_flax/cli/launch.py).
"""

import sys

from gptj_flax_entry import finish, quit_on_interrupt

with quit_on_interrupt():  # Ctrl-C during the package's seconds of imports: one line, status 130
    from gptj_flax.cli.launch import main

if __name__ == "__main__":
    sys.exit(finish(main()))
