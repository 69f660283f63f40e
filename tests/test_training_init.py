"""scripts/train.py --init-from: fine-tuning from HF weights, legacy checkpoints (with Adam state) and Orbax."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from gptj_flax import checkpoint, convert, data, partitioning
from gptj_flax.config import from_dict
from gptj_flax.data.corpus import write_stdlib_corpus
from gptj_flax.model import GPTJ
from gptj_flax.training import make_optimizer, steps, train
from tests.helpers import hf_model, hf_state_numpy, tiny_config
from tests.legacy_writer import dense_model, dense_moments, hf_state_dict, write_legacy_checkpoint

MODEL = dict(n_layers=2, d_model=32, n_heads=8, rotary_dim=4, vocab_size=320, max_len=32, dtype="float32")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    train_txt, _ = write_stdlib_corpus(str(root), max_bytes=200_000)
    data.save_tokenizer(data.train_bpe_tokenizer([train_txt], vocab_size=320), str(root / "tokenizer"))
    return train_txt, str(root / "tokenizer")


def _config(corpus, run_dir, **train):
    section = dict(
        batch_size=8,
        total_steps=2,
        warmup_steps=0,
        anneal_steps=1,
        lr=0.0,
        end_lr=0.0,
        weight_decay=0.0,
        run_dir=str(run_dir),
        train_set=corpus[0],
        tokenizer=corpus[1],
        ckpt_every=100,
    )
    section.update(train)
    return from_dict({"model": MODEL, "mesh": {"data": 2, "fsdp": 2, "model": 2}, "train": section})


def _adam(opt_state):
    return next(
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda n: isinstance(n, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)
    )


def _restore(config):
    mesh = partitioning.make_mesh((1, 1, 1))
    model = GPTJ(config.model)
    tx = make_optimizer(config.train)
    shardings = steps.state_shardings(model, tx, mesh)
    abstract = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        nn.meta.unbox(steps.abstract_state(model, tx)),
        shardings,
    )
    ckpt = checkpoint.Checkpointer(config.train.run_dir, read_only=True)
    return ckpt.restore(params_target=abstract.params, opt_state_target=abstract.opt_state)


def test_fine_tune_from_huggingface_starts_from_its_weights(corpus, tmp_path):
    hf = hf_model(tiny_config(**{k: v for k, v in MODEL.items() if k != "dtype"}), seed=1)
    hf.save_pretrained(tmp_path / "hf")
    config = _config(corpus, tmp_path / "run")  # lr 0: the weights must come out exactly as they went in
    result = train(config, init_from=f"hf:{tmp_path / 'hf'}", progress=False)
    assert result.step == 2
    restored = _restore(config)
    for name, value in convert.hf_from_params(jax.tree.map(np.asarray, restored.params), config.model):
        np.testing.assert_array_equal(value, hf_state_numpy(hf)[name], err_msg=name)
    assert int(_adam(restored.opt_state).count) == 2  # HF carries no optimiser state: a fresh one


@pytest.mark.parametrize("fresh_opt", [False, True], ids=["carried", "fresh"])
def test_fine_tune_from_a_full_legacy_checkpoint_carries_adam_unless_fresh(corpus, tmp_path, fresh_opt):
    config = _config(corpus, tmp_path / "run")
    model = dense_model(config.model, seed=2)
    mu, nu = dense_moments(model, 3), dense_moments(model, 4)
    write_legacy_checkpoint(
        tmp_path / "legacy" / "step_50",
        model,
        config.model,
        shards=2,
        step=50,
        moments=(mu, nu),
        adam_count=50,
        schedule_count=50,
    )
    result = train(config, init_from=f"legacy:{tmp_path / 'legacy' / 'step_50'}", fresh_opt=fresh_opt, progress=False)
    assert result.step == 2
    restored = _restore(config)
    adam = _adam(restored.opt_state)
    assert int(adam.count) == (2 if fresh_opt else 52)
    reference = convert.params_from_hf(hf_state_dict(model, config.model), config.model)
    for got, want in zip(jax.tree.leaves(restored.params), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=0)  # lr 0: weights untouched
    nu_norm = float(optax.tree.norm(adam.nu))
    assert (nu_norm < 1e-2) if fresh_opt else (nu_norm > 1e-2)  # carried second moments are large


def test_fine_tune_from_an_orbax_checkpoint(corpus, tmp_path):
    first = _config(corpus, tmp_path / "first", lr=1e-3, end_lr=1e-3)
    train(first, progress=False)
    second = _config(corpus, tmp_path / "second")
    train(second, init_from=str(tmp_path / "first"), progress=False)
    a, b = _restore(first), _restore(second)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert int(_adam(b.opt_state).count) == 4  # Orbax carries the optimiser state: 2 + 2 steps
