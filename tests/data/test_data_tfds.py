"""TFDS datasets by name from a local data_dir, tokenised and packed when opened; nothing downloaded."""

import numpy as np
import pytest
from data_helpers import make_documents

from gptj_flax.data import DataError, make_train_iterator
from gptj_flax.data.sources import open_source, parse_tfds_spec

tfds = pytest.importorskip("tensorflow_datasets")
import tensorflow as tf  # noqa: E402

TRAIN_DOCS = make_documents(40, seed=5)
VALIDATION_DOCS = make_documents(6, seed=6)


class GptjFlaxTinyCorpus(tfds.core.GeneratorBasedBuilder):
    """A corpus that exists only on this machine."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text(), "id": tf.int64})
        )

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(TRAIN_DOCS), "validation": self._generate_examples(VALIDATION_DOCS)}

    def _generate_examples(self, docs):
        for i, doc in enumerate(docs):
            yield i, {"text": doc, "id": i}


class GptjFlaxBodyCorpus(tfds.core.GeneratorBasedBuilder):
    """Text under another name: the one Text feature is found by itself."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({"body": tfds.features.Text()}))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples()}

    def _generate_examples(self):
        for i, doc in enumerate(TRAIN_DOCS[:5]):
            yield i, {"body": doc}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tfds")
    config = tfds.download.DownloadConfig(try_download_gcs=False)
    for builder in (GptjFlaxTinyCorpus, GptjFlaxBodyCorpus):
        builder(data_dir=str(path)).download_and_prepare(download_config=config)
    return str(path)


def documents_of(source, eos):
    stream = np.concatenate([t[i, :n] for t, ls in source.iter_sequences() for i, n in enumerate(ls)])
    return sorted(tuple(d) for d in np.split(stream, np.flatnonzero(stream == eos)[:-1] + 1))


@pytest.mark.parametrize(
    "spec,docs",
    [
        ("tfds:gptj_flax_tiny_corpus", TRAIN_DOCS),
        ("tfds:gptj_flax_tiny_corpus:1.0.0@validation", VALIDATION_DOCS),
        ("tfds:gptj_flax_body_corpus", TRAIN_DOCS[:5]),
    ],
)
def test_tfds_source_tokenises_every_document(data_dir, tokenizer, spec, docs):
    source = open_source(spec, seq_len=32, tokenizer=tokenizer, tfds_data_dir=data_dir, progress=False)
    eos = tokenizer.eos_token_id
    expected = sorted(tuple(tokenizer.encode(d) + [eos]) for d in docs)
    assert documents_of(source, eos) == expected


def test_tfds_train_iterator(data_dir, tokenizer):
    it = make_train_iterator(
        "tfds:gptj_flax_tiny_corpus",
        seq_len=32,
        batch_size=4,
        tokenizer=tokenizer,
        tfds_data_dir=data_dir,
        process_index=0,
        process_count=1,
        progress=False,
    )
    batch = next(it)
    assert batch.tokens.shape == (4, 33) and batch.segment_ids.max() > 1


def test_tfds_spec_parsing():
    assert parse_tfds_spec("tfds:wiki/en:1.0.0@train[:10%]") == ("wiki/en:1.0.0", "train[:10%]")
    assert parse_tfds_spec("tfds:corpus") == ("corpus", "train")
    with pytest.raises(DataError, match="expected tfds:NAME"):
        parse_tfds_spec("tfds:@train")


def test_tfds_errors(data_dir, tokenizer, tmp_path):
    with pytest.raises(DataError, match="TFDS dataset 'no_such_corpus' not found"):
        open_source("tfds:no_such_corpus", seq_len=32, tokenizer=tokenizer, tfds_data_dir=data_dir)
    with pytest.raises(DataError, match="cannot read split 'test'"):
        open_source("tfds:gptj_flax_tiny_corpus@test", seq_len=32, tokenizer=tokenizer, tfds_data_dir=data_dir)
    with pytest.raises(DataError, match="is not prepared"):
        open_source("tfds:gptj_flax_tiny_corpus", seq_len=32, tokenizer=tokenizer, tfds_data_dir=str(tmp_path))
