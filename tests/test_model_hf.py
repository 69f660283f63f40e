"""Numerical parity with HuggingFace ``GPTJForCausalLM`` (PyTorch) on the same weights."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from gptj_flax.model import GPTJ, apply_rotary, rotary_tables
from tests.helpers import hf_model, mean_loss, params_matching, tiny_config

# (n_layers, d_model, n_heads, rotary_dim): rotary_dim < head_dim and == head_dim, odd depths.
SHAPES = [
    (1, 32, 2, 4),  # head_dim 16, rotary 4
    (3, 64, 4, 16),  # rotary_dim == head_dim
    (5, 96, 6, 8),  # odd depth, head_dim 16
    (2, 64, 2, 32),  # few wide heads, rotary == head_dim
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "L{}_d{}_h{}_r{}".format(*s))
@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
def test_logits_and_loss_match_huggingface(shape, scan):
    n_layers, d_model, n_heads, rotary_dim = shape
    cfg = tiny_config(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads, rotary_dim=rotary_dim, vocab_size=100, scan_layers=scan
    )
    hf = hf_model(cfg, seed=n_layers)
    variables = params_matching(hf, cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(3, 21))

    with torch.no_grad():
        out = hf(torch.from_numpy(tokens), labels=torch.from_numpy(tokens))
    ref_logits, ref_loss = out.logits.numpy(), out.loss.item()

    logits = np.asarray(GPTJ(cfg).apply(variables, jnp.asarray(tokens)))
    assert logits.shape == ref_logits.shape
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=1e-4)

    loss, n = mean_loss(jnp.asarray(logits[:, :-1]), jnp.asarray(tokens[:, 1:]))
    assert int(n) == 3 * 20
    assert abs(float(loss) - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))


def test_left_padding_gives_the_unpadded_logits():
    cfg = tiny_config(n_layers=2, d_model=64, n_heads=4, rotary_dim=8)
    hf = hf_model(cfg, seed=3)
    variables = params_matching(hf, cfg)
    rng = np.random.default_rng(1)
    lengths = [9, 5, 12]
    width = max(lengths)
    seqs = [rng.integers(0, cfg.vocab_size, size=n) for n in lengths]

    tokens = np.zeros((3, width), np.int32)
    segments = np.zeros((3, width), np.int32)
    positions = np.zeros((3, width), np.int32)
    for row, seq in enumerate(seqs):
        pad = width - len(seq)
        tokens[row, pad:] = seq
        segments[row, pad:] = 1
        positions[row, pad:] = np.arange(len(seq))

    model = GPTJ(cfg)
    padded = np.asarray(model.apply(variables, tokens, positions=positions, segment_ids=segments))
    for row, seq in enumerate(seqs):
        alone = np.asarray(model.apply(variables, seq[None]))[0]
        np.testing.assert_allclose(padded[row, width - len(seq) :], alone, rtol=0, atol=1e-5)
        with torch.no_grad():
            ref = hf(torch.from_numpy(seq[None])).logits.numpy()[0]
        np.testing.assert_allclose(padded[row, width - len(seq) :], ref, rtol=0, atol=1e-4)


def test_packed_segments_do_not_attend_across_documents():
    cfg = tiny_config()
    hf = hf_model(cfg, seed=4)
    variables = params_matching(hf, cfg)
    rng = np.random.default_rng(2)
    a, b = rng.integers(0, cfg.vocab_size, size=7), rng.integers(0, cfg.vocab_size, size=10)
    packed = np.concatenate([a, b])[None]
    segments = np.array([[1] * 7 + [2] * 10])
    positions = np.array([list(range(7)) + list(range(10))])

    logits = np.asarray(GPTJ(cfg).apply(variables, packed, positions=positions, segment_ids=segments))[0]
    with torch.no_grad():
        ref_a = hf(torch.from_numpy(a[None])).logits.numpy()[0]
        ref_b = hf(torch.from_numpy(b[None])).logits.numpy()[0]
    np.testing.assert_allclose(logits[:7], ref_a, rtol=0, atol=1e-4)
    np.testing.assert_allclose(logits[7:], ref_b, rtol=0, atol=1e-4)

    # Without segment ids the second document would see the first, and its logits would differ.
    unmasked = np.asarray(GPTJ(cfg).apply(variables, packed))[0]
    assert np.abs(unmasked[7:] - ref_b).max() > 1e-2


def test_rotary_matches_huggingface_rotate_every_two():
    """The known trap: GPT-J rotates interleaved pairs, on the first rotary_dim dims only."""
    from transformers.models.gptj import modeling_gptj as hf_gptj

    rotary_dim, head_dim, length = 6, 10, 7
    x = np.random.default_rng(5).normal(size=(2, length, 3, head_dim)).astype(np.float32)
    positions = np.broadcast_to(np.arange(length), (2, length))
    sin, cos = rotary_tables(jnp.asarray(positions), rotary_dim)
    ours = np.asarray(apply_rotary(jnp.asarray(x), sin, cos))

    table = hf_gptj.create_sinusoidal_positions(length, rotary_dim)
    sincos = table[torch.from_numpy(np.ascontiguousarray(positions))]
    hf_sin, hf_cos = torch.split(sincos, rotary_dim // 2, dim=-1)
    xt = torch.from_numpy(x)
    ref = torch.cat([hf_gptj.apply_rotary_pos_emb(xt[..., :rotary_dim], hf_sin, hf_cos), xt[..., rotary_dim:]], -1)
    np.testing.assert_allclose(ours, ref.numpy(), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(ours[..., rotary_dim:], x[..., rotary_dim:])
