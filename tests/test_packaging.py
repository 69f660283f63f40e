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
    "README.md",
    "LICENSE",
    "gptj_flax",
    "gptj_flax_entry.py",
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
def built(tmp_path_factory, repo_root) -> tuple[str, str]:
    """A wheel of a copy of this checkout, built as ``pip wheel .`` builds it (offline), and the build's output."""
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
            "--verbose",  # the build backend's own output, warnings included
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
    return str(path), done.stdout + done.stderr


@pytest.fixture(scope="module")
def wheel(built) -> str:
    return built[0]


# Console commands and the modules whose main() they run (pyproject.toml's [project.scripts]).
COMMANDS = {
    "gptj-train": "train",
    "gptj-sample": "sample",
    "gptj-serve": "serve",
    "gptj-convert": "convert",
    "gptj-eval": "eval",
    "gptj-lm-eval": "lm_eval",
    "gptj-create-tfrecords": "create_tfrecords",
    "gptj-prepare-threads": "prepare_threads",
    "gptj-demo": "demo",
    "gptj-aot-check": "aot_check",
    "gptj-launch": "launch",
}


def test_the_build_warns_about_nothing_and_declares_the_license_and_commands(built):
    path, output = built
    # An environment without byte-compiling (PYTHONDONTWRITEBYTECODE) makes setuptools say so; that
    # is the machine's setting, not the project's metadata.
    warnings = [
        line for line in output.splitlines() if re.search(r"(?i)warn|deprecat", line) and "byte-compiling" not in line
    ]
    assert warnings == []
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        info = next(name.split("/")[0] for name in names if name.endswith(".dist-info/METADATA"))
        metadata = archive.read(f"{info}/METADATA").decode()
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    assert f"{info}/licenses/LICENSE" in names
    assert not [name for name in names if name.endswith(".pth")]  # nothing runs at interpreter start
    declared = dict(re.findall(r"^(gptj-[\w-]+) = (\S+)$", entry_points, re.MULTILINE))
    # Each through the entry module, which runs gptj_flax.cli.MODULE's main (tests/test_cli_hostile.py).
    assert declared == {command: f"gptj_flax_entry:gptj_{module}" for command, module in COMMANDS.items()}
    assert "gptj_flax_entry.py" in names
    assert all(f"gptj_flax/cli/{module}.py" in names for module in COMMANDS.values())


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
    top_level = {name.split("/")[0] for name in names if not name.startswith("gptj_flax-")}  # but the dist-info
    assert top_level == {"gptj_flax", "gptj_flax_entry.py"}
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
    # An installed console command runs its module's main through the entry module.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    compared = subprocess.run(
        [str(target / "bin" / "gptj-eval"), "compare", "missing.json", "other.json"],
        env={**env, "PYTHONPATH": str(target)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (compared.returncode, compared.stderr) == (
        1,
        f"error: {tmp_path / 'missing.json'}: No such file or directory\n",
    )
