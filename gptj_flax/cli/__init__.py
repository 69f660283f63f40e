"""The command-line programs (``gptj-train``, ``gptj-sample``, …): the top layer, importing from all others.

Each module's ``main()`` parses ``sys.argv`` and returns the exit status; ``scripts/*.py`` call the same.
Importing this package before JAX starts a backend keeps JAX off a TPU runtime that has no TPU to find (see below).
"""

import glob
import importlib.util
import io
import os
import sys

import jax

from gptj_flax.errors import GptjFlaxError

# The PCI vendor of Google's TPU chips, which JAX itself checks before it starts the TPU runtime.
_GOOGLE_PCI_VENDOR = "0x1ae0"


def tpu_attached() -> bool:
    """Whether this machine has TPU chips: libtpu's device files, or a Google PCI device."""
    if glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"):
        return True
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as f:
                if f.read().strip() == _GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return False


# What libtpu reads to learn its slice, which on a machine without TPUs it would otherwise look up
# in the cloud metadata server and report failing to find: one host alone. Only for loading
# libtpu's compiler (gptj-aot-check compiles for its --topology, whatever these say): set for every
# command, they would make a CPU machine look like a TPU pod host to multi-host start-up.
LONE_HOST_TPU_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost", "TPU_HOST_BOUNDS": "1,1,1"}


def libtpu_without_tpu() -> bool:
    return importlib.util.find_spec("libtpu") is not None and not tpu_attached()


def default_jax_platforms() -> str | None:
    """The ``JAX_PLATFORMS`` these commands use when the user set none, or None to leave JAX's choice.

    With libtpu installed (the ``tpu`` extra) JAX tries its TPU backend first, and on a machine without
    TPUs libtpu prints discovery errors (``TPU_WORKER_HOSTNAMES``, host bounds) before JAX falls back.
    Naming the other platforms skips that attempt.
    """
    if "JAX_PLATFORMS" in os.environ or not libtpu_without_tpu():
        return None
    cuda_plugin = any(importlib.util.find_spec(name) for name in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    nvidia_gpu = any(os.path.exists(path) for path in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg"))
    return "cuda,cpu" if cuda_plugin and nvidia_gpu else "cpu"


_platforms = default_jax_platforms()
if _platforms is not None:
    # JAX read its environment when the package root imported it, so the setting goes to its config
    # (before any backend starts) and to the environment, for the processes a command starts.
    jax.config.update("jax_platforms", _platforms)
    os.environ["JAX_PLATFORMS"] = _platforms


def keep_stdout_for_results() -> None:
    """From now on, what native code writes on file descriptor 1 goes to stderr; Python's prints keep stdout.

    Gloo, JAX's collectives between CPU processes, prints a line on C++ ``std::cout`` for every group
    it connects, which would land among the completions a multi-process ``gptj-sample`` pipes to a file.
    Commands call it when running as several processes. A stdout that is a terminal is left alone: there
    the noise is only cosmetic, and the prompt's line editing needs the original descriptor.
    """
    out = sys.stdout
    if out is not sys.__stdout__ or not isinstance(out, io.TextIOWrapper) or out.isatty():
        return
    out.flush()
    results = os.dup(out.fileno())
    os.dup2(sys.stderr.fileno(), out.fileno())
    sys.stdout = os.fdopen(
        results, "w", buffering=1 if out.line_buffering else -1, encoding=out.encoding, errors=out.errors
    )


def no_tokenizer(checkpoint: str) -> GptjFlaxError:
    """What a command that reads or writes text says of a checkpoint saved without its tokenizer (the
    library's advice, token-id prompts or ``tokenizer=``, has no command-line spelling)."""
    return GptjFlaxError(
        f"{checkpoint} has no tokenizer saved with it (a tokenizer/ directory): pass --tokenizer DIR, "
        "the tokenizer the model was trained with"
    )
