"""Train or fine-tune GPT-J.

A checkout's spelling of the ``gptj-train`` command (gptj_flax/cli/train.py).
"""

import sys

from gptj_flax.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
