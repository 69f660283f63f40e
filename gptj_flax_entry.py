"""The commands' entry points (pyproject.toml's ``[project.scripts]``): Ctrl-C gives one line and exit
status 130 from the command's first instant, and none of Python's tracebacks at its end.

A command's module imports the package, and with it JAX, Flax, Orbax and transformers: seconds during
which Python's own handling of Ctrl-C would end the command with a traceback, before ``run_cli``
(gptj_flax.errors) is there to turn it into ``error: interrupted``. The handling must be in place
before that import begins, so it lives here, outside the package (whose ``__init__`` is that
import), importing only the standard library. A console script imports this module and calls a
function below, which imports its command by name, as the console-script loader itself does: this
module sits above every layer of the package, and nothing in the package imports it.

Once the command has returned, only the interpreter's shutdown is left (joining threads, closing
files and runtimes); Ctrl-C then ends the process at once with the command's own status and prints
nothing, instead of a ``KeyboardInterrupt`` traceback from whatever was shutting down.

``scripts/*.py`` (a checkout's spelling of the commands) use :func:`quit_on_interrupt` and
:func:`finish` around their own imports.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

# gptj_flax.errors's EXIT_INTERRUPTED and run_cli's line: that module cannot be imported before the
# package, which is what this one runs before. tests/test_cli_hostile.py checks that they agree.
EXIT_INTERRUPTED = 130
INTERRUPTED_LINE = "error: interrupted\n"


def _handling_ours() -> bool:
    """Whether SIGINT is Python's default (not ignored by the parent shell, not someone else's handler),
    and this is the main thread, the only one that may change it."""
    in_main_thread = threading.current_thread() is threading.main_thread()
    return in_main_thread and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _quit_interrupted(signum, frame) -> None:
    os.write(2, INTERRUPTED_LINE.encode())
    os._exit(EXIT_INTERRUPTED)


@contextlib.contextmanager
def quit_on_interrupt() -> Iterator[None]:
    """Inside the block (the command's imports, before any work has begun, so nothing can be lost),
    Ctrl-C prints ``error: interrupted`` and exits with status 130 at once."""
    if not _handling_ours():
        yield
        return
    signal.signal(signal.SIGINT, _quit_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def finish(status: int) -> int:
    """``status``, the command's exit status, after which Ctrl-C ends the process at once with it."""
    for stream in (sys.stdout, sys.stderr):  # what the command printed is out before any interruption
        with contextlib.suppress(Exception):
            stream.flush()
    if _handling_ours():
        signal.signal(signal.SIGINT, lambda signum, frame: os._exit(status))
    return status


def run(command: str) -> int:
    """Run ``gptj_flax.cli.COMMAND``'s ``main`` as a console command; returns its exit status."""
    with quit_on_interrupt():
        main = importlib.import_module(f"gptj_flax.cli.{command}").main
    status = 1
    try:
        status = main()
    except SystemExit as e:  # argparse's usage errors (2), --help (0)
        status = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        raise
    finally:
        finish(status)
    return status


def gptj_train() -> int:
    return run("train")


def gptj_sample() -> int:
    return run("sample")


def gptj_serve() -> int:
    return run("serve")


def gptj_convert() -> int:
    return run("convert")


def gptj_eval() -> int:
    return run("eval")


def gptj_lm_eval() -> int:
    return run("lm_eval")


def gptj_create_tfrecords() -> int:
    return run("create_tfrecords")


def gptj_prepare_threads() -> int:
    return run("prepare_threads")


def gptj_demo() -> int:
    return run("demo")


def gptj_aot_check() -> int:
    return run("aot_check")


def gptj_launch() -> int:
    return run("launch")
