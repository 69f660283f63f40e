"""Tokenizers: local BPE training with EOS reserved, save/load round trip, document encoding."""

import numpy as np
import pytest

from gptj_flax.data import EOS_TOKEN, DataError, eos_token_id, load_tokenizer, save_tokenizer, train_bpe_tokenizer
from gptj_flax.data.tokenizer import encode_documents


def test_trained_bpe_reserves_eos(tokenizer):
    eos = eos_token_id(tokenizer)
    assert tokenizer.convert_tokens_to_ids(EOS_TOKEN) == eos
    assert tokenizer.encode(EOS_TOKEN) == [eos]
    ids = tokenizer.encode("the alpha of omega")
    assert eos not in ids and tokenizer.decode(ids) == "the alpha of omega"


def test_byte_level_encodes_any_text(tokenizer):
    text = "naïve 漢字 🙂"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_save_load_round_trip(tokenizer, tmp_path):
    save_tokenizer(tokenizer, tmp_path / "tok")
    loaded = load_tokenizer(tmp_path / "tok")
    assert loaded.eos_token_id == tokenizer.eos_token_id
    text = "doc 7: sigma tau upsilon."
    assert loaded.encode(text) == tokenizer.encode(text)
    assert len(loaded) == len(tokenizer)


def test_train_from_files(tmp_path):
    (tmp_path / "a.txt").write_text("hello world, hello tokenizer " * 50)
    tok = train_bpe_tokenizer([tmp_path / "a.txt"], vocab_size=300)
    assert tok.decode(tok.encode("hello world")) == "hello world"
    with pytest.raises(DataError, match="missing.txt"):
        train_bpe_tokenizer([tmp_path / "missing.txt"])


def test_vocab_size_is_an_upper_bound_never_exceeded(tmp_path):
    texts = ["hello world, hello tokenizer " * 50, "".join(map(chr, range(32, 1000)))]
    assert len(train_bpe_tokenizer(texts, vocab_size=257, from_files=False, min_frequency=1)) == 257
    assert len(train_bpe_tokenizer(texts, vocab_size=300, from_files=False, min_frequency=1)) <= 300
    # Asking for 256 used to give 257 ids, one more than a 256-row model has.
    with pytest.raises(DataError, match=r"vocab_size=256: its 256 byte tokens and <\|endoftext\|> alone are 257 ids"):
        train_bpe_tokenizer(texts, vocab_size=256, from_files=False)


def test_missing_tokenizer_directory_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="tokenizer directory not found"):
        load_tokenizer(tmp_path / "nope")


def test_encode_documents_appends_eos(tokenizer):
    docs = ["alpha beta", "gamma", "delta epsilon zeta"]
    tokens, lengths = encode_documents(tokenizer, docs)
    eos = tokenizer.eos_token_id
    expected = np.concatenate([tokenizer.encode(d) + [eos] for d in docs])
    np.testing.assert_array_equal(tokens, expected)
    assert tokens.dtype == np.int32
    assert lengths.tolist() == [len(tokenizer.encode(d)) + 1 for d in docs]
