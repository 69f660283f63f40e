"""lm-eval's own command line with the ``gptj_flax`` model registered.

    python -m gptj_flax.evaluation.lm_eval_cli --model gptj_flax --model_args checkpoint=runs/demo \\
        --tasks lambada_openai piqa --batch_size 16 --output_path results/

Every argument is lm-eval's (``lm_eval --help``). Where gptj_flax is installed, lm-eval's ``lm_eval``
command does the same: ``lm_eval --model gptj_flax …``. lm-eval 0.4 resolves ``--model`` names only
from its built-in table and from classes registered in the running process — it does not discover
models through package entry points — so the install adds ``gptj_flax_lm_eval.pth`` to
site-packages; Python runs it at start, importing ``_gptj_flax_lm_eval_hook``, which registers
``gptj_flax`` as a lazy placeholder when lm-eval's registry is imported (see setup.py). This module
imports our adapter (which registers it) and then hands over to lm-eval's entry point: it works
in a source checkout that is not installed too.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from lm_eval.__main__ import cli_evaluate

import gptj_flax.evaluation.harness  # noqa: F401  (registers "gptj_flax")


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``lm_eval`` with ``argv`` (default: this process's arguments)."""
    if argv is None:
        cli_evaluate()
        return
    saved = sys.argv
    sys.argv = [saved[0], *argv]  # lm-eval's parser reads sys.argv itself
    try:
        cli_evaluate()
    finally:
        sys.argv = saved


if __name__ == "__main__":
    main()
