"""The iterator: determinism, epochs, per-process shares, the batch format, eval batches, state."""

import json

import numpy as np
import pytest
from data_helpers import make_documents

from gptj_flax.data import Batch, DataError, create_tfrecords, make_eval_batches, make_eval_sets, make_train_iterator
from gptj_flax.data.batch import make_batch
from gptj_flax.data.sources import TFRecordShard, open_source


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_same(a: list[Batch], b: list[Batch]):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_array_equal(x.segment_ids, y.segment_ids)
        np.testing.assert_array_equal(x.loss_mask, y.loss_mask)


def train(source, **kw):
    kw = {"seq_len": 16, "batch_size": 4, "seed": 0, "process_index": 0, "process_count": 1, "progress": False, **kw}
    return make_train_iterator(source, **kw)


def test_same_seed_same_batches_other_seed_other_batches(legacy_dataset):
    index, _ = legacy_dataset()
    assert_same(take(train(index, seed=5, shuffle_buffer=4), 12), take(train(index, seed=5, shuffle_buffer=4), 12))
    a, b = take(train(index, seed=5), 3), take(train(index, seed=6), 3)
    assert not all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b))


def test_each_epoch_covers_every_sequence_once_in_a_new_order(legacy_dataset):
    index, rows = legacy_dataset(n_rows=48)
    it = train(index, batch_size=4, grad_accum=3, shuffle_buffer=3)
    assert it.steps_per_epoch == 4
    epochs = []
    for _ in range(3):
        epochs.append(np.concatenate([b.tokens.reshape(-1, 17) for b in take(it, it.steps_per_epoch)]))
        assert sorted(map(tuple, epochs[-1])) == sorted(map(tuple, rows))
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])
    assert it.state()["epoch"] == 3 and it.state()["step_in_epoch"] == 0


def test_a_partial_last_step_wraps_instead_of_dropping(legacy_dataset):
    index, rows = legacy_dataset(n_rows=30)
    it = train(index, batch_size=8)
    assert it.steps_per_epoch == 4  # 32 slots for 30 sequences: 2 repeat, none dropped
    seen = np.concatenate([b.tokens for b in take(it, 4)])
    assert set(map(tuple, seen)) == set(map(tuple, rows)) and len(seen) == 32


def test_dataset_smaller_than_one_batch(legacy_dataset):
    index, rows = legacy_dataset(n_rows=3, n_files=1)
    batch = next(train(index, batch_size=8, grad_accum=2))
    assert batch.tokens.shape == (2, 8, 17)
    assert set(map(tuple, batch.tokens.reshape(-1, 17))) == set(map(tuple, rows))


def test_batch_shapes_with_and_without_grad_accum(legacy_dataset):
    index, _ = legacy_dataset()
    plain = next(train(index, batch_size=4))
    assert plain.tokens.shape == plain.segment_ids.shape == (4, 17) and plain.loss_mask.shape == (4, 16)
    assert plain.inputs.shape == plain.targets.shape == plain.input_segment_ids.shape == (4, 16)
    accum = next(train(index, batch_size=4, grad_accum=1))
    assert accum.tokens.shape == (1, 4, 17)
    np.testing.assert_array_equal(accum.tokens[0], plain.tokens)


def test_segment_ids_and_loss_mask():
    eos = 9
    tokens = np.array([[5, 6, 9, 7, 9, 9, 8, 0, 0]], np.int32)
    batch = make_batch(tokens, np.array([7]), eos_id=eos)
    assert batch.segment_ids.tolist() == [[1, 1, 1, 2, 2, 3, 4, 0, 0]]
    assert batch.loss_mask.tolist() == [[1, 1, 1, 1, 1, 1, 0, 0]]
    assert batch.loss_mask.dtype == np.float32 and batch.segment_ids.dtype == np.int32
    legacy = make_batch(tokens, np.array([7]), eos_id=None)
    assert legacy.segment_ids.tolist() == [[1, 1, 1, 1, 1, 1, 1, 0, 0]]


def test_created_records_give_document_segments(tmp_path, tokenizer):
    docs = make_documents(20)
    (tmp_path / "a.txt").write_text("<|endoftext|>".join(docs))
    result = create_tfrecords(
        tmp_path / "a.txt", tmp_path / "out", tokenizer=tokenizer, seq_len=64, preserve_data_order=True, progress=False
    )
    batches = make_eval_batches(
        result.index_path, seq_len=64, batch_size=2, process_index=0, process_count=1, progress=False
    )
    eos = tokenizer.eos_token_id
    for batch in batches:
        for tokens, segments in zip(batch.tokens, batch.segment_ids):
            real = segments > 0
            starts = np.flatnonzero(np.diff(segments[real]) == 1) + 1
            assert np.all(tokens[starts - 1] == eos)  # a new document starts right after each EOS
    assert any(b.segment_ids.max() > 1 for b in batches)


def test_text_source_packs_documents(tmp_path, tokenizer):
    docs = make_documents(50)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    source = open_source(tmp_path / "a.jsonl", seq_len=32, tokenizer=tokenizer, progress=False)
    stream = np.concatenate([t[i, :n] for t, ls in source.iter_sequences() for i, n in enumerate(ls)])
    np.testing.assert_array_equal(
        stream, np.concatenate([tokenizer.encode(d) + [tokenizer.eos_token_id] for d in docs])
    )
    batch = next(train(source, seq_len=32))
    assert batch.segment_ids.max() > 1


def test_text_source_needs_a_tokenizer(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(DataError, match="raw text: pass a tokenizer"):
        train(tmp_path / "a.txt")


@pytest.mark.parametrize("grad_accum", [None, 2])
def test_shares_of_two_processes_make_the_global_batch(legacy_dataset, grad_accum):
    index, _ = legacy_dataset(n_rows=64)
    whole = take(train(index, batch_size=8, grad_accum=grad_accum, shuffle_buffer=5), 6)
    parts = [
        take(train(index, batch_size=8, grad_accum=grad_accum, shuffle_buffer=5, process_index=p, process_count=2), 6)
        for p in range(2)
    ]
    axis = 0 if grad_accum is None else 1
    for k, batch in enumerate(whole):
        joined = np.concatenate([parts[0][k].tokens, parts[1][k].tokens], axis=axis)
        np.testing.assert_array_equal(joined, batch.tokens)


def test_each_process_reads_only_its_own_share(legacy_dataset, monkeypatch):
    index, _ = legacy_dataset(n_rows=64, n_files=4)
    reads: list[tuple[str, int, int]] = []
    original = TFRecordShard.read

    def spy(self, start, count):
        reads.append((self.name, start, count))
        return original(self, start, count)

    monkeypatch.setattr(TFRecordShard, "read", spy)
    ranges = []
    for p in range(2):
        reads.clear()
        it = train(index, batch_size=8, process_index=p, process_count=2)
        take(it, it.steps_per_epoch)
        ranges.append({(name, i) for name, start, count in reads for i in range(start, start + count)})
    assert ranges[0] and ranges[1] and not ranges[0] & ranges[1]
    assert len(ranges[0]) + len(ranges[1]) == 64


def test_state_is_json_and_resumes_exactly(legacy_dataset):
    index, _ = legacy_dataset(n_rows=40)
    reference = take(train(index, batch_size=4, grad_accum=2, shuffle_buffer=3), 14)
    it = train(index, batch_size=4, grad_accum=2, shuffle_buffer=3)
    take(it, 7)  # past the first epoch (5 steps) and into a block's middle
    state = json.loads(json.dumps(it.state()))
    assert (state["epoch"], state["step_in_epoch"], state["step"]) == (1, 2, 7)
    resumed = train(index, batch_size=4, grad_accum=2, shuffle_buffer=3, state=state)
    assert_same(take(resumed, 7), reference[7:])


def test_state_from_another_order_is_refused(legacy_dataset):
    index, _ = legacy_dataset()
    state = train(index, batch_size=4).state()
    with pytest.raises(DataError, match="batch_size: saved 4, now 8"):
        train(index, batch_size=8, state=state)
    with pytest.raises(DataError, match="seed: saved 0, now 1"):
        train(index, batch_size=4, seed=1, state=state)
    with pytest.raises(DataError, match="not a data iterator state"):
        train(index, batch_size=4, state={"epoch": 0})


def test_bad_iterator_arguments(legacy_dataset):
    index, _ = legacy_dataset()
    with pytest.raises(DataError, match="not divisible by process_count=3"):
        train(index, batch_size=4, process_count=3, process_index=0)
    with pytest.raises(DataError, match="process_index=2"):
        train(index, batch_size=4, process_count=2, process_index=2)


def test_eval_batches_cover_the_set_once_with_padding(legacy_dataset):
    index, rows = legacy_dataset(n_rows=27)
    batches = make_eval_batches(index, seq_len=16, batch_size=4, process_index=0, process_count=1, progress=False)
    assert len(batches) == 7  # 27 sequences → 28 rows, one padding row
    all_rows = np.concatenate([b.tokens for b in batches])
    real = np.concatenate([b.loss_mask.sum(-1) > 0 for b in batches])
    assert real.sum() == 27 and sorted(map(tuple, all_rows[real])) == sorted(map(tuple, rows))
    again = make_eval_batches(index, seq_len=16, batch_size=4, process_index=0, process_count=1, progress=False)
    assert_same(batches, again)
    # Two processes: their shares make the same global batches.
    shares = [
        make_eval_batches(index, seq_len=16, batch_size=4, process_index=p, process_count=2, progress=False)
        for p in range(2)
    ]
    for k, batch in enumerate(batches):
        np.testing.assert_array_equal(np.concatenate([shares[0][k].tokens, shares[1][k].tokens]), batch.tokens)
    limited = make_eval_batches(
        index, seq_len=16, batch_size=4, n_batches=2, process_index=0, process_count=1, progress=False
    )
    assert len(limited) == 2 and all(b.loss_mask.min() == 1 for b in limited)


def test_eval_sets_by_name(legacy_dataset, tmp_path, tokenizer):
    index, _ = legacy_dataset()
    (tmp_path / "v.txt").write_text("<|endoftext|>".join(make_documents(10)))
    sets = make_eval_sets(
        {"pile": index, "notes": str(tmp_path / "v.txt")},
        seq_len=16,
        batch_size=2,
        n_batches=3,
        tokenizer=tokenizer,
        process_index=0,
        process_count=1,
        progress=False,
    )
    assert sorted(sets) == ["notes", "pile"] and all(len(v) == 3 for v in sets.values())
