"""gptj_flax.load on a HuggingFace directory: converted in memory, same as its Orbax conversion."""

import numpy as np
import pytest
import torch

import gptj_flax
import gptj_flax.config
import gptj_flax.sampling
from gptj_flax import convert, data
from tests.helpers import hf_model, tiny_config

TEXT = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    tokenizer = data.train_bpe_tokenizer(
        [TEXT * 20, "import os\nprint(os.getcwd())\n" * 20], vocab_size=300, from_files=False
    )
    cfg = tiny_config(n_layers=3, d_model=64, n_heads=4, rotary_dim=8, vocab_size=320)  # padded past the tokenizer
    model = hf_model(cfg, seed=7)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return root / "model", model, tokenizer


def test_hf_directory_scores_like_its_orbax_conversion_and_like_torch(hf_dir, tmp_path):
    directory, torch_model, tokenizer = hf_dir
    from_hf = gptj_flax.load(f"hf:{directory}", dtype="float32")
    plain = gptj_flax.load(directory, dtype="float32")  # config.json + safetensors: no prefix needed
    converted = gptj_flax.load(convert.from_hf(directory, tmp_path / "ckpt"), dtype="float32")

    a, b, c = from_hf.score(TEXT), plain.score(TEXT), converted.score(TEXT)
    assert a.tokens == b.tokens == c.tokens == tokenizer.encode(TEXT)
    np.testing.assert_array_equal(a.logprobs, c.logprobs)
    np.testing.assert_array_equal(b.logprobs, c.logprobs)

    ids = torch.tensor([a.tokens])
    with torch.no_grad():
        ref = torch.log_softmax(torch_model(ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0].numpy()
    np.testing.assert_allclose(a.logprobs, ref, atol=1e-4)


def test_hf_directory_generates_on_a_sharded_mesh(hf_dir):
    directory, _, _ = hf_dir
    one = gptj_flax.load(f"hf:{directory}").generate(TEXT, max_new_tokens=8, temperature=0, return_tokens=True)
    sharded = gptj_flax.load(f"hf:{directory}", mesh=(2, 1, 4)).generate(
        TEXT, max_new_tokens=8, temperature=0, return_tokens=True
    )
    assert one.tokens == sharded.tokens and len(one.tokens) == 8


def test_a_directory_that_is_not_gpt_j_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(convert.ConversionError, match="not 'gptj'"):
        gptj_flax.load(tmp_path)


def test_load_states_the_dtypes_in_effect_and_takes_either_spelling(hf_dir):
    directory, _, _ = hf_dir
    default = gptj_flax.load(f"hf:{directory}")  # a float32 directory: float32 throughout
    assert (default.param_dtype, default.compute_dtype) == ("float32", "float32")
    assert "parameters float32, compute float32" in repr(default)
    half = gptj_flax.load(f"hf:{directory}", dtype="bf16")
    assert (half.param_dtype, half.compute_dtype) == ("bfloat16", "bfloat16")
    assert "parameters bfloat16, compute bfloat16" in repr(half)
    with pytest.raises(gptj_flax.config.ConfigError, match="dtype='int8' is not a supported dtype"):
        gptj_flax.load(f"hf:{directory}", dtype="int8")
    with pytest.raises(gptj_flax.sampling.SamplingError, match="step= is for Orbax checkpoints"):
        gptj_flax.load(f"hf:{directory}", step=3)
