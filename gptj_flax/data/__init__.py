"""Data: tokenizers, TFRecord/text/TFDS sources, and deterministic, resumable per-process batches.

The trainer's entry points::

    it = make_train_iterator(config.train_set, seq_len=…, batch_size=…, grad_accum=…, seed=…,
                             tokenizer=…, state=saved_state_or_None)
    batch = next(it)                      # Batch of numpy arrays: this process's rows
    global_batch = to_global_batch(batch, sharding)
    checkpoint_extra = it.state()         # JSON-able; pass back as state= to resume exactly
    val = make_eval_sets(config.val_set, seq_len=…, batch_size=…, n_batches=config.val_batches, …)

Both take ``vocab_size=`` (the model's) to refuse token ids the model has no embedding for.

Module map: ``tokenizer`` (load/save/train), ``compression`` (plain/gzip/zstd/xz files, truncation
detected), ``text`` (documents from txt/jsonl files),
``tfrecord`` (the legacy record format, index files, layouts), ``sources`` (everything as indexed
shards of sequences), ``iterator`` (global order, per-process shares, state), ``batch`` (the batch
format and global arrays), ``create`` (text → TFRecords), ``corpus`` (the demo's local corpus).
TensorFlow is imported only when TFRecords or TFDS are touched.
"""

from gptj_flax.data.batch import Batch, make_batch, process_share, to_global_batch
from gptj_flax.data.create import CreateResult, create_tfrecords
from gptj_flax.data.errors import DataError, DataWarning
from gptj_flax.data.iterator import (
    DataIterator,
    DataOrderChanged,
    make_eval_batches,
    make_eval_sets,
    make_train_iterator,
)
from gptj_flax.data.sources import Source, open_source
from gptj_flax.data.tokenizer import (
    EOS_TOKEN,
    eos_token_id,
    load_tokenizer,
    resolve_tokenizer,
    save_tokenizer,
    train_bpe_tokenizer,
)

__all__ = [
    "Batch",
    "CreateResult",
    "DataError",
    "DataIterator",
    "DataOrderChanged",
    "DataWarning",
    "EOS_TOKEN",
    "Source",
    "create_tfrecords",
    "eos_token_id",
    "load_tokenizer",
    "make_batch",
    "make_eval_batches",
    "make_eval_sets",
    "make_train_iterator",
    "open_source",
    "process_share",
    "resolve_tokenizer",
    "save_tokenizer",
    "to_global_batch",
    "train_bpe_tokenizer",
]
