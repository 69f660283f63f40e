"""Sample from a checkpoint: one prompt, or an interactive prompt loop (the original device_sample.py).

A checkout's spelling of the ``gptj-sample`` command (gptj_flax/cli/sample.py).
"""

import sys

from gptj_flax_entry import finish, quit_on_interrupt

with quit_on_interrupt():  # Ctrl-C during the package's seconds of imports: one line, status 130
    from gptj_flax.cli.sample import main

if __name__ == "__main__":
    sys.exit(finish(main()))
