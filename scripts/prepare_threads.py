"""Convert ndjson thread dumps (one {"posts": [...]} per line; plain, .gz, .zst or .xz) into GPT-4chan's

A checkout's spelling of the ``gptj-prepare-threads`` command (gptj_flax/cli/prepare_threads.py).
"""

import sys

from gptj_flax_entry import finish, quit_on_interrupt

with quit_on_interrupt():  # Ctrl-C during the package's seconds of imports: one line, status 130
    from gptj_flax.cli.prepare_threads import main

if __name__ == "__main__":
    sys.exit(finish(main()))
