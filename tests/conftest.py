"""Test setup: 8 virtual CPU devices, float32 matmuls, shared fixtures."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import gc  # noqa: E402
import logging  # noqa: E402
import pathlib  # noqa: E402

import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent

# Past this share of the kernel's limit a module's own compiles could reach it.
MAP_SHARE_LEFT_AFTER_A_MODULE = 0.5


@pytest.fixture(scope="session")
def repo_root() -> pathlib.Path:
    return REPO


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
