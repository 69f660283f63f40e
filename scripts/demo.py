"""The CPU demo: train a small GPT-J on the Python standard library's source, then sample from it.

A checkout's spelling of the ``gptj-demo`` command (gptj_flax/cli/demo.py).
"""

import sys

from gptj_flax_entry import finish, quit_on_interrupt

with quit_on_interrupt():  # Ctrl-C during the package's seconds of imports: one line, status 130
    from gptj_flax.cli.demo import main

if __name__ == "__main__":
    sys.exit(finish(main()))
