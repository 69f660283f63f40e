"""One process of the multi-process sampling test: 4 CPU devices each, one mesh over all processes.

python infer_worker.py CHECKPOINT OUT_DIR NUM_PROCESSES PROCESS_ID PORT MESH [MESH ...]

On each mesh, every process makes ``tests.multihost_helpers.run_calls``'s calls, then process 1
asks for another prompt than process 0 (both must fail with a clear error); each process writes
what it got to OUT_DIR/process_ID.json. Last, process 1 exits in the middle of a stream, and
process 0 must end with an error rather than wait for it.
"""

import json
import os
import sys

import jax

checkpoint_dir, out_dir, n_proc, pid, port, *meshes = sys.argv[1:]
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_platforms", "cpu")
# A process that stops answering is declared dead after this long (JAX's default is 100 s).
jax.distributed.initialize(f"127.0.0.1:{port}", int(n_proc), int(pid), heartbeat_timeout_seconds=30)

import gptj_flax  # noqa: E402
from gptj_flax.sampling import SamplingError  # noqa: E402
from tests.multihost_helpers import run_calls  # noqa: E402

results = {}
for mesh in meshes:
    lm = gptj_flax.load(checkpoint_dir, mesh=mesh)
    results[mesh] = run_calls(lm)
    try:
        lm.generate("The cat" if jax.process_index() == 0 else "The dog", max_new_tokens=4, temperature=0)
        results[mesh]["divergent"] = "no error"
    except SamplingError as e:
        results[mesh]["divergent"] = str(e)
with open(os.path.join(out_dir, f"process_{pid}.json"), "w") as f:
    json.dump(results, f)

stream = lm.stream("One two three", max_new_tokens=40, temperature=0, ignore_eos=True)
next(stream)
if jax.process_index() == 1:
    print("process 1 exits mid-stream", flush=True)
    os._exit(3)
for _ in stream:
    pass
sys.exit("process 0 finished a stream whose other half had died")
