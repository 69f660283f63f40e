"""Runs installed commands one after another in this one process, for tests/test_docs.py.

python run_commands.py JOBS.json

JOBS.json holds a list of {"argv": [...], "stdout": PATH, "stderr": PATH, "status": PATH}. Each command's
entry point ([project.scripts] in pyproject.toml) is called as its console script calls it, with
``sys.argv`` set to argv and file descriptors 1 and 2 pointed at its own files, so that what libraries
write below Python lands there too; its exit status is written to its "status" file. Commands share the
process's start-up (Python, JAX, TensorFlow), which is most of a short command's time.
"""

import importlib
import json
import os
import sys
import tomllib
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def exit_status(code) -> int:
    """What the shell would see for ``sys.exit(code)``."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def call(argv: list[str]) -> int:
    module, function = SCRIPTS[argv[0]].split(":")
    main = getattr(importlib.import_module(module), function)
    sys.argv = argv
    try:
        return exit_status(main())
    except SystemExit as stop:
        return exit_status(stop.code)
    except BaseException:  # noqa: BLE001 - shown as the console script would show it
        traceback.print_exc()
        return 1


def run(job: dict) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(job["stdout"], "w") as out, open(job["stderr"], "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            status = call(job["argv"])
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in enumerate(saved, start=1):
                os.dup2(copy, fd)
                os.close(copy)
    Path(job["status"]).write_text(str(status))


if __name__ == "__main__":
    for job in json.loads(Path(sys.argv[1]).read_text()):
        run(job)
