"""run_cli: every failure of a command becomes one `error:` line, tracebacks only under --debug."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gptj_flax.config import ConfigError
from gptj_flax.errors import EXIT_ERROR, EXIT_INTERRUPTED, GptjFlaxError, missing_extra, run_cli

REPO = Path(__file__).resolve().parent.parent


def _raises(error):
    def main():
        raise error

    return main


def test_project_error_is_one_line(capsys):
    status = run_cli(_raises(ConfigError("model.d_model=7 is not divisible by model.n_heads=2")), argv=[])
    err = capsys.readouterr().err
    assert status == EXIT_ERROR
    assert err == "error: model.d_model=7 is not divisible by model.n_heads=2\n"
    assert issubclass(ConfigError, GptjFlaxError) and issubclass(ConfigError, ValueError)


def test_disk_full_names_the_path(capsys):
    error = OSError(errno.ENOSPC, "No space left on device", "/runs/x/100/params")
    assert run_cli(_raises(error), argv=[]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "/runs/x/100/params" in err and "no space left" in err


def test_unexpected_error_says_how_to_see_the_traceback(capsys):
    assert run_cli(_raises(KeyError("oops")), argv=[]) == EXIT_ERROR
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "error: KeyError: 'oops'"
    assert "--debug" in lines[1] and "Traceback" not in "\n".join(lines)


def test_ctrl_c_exits_130_without_traceback(capsys):
    assert run_cli(_raises(KeyboardInterrupt()), argv=[]) == EXIT_INTERRUPTED
    assert capsys.readouterr().err == "error: interrupted\n"


def test_debug_propagates_the_exception(monkeypatch):
    monkeypatch.delenv("GPTJ_FLAX_DEBUG", raising=False)
    with pytest.raises(KeyError):
        run_cli(_raises(KeyError("oops")), argv=["--debug"])
    monkeypatch.setenv("GPTJ_FLAX_DEBUG", "1")
    with pytest.raises(KeyError):
        run_cli(_raises(KeyError("oops")), argv=[])


def test_status_passes_through():
    assert run_cli(lambda: None, argv=[]) == 0
    assert run_cli(lambda: 3, argv=[]) == 3


# A child Python in which the named top-level modules cannot be imported, as if their extra were
# not installed, running one command line.
_WITHOUT = """
import sys
from importlib.abc import MetaPathFinder

class Missing(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, Missing())
sys.argv = {argv!r}
from {module} import main
sys.exit(main())
"""


def _run_without(blocked: set[str], module: str, argv: list[str], cwd) -> subprocess.CompletedProcess:
    code = _WITHOUT.format(blocked=blocked, argv=argv, module=module)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_serve_without_its_extra_names_the_extra(tmp_path):
    result = _run_without({"fastapi"}, "gptj_flax.cli.serve", ["gptj-serve", "--checkpoint", "x"], tmp_path)
    assert result.returncode == EXIT_ERROR, result.stderr
    assert result.stderr.splitlines() == [
        "error: this command needs the 'serve' extra (fastapi is not installed): "
        "pip install -c constraints.txt -e '.[serve]' in the project's checkout"
    ]


def test_eval_without_lm_eval_compares_but_harness_names_the_extra(tmp_path):
    for name, score in (("a", 0.5), ("b", 0.25)):
        results = {"results": {"piqa": {"acc,none": score, "acc_stderr,none": 0.01}}}
        (tmp_path / f"{name}.json").write_text(json.dumps(results))
    compared = _run_without({"lm_eval"}, "gptj_flax.cli.eval", ["gptj-eval", "compare", "a.json", "b.json"], tmp_path)
    assert compared.returncode == 0, compared.stderr
    assert "piqa" in compared.stdout and (tmp_path / "comparison.png").stat().st_size > 0

    argv = ["gptj-eval", "harness", "--checkpoint", str(tmp_path), "--tasks", "piqa", "--output", "r.json"]
    harness = _run_without({"lm_eval"}, "gptj_flax.cli.eval", argv, tmp_path)
    assert harness.returncode == EXIT_ERROR
    assert harness.stderr.splitlines()[-1].startswith("error: this command needs the 'eval' extra (lm_eval is")


def test_a_missing_module_outside_the_extras_is_not_blamed_on_one():
    with pytest.raises(ModuleNotFoundError, match="numpyy"):
        missing_extra(ModuleNotFoundError("No module named 'numpyy'", name="numpyy"))
    assert "'eval' extra" in str(missing_extra(ModuleNotFoundError("x", name="lm_eval.api")))


def test_train_without_lm_eval_names_the_extra_only_for_harness_tasks(tmp_path):
    config = str(REPO / "configs" / "tiny.json")
    argv = ["gptj-train", "--config", config, "--set", f"train.run_dir={tmp_path / 'run'}"]
    harness = argv + ["--set", 'train.eval_harness_tasks=["piqa"]']
    result = _run_without({"lm_eval"}, "gptj_flax.cli.train", harness, tmp_path)
    assert result.returncode == EXIT_ERROR, result.stderr
    assert result.stderr.splitlines()[-1].startswith(
        "error: train.eval_harness_tasks: this command needs the 'eval' extra (lm_eval is not installed)"
    )
    assert not (tmp_path / "run").exists()
    # without harness tasks the same command gets past the extra, to the next problem with its config
    plain = _run_without({"lm_eval"}, "gptj_flax.cli.train", argv, tmp_path)
    assert plain.returncode == EXIT_ERROR
    assert plain.stderr.splitlines() == [
        "error: train.train_set is not set: give an .index file, a text/jsonl path or tfds:NAME"
    ]


_LOGGING = """
import logging
import gptj_flax.cli.train  # imports Orbax, as every command does
from gptj_flax.errors import configure_logging
assert logging.root.handlers, "importing the package no longer configures the root logger; find another trigger"
configure_logging("INFO", "[%(levelname)s] %(message)s")
logging.getLogger("gptj_flax.training.loop").info("ours")
logging.getLogger("gptj_flax.training.loop").debug("our debug line")
logging.getLogger("jax._src.xla_bridge").info("theirs")
logging.getLogger("orbax").warning("their warning")
# loggers keep their own levels, so a later caller (a test's caplog) can still lower them
assert logging.getLogger("gptj_flax").level == logging.getLogger("jax").level == logging.NOTSET
"""


@pytest.mark.parametrize("debug", [False, True])
def test_the_commands_logging_holds_although_absl_configured_the_root_logger_at_import(debug):
    # Absl puts a default WARNING handler on the root logger while Orbax imports; the commands' set-up must
    # still decide level and format. Other libraries' INFO lines (JAX naming each backend it could not start)
    # stay out unless --debug.
    env = {**os.environ, "GPTJ_FLAX_DEBUG": "1" if debug else "0"}
    done = subprocess.run([sys.executable, "-c", _LOGGING], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("[")]
    if debug:
        assert lines[-4:] == ["[INFO] ours", "[DEBUG] our debug line", "[INFO] theirs", "[WARNING] their warning"]
    else:
        assert lines == ["[INFO] ours", "[WARNING] their warning"]
