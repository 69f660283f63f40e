"""Convert GPT-J weights between HuggingFace, legacy mesh-transformer-jax and gptj_flax (Orbax) checkpoints.

    python scripts/convert.py from-hf HF_DIR OUT [--no-tokenizer] [--dtype float32|bfloat16|float16]
    python scripts/convert.py to-hf CKPT OUT [--dtype float32|float16|bfloat16] [--max-shard-size 5GB]
    python scripts/convert.py from-legacy STEP_DIR OUT --config legacy.json [--with-opt-state] [--dtype …]
    python scripts/convert.py slim CKPT OUT [--dtype bfloat16|float16]
    python scripts/convert.py quantize CKPT OUT
    python scripts/convert.py merge-lora LORA_CKPT OUT
    python scripts/convert.py to-hf --merge-lora LORA_CKPT OUT [--dtype …]
    python scripts/convert.py to-peft LORA_CKPT OUT

A LoRA checkpoint (a LoRA run directory or one of its steps) holds adapters and names its base;
merge-lora writes the base with the adapters merged in as an ordinary checkpoint (float32), after
checking the base's checksum; to-peft writes HuggingFace PEFT's adapter_config.json and
adapter_model.safetensors, which peft.PeftModel.from_pretrained loads onto the base's to-hf export.

Imported weights compute in the precision they are stored in (a float32 HuggingFace model or a full
legacy checkpoint in float32, a bf16 one in bfloat16), so the result scores as the source does;
--dtype chooses another compute dtype. Every --dtype takes fp32/bf16/fp16 as well. quantize stores
q/k/v/out_proj, fc_in and fc_out as int8 with a float32 scale per output channel (inference only;
its config records it, so loading OUT needs no flag).

Every conversion streams tensor by tensor (memory: about the largest tensor, never the model) and
writes OUT atomically: an interrupted or failed run leaves no OUT behind. CKPT is an Orbax run
directory (its latest step) or one step directory; its data is verified against its checksums as
it is read. Paths may be relative to the current directory.
"""

import argparse
import logging

from gptj_flax import convert
from gptj_flax.checkpoint import absolute_path
from gptj_flax.cli.args import cli_dtype
from gptj_flax.cli.compile_cache import add_compile_cache_flag, run_command
from gptj_flax.convert import lora
from gptj_flax.convert.hf import DEFAULT_MAX_SHARD_SIZE
from gptj_flax.convert.orbax_io import OrbaxParams
from gptj_flax.errors import add_debug_flag, configure_logging
from gptj_flax.training import make_optimizer

COMPUTE_DTYPE_HELP = "compute dtype the checkpoint's config records (default: the precision the weights are stored in)"

PATH_ARGUMENTS = ("src", "out", "ckpt", "step_dir", "config")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_imports(commands)
    _add_exports(commands)
    for each in (parser, *commands.choices.values()):  # accepted before or after the command
        add_debug_flag(each)
        add_compile_cache_flag(each)
    return parser


def _add_imports(commands) -> None:
    """The commands that read another tool's weights."""
    p = commands.add_parser("from-hf", help="HuggingFace GPT-J directory -> Orbax checkpoint")
    p.add_argument("src", help="directory with config.json and safetensors or pytorch_model.bin weights")
    p.add_argument("out", help="new Orbax checkpoint directory")
    p.add_argument("--unrolled", action="store_true", help="store layer_0 … layer_N instead of scanned layers")
    p.add_argument(
        "--no-tokenizer",
        action="store_true",
        help="convert the weights alone; without it SRC's tokenizer files are carried and must load",
    )
    p.add_argument("--dtype", type=cli_dtype, help=COMPUTE_DTYPE_HELP)

    p = commands.add_parser("from-legacy", help="mesh-transformer-jax step directory -> Orbax checkpoint")
    p.add_argument("step_dir", help="the step_N directory holding shard_0 … shard_{S-1}")
    p.add_argument("out", help="new Orbax checkpoint directory")
    p.add_argument("--config", required=True, help="the JSON config the checkpoint was trained with (legacy or modern)")
    p.add_argument(
        "--with-opt-state",
        action="store_true",
        help="carry Adam's count and moments (full checkpoints) into the training optimiser's state",
    )
    p.add_argument("--dtype", type=cli_dtype, help=COMPUTE_DTYPE_HELP)


def _add_exports(commands) -> None:
    """The commands that read a gptj_flax checkpoint."""
    p = commands.add_parser("to-hf", help="Orbax checkpoint -> HuggingFace GPT-J directory")
    p.add_argument("ckpt", help="Orbax run directory (latest step) or step directory")
    p.add_argument("out", help="new HuggingFace model directory")
    p.add_argument(
        "--dtype",
        type=cli_dtype,
        default="float32",
        help="stored weight dtype: float32, float16 or bfloat16 (default: %(default)s)",
    )
    p.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        help="split the safetensors above this size, e.g. 5GB, 500MB (default: %(default)s)",
    )
    p.add_argument(
        "--merge-lora",
        action="store_true",
        help="CKPT is a LoRA checkpoint: export its base with the adapters merged in",
    )

    p = commands.add_parser("slim", help="drop the optimiser state and store params in half precision")
    p.add_argument("ckpt", help="Orbax run directory (latest step) or step directory")
    p.add_argument("out", help="new Orbax checkpoint directory")
    p.add_argument(
        "--dtype",
        type=cli_dtype,
        default="bfloat16",
        help="stored parameter dtype: bfloat16 or float16 (default: %(default)s)",
    )

    p = commands.add_parser("quantize", help="store the block projections int8 (weight-only, for inference)")
    p.add_argument("ckpt", help="float Orbax run directory (latest step) or step directory")
    p.add_argument("out", help="new Orbax checkpoint directory; load(OUT) reads it as int8")

    p = commands.add_parser("merge-lora", help="LoRA checkpoint -> ordinary checkpoint with the adapters merged in")
    p.add_argument("ckpt", help="LoRA run directory (latest step) or step directory")
    p.add_argument("out", help="new Orbax checkpoint directory")

    p = commands.add_parser("to-peft", help="LoRA checkpoint -> HuggingFace PEFT adapter directory")
    p.add_argument("ckpt", help="LoRA run directory (latest step) or step directory")
    p.add_argument("out", help="new PEFT adapter directory")


def _main() -> None:
    args = _parser().parse_args()
    for name in PATH_ARGUMENTS:  # resolved once, against the directory the command was started in
        if getattr(args, name, None):
            setattr(args, name, str(absolute_path(getattr(args, name))))
    configure_logging(logging.WARNING, "%(levelname)s: %(message)s")
    if args.command == "from-hf":
        out = convert.from_hf(
            args.src, args.out, scan_layers=not args.unrolled, tokenizer=not args.no_tokenizer, dtype=args.dtype
        )
        print(f"wrote {out}: parameters float32, compute {OrbaxParams.open(out).config.model.dtype}")
    elif args.command == "to-hf":
        export = lora.to_hf_merged if args.merge_lora else convert.to_hf
        out = export(args.ckpt, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size)
        print(f"wrote {out}: weights {args.dtype}{', LoRA adapters merged' if args.merge_lora else ''}")
    elif args.command == "merge-lora":
        out = lora.merge_lora(args.ckpt, args.out)
        print(f"wrote {out}: parameters float32, LoRA adapters merged into the base")
    elif args.command == "to-peft":
        out = lora.to_peft(args.ckpt, args.out)
        print(f"wrote {out}: PEFT LoRA adapter ({lora.PEFT_CONFIG}, {lora.PEFT_WEIGHTS})")
    elif args.command == "from-legacy":
        config, shards = convert.config_for_legacy(args.config)
        opt_init = make_optimizer(config.train).init if args.with_opt_state else None
        out = convert.from_legacy(args.step_dir, args.out, config, shards, dtype=args.dtype, opt_init=opt_init)
        print(f"wrote {out}: parameters float32, compute {OrbaxParams.open(out).config.model.dtype}")
    elif args.command == "quantize":
        out = convert.quantize(args.ckpt, args.out)
        print(f"wrote {out}: block projections int8 with a float32 scale per output channel, the rest as stored")
    elif args.command == "slim":
        out = convert.slim(args.ckpt, args.out, dtype=args.dtype)
        print(f"wrote {out}: parameters {args.dtype}")


def main() -> int:
    """The ``gptj-convert`` command; ``scripts/convert.py`` runs it too."""
    return run_command(_main)
