"""scripts/create_tfrecords.py: exact round trip, legacy readability, the short-tail fix, its options."""

import json

import numpy as np
import pytest
from data_helpers import make_documents, real_tokens, run_script

from gptj_flax.data import DataError, DataWarning, create_tfrecords
from gptj_flax.data.sources import open_source
from gptj_flax.errors import EXIT_ERROR


def expected_stream(tokenizer, docs):
    eos = tokenizer.eos_token_id
    return np.concatenate([tokenizer.encode(d) + [eos] for d in docs])


def write_corpus(tmp_path, docs, n_files=2):
    paths = []
    for i in range(n_files):
        path = tmp_path / f"in{i}.txt"
        path.write_text("<|endoftext|>".join(docs[len(docs) * i // n_files : len(docs) * (i + 1) // n_files]))
        paths.append(str(path))
    return paths


def test_cli_round_trip_in_order(tmp_path, tokenizer, tokenizer_dir, repo_root):
    docs = make_documents(150)
    inputs = write_corpus(tmp_path, docs)
    rc = run_script(
        repo_root,
        "create_tfrecords",
        [
            *inputs,
            "--output-dir",
            str(tmp_path / "out"),
            "--name",
            "corpus",
            "--tokenizer",
            str(tokenizer_dir),
            "--seq-len",
            "32",
            "--preserve-data-order",
            "--sequences-per-file",
            "20",
            "--quiet",
        ],
    )
    assert rc == 0
    index = tmp_path / "out" / "corpus.index"
    files = index.read_text().split()
    source = open_source(index, seq_len=32)
    expected = expected_stream(tokenizer, docs)
    np.testing.assert_array_equal(real_tokens(source), expected)
    # Several bounded files, named NAME_<i>_<count>, every record but the tail full.
    n_records = -(-expected.size // 33)
    assert len(files) == -(-n_records // 20)
    assert all(f.startswith("/") for f in files)
    assert [int(f.rsplit("_", 1)[1].split(".")[0]) for f in files] == [
        min(20, n_records - i) for i in range(0, n_records, 20)
    ]
    assert source.eos_id == tokenizer.eos_token_id


def test_records_are_readable_by_the_original_loader(tmp_path, tokenizer):
    """Parse as mesh-transformer-jax did: only a VarLen int64 'text' feature, every record seq+1 long."""
    import tensorflow as tf

    docs = make_documents(40)
    result = create_tfrecords(
        write_corpus(tmp_path, docs),
        tmp_path / "out",
        tokenizer=tokenizer,
        seq_len=32,
        preserve_data_order=True,
        progress=False,
    )

    def tf_parse(example_proto):
        parsed = tf.io.parse_single_example(example_proto, {"text": tf.io.VarLenFeature(tf.int64)})
        return tf.cast(tf.sparse.to_dense(tf.sparse.reorder(parsed["text"])), tf.uint32)

    files = open(result.index_path).read().splitlines()
    records = [r for r in tf.data.TFRecordDataset(files).map(tf_parse).as_numpy_iterator()]
    assert len(records) == result.sequences and all(r.size == 33 for r in records)
    stream = np.concatenate(records)
    expected = expected_stream(tokenizer, docs)
    np.testing.assert_array_equal(stream[: expected.size], expected)
    assert np.all(stream[expected.size :] == tokenizer.eos_token_id)  # the tail's padding is EOS


def test_ten_token_corpus_gives_one_record_and_a_warning(tmp_path, tokenizer, tokenizer_dir, repo_root):
    text = "alpha beta gamma delta"
    ids = tokenizer.encode(text)
    assert len(ids) + 1 < 2049
    (tmp_path / "tiny.txt").write_text(text)
    with pytest.warns(DataWarning, match="fewer than one sequence"):
        rc = run_script(
            repo_root,
            "create_tfrecords",
            [
                str(tmp_path / "tiny.txt"),
                "--output-dir",
                str(tmp_path / "out"),
                "--tokenizer",
                str(tokenizer_dir),
                "--quiet",
            ],
        )
    assert rc == 0
    source = open_source(tmp_path / "out" / "data.index", seq_len=2048)
    assert source.num_sequences == 1
    ((tokens, lengths),) = list(source.iter_sequences())
    assert lengths.tolist() == [len(ids) + 1]
    np.testing.assert_array_equal(tokens[0, : len(ids) + 1], ids + [tokenizer.eos_token_id])


def test_shuffle_is_seeded_and_keeps_every_document(tmp_path, tokenizer):
    docs = make_documents(60)
    inputs = write_corpus(tmp_path, docs)
    streams = []
    for run, seed in enumerate((3, 3, 4)):
        result = create_tfrecords(
            inputs, tmp_path / f"out{run}", tokenizer=tokenizer, seq_len=32, seed=seed, progress=False
        )
        streams.append(real_tokens(open_source(result.index_path, seq_len=32)))
    ordered = expected_stream(tokenizer, docs)
    np.testing.assert_array_equal(streams[0], streams[1])
    assert not np.array_equal(streams[0], streams[2]) and not np.array_equal(streams[0], ordered)
    eos = tokenizer.eos_token_id
    as_docs = lambda s: sorted(tuple(d) for d in np.split(s, np.flatnonzero(s == eos)[:-1] + 1))  # noqa: E731
    assert as_docs(streams[0]) == as_docs(ordered)


def test_repack_epochs_repeat_the_corpus_on_new_boundaries(tmp_path, tokenizer):
    docs = make_documents(30)
    result = create_tfrecords(
        write_corpus(tmp_path, docs),
        tmp_path / "out",
        tokenizer=tokenizer,
        seq_len=32,
        preserve_data_order=True,
        n_repack_epochs=3,
        progress=False,
    )
    once = expected_stream(tokenizer, docs)
    np.testing.assert_array_equal(real_tokens(open_source(result.index_path, seq_len=32)), np.tile(once, 3))
    assert result.tokens == 3 * once.size and result.sequences == -(-3 * once.size // 33)


def test_min_unique_tokens_drops_repetitive_documents(tmp_path, tokenizer):
    docs = ["alpha " * 50, "alpha beta gamma delta epsilon zeta eta theta iota kappa", "beta beta beta"]
    unique = [len(set(tokenizer.encode(d))) for d in docs]
    threshold = unique[1]
    assert unique[0] < threshold and unique[2] < threshold
    (tmp_path / "a.txt").write_text("<|endoftext|>".join(docs))
    result = create_tfrecords(
        tmp_path / "a.txt",
        tmp_path / "out",
        tokenizer=tokenizer,
        seq_len=8,
        min_unique_tokens=threshold,
        preserve_data_order=True,
        progress=False,
    )
    assert (result.documents, result.dropped_documents) == (1, 2)
    np.testing.assert_array_equal(
        real_tokens(open_source(result.index_path, seq_len=8)), expected_stream(tokenizer, docs[1:2])
    )
    meta = json.loads(open(result.metadata_path).read())
    assert meta["dropped_documents"] == 2 and meta["min_unique_tokens"] == threshold


def test_ftfy_option_changes_the_text(tmp_path, tokenizer):
    (tmp_path / "a.txt").write_text("doesnÃ¢â‚¬â„¢t")
    with pytest.warns(DataWarning):
        fixed = create_tfrecords(
            tmp_path / "a.txt",
            tmp_path / "fixed",
            tokenizer=tokenizer,
            seq_len=16,
            normalize_with_ftfy=True,
            progress=False,
        )
    np.testing.assert_array_equal(
        real_tokens(open_source(fixed.index_path, seq_len=16)), expected_stream(tokenizer, ["doesn't"])
    )


def test_no_documents_is_an_error(tmp_path, tokenizer, tokenizer_dir, repo_root, capsys):
    (tmp_path / "blank.txt").write_text("  \n<|endoftext|>\n")
    with pytest.raises(DataError, match="no documents"):
        create_tfrecords(tmp_path / "blank.txt", tmp_path / "out", tokenizer=tokenizer, progress=False)
    rc = run_script(
        repo_root,
        "create_tfrecords",
        [
            str(tmp_path / "blank.txt"),
            "--output-dir",
            str(tmp_path / "o"),
            "--tokenizer",
            str(tokenizer_dir),
            "--quiet",
        ],
    )
    assert rc == EXIT_ERROR and "no documents" in capsys.readouterr().err
