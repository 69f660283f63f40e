"""HuggingFace parity through every default path: weights brought in from elsewhere compute in their
own precision, so with no dtype argument the log-probabilities are HuggingFace PyTorch float32's.

Each path is taken as a user takes it (the command line for conversions), on a random GPT-J of odd
shapes: 11 layers, rotary_dim < head_dim, a vocabulary and widths no power of two.
"""

import json

import numpy as np
import pytest
import torch

import gptj_flax
from gptj_flax.config import ModelConfig
from tests import commands
from tests.helpers import hf_model
from tests.legacy_writer import dense_model, hf_state_dict, legacy_config_dict, write_legacy_checkpoint

HF_SHAPE = ModelConfig(n_layers=11, d_model=48, n_heads=6, rotary_dim=4, vocab_size=101, max_len=40, d_ff=72)
LEGACY_SHAPE = ModelConfig(n_layers=11, d_model=48, n_heads=6, rotary_dim=4, vocab_size=103, max_len=40)
TOLERANCE = 1e-4


def tokens(config: ModelConfig, n: int = 33) -> list[int]:
    return np.random.default_rng(3).integers(0, config.vocab_size, size=n).tolist()


def torch_log_probs(model, ids: list[int]) -> np.ndarray:
    """log p(ids[j+1] | ids[:j+1]) under the float32 HuggingFace model."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()


def run_script(run_command, *args):
    done = run_command(commands.script("convert.py"), *args)
    assert done.status == 0, done.err[-3000:]
    return done


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf") / "model"
    model = hf_model(HF_SHAPE, seed=11)
    model.save_pretrained(directory)
    return directory, model


def test_from_hf_cli_then_load_scores_like_huggingface(hf_dir, tmp_path, run_command):
    directory, model = hf_dir
    run_script(run_command, "from-hf", directory, tmp_path / "out", "--no-tokenizer")
    lm = gptj_flax.load(tmp_path / "out")
    ids = tokens(HF_SHAPE)
    np.testing.assert_allclose(lm.score(ids).logprobs, torch_log_probs(model, ids), rtol=0, atol=TOLERANCE)


def test_load_of_an_hf_directory_scores_like_huggingface(hf_dir):
    directory, model = hf_dir
    lm = gptj_flax.load(f"hf:{directory}")
    ids = tokens(HF_SHAPE)
    np.testing.assert_allclose(lm.score(ids).logprobs, torch_log_probs(model, ids), rtol=0, atol=TOLERANCE)


def test_from_legacy_cli_of_a_full_float32_checkpoint_scores_like_huggingface(tmp_path, run_command):
    dense = dense_model(LEGACY_SHAPE, seed=4)
    step_dir = tmp_path / "legacy" / "step_500"
    write_legacy_checkpoint(
        step_dir, dense, LEGACY_SHAPE, shards=1, step=500, dtype=np.float32, moments=(dense, dense), adam_count=500
    )
    config = tmp_path / "legacy.json"
    config.write_text(json.dumps(legacy_config_dict(LEGACY_SHAPE, shards=1)))
    run_script(run_command, "from-legacy", step_dir, tmp_path / "out", "--config", config)

    reference = hf_model(LEGACY_SHAPE)
    reference.load_state_dict({k: torch.from_numpy(v) for k, v in hf_state_dict(dense, LEGACY_SHAPE).items()})
    lm = gptj_flax.load(tmp_path / "out")
    ids = tokens(LEGACY_SHAPE)
    np.testing.assert_allclose(lm.score(ids).logprobs, torch_log_probs(reference, ids), rtol=0, atol=TOLERANCE)
