"""What ``pip install .`` installs: the library alone (no benchmarks, fixtures or tests); and importing
the data package loads neither the benchmarks nor the GPT-4chan code."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

# What a wheel is built from: the checkout's files, benchmarks and tests included, so that leaving
# them out is the build configuration's doing.
SOURCES = (
    "pyproject.toml",
    "setup.py",
    "README.md",
    "_gptj_flax_lm_eval_hook.py",
    "gptj_flax",
    "benchmarks",
    "tests",
    "scripts",
    "configs",
)
# Functions that only benchmarks and tests use; the package once defined them.
NOT_IN_THE_PACKAGE = ("write_random_hf", "write_synthetic_dump", "benchmark_pipeline", "demo_step_tokens_per_s")
NOT_A_LIBRARY_MODULE = re.compile(
    r"(^|/)(bench\w*|benchmarks?|\w*fixtures?|conftest|tests?|test_\w+|\w+_test)(\.py$|/)"
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory, repo_root) -> str:
    """A wheel of a copy of this checkout, built as ``pip wheel .`` builds it (offline)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    source.mkdir()
    for name in SOURCES:
        if (repo_root / name).is_dir():
            shutil.copytree(repo_root / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(repo_root / name, source / name)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--quiet",
            "-w",
            str(root / "dist"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (path,) = (root / "dist").glob("gptj_flax-*.whl")
    return str(path)


def test_the_wheel_holds_the_library_and_no_benchmark_fixture_or_test(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        modules = {name: archive.read(name).decode("utf-8") for name in names if name.endswith(".py")}
    assert {
        "gptj_flax/data/corpus.py",
        "gptj_flax/gpt4chan/thread_dumps.py",
        "gptj_flax/gpt4chan/post_html.py",
        "gptj_flax/convert/hf.py",
    } <= set(modules)
    assert not {name.split("/")[0] for name in names if not name.startswith(("gptj_flax", "_gptj_flax"))}
    assert not [name for name in modules if NOT_A_LIBRARY_MODULE.search(name)]
    defined = [
        (name, function)
        for name, text in modules.items()
        for function in NOT_IN_THE_PACKAGE
        if re.search(rf"^\s*def {function}\(", text, re.MULTILINE)
    ]
    assert not defined


def _fresh_import(code: str, python_path: str, cwd) -> dict:
    """Run ``code`` in a new interpreter with only ``python_path`` added; it prints one JSON object."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "PYTHONPATH": python_path},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


# Prints where gptj_flax.data came from, and which benchmark or thread-dump modules importing it loaded.
LOADED_BY_IMPORTING_DATA = """
import importlib.util, json, sys
import gptj_flax.data
print(json.dumps({
    "package": gptj_flax.data.__file__,
    "benchmarks_importable": importlib.util.find_spec("benchmarks") is not None,
    "unwanted": sorted(m for m in sys.modules if m.split(".")[0] == "benchmarks" or (
        m.startswith("gptj_flax.") and any(word in m for word in ("bench", "gpt4chan", "threads")))),
}))
"""


def test_importing_the_data_package_loads_no_benchmark_and_no_gpt4chan_code(tmp_path, repo_root):
    # From the checkout, where benchmarks/ is importable: nothing loads it.
    loaded = _fresh_import(LOADED_BY_IMPORTING_DATA, str(repo_root), tmp_path)
    assert loaded["package"] == str(repo_root / "gptj_flax" / "data" / "__init__.py")
    assert loaded["benchmarks_importable"] and loaded["unwanted"] == []


def test_the_installed_package_works_without_the_checkout(wheel, tmp_path):
    target = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", "--target", str(target), wheel],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    loaded = _fresh_import(LOADED_BY_IMPORTING_DATA, str(target), tmp_path)
    assert loaded["package"] == str(target / "gptj_flax" / "data" / "__init__.py")
    assert not loaded["benchmarks_importable"] and loaded["unwanted"] == []
    gpt4chan = _fresh_import(
        "import json, gptj_flax.gpt4chan as g; print(json.dumps({'file': g.__file__, "
        "'text': g.html_to_text('a<br>&gt;&gt;1')}))",
        str(target),
        tmp_path,
    )
    assert gpt4chan == {"file": str(target / "gptj_flax" / "gpt4chan" / "__init__.py"), "text": "a\n>>1"}
