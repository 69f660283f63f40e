"""The CPU demo: train a small GPT-J on the Python standard library's source, then sample from it.

    python scripts/demo.py [--config configs/demo_cpu.json] [--mesh 2,2,2] [--set train.total_steps=100]

Runs on 8 virtual CPU devices over a mesh that uses the data, fsdp and model axes together. The
corpus and a byte-level BPE tokenizer are made locally (no network) in the directory the config's
train_set names; the run (Orbax checkpoints, metrics, TensorBoard, loss.png) goes to train.run_dir
and resumes there if interrupted.
"""

import argparse
import json
import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

import gptj_flax  # noqa: E402
from gptj_flax import partitioning  # noqa: E402
from gptj_flax.cli.args import cli_path, join_negative_values  # noqa: E402
from gptj_flax.cli.compile_cache import add_compile_cache_flag, run_command  # noqa: E402
from gptj_flax.config import ConfigError, load_config  # noqa: E402
from gptj_flax.data.corpus import prepare_demo_data  # noqa: E402
from gptj_flax.errors import (  # noqa: E402
    EXIT_INTERRUPTED,
    add_debug_flag,
    configure_logging,
)
from gptj_flax.sampling import Completion  # noqa: E402
from gptj_flax.training import train  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


# The checkout's demo config, whatever directory the command starts in; the run and its data go
# under the current directory (the config's relative paths).
DEMO_CONFIG = Path(gptj_flax.__file__).resolve().parent.parent / "configs" / "demo_cpu.json"


def _main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--config", default=str(DEMO_CONFIG), type=cli_path, help="default: the checkout's configs/demo_cpu.json"
    )
    parser.add_argument("--mesh", help="data,fsdp,model sizes (default: the config's 2,2,2)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config value"
    )
    parser.add_argument("--prompt", default="def ", help="what the sample starts from")
    add_debug_flag(parser)
    add_compile_cache_flag(parser)
    args = parser.parse_args(join_negative_values(sys.argv[1:]))
    configure_logging(logging.WARNING, "%(levelname)s %(name)s: %(message)s")

    config = load_config(args.config, args.set)
    mesh = partitioning.make_mesh(args.mesh or config.mesh)
    print(
        f"{jax.device_count()} {jax.devices()[0].platform} devices, mesh {dict(mesh.shape)}; "
        f"model of {config.model.param_count():,} parameters"
    )
    if not config.train.train_set:
        raise ConfigError(f"{args.config}: the demo needs train.train_set, the directory its corpus is written to")
    prepare_demo_data(os.path.dirname(config.train.train_set), config.model.vocab_size)
    result = train(config, mesh=mesh)
    if result.preempted:
        print(f"stopped at step {result.step}, saved in {result.run_dir}; run the same command again to continue")
        return EXIT_INTERRUPTED if result.interrupted else 0

    rows = [json.loads(line) for line in open(os.path.join(result.run_dir, "metrics.jsonl"))]
    val = [(r["step"], r["val/ppl_stdlib"]) for r in rows if "val/ppl_stdlib" in r]
    (first_step, first), (last_step, last) = val[0], val[-1]
    print(f"\nvalidation perplexity: {first:.1f} at step {first_step} -> {last:.1f} at step {last_step}")
    print(f"checkpoint: {result.run_dir} (loss curves: {os.path.join(result.run_dir, 'loss.png')})")

    lm = gptj_flax.load(result.run_dir, mesh=mesh)
    completion = lm.generate(args.prompt, max_new_tokens=80, temperature=0.7, top_k=40, seed=0)
    assert isinstance(completion, Completion)  # one prompt, one completion
    print(
        f"\nsample ({completion.finish_reason}, {completion.completion_tokens} tokens):\n{args.prompt}{completion.text}"
    )
    return 0 if last < first else 1


def main() -> int:
    """The ``gptj-demo`` command; ``scripts/demo.py`` runs it too."""
    return run_command(_main)
