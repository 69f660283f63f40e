"""Every command keeps compiled programs in JAX's persistent compilation cache, under $GPTJ_FLAX_CACHE by
default, so that a second run loads what the first compiled; --no-compile-cache and an unwritable
directory run without it."""

from __future__ import annotations

import collections
import os

import jax
import pytest
from jax import monitoring
from jax.experimental.compilation_cache import compilation_cache

from gptj_flax.cli import compile_cache, convert, eval, sample, serve, train
from gptj_flax.cli import lm_eval as lm_eval_cli

CACHE_SETTINGS = (
    "jax_enable_compilation_cache",
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
)
HITS = "/jax/compilation_cache/cache_hits"
MISSES = "/jax/compilation_cache/cache_misses"
REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"  # a program looked up in the cache
COMPILES = "/jax/core/compile/backend_compile_duration"  # a program compiled or loaded from the cache


@pytest.fixture(autouse=True)
def cache_settings_restored():
    """The suite's own cache (tests/conftest.py) back in force after each test, whatever a command set."""
    saved = {name: getattr(jax.config, name) for name in CACHE_SETTINGS}
    yield
    for name, value in saved.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


@pytest.fixture
def events():
    """Counts of JAX's monitoring events from now on (cache hits, compile requests, compiles)."""
    counts: collections.Counter[str] = collections.Counter()

    def count(event: str, *args, **kwargs) -> None:
        counts[event] += 1

    monitoring.register_event_listener(count)
    monitoring.register_event_duration_secs_listener(count)
    yield counts
    monitoring.unregister_event_listener(count)
    monitoring.unregister_event_duration_listener(count)


@pytest.fixture
def no_suite_cache(monkeypatch):
    """The environment of a user who set nothing: the suite's JAX_COMPILATION_CACHE_DIR removed."""
    for name in (compile_cache.JAX_CACHE_DIR_ENV, "GPTJ_FLAX_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)


def test_the_cache_is_under_gptj_flax_cache_else_xdg_else_home_and_an_explicit_jax_dir_wins(
    no_suite_cache, monkeypatch, tmp_path
):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.use_compile_cache([]) == str(tmp_path / "home" / ".cache" / "gptj_flax" / "jax")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.use_compile_cache([]) == str(tmp_path / "xdg" / "gptj_flax" / "jax")
    monkeypatch.setenv("GPTJ_FLAX_CACHE", str(tmp_path / "mine"))
    directory = compile_cache.use_compile_cache(["--prompt", "x"])
    assert directory == str(tmp_path / "mine" / "jax") and os.path.isdir(directory)
    assert jax.config.jax_compilation_cache_dir == directory and jax.config.jax_enable_compilation_cache
    monkeypatch.setenv(compile_cache.JAX_CACHE_DIR_ENV, str(tmp_path / "explicit"))
    assert compile_cache.use_compile_cache([]) == str(tmp_path / "explicit")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "explicit")


def test_small_programs_are_kept_unless_the_environment_says_otherwise(no_suite_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("GPTJ_FLAX_CACHE", str(tmp_path))
    for variable, _ in compile_cache.EVERY_PROGRAM.values():
        monkeypatch.delenv(variable, raising=False)
    compile_cache.use_compile_cache([])
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    assert jax.config.jax_persistent_cache_min_entry_size_bytes == -1
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.0)
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "2")
    compile_cache.use_compile_cache([])
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 2.0


def test_no_compile_cache_turns_it_off_even_over_an_explicit_directory():
    assert os.environ.get(compile_cache.JAX_CACHE_DIR_ENV)  # the suite's
    assert compile_cache.use_compile_cache(["--no-compile-cache"]) is None
    assert not jax.config.jax_enable_compilation_cache


@pytest.mark.parametrize("main", [sample.main, serve.main, train.main, eval.main, convert.main, lm_eval_cli.main])
def test_every_command_that_runs_jax_programs_takes_the_flag(run_command, main):
    argv = ["--no-compile-cache", "--help"]
    ran = run_command(lambda: main(argv) if main is lm_eval_cli.main else main(), *argv)
    assert ran.status == 0
    assert "--no-compile-cache" in ran.out or main is lm_eval_cli.main  # lm-eval's own help, without ours
    assert not jax.config.jax_enable_compilation_cache


def test_a_second_gptj_sample_loads_every_program_from_the_cache_and_compiles_none(
    run_command, eval_checkpoint, no_suite_cache, tmp_path, events
):
    checkpoint, _ = eval_checkpoint
    argv = [checkpoint, "--prompt", "hello", "--max-new-tokens", "4", "--temperature", "0"]
    env = {"GPTJ_FLAX_CACHE": str(tmp_path / "cache")}
    jax.clear_caches()  # what this process compiled before is compiled (or loaded) again
    first = run_command(sample.main, *argv, env=env)
    assert first.status == 0, first.err
    written = os.listdir(tmp_path / "cache" / "jax")
    cold = dict(events)
    assert cold[MISSES] == cold[REQUESTS] == cold[COMPILES] > 0 and HITS not in cold
    assert len(written) == cold[MISSES]  # every program, however small

    jax.clear_caches()
    events.clear()
    second = run_command(sample.main, *argv, env=env)
    assert second.status == 0 and second.out == first.out
    assert events[HITS] == events[REQUESTS] == cold[REQUESTS] and events[MISSES] == 0

    jax.clear_caches()
    events.clear()
    uncached = run_command(sample.main, *argv, "--no-compile-cache", env=env)
    assert uncached.status == 0 and uncached.out == first.out
    assert events[REQUESTS] == events[HITS] == 0 and events[COMPILES] == cold[COMPILES]
    assert sorted(os.listdir(tmp_path / "cache" / "jax")) == sorted(written)


def test_an_unwritable_cache_is_a_warning_and_the_command_runs_without_it(
    run_command, eval_checkpoint, no_suite_cache, tmp_path, events
):
    checkpoint, _ = eval_checkpoint
    (tmp_path / "a-file").write_text("not a directory")
    ran = run_command(
        sample.main,
        *(checkpoint, "--prompt", "hello", "--max-new-tokens", "2"),
        env={"GPTJ_FLAX_CACHE": str(tmp_path / "a-file")},
    )
    assert ran.status == 0, ran.err
    (warning,) = [line for line in ran.err.splitlines() if line.startswith("warning:")]
    assert str(tmp_path / "a-file" / "jax") in warning and "GPTJ_FLAX_CACHE" in warning
    assert not ran.error_lines() and events[REQUESTS] == 0 and events[COMPILES] > 0
