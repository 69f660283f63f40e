"""One process of a (possibly multi-process) training run, for tests.

python train_worker.py CONFIG_JSON OUT_JSON NUM_PROCESSES PROCESS_ID PORT LOCAL_DEVICES MESH STOP_AFTER
"""

import json
import sys

import jax

config_path, out_path, n_proc, pid, port, local_devices, mesh_spec, stop_after = sys.argv[1:9]
jax.config.update("jax_num_cpu_devices", int(local_devices))
jax.config.update("jax_platforms", "cpu")
if int(n_proc) > 1:
    jax.distributed.initialize(f"127.0.0.1:{port}", int(n_proc), int(pid))

from gptj_flax import partitioning  # noqa: E402
from gptj_flax.config import load_config  # noqa: E402
from gptj_flax.training import train  # noqa: E402

config = load_config(config_path)
result = train(config, mesh=partitioning.make_mesh(mesh_spec), stop_after=int(stop_after), progress=False)
if jax.process_index() == 0:
    with open(out_path, "w") as f:
        json.dump({"losses": {str(k): v for k, v in result.losses.items()}, "step": result.step}, f)
