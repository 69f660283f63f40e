"""Token ids the model has no embedding row for are refused when the data are opened (naming the
tokenizer's size or the largest id, model.vocab_size and the file), not met as a NaN loss at step 1."""

from __future__ import annotations

import numpy as np
import pytest
from data_helpers import write_index, write_legacy_tfrecords

from gptj_flax import data
from gptj_flax.config import from_dict
from gptj_flax.data import DataError, make_eval_sets, make_train_iterator, open_source
from gptj_flax.data.corpus import write_stdlib_corpus
from gptj_flax.training import train

SEQ_LEN = 32
LOCAL = dict(process_index=0, process_count=1, progress=False)


@pytest.fixture(scope="module")
def corpus_2048(tmp_path_factory):
    """A text corpus and a byte-level BPE of exactly 2048 ids trained on it."""
    root = tmp_path_factory.mktemp("corpus_2048")
    train_txt, val_txt = write_stdlib_corpus(str(root), max_bytes=200_000)
    tokenizer = data.train_bpe_tokenizer([train_txt], vocab_size=2048)
    assert len(tokenizer) == 2048
    data.save_tokenizer(tokenizer, root / "tokenizer")
    return {"train": train_txt, "val": val_txt, "tokenizer": tokenizer, "tokenizer_dir": str(root / "tokenizer")}


def write_records(
    tmp_path, name: str, largest: int, *, others_below: int | None = None, n_rows: int = 16, seed: int = 0
) -> str:
    """A legacy TFRecord file of ids up to ``largest`` (present once at least); ``others_below``: every
    other id is below it."""
    high = largest + 1 if others_below is None else others_below
    rows = np.random.default_rng(seed).integers(0, high, (n_rows, SEQ_LEN + 1))
    rows[n_rows // 2, 3] = largest
    return write_legacy_tfrecords(tmp_path / name, rows)


def test_tokenizer_larger_than_the_model_is_refused(corpus_2048):
    message = r"tokenizer .* has 2048 ids but model\.vocab_size is 512: ids 512\.\.2047 have no embedding row"
    for tokenizer in (corpus_2048["tokenizer"], corpus_2048["tokenizer_dir"]):
        with pytest.raises(DataError, match=message):
            make_train_iterator(
                corpus_2048["train"], seq_len=SEQ_LEN, batch_size=8, tokenizer=tokenizer, vocab_size=512, **LOCAL
            )
        with pytest.raises(DataError, match=message):
            make_eval_sets(
                {"val": corpus_2048["val"]}, seq_len=SEQ_LEN, batch_size=8, tokenizer=tokenizer, vocab_size=512, **LOCAL
            )
    batch = next(
        make_train_iterator(
            corpus_2048["train"],
            seq_len=SEQ_LEN,
            batch_size=8,
            tokenizer=corpus_2048["tokenizer"],
            vocab_size=2048,
            **LOCAL,
        )
    )
    assert batch.tokens.max() < 2048


def test_records_from_another_tokenizer_are_refused_when_opened(tmp_path):
    index = write_index(tmp_path / "foreign.index", [write_records(tmp_path, "foreign.tfrecords", 1000)])
    message = (
        rf"{tmp_path / 'foreign.tfrecords'}: token id 1000 \(the largest of the sequences read\) is not below "
        r"model\.vocab_size=512"
    )
    with pytest.raises(DataError, match=message):
        open_source(index, seq_len=SEQ_LEN, vocab_size=512, progress=False)
    with pytest.raises(DataError, match=message):
        make_train_iterator(index, seq_len=SEQ_LEN, batch_size=4, vocab_size=512, **LOCAL)
    with pytest.raises(DataError, match=message):
        make_eval_sets({"val": index}, seq_len=SEQ_LEN, batch_size=4, vocab_size=512, **LOCAL)
    # The bound is exclusive: id 1000 fits a vocabulary of 1001, not one of 1000.
    with pytest.raises(DataError, match=r"token id 1000 .* model\.vocab_size=1000"):
        open_source(index, seq_len=SEQ_LEN, vocab_size=1000, progress=False)
    assert open_source(index, seq_len=SEQ_LEN, vocab_size=1001, progress=False).num_sequences == 16
    assert open_source(index, seq_len=SEQ_LEN, progress=False).num_sequences == 16  # no model: no check


def test_foreign_ids_in_a_later_file_stop_the_batch_that_reads_them(tmp_path):
    files = [
        write_records(tmp_path, "a.tfrecords", 511),
        write_records(tmp_path, "b.tfrecords", 700, others_below=512, seed=1),
    ]
    index = write_index(tmp_path / "mixed.index", files)
    source = open_source(index, seq_len=SEQ_LEN, vocab_size=512, progress=False)  # the first file is fine
    iterator = make_train_iterator(source, seq_len=SEQ_LEN, batch_size=4, **LOCAL)
    with pytest.raises(DataError, match=rf"{tmp_path / 'b.tfrecords'}: token id 700 .* model\.vocab_size=512"):
        next(iterator)


def tiny_config(run_dir, train_set, val_set=None):
    """configs/tiny.json's model (vocab 512) and mesh, two steps."""
    return from_dict(
        {
            "model": dict(
                n_layers=2, d_model=64, n_heads=4, rotary_dim=8, vocab_size=512, max_len=SEQ_LEN, dtype="float32"
            ),
            "mesh": dict(data=2, fsdp=2, model=2),
            "train": dict(
                batch_size=8,
                total_steps=2,
                warmup_steps=1,
                anneal_steps=1,
                lr=1e-3,
                end_lr=1e-4,
                run_dir=str(run_dir),
                train_set=train_set,
                val_set=val_set or {},
                val_every=2,
                ckpt_every=2,
            ),
        }
    )


def test_training_stops_before_the_first_step_not_with_nan(tmp_path):
    index = write_index(tmp_path / "foreign.index", [write_records(tmp_path, "foreign.tfrecords", 1000, n_rows=32)])
    with pytest.raises(DataError, match=r"foreign\.tfrecords: token id 1000 .* model\.vocab_size=512"):
        train(tiny_config(tmp_path / "run", index), progress=False)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_training_checks_the_validation_sets_too(tmp_path):
    good = write_index(tmp_path / "good.index", [write_records(tmp_path, "good.tfrecords", 511, n_rows=32)])
    foreign = write_index(tmp_path / "val.index", [write_records(tmp_path, "val.tfrecords", 600, n_rows=8)])
    with pytest.raises(DataError, match=r"val\.tfrecords: token id 600 .* model\.vocab_size=512"):
        train(tiny_config(tmp_path / "run", good, {"val": foreign}), progress=False)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
