"""Sample from a checkpoint: one prompt, or an interactive prompt loop (the original device_sample.py).

A checkout's spelling of the ``gptj-sample`` command (gptj_flax/cli/sample.py).
"""

import sys

from gptj_flax.cli.sample import main

if __name__ == "__main__":
    sys.exit(main())
