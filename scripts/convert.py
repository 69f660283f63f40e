"""Convert GPT-J weights between HuggingFace, legacy mesh-transformer-jax and gptj_flax (Orbax) checkpoints.

A checkout's spelling of the ``gptj-convert`` command (gptj_flax/cli/convert.py).
"""

import sys

from gptj_flax.cli.convert import main

if __name__ == "__main__":
    sys.exit(main())
