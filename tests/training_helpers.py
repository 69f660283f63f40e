"""A small training run for tests: a stdlib text corpus, its tokenizer, a tiny config, subprocess trainers."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

from gptj_flax import data
from gptj_flax.config import Config, from_dict, save_config
from gptj_flax.data.corpus import write_stdlib_corpus

REPO = pathlib.Path(__file__).resolve().parent.parent
MODEL = dict(n_layers=2, d_model=32, n_heads=8, rotary_dim=4, vocab_size=320, max_len=32, dtype="float32")


def make_corpus(root: pathlib.Path, max_bytes: int = 400_000) -> dict[str, str]:
    train_txt, val_txt = write_stdlib_corpus(str(root), max_bytes=max_bytes)
    tokenizer = data.train_bpe_tokenizer([train_txt], vocab_size=320)
    data.save_tokenizer(tokenizer, str(root / "tokenizer"))
    return {"train": train_txt, "val": val_txt, "tokenizer": str(root / "tokenizer")}


def make_config(corpus: dict[str, str], run_dir, **train_overrides) -> Config:
    train_section = dict(
        batch_size=8,
        total_steps=20,
        warmup_steps=3,
        anneal_steps=17,
        lr=3e-3,
        end_lr=3e-4,
        run_dir=str(run_dir),
        train_set=corpus["train"],
        val_set={"stdlib": corpus["val"]},
        tokenizer=corpus["tokenizer"],
        val_every=10,
        val_batches=2,
        ckpt_every=10,
        grad_accum_steps=2,
    )
    train_section.update(train_overrides)
    return from_dict({"model": MODEL, "mesh": dict(data=2, fsdp=2, model=2), "train": train_section})


def write_config(config: Config, path) -> str:
    save_config(config, path)
    return str(path)


def start_trainer(config_path: str, log_path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """scripts/train.py on ``config_path`` in the background, stdout and stderr into ``log_path``
    (``env``: variables to set besides the tests' own)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [sys.executable, "scripts/train.py", "--config", config_path, "--no-progress", *extra],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )


def train_losses(run_dir) -> list[tuple[int, float]]:
    """(step, loss) of every train row of ``run_dir/metrics.jsonl``, in file order."""
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r]


def wait_for(condition, proc: subprocess.Popen, log_path, timeout: float = 400, what: str = "") -> None:
    """Poll ``condition()`` until true; fail with the trainer's log if it exits or time runs out."""
    deadline = time.time() + timeout
    while not condition():
        if proc.poll() is not None or time.time() > deadline:
            raise AssertionError(
                f"trainer {'exited' if proc.poll() is not None else 'timed out'} before {what}:\n"
                + pathlib.Path(log_path).read_text()[-4000:]
            )
        time.sleep(0.1)
