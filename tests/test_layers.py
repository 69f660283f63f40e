"""The package's layering: the import-linter contract in pyproject.toml holds, and no import of a
project module (the package, the benchmarks, the tests' helpers) inside a function hides a dependency."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "gptj_flax"
PROJECT = {"gptj_flax", "benchmarks", "tests"}


def function_level_project_imports(source: str, filename: str) -> list[tuple[str, str, int]]:
    """(enclosing function, imported module, line) for every import of a project module (``gptj_flax``,
    ``benchmarks``, ``tests``, or a relative one) made inside a function or method of ``source``."""
    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if function is not None and isinstance(child, ast.Import):
                found.extend((function, a.name, child.lineno) for a in child.names if a.name.split(".")[0] in PROJECT)
            elif function is not None and isinstance(child, ast.ImportFrom):
                module = "." * child.level + (child.module or "")
                if child.level or module.split(".")[0] in PROJECT:
                    found.append((function, module, child.lineno))
            visit(child, inner)

    visit(ast.parse(source, filename), None)
    return found


def test_the_scan_finds_imports_in_functions_methods_and_nested_blocks():
    source = (
        "import gptj_flax.config\n"
        "from gptj_flax import model\n"
        "def f():\n    import os\n    from gptj_flax.training import train\n"
        "class C:\n    def m(self):\n        if True:\n            import gptj_flax.convert as c\n"
        "        from . import sibling\n"
        "async def g():\n    from jax import numpy\n    from tests.helpers import tiny_config\n"
    )
    assert function_level_project_imports(source, "x.py") == [
        ("f", "gptj_flax.training", 5),
        ("m", "gptj_flax.convert", 9),
        ("m", ".", 10),
        ("g", "tests.helpers", 13),
    ]


# Every module, the commands in gptj_flax/cli included: a command's optional extra is imported at
# its top inside ``try`` (gptj_flax.errors.missing_extra), not inside the function that needs it.
# Heavy third-party imports (torch, TensorFlow) may still wait inside the function that needs them.
MODULES = sorted(
    str(p.relative_to(REPO)) for d in ("gptj_flax", "benchmarks", "scripts", "tests") for p in (REPO / d).rglob("*.py")
) + ["gptj_flax_entry.py"]


@pytest.mark.parametrize("module", MODULES)
def test_no_function_level_import_of_a_project_module(module):
    found = function_level_project_imports((REPO / module).read_text(), module)
    assert not found, (
        f"{module} imports project modules inside functions, which hides its dependencies (and "
        f"can hide a cycle): {found}; import at the top, and move code to the right layer if that "
        "makes a cycle"
    )


def test_the_layers_contract_holds():
    lint = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run(
        [str(lint), "--config", str(REPO / "pyproject.toml")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "1 kept, 0 broken" in done.stdout


def test_the_contract_catches_an_upward_import(tmp_path):
    """The same contract on a copy of the package with one upward import added: broken."""
    copy = tmp_path / "gptj_flax"
    subprocess.run(["cp", "-r", str(PACKAGE), str(copy)], check=True)
    convert_init = copy / "convert" / "__init__.py"
    convert_init.write_text(convert_init.read_text() + "\n\ndef _hidden():\n    from gptj_flax import training\n")
    lint = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run(
        [str(lint), "--config", str(REPO / "pyproject.toml")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert done.returncode == 1 and "gptj_flax.convert -> gptj_flax.training" in done.stdout, done.stdout[-3000:]
