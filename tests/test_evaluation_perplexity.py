"""Perplexity over text and TFRecords equals HuggingFace's token-weighted loss on the same sequences;
``scripts/eval.py perplexity`` on a sharded mesh gives the same numbers."""

import json
import math
import os

import numpy as np
import pytest
import torch

from gptj_flax import data
from gptj_flax.evaluation.perplexity import perplexity
from tests import commands
from tests.evaluation_helpers import CORPUS

SEQ_LEN = 24


@pytest.fixture(scope="module")
def run(eval_checkpoint):
    return eval_checkpoint


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "val.txt"
    path.write_text("<|endoftext|>".join(CORPUS[:5]))  # five documents
    return str(path)


def hf_loss(model, batches: list[data.Batch]) -> tuple[float, int]:
    """Token-weighted mean loss of HF's model: each target predicted within its input's document."""
    total, count = 0.0, 0
    for batch in batches:
        for tokens, segments, mask in zip(batch.tokens, batch.segment_ids, batch.loss_mask):
            inputs = segments[:-1]
            for segment in set(inputs[inputs > 0].tolist()):
                start, stop = np.flatnonzero(inputs == segment)[[0, -1]]
                with torch.no_grad():
                    logits = model(torch.tensor([tokens[start : stop + 1].tolist()])).logits[0].double()
                log_probs = torch.log_softmax(logits, -1)[
                    torch.arange(stop + 1 - start), torch.tensor(tokens[start + 1 : stop + 2].tolist())
                ]
                total -= float((log_probs.numpy() * mask[start : stop + 1]).sum())
                count += int(mask[start : stop + 1].sum())
    return total / count, count


def test_text_perplexity_is_huggingfaces_token_weighted_loss(run, text_file):
    directory, hf = run
    result = perplexity(directory, text_file, seq_len=SEQ_LEN, batch_size=4, progress=False)
    batches = data.make_eval_batches(
        text_file, seq_len=SEQ_LEN, batch_size=4, tokenizer=os.path.join(directory, "tokenizer"), progress=False
    )
    expected, count = hf_loss(hf, batches)
    assert result.tokens == count and result.batches == len(batches) > 1
    assert result.loss == pytest.approx(expected, abs=1e-5)
    assert result.perplexity == pytest.approx(math.exp(expected), rel=1e-5)
    assert (result.step, result.seq_len, result.source) == (0, SEQ_LEN, text_file)
    first = perplexity(directory, text_file, seq_len=SEQ_LEN, batch_size=4, max_batches=1, progress=False)
    assert first.batches == 1 and first.tokens < result.tokens


def test_tfrecords_perplexity_is_huggingfaces_token_weighted_loss(run, text_file, tmp_path):
    directory, hf = run
    created = data.create_tfrecords(
        text_file,
        tmp_path,
        name="val",
        tokenizer=os.path.join(directory, "tokenizer"),
        seq_len=SEQ_LEN,
        preserve_data_order=True,
        progress=False,
    )
    result = perplexity(directory, created.index_path, batch_size=2, seq_len=SEQ_LEN, mesh="2,1,4", progress=False)
    expected, count = hf_loss(
        hf, data.make_eval_batches(created.index_path, seq_len=SEQ_LEN, batch_size=2, progress=False)
    )
    assert result.tokens == count and result.loss == pytest.approx(expected, abs=1e-5)


def test_bad_arguments_say_what_to_fix(run, text_file):
    with pytest.raises(ValueError, match="not a multiple of the 2 data-parallel"):
        perplexity(run[0], text_file, batch_size=3, mesh="2,1,1", progress=False)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        perplexity(run[0], text_file, seq_len=1000, progress=False)


@pytest.mark.slow  # the script and a reference both compile perplexity on an 8-device mesh
def test_eval_script_perplexity_on_a_sharded_mesh(run, text_file, tmp_path, run_command):
    directory, _ = run
    output = tmp_path / "ppl.json"
    done = run_command(
        commands.script("eval.py"),
        "perplexity",
        "--checkpoint",
        directory,
        "--data",
        text_file,
        "--seq-len",
        SEQ_LEN,
        "--batch-size",
        "4",
        "--mesh",
        "2,1,4",
        "--output",
        output,
    )
    assert done.status == 0, done.err[-3000:]
    written = json.loads(output.read_text())
    reference = perplexity(directory, text_file, seq_len=SEQ_LEN, batch_size=4, progress=False)
    assert written["loss"] == pytest.approx(reference.loss, abs=1e-5) and written["tokens"] == reference.tokens
    assert f"perplexity {written['perplexity']:.4f}" in done.out
    assert "parameters float32, compute float32)" in done.out  # the dtypes in effect
    assert (written["param_dtype"], written["dtype"]) == ("float32", "float32")
    assert "perplexity: 100%" in done.err  # the progress bar
