"""Bare ``pytest`` collects the same suite as ``python -m pytest`` (pyproject.toml sets the pythonpath)."""

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest


def collected(command: list[str], cwd) -> int:
    # No PYTHONPATH: the checkout must be found through the pytest configuration alone.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run(
        [*command, "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [count] = re.findall(r"^(\d+) tests? collected", done.stdout, re.MULTILINE)
    return int(count)


@pytest.mark.slow
def test_bare_pytest_and_python_m_pytest_collect_the_whole_suite(repo_root):
    # Both at once: each is a minute of single-threaded imports.
    with ThreadPoolExecutor(2) as pool:
        bare, module = pool.map(
            lambda command: collected(command, repo_root),
            [[str(Path(sys.executable).parent / "pytest")], [sys.executable, "-m", "pytest"]],
        )
    test_files = list((repo_root / "tests").glob("test_*.py"))
    assert bare == module and bare > len(test_files)
