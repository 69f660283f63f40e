"""Will this config's train step fit a TPU slice? Compile it for the slice on this (CPU) machine.

A checkout's spelling of the ``gptj-aot-check`` command (gptj_flax/cli/aot_check.py).
"""

import sys

from gptj_flax_entry import finish, quit_on_interrupt

with quit_on_interrupt():  # Ctrl-C during the package's seconds of imports: one line, status 130
    from gptj_flax.cli.aot_check import main

if __name__ == "__main__":
    sys.exit(finish(main()))
