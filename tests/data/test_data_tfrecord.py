"""Records as the original tools wrote them: fixed 2049-token records, long streams, ZLIB "zstd" files."""

import numpy as np
import pytest
from data_helpers import make_documents, real_tokens, write_index, write_legacy_tfrecords

from gptj_flax.data import create_tfrecords, make_eval_batches, make_train_iterator
from gptj_flax.data import tfrecord as tfrecord_module
from gptj_flax.data.sources import open_source


@pytest.mark.parametrize("compressed", [False, True], ids=["plain", "zstd-named-zlib"])
def test_fixed_2049_token_records(tmp_path, compressed):
    rng = np.random.default_rng(1)
    rows = rng.integers(0, 50257, (24, 2049))
    suffix = "_zstd" if compressed else ""
    files = [
        write_legacy_tfrecords(
            tmp_path / f"pile_{i}{suffix}.tfrecords", rows[i * 8 : (i + 1) * 8], compressed=compressed
        )
        for i in range(3)
    ]
    index = write_index(tmp_path / "pile.index", files)
    source = open_source(index, seq_len=2048)
    assert source.num_sequences == 24 and source.eos_id is None
    np.testing.assert_array_equal(np.concatenate([t for t, _ in source.iter_sequences()]), rows)

    # One epoch of training batches holds every record exactly once, whole rows, one segment each.
    it = make_train_iterator(index, seq_len=2048, batch_size=4, grad_accum=2, seed=0, process_index=0, process_count=1)
    seen = []
    for _ in range(it.steps_per_epoch):
        batch = next(it)
        assert batch.tokens.shape == (2, 4, 2049) and batch.tokens.dtype == np.int32
        assert np.all(batch.segment_ids == 1) and np.all(batch.loss_mask == 1)
        seen.extend(map(tuple, batch.tokens.reshape(-1, 2049)))
    assert sorted(seen) == sorted(map(tuple, rows))


@pytest.mark.parametrize("compressed", [False, True], ids=["plain", "zstd-named-zlib"])
def test_long_stream_records_are_cut_into_windows(tmp_path, compressed):
    """GPT-4chan style: each record is a long token stream with no boundaries."""
    rng = np.random.default_rng(2)
    streams = [rng.integers(0, 50257, n) for n in (5000, 7000, 2049)]
    name = "stream_zstd.tfrecords" if compressed else "stream.tfrecords"
    index = write_index(tmp_path / "s.index", [write_legacy_tfrecords(tmp_path / name, streams, compressed=compressed)])
    seq_len = 1023
    source = open_source(index, seq_len=seq_len)
    assert source.num_sequences == sum(-(-s.size // 1024) for s in streams)
    windows = np.concatenate([t for t, _ in source.iter_sequences()])
    lengths = np.concatenate([n for _, n in source.iter_sequences()])
    np.testing.assert_array_equal(real_tokens(source), np.concatenate(streams))
    # Windows never straddle records: each record ends in its own (padded) window.
    assert lengths.tolist() == [1024] * 4 + [5000 - 4096] + [1024] * 6 + [7000 - 6144] + [1024] * 2 + [1]
    assert np.all(windows[4, 5000 - 4096 :] == 0)

    batches = make_eval_batches(index, seq_len=seq_len, batch_size=4, process_index=0, process_count=1)
    padded = [b for b in batches if b.loss_mask.min() == 0]
    assert padded  # tail windows carry their mask
    assert sum(b.loss_mask.sum() for b in batches) == sum(max(n - 1, 0) for n in lengths.tolist())


def test_index_paths_relative_to_the_index(tmp_path, monkeypatch):
    rows = np.arange(2 * 17).reshape(2, 17)
    (tmp_path / "data").mkdir()
    write_legacy_tfrecords(tmp_path / "data" / "a.tfrecords", rows)
    index = write_index(tmp_path / "data" / "x.index", ["a.tfrecords"])
    monkeypatch.chdir(tmp_path)
    np.testing.assert_array_equal(np.concatenate([t for t, _ in open_source(index, seq_len=16).iter_sequences()]), rows)
    # The original tools wrote paths relative to the working directory: those resolve too.
    write_index(tmp_path / "data" / "y.index", ["data/a.tfrecords"])
    assert open_source(tmp_path / "data" / "y.index", seq_len=16).num_sequences == 2


def test_single_tfrecord_file_as_a_source(tmp_path):
    rows = np.arange(3 * 9).reshape(3, 9)
    path = write_legacy_tfrecords(tmp_path / "one.tfrecords", rows)
    np.testing.assert_array_equal(real_tokens(open_source(path, seq_len=8)), rows.ravel())


def test_layouts_are_counted_once_and_cached(tmp_path, legacy_dataset, monkeypatch):
    index, rows = legacy_dataset()
    assert open_source(index, seq_len=16).num_sequences == len(rows)

    def no_recount(*args, **kwargs):
        raise AssertionError("counted again")

    monkeypatch.setattr(tfrecord_module, "count_records", no_recount)
    assert open_source(index, seq_len=16).num_sequences == len(rows)
    # A different sequence length reuses the same layout (layouts are independent of seq_len).
    assert open_source(index, seq_len=7).num_sequences == len(rows) * 3


def test_sidecar_spares_the_counting_pass(tmp_path, tokenizer, monkeypatch):
    (tmp_path / "a.txt").write_text("<|endoftext|>".join(make_documents(30)))
    result = create_tfrecords(tmp_path / "a.txt", tmp_path / "out", tokenizer=tokenizer, seq_len=16, progress=False)
    monkeypatch.setattr(tfrecord_module, "count_records", lambda *a, **k: pytest.fail("counted despite the sidecar"))
    assert open_source(result.index_path, seq_len=16).num_sequences == result.sequences


def test_url_paths_go_through_tensorflow_filesystems(tmp_path):
    """gs:// is read through tf.io.gfile; TF's in-memory ram:// filesystem stands in for it here."""
    import tensorflow as tf

    rows = np.arange(4 * 17).reshape(4, 17)
    root = f"ram://{tmp_path.name}"
    with tf.io.TFRecordWriter(f"{root}/data/a_zstd.tfrecords", tf.io.TFRecordOptions(compression_type="ZLIB")) as w:
        for row in rows:
            w.write(tfrecord_module.serialize_example(row))
    with tf.io.gfile.GFile(f"{root}/data/remote.index", "w") as f:
        f.write("a_zstd.tfrecords\n")  # relative to the index, as a URL
    source = open_source(f"{root}/data/remote.index", seq_len=16, progress=False)
    assert source.shards[0].name == f"{root}/data/a_zstd.tfrecords"
    np.testing.assert_array_equal(np.concatenate([t for t, _ in source.iter_sequences()]), rows)
