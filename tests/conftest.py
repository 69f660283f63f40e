"""Test setup: 8 virtual CPU devices, float32 matmuls, a compilation cache per run, shared fixtures."""

import atexit
import os
import shutil
import tempfile

# tests.commands is imported before JAX: its one flag must be in XLA_FLAGS when the backend starts
from tests.commands import QUICK_COMPILE  # noqa: E402

os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {QUICK_COMPILE}")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# One persistent compilation cache per run, for this process, pytest-xdist's workers and every process
# a test starts (they inherit the environment): tests, modules and processes build the same tiny
# programs again and again, and each compiles once. Every program is kept however quick its compile.
# The process that made the directory removes it when it exits; a worker finds it already set.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="gptj-flax-tests-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import gc  # noqa: E402
import logging  # noqa: E402
import pathlib  # noqa: E402

import pytest  # noqa: E402

from tests import commands, suite_report  # noqa: E402
from tests.evaluation_helpers import make_checkpoint  # noqa: E402
from tests.training_helpers import make_corpus  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent

# Past this share of the kernel's limit a module's own compiles could reach it.
MAP_SHARE_LEFT_AFTER_A_MODULE = 0.5


def pytest_configure(config: pytest.Config) -> None:
    suite_report.register(config)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Leave what collection imported out of every later garbage collection.

    Collection imports the whole suite (JAX, PyTorch, TensorFlow, transformers): about a million
    objects that live until the process ends, which each full collection walks again, half a second
    each time at the end of every module (:func:`free_the_modules_programs`) and whenever Python's
    own collector runs a full pass. Frozen, they are skipped; what the tests create is still collected.
    """
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def repo_root() -> pathlib.Path:
    return REPO


@pytest.fixture(scope="session")
def eval_checkpoint(tmp_path_factory):
    """``(directory, hf_model)``: a checkpoint of tests/evaluation_helpers.py's CFG (step 0) holding
    ``hf_model``'s weights, a random HuggingFace GPT-J, with a local BPE tokenizer. Shared by every
    module: read it, never write into it (copy it first)."""
    directory = str(tmp_path_factory.mktemp("eval_checkpoint"))
    return directory, make_checkpoint(directory)


@pytest.fixture(scope="session")
def stdlib_corpus(tmp_path_factory):
    """``stdlib_corpus(max_bytes=400_000)``: tests/training_helpers.py's corpus of standard-library
    text and its tokenizer, made once per size in a session. Read-only, as ``eval_checkpoint``."""
    made: dict[int, dict[str, str]] = {}

    def corpus(max_bytes: int = 400_000) -> dict[str, str]:
        if max_bytes not in made:
            made[max_bytes] = make_corpus(tmp_path_factory.mktemp("corpus"), max_bytes=max_bytes)
        return made[max_bytes]

    return corpus


@pytest.fixture
def run_command(capfd):
    """``run_command(main, *argv, cwd=None, env=None, stdin="")``: a command line run in this process, giving its
    status, stdout and stderr (tests/commands.py). ``main`` is a command's ``main`` or
    ``commands.script("train.py")``, which runs the script as ``python scripts/train.py`` does."""

    def run(main, *argv, cwd=None, env=None, stdin="") -> commands.Ran:
        return commands.run_main(main, list(argv), capfd, cwd=cwd, env=env, stdin=stdin)

    return run


def memory_maps() -> tuple[int, int] | None:
    """(maps this process holds, vm.max_map_count), or None where Linux's /proc can't tell."""
    try:
        with open("/proc/self/maps", "rb") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except (OSError, ValueError):
        return None


@pytest.fixture(scope="module", autouse=True)
def free_the_modules_programs():
    """Drop every compiled program once a test module ends.

    Each program XLA compiles for the CPU keeps a few memory maps of its own until it is freed, and
    jit's caches keep every program alive. The whole suite compiles tens of thousands of them in one
    process; it crossed the kernel's per-process limit (vm.max_map_count, 65530 by default), where
    the next compile's mmap fails and XLA dies of SIGSEGV or abort in whatever test is running.
    """
    yield
    jax.clear_caches()
    gc.collect()
    counted = memory_maps()
    if counted is not None and counted[0] > MAP_SHARE_LEFT_AFTER_A_MODULE * counted[1]:
        pytest.fail(
            f"this process holds {counted[0]} memory maps after the module's programs were freed, "
            f"over {MAP_SHARE_LEFT_AFTER_A_MODULE:.0%} of vm.max_map_count={counted[1]}: something "
            "keeps compiled programs alive, and the next modules would crash XLA at the limit"
        )


@pytest.fixture(autouse=True)
def restore_root_logging():
    """Put the root logger's handlers and level back after each test.

    A command's ``main(argv)`` run in the test process sets up logging with a handler on the
    sys.stderr of that moment, pytest's capture of that one test; once the capture is closed,
    each later record written through it prints a "Logging error" traceback elsewhere.
    """
    handlers, level = logging.root.handlers[:], logging.root.level
    yield
    logging.root.handlers[:] = handlers
    logging.root.setLevel(level)
