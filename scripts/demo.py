"""CPU smoke run: build the demo GPT-J on an 8-device mesh, show where every tensor lives, run it.

    python scripts/demo.py [--config configs/demo_cpu.json] [--mesh 2,2,2]
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from gptj_flax import partitioning  # noqa: E402
from gptj_flax.config import load_config  # noqa: E402
from gptj_flax.model import GPTJ, cross_entropy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo_cpu.json")
    parser.add_argument("--mesh", default=None, help="data,fsdp,model sizes or a layout name (default: the config's)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config value")
    args = parser.parse_args()

    config = load_config(args.config, args.set)
    mesh = partitioning.make_mesh(args.mesh or config.mesh)
    config.model.validate_for_mesh(partitioning.mesh_shape(mesh))
    model = GPTJ(config.model)
    batch = config.train.global_batch_size(mesh.shape["data"] * mesh.shape["fsdp"])
    tokens = jax.random.randint(jax.random.key(1), (batch, config.model.max_len + 1), 0, config.model.vocab_size)

    print(f"{jax.device_count()} {jax.devices()[0].platform} devices, mesh {dict(mesh.shape)}\n")
    abstract = partitioning.abstract_init(model.init, jax.random.key(0), tokens[:, :-1])
    print(partitioning.sharding_table(abstract, mesh), "\n")

    variables, shardings = partitioning.sharded_init(model.init, mesh, jax.random.key(0), tokens[:, :-1])
    batch_sharding = partitioning.named_sharding(mesh, ("batch", "length"))

    @jax.jit
    def forward(v, t):
        logits = model.apply(v, t[:, :-1])
        return logits, cross_entropy(logits, t[:, 1:])[0]

    with partitioning.activate(mesh):
        logits, loss = forward(variables, jax.device_put(tokens, batch_sharding))
    print(f"forward: tokens {tuple(tokens[:, :-1].shape)} -> logits {logits.shape} {logits.dtype}, "
          f"sharded {logits.sharding.spec}")
    print(f"loss on random tokens {float(loss):.4f} (uniform guess: ln(vocab) = {np.log(config.model.vocab_size):.4f})")
    if not np.isfinite(float(loss)):
        raise SystemExit("the forward pass produced a non-finite loss")


if __name__ == "__main__":
    main()
