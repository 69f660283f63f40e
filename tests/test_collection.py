"""Bare ``pytest`` collects the same suite as ``python -m pytest`` (pyproject.toml sets the pythonpath)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


def collected_by_a_process(command: list[str], cwd) -> int:
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


class Count:
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.items = len(session.items)


def collected_here(cwd, monkeypatch) -> int:
    """What ``python -m pytest`` collects from ``cwd``, collected in this process, where every test
    module is already imported (``python -m pytest`` differs from bare ``pytest`` only in putting
    the working directory on sys.path, which this process has)."""
    monkeypatch.chdir(cwd)
    monkeypatch.syspath_prepend(str(cwd))
    count = Count()
    assert pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider"], plugins=[count]) == pytest.ExitCode.OK
    return count.items


@pytest.mark.slow  # a fresh process imports every test module: TensorFlow, PyTorch, lm-eval, JAX
def test_bare_pytest_and_python_m_pytest_collect_the_whole_suite(repo_root, monkeypatch):
    bare = collected_by_a_process([str(Path(sys.executable).parent / "pytest")], repo_root)
    module = collected_here(repo_root, monkeypatch)
    test_files = list((repo_root / "tests").glob("test_*.py"))
    assert bare == module and bare > len(test_files)
