"""JAX's persistent compilation cache, on for every command that runs JAX programs.

A second run of a command (a restarted server, another ``gptj-sample`` of the same checkpoint) loads
the programs the first one compiled instead of compiling them again. The cache is the directory
``jax`` under :func:`gptj_flax.config.cache_root` (``$GPTJ_FLAX_CACHE``); a ``JAX_COMPILATION_CACHE_DIR``
set in the environment wins, and ``--no-compile-cache`` turns the cache off. JAX's key for a program
holds the backend and its version, the devices and the compile options, so machines, platforms and
device counts that share one directory never load each other's programs.

JAX runs what it reads from the directory: like any cache of code, it must be writable by its owner
only (the default is under the user's home).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable, Sequence

import jax
from jax.experimental.compilation_cache import compilation_cache

from gptj_flax.config import CACHE_ENV, cache_root
from gptj_flax.errors import run_cli

NO_COMPILE_CACHE_FLAG = "--no-compile-cache"
JAX_CACHE_DIR_ENV = "JAX_COMPILATION_CACHE_DIR"

# Every program is kept, however quick its compile or small its executable: JAX's default keeps only
# those that took a second to compile, which leaves out most of a sampler's or a server's programs,
# whose compiles add up to most of their start-up. An environment variable JAX reads still wins.
EVERY_PROGRAM = {
    "jax_persistent_cache_min_compile_time_secs": ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", 0.0),
    "jax_persistent_cache_min_entry_size_bytes": ("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", -1),
}


def compile_cache_dir() -> str:
    """The directory the commands cache compiled programs in (when the cache is on)."""
    return os.environ.get(JAX_CACHE_DIR_ENV) or os.path.join(cache_root(), "jax")


def add_compile_cache_flag(parser: argparse.ArgumentParser) -> None:
    """Document ``--no-compile-cache`` in a command's help (:func:`run_command` acts on it)."""
    parser.add_argument(
        NO_COMPILE_CACHE_FLAG,
        action="store_true",
        help=f"compile every program anew, neither reading nor writing the compilation cache "
        f"(default: {JAX_CACHE_DIR_ENV}, else ${CACHE_ENV}/jax, else ~/.cache/gptj_flax/jax)",
    )


def unwritable(directory: str) -> str | None:
    """Why ``directory`` cannot hold the cache (it is made if missing), or None if it can."""
    if "://" in directory:  # a bucket (gs://…): JAX writes there through etils, and says so if it cannot
        return None
    try:
        os.makedirs(directory, exist_ok=True)
        probe, path = tempfile.mkstemp(dir=directory, prefix=".write-test-")
        os.close(probe)
        os.remove(path)
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def _settings(directory: str | None) -> dict[str, object]:
    if directory is None:
        return {"jax_enable_compilation_cache": False}
    settings: dict[str, object] = {"jax_enable_compilation_cache": True, "jax_compilation_cache_dir": directory}
    for name, (variable, value) in EVERY_PROGRAM.items():
        if variable not in os.environ:
            settings[name] = value
    return settings


def use_compile_cache(argv: Sequence[str]) -> str | None:
    """Turn the cache on (or off, under ``--no-compile-cache``) for this process's compiles; returns
    its directory, or None when off. A directory that cannot be written is a warning, and the command
    runs without the cache."""
    directory = None if NO_COMPILE_CACHE_FLAG in argv else compile_cache_dir()
    problem = None if directory is None else unwritable(directory)
    if problem is not None:
        print(
            f"warning: the compilation cache {directory} cannot be written ({problem}): compiling every "
            f"program anew; set {CACHE_ENV} to a writable directory, or pass {NO_COMPILE_CACHE_FLAG}",
            file=sys.stderr,
        )
        directory = None
    settings = _settings(directory)
    changed = [name for name, value in settings.items() if getattr(jax.config, name) != value]
    for name in changed:
        jax.config.update(name, settings[name])
    if changed:  # JAX opens its cache once, at the first compile: a change must start it anew
        compilation_cache.reset_cache()
    return directory


def run_command(main: Callable[[], int | None], argv: Sequence[str] | None = None) -> int:
    """:func:`gptj_flax.errors.run_cli` of a command that runs JAX programs, with the compilation
    cache set up first (``argv``: the command's arguments, default this process's)."""
    use_compile_cache(sys.argv[1:] if argv is None else argv)
    return run_cli(main, argv)
