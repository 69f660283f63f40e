"""Running a command line inside the test process: its ``main()`` with an argv, a working directory and
environment variables, giving back the exit status and what it printed (``conftest.run_command``).

A fresh Python costs seconds of imports (JAX, TensorFlow, transformers); a command's arguments, error
messages and output are the same in this process. A real process stays for what only a process
has: signals, exit codes set by the interpreter, the run-directory lock, several processes, a
different device count or import environment.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import runpy
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# The tests' XLA flag for every process they start: LLVM's optimisation of the compiled programs took
# a third of a compile's CPU time, and the tests' tiny models run in microseconds either way; the
# programs compute the same (XLA's own passes and the float semantics are unchanged).
QUICK_COMPILE = "--xla_backend_optimization_level=0"


@dataclasses.dataclass
class Ran:
    """A command's exit status and its stdout and stderr (file-descriptor level: native code's too)."""

    status: int
    out: str
    err: str

    def error_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.startswith("error:")]


def script(name: str) -> Callable[[], None]:
    """``python scripts/NAME``: the file run as ``__main__``, its own ``sys.exit`` included."""
    path = str(REPO / "scripts" / name)
    return lambda: runpy.run_path(path, run_name="__main__")


def exit_status(code: object) -> int:
    """The status the interpreter would exit with for ``sys.exit(code)`` (a message is status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def run_main(
    main: Callable[[], int | None],
    argv: list[str],
    capfd: pytest.CaptureFixture,
    *,
    cwd: str | os.PathLike | None = None,
    env: dict[str, str | None] | None = None,
    stdin: str = "",
) -> Ran:
    """Call ``main()`` as ``PROG ARGV`` would run it from ``cwd`` with ``env`` changed (None unsets a
    variable) and ``stdin`` to read; the process's directory, environment, argv, sys.path, stdin and
    logging set-up are restored after."""
    capfd.readouterr()  # what came before is not the command's
    saved_environ, saved_argv, saved_path, saved_cwd = dict(os.environ), sys.argv, sys.path[:], os.getcwd()
    saved_stdin = sys.stdin
    saved_handlers, saved_level = logging.root.handlers[:], logging.root.level
    try:
        for key, value in (env or {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        sys.argv, sys.stdin = ["prog", *map(str, argv)], io.StringIO(stdin)
        if cwd is not None:
            os.chdir(cwd)
        try:
            status = exit_status(main())
        except SystemExit as stop:  # a script's sys.exit, argparse's usage errors
            status = exit_status(stop.code)
        except Exception:  # noqa: BLE001 - as the interpreter ends a program (under --debug, for one)
            traceback.print_exc()
            status = 1
    finally:
        os.chdir(saved_cwd)
        sys.argv, sys.path[:], sys.stdin = saved_argv, saved_path, saved_stdin
        os.environ.clear()
        os.environ.update(saved_environ)
        logging.root.handlers[:] = saved_handlers  # a command's logging set-up replaces them
        logging.root.setLevel(saved_level)
        sys.stdout.flush()
        sys.stderr.flush()
    out, err = capfd.readouterr()
    return Ran(status, out, err)
