"""Tokenise text/jsonl files into TFRecords readable by both gptj_flax and mesh-transformer-jax.

A checkout's spelling of the ``gptj-create-tfrecords`` command (gptj_flax/cli/create_tfrecords.py).
"""

import sys

from gptj_flax_entry import finish, quit_on_interrupt

with quit_on_interrupt():  # Ctrl-C during the package's seconds of imports: one line, status 130
    from gptj_flax.cli.create_tfrecords import main

if __name__ == "__main__":
    sys.exit(finish(main()))
