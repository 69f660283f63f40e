"""Resuming a run whose directory is damaged or does not match: a corrupted step is refused by name
and the previous one resumes (``--resume-step``); ``init_from`` on a resumed run says it is unused;
a partial ``RUN/tokenizer/`` is rebuilt; a changed model shape is one line naming the parameter."""

import dataclasses
import errno
import json
import logging
import os
import shutil

import numpy as np
import pytest

from benchmarks.common import write_random_hf
from gptj_flax import data
from gptj_flax.checkpoint import CheckpointCorrupted, Checkpointer, CheckpointError
from gptj_flax.config import save_config
from gptj_flax.training import train
from tests import commands
from tests.test_checkpoint_integrity import flip_bytes_in_a_chunk
from tests.test_training_loop import corpus, make_config  # noqa: F401 - corpus is a fixture

STEPS = dict(total_steps=4, ckpt_every=2, val_set={})


@pytest.fixture(scope="module")
def base_run(corpus, tmp_path_factory):  # noqa: F811
    """A run directory with steps 2 and 4, its losses, and the tokenizer the run saved."""
    run = tmp_path_factory.mktemp("base") / "run"
    result = train(make_config(corpus, run, **STEPS), progress=False)
    assert Checkpointer(run, read_only=True).all_steps() == [2, 4]
    return run, result.losses


@pytest.fixture
def run(base_run, tmp_path):
    shutil.copytree(base_run[0], tmp_path / "run")
    return tmp_path / "run"


def _losses_by_step(run_dir):
    """The last logged training loss of each step (a resumed step is logged again)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def test_a_corrupted_latest_step_is_refused_and_the_run_resumes_from_the_previous_one(
    corpus, base_run, run, tmp_path, repo_root, run_command
):  # noqa: F811
    flip_bytes_in_a_chunk(run / "4" / "params")
    config = make_config(corpus, run, **{**STEPS, "total_steps": 6})
    with pytest.raises(CheckpointCorrupted) as caught:
        train(config, progress=False)
    message = str(caught.value)
    assert "\n" not in message and (caught.value.step, caught.value.previous_step) == (4, 2)
    assert message.startswith(f"checkpoint step 4 in {run} is corrupted: the stored data of array ")
    assert message.endswith(
        "To resume from step 2, rerun with --resume-step 2 (train(…, resume_step=2)); the steps "
        "after it are then set aside."
    )
    assert Checkpointer(run, read_only=True).all_steps() == [2, 4]  # nothing was changed

    save_config(config, tmp_path / "config.json")
    result = run_command(
        commands.script("train.py"),
        "--config",
        tmp_path / "config.json",
        "--resume-step",
        "2",
        "--no-progress",
        cwd=repo_root,
    )
    assert result.status == 0, result.err[-3000:]
    assert f"step 6: saved in {run}" in result.out
    assert "the later step(s) [4] were moved to" in result.err
    assert (run / "abandoned" / "4" / "params").is_dir()
    assert Checkpointer(run, read_only=True).all_steps() == [4, 6]
    # Steps 3 and 4 ran again from step 2's state and data position: exactly as the first time.
    losses = _losses_by_step(run)
    for step in (3, 4):
        assert abs(losses[step] - base_run[1][step]) <= 1e-6, step
    assert np.isfinite(losses[6])


def test_a_corrupted_optimiser_state_is_refused_on_resume(corpus, run):  # noqa: F811
    # A damaged disk region: every data file of the item (chunks of a model this small may sit
    # inline in OCDBT's b-tree nodes, which are themselves data files).
    for node in [p for p in (run / "4" / "opt_state").rglob("*") if p.is_file() and p.parent.name == "d"]:
        data_bytes = bytearray(node.read_bytes())
        data_bytes[len(data_bytes) // 2] ^= 0xFF
        node.write_bytes(bytes(data_bytes))
    with pytest.raises(CheckpointCorrupted, match=r"step 4 .* of its opt_state is damaged .*--resume-step 2") as caught:
        train(make_config(corpus, run, **{**STEPS, "total_steps": 6}), progress=False)
    assert caught.value.item == "opt_state"


def test_init_from_on_a_run_with_checkpoints_says_it_resumes_instead(corpus, run, tmp_path, caplog):  # noqa: F811
    config = make_config(corpus, run, **{**STEPS, "total_steps": 5})
    write_random_hf(tmp_path / "hf", config.model)
    with caplog.at_level(logging.WARNING, logger="gptj_flax.training.loop"):
        result = train(config, init_from=f"hf:{tmp_path / 'hf'}", progress=False)
    warnings = [r.getMessage() for r in caplog.records if "is not used" in r.getMessage()]
    assert warnings == [
        f"{run} holds checkpoints (latest step 4): the run resumes from them and "
        f"init_from=hf:{tmp_path / 'hf'} is not used (it only starts a run directory without "
        "checkpoints)"
    ]
    assert sorted(result.losses) == [5]  # resumed at step 4, not started over from the HF weights


def test_a_partial_run_tokenizer_is_rebuilt_from_train_tokenizer(corpus, run, caplog):  # noqa: F811
    saved = run / "tokenizer"
    for name in os.listdir(saved):  # what a full disk at the first start left: one truncated file
        if name != "tokenizer_config.json":
            os.remove(saved / name)
    (saved / "tokenizer_config.json").write_text('{"tokenizer_class": ')

    without = make_config(corpus, run, **{**STEPS, "total_steps": 5, "tokenizer": None})
    with pytest.raises(
        data.DataError,
        match=rf"^{saved} is incomplete or damaged \(.*\); set train\.tokenizer to "
        "rebuild it",
    ):
        train(without, progress=False)

    with caplog.at_level(logging.WARNING, logger="gptj_flax.training.loop"):
        result = train(make_config(corpus, run, **{**STEPS, "total_steps": 5}), progress=False)
    assert result.step == 5
    assert any(
        f"{saved} is incomplete or damaged; writing it again from train.tokenizer=" in r.getMessage()
        for r in caplog.records
    )
    text = "def main():\n    return 0\n"
    assert data.load_tokenizer(saved).encode(text) == data.load_tokenizer(corpus["tokenizer"]).encode(text)
    assert not list(run.glob("tokenizer.tmp-*"))


def test_an_interrupted_tokenizer_save_leaves_no_partial_directory(corpus, tmp_path, monkeypatch):  # noqa: F811
    tokenizer = data.load_tokenizer(corpus["tokenizer"])

    def disk_fills_after_one_file(directory, *args, **kwargs):
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            f.write('{"tokenizer_cl')
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(directory, "tokenizer.json"))

    monkeypatch.setattr(tokenizer, "save_pretrained", disk_fills_after_one_file)
    ckpt = Checkpointer(tmp_path / "run")
    with pytest.raises(OSError, match="No space left"):
        ckpt.save_tokenizer(tokenizer)
    ckpt.close()
    assert os.listdir(tmp_path / "run") == []  # neither tokenizer/ nor its temporary directory

    # A process killed while saving leaves its temporary directory; the next writer removes it.
    (tmp_path / "run" / "tokenizer.tmp-0badf00d").mkdir()
    (tmp_path / "run" / "tokenizer.tmp-0badf00d" / "vocab.json").write_text("{")
    Checkpointer(tmp_path / "run").close()
    assert os.listdir(tmp_path / "run") == []
    monkeypatch.undo()
    ckpt = Checkpointer(tmp_path / "run")
    ckpt.save_tokenizer(tokenizer)
    ckpt.close()
    assert os.listdir(tmp_path / "run") == ["tokenizer"] and data.load_tokenizer(tmp_path / "run" / "tokenizer")


def test_a_changed_d_model_on_resume_names_the_parameter_and_both_shapes(corpus, run):  # noqa: F811
    config = make_config(corpus, run, **{**STEPS, "total_steps": 5})
    wider = dataclasses.replace(config, model=dataclasses.replace(config.model, d_model=64))
    with pytest.raises(CheckpointError) as caught:
        train(wider, progress=False)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{run}/4: params ") and " was saved with shape (" in message
    assert "but the model being restored expects (" in message
    saved, expected = message.split("was saved with shape ")[1].split(" but the model being restored expects ")
    assert "32" in saved.split(")")[0] and "64" in expected.split(")")[0]
    assert Checkpointer(run, read_only=True).all_steps() == [2, 4]
