"""The command-line programs (``gptj-train``, ``gptj-sample``, …): the top layer, importing from all others.

Each module's ``main()`` parses ``sys.argv`` and returns the exit status; ``scripts/*.py`` call the same.
Importing this package first keeps JAX off a TPU runtime that has no TPU to find (see below).
"""

import glob
import importlib.util
import os

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
# in the cloud metadata server and report failing to find: here, one host alone (gptj-aot-check
# compiles for the slice its --topology names, whatever these say).
LONE_HOST_TPU_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost", "TPU_HOST_BOUNDS": "1,1,1"}


def quiet_libtpu_environment() -> dict[str, str]:
    """The variables these commands set (where the user set none) on a machine with libtpu but no TPU.

    With libtpu installed (the ``tpu`` extra) JAX tries its TPU backend first, and libtpu prints
    discovery errors (``TPU_WORKER_HOSTNAMES``, host bounds) before JAX falls back; loading libtpu's
    compiler for ``gptj-aot-check`` prints them too. ``JAX_PLATFORMS`` naming the other platforms
    skips the attempt, and the lone-host variables answer libtpu's questions.
    """
    if importlib.util.find_spec("libtpu") is None or tpu_attached():
        return {}
    cuda_plugin = any(importlib.util.find_spec(name) for name in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    nvidia_gpu = any(os.path.exists(path) for path in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg"))
    wanted = {"JAX_PLATFORMS": "cuda,cpu" if cuda_plugin and nvidia_gpu else "cpu", **LONE_HOST_TPU_ENV}
    return {name: value for name, value in wanted.items() if name not in os.environ}


# Read by JAX and libtpu when they start; every command module imports JAX after this package.
os.environ.update(quiet_libtpu_environment())
