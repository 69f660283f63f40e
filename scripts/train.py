"""Train or fine-tune GPT-J.

A checkout's spelling of the ``gptj-train`` command (gptj_flax/cli/train.py).
"""

import sys

from gptj_flax_entry import finish, quit_on_interrupt

with quit_on_interrupt():  # Ctrl-C during the package's seconds of imports: one line, status 130
    from gptj_flax.cli.train import main

if __name__ == "__main__":
    sys.exit(finish(main()))
