"""Will this config's train step fit a TPU slice? Compile it for the slice on this (CPU) machine.

pip install -e '.[tpu]'
python scripts/aot_check.py --config configs/gptj_6b.json --topology v3:2x2 [--mesh 1,1,8]
                            [--set model.remat_policy=full --set train.per_replica_batch=2 …]

--serve asks the same of serving instead (gptj-serve's own decode-slot programs for --batch slots of
--cache-len tokens: a decode step, a batch of short prompts admitted, a long prompt's chunk and its
insert), parameters in the compute dtype, --quantize int8 for int8 block projections, --kv-cache
int8 for an int8 KV cache:

python scripts/aot_check.py --serve --config configs/gptj_6b.json --topology v5e:1x1 --topology v4:1x1x1 \
                            --quantize int8 --batch 8 --cache-len 2048

Without libtpu a one-chip topology (v4:1x1x1, v5e:1x1, v5p:1x1x1, v6e:1x1) is still answered: the
parameter and cache bytes are exact, the activations XLA:CPU's estimate.
"""

import argparse
import os
import sys

from gptj_flax.cli import LONE_HOST_TPU_ENV, libtpu_without_tpu
from gptj_flax.cli.args import cli_path, join_negative_values
from gptj_flax.config import KV_CACHE_DTYPES, LORA_PROJECTIONS, QUANTIZATIONS, load_config
from gptj_flax.errors import add_debug_flag, run_cli
from gptj_flax.sampling.serving_fit import ServingFit, serving_fit
from gptj_flax.training.aot import AotReport, compile_for_topology


def _main() -> int:
    if libtpu_without_tpu():  # read when libtpu's compiler loads, before the first compile
        for name, value in LONE_HOST_TPU_ENV.items():
            os.environ.setdefault(name, value)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, type=cli_path)
    parser.add_argument(
        "--topology", required=True, action="append", help="a TPU slice such as v3:2x2, v4:2x2x1, v5e:2x4 (repeatable)"
    )
    parser.add_argument("--mesh", help="data,fsdp,model sizes (default: the config's)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    serving = parser.add_argument_group("serving fit (--serve)")
    serving.add_argument("--serve", action="store_true", help="check gptj-serve's programs instead of the train step")
    serving.add_argument("--batch", type=int, default=8, help="decode slots (gptj-serve --max-batch; default 8)")
    serving.add_argument("--cache-len", type=int, help="tokens per slot (gptj-serve --max-len; default model.max_len)")
    serving.add_argument("--prefill-chunk", type=int, default=128, help="prefill chunk (default 128)")
    serving.add_argument("--quantize", choices=QUANTIZATIONS, help="block projections in int8 (model.quantize)")
    serving.add_argument("--kv-cache", choices=KV_CACHE_DTYPES, help="cached keys and values in int8 (model.kv_cache)")
    serving.add_argument(
        "--adapter-rank",
        type=int,
        help="also say how many LoRA adapters of this rank fit beside the base (gptj-serve --adapter NAME=DIR)",
    )
    serving.add_argument(
        "--adapter-targets",
        default="q_proj,v_proj",
        help="the projections those adapters adapt, comma-separated (default q_proj,v_proj)",
    )
    add_debug_flag(parser)
    args = parser.parse_args(join_negative_values(sys.argv[1:]))
    if not args.serve:
        serve_only = (
            ("--quantize", args.quantize),
            ("--kv-cache", args.kv_cache),
            ("--cache-len", args.cache_len),
            ("--adapter-rank", args.adapter_rank),
        )
        given = [f for f, v in serve_only if v is not None]
        if given:
            parser.error(f"{', '.join(given)} only apply with --serve (QLoRA trains with --set model.quantize=int8)")
    if args.batch < 1 or (args.cache_len is not None and args.cache_len < 2):
        parser.error("--batch must be >= 1 and --cache-len >= 2")
    targets = tuple(t.strip() for t in args.adapter_targets.split(",") if t.strip())
    if args.adapter_rank is not None and (
        args.adapter_rank < 1 or not set(targets) <= set(LORA_PROJECTIONS) or not targets
    ):
        parser.error(f"--adapter-rank must be >= 1 and --adapter-targets some of {', '.join(LORA_PROJECTIONS)}")

    overrides = [*args.set, *([f"model.quantize={args.quantize}"] if args.quantize else [])]
    overrides += [f"model.kv_cache={args.kv_cache}"] if args.kv_cache else []
    config = load_config(args.config, overrides)
    fits = True
    for topology in args.topology:
        report: AotReport | ServingFit
        if args.serve:
            cache_len = args.cache_len or config.model.max_len
            report = serving_fit(
                config,
                topology,
                batch=args.batch,
                cache_len=cache_len,
                chunk=args.prefill_chunk,
                mesh_spec=args.mesh,
                adapter_rank=args.adapter_rank,
                adapter_targets=targets,
            )
        else:
            report = compile_for_topology(config, topology, args.mesh)
        print(report.format(), "\n")
        fits = fits and report.fits
    return 0 if fits else 1


def main() -> int:
    """The ``gptj-aot-check`` command; ``scripts/aot_check.py`` runs it too."""
    return run_cli(_main)
