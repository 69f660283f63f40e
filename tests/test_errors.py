"""run_cli: every failure of a command becomes one `error:` line, tracebacks only under --debug."""

import errno

import pytest

from gptj_flax.config import ConfigError
from gptj_flax.errors import EXIT_ERROR, EXIT_INTERRUPTED, GptjFlaxError, run_cli


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
