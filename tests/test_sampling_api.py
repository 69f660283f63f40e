"""``gptj_flax.load`` on an Orbax checkpoint with its tokenizer: generate, stream, score, stop strings,
the padded vocabulary and ``scripts/sample.py`` (``tests/test_notebook.py`` runs ``examples/sampling.ipynb``)."""

import os
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gptj_flax
import gptj_flax.sampling
from gptj_flax.checkpoint import Checkpointer, CheckpointError
from gptj_flax.config import Config, TrainConfig
from gptj_flax.model import GPTJ
from gptj_flax.sampling import LanguageModel, Sampling, SamplingError
from tests import commands
from tests.helpers import CORPUS, tiny_config

TOKENIZER_VOCAB = 300
# The model's vocabulary is padded past the tokenizer's (as GPT-J's 50400 > 50257).
CFG = tiny_config(n_layers=2, d_model=64, n_heads=4, rotary_dim=8, vocab_size=320, max_len=128)


def test_the_sampling_namespace_leaves_the_device_programs_in_their_modules():
    """``gptj_flax.sampling`` exports what a library user calls (``load``, ``LanguageModel`` and its
    settings, results and errors), not the compiled programs behind them (``Decoder``, ``Slots``)."""
    assert {"load", "LanguageModel", "SamplingParams"} <= set(gptj_flax.sampling.__all__)
    assert not {"Decoder", "Slots"} & set(dir(gptj_flax.sampling))


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")


def make_checkpoint(directory) -> None:
    """Steps 0 and 5 of a tiny random model, and a tokenizer, as a training run would leave them.

    The LM head's bias makes the padded ids (≥ the tokenizer's size) by far the most likely, so
    any of them escaping the mask would show in every output.
    """
    params = nn.meta.unbox(GPTJ(CFG).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"]
    params["lm_head"]["bias"] = params["lm_head"]["bias"].at[TOKENIZER_VOCAB:].set(50.0)
    config = Config(model=CFG, train=TrainConfig(batch_size=2))
    ckpt = Checkpointer(directory)
    ckpt.save(0, params=jax.tree.map(lambda x: 0.5 * x, params), config=config)
    ckpt.save(5, params=params, config=config)
    ckpt.close()
    make_tokenizer().save_pretrained(os.path.join(directory, "tokenizer"))


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("run"))
    make_checkpoint(directory)
    return directory


@pytest.fixture(scope="module")
def lm(checkpoint_dir):
    return gptj_flax.load(checkpoint_dir)


def test_load_gives_the_latest_step_config_and_tokenizer(lm, checkpoint_dir):
    assert isinstance(lm, LanguageModel) and lm.step == 5 and lm.config == CFG
    assert len(lm.tokenizer) == TOKENIZER_VOCAB and lm.eos_token_id == 0
    assert lm.decoder.valid_vocab == TOKENIZER_VOCAB
    older = gptj_flax.load(checkpoint_dir, step=0, dtype="bfloat16")
    assert older.step == 0 and older.config.dtype == "bfloat16"
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(older.decoder.params))
    with pytest.raises(CheckpointError, match="step 3 not in"):
        gptj_flax.load(checkpoint_dir, step=3)
    with pytest.raises(CheckpointError, match="not found"):
        gptj_flax.load(os.path.join(checkpoint_dir, "missing"))


def test_generate_decodes_its_tokens_and_never_emits_padded_ids(lm):
    greedy = lm.generate("def add(", 36, temperature=0, ignore_eos=True, return_tokens=True, return_logprobs=True)
    assert greedy.finish_reason == "length" and greedy.completion_tokens == 36 == len(greedy.logprobs)
    assert greedy.prompt_tokens == len(lm.encode("def add("))
    assert greedy.text == lm.decode(greedy.tokens)
    sampled = lm.generate(["def ", "class ", "for i"], 40, temperature=1.5, seed=0, ignore_eos=True, return_tokens=True)
    tokens = [t for c in [greedy, *sampled] for t in c.tokens]
    assert max(tokens) < TOKENIZER_VOCAB  # the +50 bias would have put them everywhere otherwise
    assert len(set(tokens)) > 20


def test_stop_strings_end_each_sequence_on_its_own_and_are_trimmed(lm):
    prompts = ["def add(", "class Point", "import os"]
    full = lm.generate(prompts, 40, temperature=0, ignore_eos=True, return_tokens=True)

    def stop_in(text):  # two characters a few in, avoiding half-decoded characters
        i = next(i for i in range(4, len(text) - 1) if "\ufffd" not in text[i : i + 2])
        return text[i : i + 2]

    stops = [[stop_in(full[0].text)], None, [stop_in(full[2].text), "never-generated"]]
    out = lm.generate(prompts, 40, temperature=0, ignore_eos=True, stop=stops, return_tokens=True)
    for completion, reference, stop in zip(out, full, stops):
        if stop is None:
            assert completion.finish_reason == "length" and completion.text == reference.text
            continue
        assert completion.finish_reason == "stop"
        assert completion.text == reference.text[: reference.text.index(stop[0])]
        # the tokens end with the one that completed the stop string
        n = completion.completion_tokens
        assert completion.tokens == reference.tokens[:n]
        assert stop[0] in lm.decode(reference.tokens[:n]) and stop[0] not in lm.decode(reference.tokens[: n - 1])


def test_eos_ends_a_row_and_is_not_part_of_the_text(lm):
    prompts = ["def add(", "class Point"]
    full = lm.generate(prompts, 40, temperature=0, ignore_eos=True, return_tokens=True)
    eos = full[0].tokens[5]  # pretend this token is the EOS: row 0 must end at its first occurrence
    first = full[0].tokens.index(eos)
    saved, lm.eos_token_id = lm.eos_token_id, eos
    try:
        out = lm.generate(prompts, 40, temperature=0, ignore_eos=[False, True], return_tokens=True)
    finally:
        lm.eos_token_id = saved
    assert out[0].finish_reason == "eos" and out[0].tokens == full[0].tokens[: first + 1]
    assert out[0].text == lm.decode(full[0].tokens[:first])
    assert out[1].finish_reason == "length" and out[1].tokens == full[1].tokens


def test_stream_pieces_add_up_to_generate(lm):
    settings = dict(temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    single = lm.generate("for i", 40, stop=[" i"], **settings)
    pieces = list(lm.stream("for i", 40, stop=[" i"], **settings))
    assert "".join(pieces) == single.text and all(isinstance(p, str) and p for p in pieces)
    prompts = ["def ", "import os", "class "]
    batch = lm.generate(prompts, 40, stop=[None, ["os"], ["\n"]], **settings)
    rows = [""] * 3
    stream = lm.stream(prompts, 40, stop=[None, ["os"], ["\n"]], **settings)
    assert stream.completions is None  # not before the end
    for step in stream:
        assert isinstance(step, list) and len(step) == 3
        rows = [r + p for r, p in zip(rows, step)]
    assert rows == [c.text for c in batch]
    # once exhausted, the stream reports what generate does: finish reasons and token counts
    assert [(c.text, c.finish_reason, c.completion_tokens) for c in stream.completions] == [
        (c.text, c.finish_reason, c.completion_tokens) for c in batch
    ]


def test_sampling_settings_as_one_value_are_the_keywords(lm):
    """``sampling=Sampling(...)`` (one for every prompt, or one per prompt) generates and streams what
    the same six keywords do; both at once, or a list of the wrong length, is refused by name."""
    prompts = ["def ", "import os"]
    keywords = dict(temperature=0.8, top_k=20, top_p=0.9, typical_p=0.95, min_p=0.05, repetition_penalty=1.2)
    by_keywords = lm.generate(prompts, 16, seed=3, return_tokens=True, **keywords)
    by_value = lm.generate(prompts, 16, seed=3, return_tokens=True, sampling=Sampling(**keywords))
    assert [c.tokens for c in by_value] == [c.tokens for c in by_keywords]
    rows = [Sampling(temperature=0), Sampling(**keywords)]
    per_row = lm.generate(prompts, 16, seed=3, return_tokens=True, sampling=rows)
    per_keyword = lm.generate(
        prompts, 16, seed=3, return_tokens=True, **{k: [getattr(r, k) for r in rows] for k in keywords}
    )
    assert [c.tokens for c in per_row] == [c.tokens for c in per_keyword]
    assert per_row[1].tokens == by_keywords[1].tokens  # a row's draw is its own, whatever its neighbours
    assert "".join(lm.stream(prompts[0], 16, seed=3, sampling=Sampling(**keywords))) == by_keywords[0].text
    with pytest.raises(SamplingError, match=r"^got sampling and temperature: give the sampling settings as a"):
        lm.generate("x", 4, sampling=Sampling(), temperature=0.5)
    with pytest.raises(SamplingError, match=r"^sampling: got 1 for 2 prompts"):
        lm.generate(prompts, 4, sampling=[Sampling()])
    with pytest.raises(SamplingError, match=r"^sampling must be a Sampling, or a list of one per prompt"):
        lm.generate("x", 4, sampling={"temperature": 0})


def test_top_logprobs_of_generate_stream_and_score_agree(lm):
    """The alternatives of each generated token (decode loop) are those the one-pass score of the same
    text gives, the chosen token's value is its log-prob, and streamed pieces carry the same tokens."""
    settings = dict(temperature=0.9, seed=5, stop=[None, ["os"]])
    prompts = ["def ", "import os"]
    batch = lm.generate(prompts, 12, return_tokens=True, return_logprobs=True, return_top_logprobs=[3, 0], **settings)
    assert batch[1].top_logprobs is None and len(batch[0].top_logprobs) == len(batch[0].tokens)
    prompt = lm.encode(prompts[0])
    scored = lm.score(prompt + batch[0].tokens, top_logprobs=3)
    for step, (top, token, value) in enumerate(zip(batch[0].top_logprobs, batch[0].tokens, batch[0].logprobs)):
        reference = scored.top_logprobs[len(prompt) - 1 + step]
        assert list(top) == list(reference) and list(top.values()) == pytest.approx(list(reference.values()), abs=1e-5)
        assert token not in top or top[token] == value
    pieces = [[], []]
    for step in lm.stream(prompts, 12, return_logprobs=True, return_top_logprobs=[3, 0], **settings):
        for row, piece in enumerate(step):
            pieces[row].append(piece)
    for row, completion in enumerate(batch):
        assert "".join(pieces[row]) == completion.text
        assert [t for p in pieces[row] for t in p.tokens] == completion.tokens
        assert [x for p in pieces[row] for x in p.logprobs] == completion.logprobs
    assert [top for p in pieces[0] for top in p.top_logprobs] == batch[0].top_logprobs
    assert scored.logprobs[len(prompt) - 1 :] == pytest.approx(batch[0].logprobs, abs=1e-5)


def test_score_texts_and_token_ids(lm):
    text = "def add(a, b):\n    return a + b\n"
    scored = lm.score(text)
    assert scored.tokens == lm.encode(text) and scored.logprobs.shape == (len(scored.tokens) - 1,)
    by_ids = lm.score([scored.tokens, scored.tokens[:5]])
    # (log-probs near -50 here: the padded ids' bias takes almost all the mass)
    np.testing.assert_allclose(by_ids[0].logprobs, scored.logprobs, rtol=1e-6)
    np.testing.assert_allclose(by_ids[1].logprobs, scored.logprobs[:4], rtol=1e-6)
    assert scored.total == pytest.approx(float(np.sum(scored.logprobs)))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda lm: lm.generate("x", 4, stop=[""]), "stop: stop strings must be non-empty strings"),
        (lambda lm: lm.generate(["x", "y"], 4, stop=[["a"], ["b"], ["c"]]), "stop: got 3 entries for 2 prompts"),
        (lambda lm: lm.generate("", 4), "prompt 0 has no tokens"),
        (lambda lm: lm.generate("x" * 200, 4), "that exceeds the model's context of 128 tokens"),
        (lambda lm: lm.score(""), "sequence 0 has 0 token(s)"),
    ],
)
def test_bad_requests_raise_clear_errors(lm, call, message):
    with pytest.raises(SamplingError, match=re.escape(message)):
        call(lm)


def test_sample_script_one_shot_and_interactive(lm, checkpoint_dir, repo_root, run_command):
    def _run_script(*args, stdin=""):
        return run_command(commands.script("sample.py"), *args, cwd=repo_root, stdin=stdin)

    expected = lm.generate("def add(", 16, temperature=0, ignore_eos=True).text
    one_shot = _run_script(
        checkpoint_dir,
        "--prompt",
        "def add(",
        "--max-new-tokens",
        "16",
        "--temperature",
        "0",
        "--ignore-eos",
    )
    assert one_shot.status == 0, one_shot.err
    assert one_shot.out == expected + "\n"

    loop = _run_script(
        checkpoint_dir,
        "--interactive",
        "--max-new-tokens",
        "8",
        "--top-k",
        "5",
        "--seed",
        "3",
        "--num-samples",
        "2",
        "--dtype",
        "bfloat16",
        stdin="import os\n" + "x" * 200 + "\nclass \n\n",
    )
    assert loop.status == 0, loop.err
    assert loop.out.count("===== sample 0") == 2 and loop.out.count("===== sample 1") == 2
    assert "exceeds the model's context" in loop.err  # the over-long prompt is refused, the loop goes on
    assert loop.err.count("completion done in") == 2
