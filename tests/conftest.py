"""Test setup: 8 virtual CPU devices, float32 matmuls, shared fixtures."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import gc  # noqa: E402
import pathlib  # noqa: E402

import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo_root() -> pathlib.Path:
    return REPO


@pytest.fixture(scope="module", autouse=True)
def free_the_modules_models():
    """Collect what a test module dropped once it ends, on this thread while nothing compiles.

    A decoder's jitted methods hold the decoder, so its compiled programs are freed only by the
    cycle collector, which may run on any thread; XLA has crashed in a compile on one thread while
    another freed a compiled program.
    """
    yield
    gc.collect()
