"""The errors a user is meant to read, and how every command line shows them.

Each package raises its own subclass of :class:`GptjFlaxError` (``ConfigError``, ``DataError``,
``CheckpointError`` …) with a message that names the input at fault and how to fix it. Command
lines run their ``main`` through :func:`run_cli`, which turns any exception into one
``error: …`` line and a non-zero exit status; ``--debug`` shows the traceback instead.

This module imports nothing from the package, so every layer may use it.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
from collections.abc import Callable, Sequence

DEBUG_FLAG = "--debug"
DEBUG_ENV = "GPTJ_FLAX_DEBUG"

# Exit statuses: 1 for an error the message explains, 130 for Ctrl-C (the shell's 128 + SIGINT).
EXIT_ERROR = 1
EXIT_INTERRUPTED = 130
# A worker of gptj-launch (which sets LAUNCHED_ENV to its job and attempt, JOB:ATTEMPT) that SIGTERM
# stopped early, after saving, exits with this status (sysexits' EX_TEMPFAIL) rather than 0: the
# launcher must tell a preempted host from a finished one, and restart the job rather than end it.
EXIT_PREEMPTED = 75
LAUNCHED_ENV = "GPTJ_FLAX_LAUNCHED"
# What run_cli prints under the error line of an exception that is not a GptjFlaxError or OSError:
# gptj-launch retries such a failure once (it may be a lost peer's echo) and a GptjFlaxError never.
UNEXPECTED_HINT = f"(an unexpected error; rerun with {DEBUG_FLAG} for the traceback)"


class GptjFlaxError(Exception):
    """A problem with the user's input or environment; the message says what is wrong and what to do."""


# The optional dependencies (pyproject.toml's extras) that command lines import, by top-level module.
EXTRA_OF_MODULE = {
    "fastapi": "serve",
    "uvicorn": "serve",
    "prometheus_client": "serve",
    "lm_eval": "eval",
    "ray": "pod",
}


class MissingExtraError(GptjFlaxError):
    """A command needs an optional dependency that is not installed."""


def missing_extra(error: ModuleNotFoundError) -> MissingExtraError:
    """The error a command raises when it runs without the extra whose import failed with ``error``.

    A command module imports an extra's modules at its top inside ``try``; only a missing extra
    becomes this error, and anything else missing is re-raised at once, as a broken install.
    """
    extra = EXTRA_OF_MODULE.get((error.name or "").partition(".")[0])
    if extra is None:
        raise error
    return MissingExtraError(
        f"this command needs the {extra!r} extra ({error.name} is not installed): "
        f"pip install -c constraints.txt -e '.[{extra}]' in the project's checkout"
    )


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """Document ``--debug`` in a command's help (:func:`run_cli` acts on it)."""
    parser.add_argument(
        DEBUG_FLAG, action="store_true", help=f"show the full traceback of an error (or set {DEBUG_ENV}=1)"
    )


def debug_requested(argv: Sequence[str] | None = None) -> bool:
    argv = sys.argv[1:] if argv is None else argv
    return DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")


class _Thresholds(logging.Filter):
    """Passes this package's records from ``own`` up and other libraries' from ``others`` up."""

    def __init__(self, own: int, others: int) -> None:
        super().__init__()
        self.own, self.others = own, others

    def filter(self, record: logging.LogRecord) -> bool:
        ours = record.name == "gptj_flax" or record.name.startswith("gptj_flax.")
        return record.levelno >= (self.own if ours else self.others)


def configure_logging(level: int | str, fmt: str) -> None:
    """Write this package's log records at ``level`` and up, and other libraries' warnings, to stderr in ``fmt``.

    Other libraries stay at WARNING (at INFO, JAX reports each backend it tried and could not start),
    except under ``--debug``, which writes every record. The choice is made by a filter on the handler,
    leaving loggers' own levels alone. Forced, because importing Orbax logs through absl, which gives
    the root logger a default handler when it has none; a plain ``basicConfig`` would then change nothing.
    """
    debug = debug_requested()
    own = logging.DEBUG if debug else logging.getLevelName(level) if isinstance(level, str) else level
    logging.basicConfig(level=own, format=fmt, force=True)
    if not debug:
        for handler in logging.root.handlers:
            handler.addFilter(_Thresholds(own, max(logging.WARNING, own)))


def describe(error: BaseException) -> str:
    """One line for ``error``: its own message for project and OS errors, its type for anything else."""
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        where = f"{error.filename}: " if error.filename else ""
        return f"{where}no space left on the device; free some space or write elsewhere"
    if isinstance(error, GptjFlaxError):
        return str(error)
    if isinstance(error, OSError) and error.strerror:
        return f"{error.filename}: {error.strerror}" if error.filename else error.strerror
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def run_cli(main: Callable[[], int | None], argv: Sequence[str] | None = None) -> int:
    """Run a command's ``main`` and return its exit status; errors become one ``error:`` line.

    ``argparse`` keeps its own usage errors (status 2). Ctrl-C exits with 130 and no traceback.
    Under ``--debug`` (or ``GPTJ_FLAX_DEBUG=1``) exceptions propagate with their traceback.
    """
    debug = debug_requested(argv)
    if debug:
        logging.getLogger().setLevel(logging.DEBUG)
        status = main()
        return 0 if status is None else int(status)
    try:
        status = main()
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - every failure becomes one readable line
        print(f"error: {describe(e)}", file=sys.stderr)
        if not isinstance(e, (GptjFlaxError, OSError)):
            print(UNEXPECTED_HINT, file=sys.stderr)
        return EXIT_ERROR
    return 0 if status is None else int(status)
