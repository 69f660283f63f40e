"""Every kind of bad input stops with a DataError that names the file (and record), never a hang."""

import numpy as np
import pytest
from data_helpers import write_index, write_legacy_tfrecords

from gptj_flax.data import DataError, create_tfrecords, make_eval_batches, make_train_iterator
from gptj_flax.data.sources import open_source


def open_index(index, seq_len=16):
    return open_source(index, seq_len=seq_len, progress=False)


def write_examples(path, features_per_record):
    """Records with arbitrary features: ``{"text": ("int64"|"float"|"bytes", values), ...}`` each."""
    import tensorflow as tf

    kinds = {
        "int64": lambda v: tf.train.Feature(int64_list=tf.train.Int64List(value=v)),
        "float": lambda v: tf.train.Feature(float_list=tf.train.FloatList(value=v)),
        "bytes": lambda v: tf.train.Feature(bytes_list=tf.train.BytesList(value=v)),
    }
    with tf.io.TFRecordWriter(str(path)) as writer:
        for features in features_per_record:
            feature = {name: kinds[kind](values) for name, (kind, values) in features.items()}
            writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    return str(path)


def test_missing_index_file(tmp_path):
    with pytest.raises(DataError, match=r"index file not found: .*nope\.index"):
        open_index(tmp_path / "nope.index")


def test_index_lists_a_missing_file(tmp_path, legacy_dataset):
    index, _ = legacy_dataset()
    with open(index, "a") as f:
        f.write("\n/data/gone.tfrecords\n")
    with pytest.raises(DataError, match=r"legacy\.index, line 5: TFRecord file not found: /data/gone\.tfrecords"):
        open_index(index)


def test_empty_index(tmp_path):
    (tmp_path / "empty.index").write_text("\n\n")
    with pytest.raises(DataError, match=r"empty\.index lists no TFRecord files"):
        open_index(tmp_path / "empty.index")


def test_empty_dataset_is_an_error_not_an_endless_loop(tmp_path):
    index = write_index(tmp_path / "e.index", [write_legacy_tfrecords(tmp_path / "e.tfrecords", [])])
    with pytest.raises(DataError, match=r"e\.index holds no records"):
        make_train_iterator(index, seq_len=16, batch_size=2, process_index=0, process_count=1, progress=False)
    with pytest.raises(DataError, match="holds no records"):
        make_eval_batches(index, seq_len=16, batch_size=2, process_index=0, process_count=1, progress=False)


def test_empty_text_source(tmp_path, tokenizer):
    (tmp_path / "blank.txt").write_text("<|endoftext|>  \n")
    with pytest.raises(DataError, match=r"blank\.txt holds no documents"):
        open_source(tmp_path / "blank.txt", seq_len=16, tokenizer=tokenizer, progress=False)


def test_record_shorter_than_seq_plus_one(tmp_path):
    rows = [np.arange(17), np.arange(17), np.arange(10), np.arange(17)]
    index = write_index(tmp_path / "s.index", [write_legacy_tfrecords(tmp_path / "short.tfrecords", rows)])
    with pytest.raises(DataError, match=r"short\.tfrecords: record 2 has 10 tokens, fewer than seq_len \+ 1 = 17"):
        open_index(index)


def test_records_for_a_longer_context(tmp_path, legacy_dataset):
    index, _ = legacy_dataset(seq_len=16)
    with pytest.raises(DataError, match=r"part0\.tfrecords: record 0 has 17 tokens, fewer than seq_len \+ 1 = 33"):
        open_index(index, seq_len=32)


@pytest.mark.parametrize(
    "kind,values,expected",
    [
        ("float", [1.0] * 17, "stores feature 'text' as float_list, expected int64_list"),
        ("bytes", [b"abc"], "stores feature 'text' as bytes_list, expected int64_list"),
    ],
)
def test_non_int64_text_feature(tmp_path, kind, values, expected):
    records = [{"text": ("int64", list(range(17)))}] * 3 + [{"text": (kind, values)}]
    index = write_index(tmp_path / "t.index", [write_examples(tmp_path / "typed.tfrecords", records)])
    with pytest.raises(DataError, match=rf"typed\.tfrecords: record 3 {expected}"):
        open_index(index)


def test_missing_text_feature(tmp_path):
    records = [{"text": ("int64", list(range(17)))}, {"tokens": ("int64", list(range(17)))}]
    index = write_index(tmp_path / "m.index", [write_examples(tmp_path / "m.tfrecords", records)])
    with pytest.raises(DataError, match=r"m\.tfrecords: record 1 has no 'text' feature \(features: tokens\)"):
        open_index(index)


def test_bad_length_feature(tmp_path):
    records = [{"text": ("int64", list(range(17))), "length": ("int64", [40])}]
    index = write_index(tmp_path / "l.index", [write_examples(tmp_path / "l.tfrecords", records)])
    with pytest.raises(DataError, match=r"l\.tfrecords: record 0 declares length 40 but stores 17 tokens"):
        open_index(index)


def corrupt(path, record_size, record_index):
    data = bytearray(open(path, "rb").read())
    data[record_index * record_size + record_size // 2] ^= 0xFF  # a byte inside that record's payload
    open(path, "wb").write(bytes(data))


def test_corrupt_record_while_counting(tmp_path):
    path = write_legacy_tfrecords(tmp_path / "c.tfrecords", [np.arange(17)] * 6)
    record_size = len(open(path, "rb").read()) // 6
    corrupt(path, record_size, 4)
    with pytest.raises(DataError, match=r"c\.tfrecords: record 4 is corrupt or truncated"):
        open_index(write_index(tmp_path / "c.index", [path]))


def test_corrupt_record_while_reading(tmp_path, tokenizer):
    """With a sidecar no counting pass runs: the reader itself must name the record."""
    (tmp_path / "a.txt").write_text(" ".join(["alpha beta gamma"] * 200))
    result = create_tfrecords(
        tmp_path / "a.txt", tmp_path / "out", tokenizer=tokenizer, seq_len=16, sequences_per_file=1000, progress=False
    )
    path = result.files[0]
    size = len(open(path, "rb").read())
    n = result.sequences
    corrupt(path, size // n, 7)
    # Keep the size the sidecar records, so the reader trusts it and meets the damage itself.
    source = open_source(result.index_path, seq_len=16, progress=False)
    with pytest.raises(DataError, match=rf"{path.rsplit('/', 1)[1]}: record 7 is corrupt or truncated"):
        list(source.iter_sequences())


def test_truncated_file(tmp_path):
    path = write_legacy_tfrecords(tmp_path / "t.tfrecords", [np.arange(17)] * 5)
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-20])
    with pytest.raises(DataError, match=r"t\.tfrecords: record 4 is corrupt or truncated"):
        open_index(write_index(tmp_path / "t.index", [path]))


def test_not_a_tfrecord_file(tmp_path):
    (tmp_path / "x.tfrecords").write_bytes(b"this is not a tfrecord file at all")
    with pytest.raises(DataError, match=r"x\.tfrecords: record 0 is corrupt or truncated"):
        open_source(tmp_path / "x.tfrecords", seq_len=16, progress=False)


def test_missing_single_file_and_text(tmp_path, tokenizer):
    with pytest.raises(DataError, match="TFRecord file not found"):
        open_source(tmp_path / "gone.tfrecords", seq_len=16)
    with pytest.raises(DataError, match="input not found"):
        open_source(tmp_path / "gone.txt", seq_len=16, tokenizer=tokenizer)
