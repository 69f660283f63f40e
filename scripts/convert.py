"""Convert GPT-J weights between HuggingFace, legacy mesh-transformer-jax and gptj_flax (Orbax) checkpoints.

A checkout's spelling of the ``gptj-convert`` command (gptj_flax/cli/convert.py).
"""

import sys

from gptj_flax_entry import finish, quit_on_interrupt

with quit_on_interrupt():  # Ctrl-C during the package's seconds of imports: one line, status 130
    from gptj_flax.cli.convert import main

if __name__ == "__main__":
    sys.exit(finish(main()))
