"""One process of a multi-process training run with lm-eval tasks at its validation steps, for tests.

python train_harness_worker.py CONFIG_JSON TASKS_DIR OUT_DIR NUM_PROCESSES PROCESS_ID PORT MESH

Each process writes the harness metrics its training loop returned to OUT_DIR/process_ID.json.
"""

import json
import os
import sys

import jax

config_path, tasks_dir, out_dir, n_proc, pid, port, mesh_spec = sys.argv[1:8]
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_platforms", "cpu")
jax.distributed.initialize(f"127.0.0.1:{port}", int(n_proc), int(pid))

from gptj_flax import partitioning  # noqa: E402
from gptj_flax.config import load_config  # noqa: E402
from gptj_flax.evaluation.during_training import HarnessDuringTraining  # noqa: E402
from gptj_flax.training import train  # noqa: E402

config = load_config(config_path)
harness = HarnessDuringTraining(
    config.train.eval_harness_tasks,
    include_path=tasks_dir,
    builtin_tasks=False,
    batch_size=3,
    bootstrap_iters=0,
    results_dir=os.path.join(config.train.run_dir, "harness"),
)
result = train(config, mesh=partitioning.make_mesh(mesh_spec), harness=harness, progress=False)
with open(os.path.join(out_dir, f"process_{pid}.json"), "w") as f:
    json.dump({str(step): metrics for step, metrics in result.harness.items()}, f)
