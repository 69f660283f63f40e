"""Write a random GPT-J as a HuggingFace directory, tensor by tensor (memory: one tensor).

For benchmarking and measuring the converters on models too large to build in memory:

    python scripts/make_random_hf.py OUT --config configs/gptj_6b.json [--set model.n_layers=16 …]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/ sits beside scripts/, never installed

from benchmarks.common import write_random_hf  # noqa: E402
from gptj_flax.cli.args import cli_dtype  # noqa: E402
from gptj_flax.config import load_config  # noqa: E402
from gptj_flax.convert.hf import DEFAULT_MAX_SHARD_SIZE  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="new HuggingFace model directory")
    parser.add_argument("--config", required=True, help="model shape: a modern or legacy JSON config")
    parser.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config value"
    )
    parser.add_argument(
        "--dtype", type=cli_dtype, default="float32", help="float32/fp32, bfloat16/bf16 or float16/fp16"
    )
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model = load_config(args.config, args.set).model
    out = write_random_hf(args.out, model, seed=args.seed, dtype=args.dtype, max_shard_size=args.max_shard_size)
    print(f"wrote {out}: {model.param_count():,} parameters")


if __name__ == "__main__":
    main()
