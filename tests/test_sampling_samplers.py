"""Samplers on constructed and random logits: exact kept sets, HuggingFace parity, seeded draws."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from gptj_flax.losses import first_argmax, mask_vocab
from gptj_flax.sampling.samplers import (
    Sampling,
    SamplingError,
    SamplingParams,
    min_p_filter,
    next_tokens,
    repetition_penalty,
    top_bucket,
    top_k_filter,
    top_logprobs,
    top_p_filter,
    typical_filter,
    warp,
)

# Two constructed distributions over 5 tokens: token 0 is the least likely in A, the most likely in B.
PROBS_A = [0.05, 0.4, 0.3, 0.15, 0.1]
PROBS_B = [0.5, 0.1, 0.2, 0.15, 0.05]


def _logits(*rows):
    return jnp.log(jnp.asarray(rows, jnp.float32))


def _kept(filtered) -> list[set[int]]:
    return [set(np.flatnonzero(np.isfinite(row)).tolist()) for row in np.asarray(filtered)]


def _params(batch, **settings):
    return jax.tree.map(jnp.asarray, SamplingParams.build(batch, **settings))


def test_top_k_keeps_exactly_the_k_most_likely_token_id_0_included():
    logits = _logits(PROBS_A, PROBS_B, PROBS_A, PROBS_B, PROBS_A)
    k = jnp.asarray([2, 1, 0, 3, 4])  # one k per row; 0 is off
    # The original's bug kept token 0 whatever k was: row 0 must drop it, row 1 must keep only it.
    assert _kept(top_k_filter(logits, k)) == [{1, 2}, {0}, {0, 1, 2, 3, 4}, {0, 2, 3}, {1, 2, 3, 4}]


def test_top_k_keeps_ties_with_the_kth_value():
    logits = jnp.asarray([[1.0, 3.0, 2.0, 2.0, 0.0]])
    assert _kept(top_k_filter(logits, jnp.asarray([2]))) == [{1, 2, 3}]


def test_top_k_equals_a_sort_of_each_row_on_ties_infinities_signed_zeros_and_any_k():
    """The k-th largest value comes from bisecting the floats' bits, not from a sort: against
    numpy's sort of every row, over ties, ±inf, −0 beside +0, magnitudes from 1e-30 to 1e30 and
    k below 1 and past the vocabulary."""
    rng = np.random.default_rng(5)
    for vocab in (1, 2, 5, 97, 300):
        scale = rng.choice([1e-30, 1.0, 1e30], size=(64, 1))
        logits = np.round(rng.normal(size=(64, vocab)) * scale, int(rng.integers(0, 3))).astype(np.float32)  # ties
        for value, share in ((-np.inf, 0.1), (np.inf, 0.05), (-0.0, 0.05), (0.0, 0.05)):
            logits[rng.random(logits.shape) < share] = value
        k = rng.integers(-1, vocab + 3, size=64).astype(np.int32)
        kth = -np.sort(-logits, axis=-1)[np.arange(64), np.clip(k, 1, vocab) - 1]
        expected = np.where((logits >= kth[:, None]) | (k <= 0)[:, None], logits, -np.inf)
        got = np.asarray(top_k_filter(jnp.asarray(logits), jnp.asarray(k)))
        np.testing.assert_array_equal(got, expected, err_msg=f"vocabulary of {vocab}")


def test_top_p_equals_huggingfaces_sorted_running_sum_on_ties_and_infinities():
    """The nucleus threshold comes from bisecting the floats' bits: against HuggingFace's rule on
    numpy's sort of every row (a running sum of the ascending probabilities, in float64), over ties
    (kept whole), −inf logits, −0 beside +0, and p from nearly 0 to 1."""
    rng = np.random.default_rng(6)
    for vocab in (1, 2, 5, 97, 300):
        logits = np.round(rng.normal(size=(64, vocab)) * rng.uniform(0.3, 4.0, size=(64, 1)), 1).astype(np.float32)
        for value, share in ((-np.inf, 0.1), (-0.0, 0.05), (0.0, 0.05)):
            logits[rng.random(logits.shape) < share] = value
        logits[:, 0] = np.where(np.isinf(logits).all(axis=1), 0.0, logits[:, 0])  # a row needs a finite logit
        p = rng.choice([1e-6, 0.3, 0.9, 0.999, 1.0], size=64).astype(np.float32)
        ascending = np.sort(logits, axis=-1).astype(np.float64)
        probs = np.exp(ascending - ascending[:, -1:])
        removed = np.cumsum(probs / probs.sum(-1, keepdims=True), axis=-1) <= 1.0 - p[:, None].astype(np.float64)
        threshold = ascending[np.arange(64), np.minimum(removed.sum(-1), vocab - 1)]
        expected = np.where((logits >= threshold[:, None]) | (p >= 1.0)[:, None], logits, -np.inf)
        got = np.asarray(top_p_filter(jnp.asarray(logits), jnp.asarray(p)))
        np.testing.assert_array_equal(got, expected, err_msg=f"vocabulary of {vocab}")


def test_typical_p_equals_huggingfaces_sorted_running_sum_on_ties_and_infinities():
    """The typical set's last distance comes from bisecting the floats' bits: against HuggingFace's
    rule on numpy's sort of every row by distance from the entropy (a running sum in float64), over
    ties (kept whole), −inf logits and masses from nearly 0 to 1."""
    rng = np.random.default_rng(7)
    for vocab in (1, 2, 5, 97, 300):
        logits = np.round(rng.normal(size=(64, vocab)) * rng.uniform(0.3, 4.0, size=(64, 1)), 1).astype(np.float32)
        logits[rng.random(logits.shape) < 0.1] = -np.inf
        logits[:, 0] = np.where(np.isinf(logits).all(axis=1), 0.0, logits[:, 0])  # a row needs a finite logit
        mass = rng.choice([1e-6, 0.3, 0.9, 0.999, 1.0], size=64).astype(np.float32)
        # the distances as the filter computes them, so that ties are the same ties
        log_probs = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
        probs = np.exp(log_probs)
        with np.errstate(invalid="ignore"):  # 0·(−inf) is nan, which the sum skips, as the filter's does
            distance = np.abs(-log_probs - (-np.nansum(log_probs * probs, axis=-1, keepdims=True)))
        order = np.argsort(distance, axis=-1, kind="stable")
        running = np.cumsum(np.take_along_axis(probs.astype(np.float64), order, axis=-1), axis=-1)
        last = np.minimum((running < mass[:, None]).sum(-1), vocab - 1)
        threshold = np.take_along_axis(distance, order, axis=-1)[np.arange(64), last]
        expected = np.where((distance <= threshold[:, None]) | (mass >= 1.0)[:, None], logits, -np.inf)
        got = np.asarray(typical_filter(jnp.asarray(logits), jnp.asarray(mass)))
        np.testing.assert_array_equal(got, expected, err_msg=f"vocabulary of {vocab}")


def test_top_p_keeps_exactly_the_nucleus():
    logits = _logits(PROBS_A, PROBS_A, PROBS_B, PROBS_B, PROBS_A)
    p = jnp.asarray([0.6, 0.75, 0.45, 0.7, 1.0])
    assert _kept(top_p_filter(logits, p)) == [{1, 2}, {1, 2, 3}, {0}, {0, 2}, {0, 1, 2, 3, 4}]


def test_min_p_keeps_tokens_above_the_scaled_threshold():
    logits = _logits(PROBS_A, PROBS_A, PROBS_B, PROBS_A)
    min_p = jnp.asarray([0.3, 0.2, 0.5, 0.0])
    assert _kept(min_p_filter(logits, min_p)) == [{1, 2, 3}, {1, 2, 3, 4}, {0}, {0, 1, 2, 3, 4}]


def test_typical_p_keeps_the_locally_typical_set():
    # PROBS_A: entropy 1.392 nats; tokens by |surprisal - entropy|: 2, 1, 3, 4, 0 (cumulative mass
    # 0.3, 0.7, 0.85, 0.95, 1). A small mass keeps token 2 alone, not the most likely token 1.
    logits = _logits(PROBS_A, PROBS_A, PROBS_A, PROBS_A)
    mass = jnp.asarray([0.2, 0.5, 0.8, 1.0])
    assert _kept(typical_filter(logits, mass)) == [{2}, {1, 2}, {1, 2, 3}, {0, 1, 2, 3, 4}]


@pytest.mark.parametrize("name", ["typical_p", "top_p", "top_k", "min_p"])
def test_filters_match_huggingface_on_random_logits(name):
    rng = np.random.default_rng({"typical_p": 0, "top_p": 1, "top_k": 2, "min_p": 3}[name])
    logits = (rng.normal(size=(24, 97)) * rng.uniform(0.3, 4.0, size=(24, 1))).astype(np.float32)
    if name == "top_k":
        values = rng.integers(1, 97, size=24)
        ours = top_k_filter(jnp.asarray(logits), jnp.asarray(values))
        warper = lambda v: TopKLogitsWarper(int(v))  # noqa: E731
    else:
        values = rng.uniform(0.05, 0.98, size=24).astype(np.float32)
        fn, cls = {
            "typical_p": (typical_filter, TypicalLogitsWarper),
            "top_p": (top_p_filter, TopPLogitsWarper),
            "min_p": (min_p_filter, MinPLogitsWarper),
        }[name]
        ours = fn(jnp.asarray(logits), jnp.asarray(values))
        warper = lambda v: cls(float(v))  # noqa: E731
    for row, value in enumerate(values):
        ref = warper(value)(None, torch.from_numpy(logits[row : row + 1])).numpy()[0]
        np.testing.assert_array_equal(np.isfinite(np.asarray(ours[row])), np.isfinite(ref), err_msg=f"row {row}")
        kept = np.isfinite(ref)
        np.testing.assert_array_equal(np.asarray(ours[row])[kept], ref[kept])


def test_repetition_penalty_matches_huggingface():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(3, 40)).astype(np.float32) * 3
    history = rng.integers(0, 40, size=(3, 12))
    seen = np.zeros((3, 40), bool)
    np.put_along_axis(seen, history, True, axis=1)
    for row, penalty in enumerate([1.3, 0.7, 2.0]):
        ours = repetition_penalty(
            jnp.asarray(logits[row : row + 1]), jnp.asarray(seen[row : row + 1]), jnp.asarray([penalty])
        )
        ref = RepetitionPenaltyLogitsProcessor(penalty)(
            torch.from_numpy(history[row : row + 1]), torch.from_numpy(logits[row : row + 1])
        )
        np.testing.assert_allclose(np.asarray(ours), ref.numpy(), rtol=1e-6)


def test_temperature_comes_first_unless_original_order():
    # At temperature 2 the distribution is flatter, so the 0.6 nucleus needs three tokens; the
    # original applied top-p to the untempered distribution, where two suffice.
    logits = _logits(PROBS_A)
    params = _params(1, temperature=2.0, top_p=0.6)
    assert _kept(warp(logits, params)) == [{1, 2, 3}]
    assert _kept(warp(logits, params, original_order=True)) == [{1, 2}]
    np.testing.assert_allclose(
        np.asarray(warp(logits, params, original_order=True))[0, [1, 2]], np.log([0.4, 0.3]) / 2, rtol=1e-6
    )


_next_tokens = jax.jit(next_tokens, static_argnums=(4, 5))
# 40,000 rows of up to 8192 logits sorted and drawn from: this program's run, not its compile, is the
# test's cost, so it gets the LLVM optimisations the suite's other programs go without (conftest)
_next_tokens_optimised = jax.jit(
    next_tokens, static_argnums=(4, 5), compiler_options={"xla_backend_optimization_level": 2}
)


def _draw(logits_row, n, seed=0, valid_vocab=None, **settings):
    """``n`` draws from one distribution: ``n`` identical rows, each with its own key."""
    logits = jnp.tile(jnp.asarray(logits_row)[None], (n, 1))
    keys = jax.random.split(jax.random.key(seed), n)
    seen = jnp.zeros(logits.shape, bool)
    return np.asarray(_next_tokens(logits, _params(n, **settings), seen, keys, valid_vocab or logits.shape[1]))


@pytest.mark.parametrize(
    "settings, kept",
    [
        (dict(top_k=2), {1, 2}),
        (dict(top_p=0.6), {1, 2}),
        (dict(min_p=0.3), {1, 2, 3}),
        (dict(typical_p=0.2), {2}),
        (dict(top_k=3, top_p=0.75, temperature=0.5), {1, 2}),
    ],
)
def test_many_seeded_draws_stay_in_the_kept_set(settings, kept):
    draws = _draw(np.log(PROBS_A), 4000, **settings)
    assert set(np.unique(draws).tolist()) == kept
    if settings == dict(top_p=0.6):  # and in proportion to the renormalised probabilities
        np.testing.assert_allclose(np.mean(draws == 1), 0.4 / 0.7, atol=0.03)


def test_draws_are_reproducible_from_the_seed():
    a, b, c = (_draw(np.log(PROBS_A), 4000, seed=s, temperature=1.0) for s in (7, 7, 8))
    np.testing.assert_array_equal(a, b)
    assert np.any(a != c)


@pytest.mark.parametrize(
    "vocab",
    [
        37,
        # 40,000 rows of 8192 logits (1.3 GB): a chi-square test over 20 kept ids needs that many
        # draws to see a misweighted one
        8192,
    ],
)
def test_draws_follow_the_warped_distribution(vocab):
    """Many draws of one row against softmax of the warped logits computed in numpy: a chi-square
    test over the kept ids, none drawn outside them; the vocabulary need not fill the last block."""
    logits = np.asarray(jax.random.normal(jax.random.key(1), (vocab,)), np.float64) * 3
    n, top_k, temperature = 40_000, 20, 0.7
    keys = jax.random.split(jax.random.key(2), n)
    params = _params(n, temperature=temperature, top_k=top_k)
    tokens = _next_tokens_optimised(
        jnp.tile(jnp.asarray(logits, jnp.float32), (n, 1)), params, jnp.zeros((n, vocab), bool), keys, vocab
    )
    kept = np.argsort(-logits)[:top_k]
    expected = np.exp((logits[kept] - logits[kept].max()) / temperature)
    expected /= expected.sum()
    counts = np.bincount(np.asarray(tokens), minlength=vocab)
    assert counts.sum() == counts[kept].sum()  # nothing outside the top 20
    chi2 = np.sum((counts[kept] - n * expected) ** 2 / (n * expected))
    assert chi2 < scipy.stats.chi2.ppf(1 - 1e-6, df=top_k - 1), chi2


def test_a_row_with_one_possible_token_draws_it():
    logits = jax.random.normal(jax.random.key(1), (64, 500)) * 3
    logits = logits.at[3, :].set(-jnp.inf).at[3, 5].set(0.0).at[7, :].set(-jnp.inf).at[7, 499].set(2.0)
    keys = jax.random.split(jax.random.key(2), 64)
    tokens = next_tokens(logits, _params(64, temperature=0.7), jnp.zeros(logits.shape, bool), keys, 500)
    assert (int(tokens[3]), int(tokens[7])) == (5, 499)
    # a row's draw depends on its own key and logits, not on its neighbours
    alone = next_tokens(logits[10:11], _params(1, temperature=0.7), jnp.zeros((1, 500), bool), keys[10:11], 500)
    assert int(alone[0]) == int(tokens[10])


def test_padded_vocabulary_ids_are_never_chosen():
    logits = np.log(PROBS_A + [0.3]).astype(np.float32)  # id 5 would win greedy and be drawn often
    logits[5] = 10.0
    assert set(np.unique(_draw(logits, 4000, valid_vocab=5, temperature=1.0)).tolist()) == set(range(5))
    masked = mask_vocab(jnp.asarray(logits)[None], 5)
    assert not np.isfinite(np.asarray(masked)[0, 5])
    seen = jnp.zeros((1, 6), bool)
    assert (
        int(
            next_tokens(
                jnp.asarray(logits)[None], _params(1, temperature=0.0), seen, jax.random.split(jax.random.key(0), 1), 5
            )[0]
        )
        == 1
    )


def test_greedy_and_sampled_rows_mix_in_one_batch():
    logits = jnp.tile(_logits(PROBS_A), (4, 1))
    params = _params(4, temperature=[0.0, 1.0, 0.0, 1.0], top_k=[0, 1, 0, 0], top_p=[1.0, 1.0, 0.5, 0.3])
    keys = jax.random.split(jax.random.key(3), 4)
    tokens = np.asarray(next_tokens(logits, params, jnp.zeros((4, 5), bool), keys, 5))
    # greedy rows ignore the filters; top_k=1 and a tiny top_p leave only the argmax to draw
    assert tokens.tolist() == [1, 1, 1, 1]


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(top_p=1.5), "top_p must be in (0, 1]"),
        (dict(top_p=0.0), "top_p must be in (0, 1]"),
        (dict(typical_p=-0.1), "typical_p must be in (0, 1]"),
        (dict(top_k=-1), "top_k must be an integer >= 0"),
        (dict(top_k=2.5), "top_k must be an integer >= 0"),
        (dict(temperature=-1.0), "temperature must be >= 0"),
        (dict(temperature=float("nan")), "temperature must be >= 0"),
        (dict(min_p=2.0), "min_p must be in [0, 1]"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
        (dict(temperature=[0.5, 1.0, 1.0]), "got 3 values for 2 prompts"),
        (dict(top_p=[0.5, 2.0]), "top_p[1] must be in (0, 1]"),
        (dict(top_k=True), "top_k must be an integer >= 0"),
        (dict(temperature="hot"), "temperature must be >= 0"),
    ],
)
def test_bad_settings_are_rejected_by_name(settings, message):
    with pytest.raises(SamplingError, match=re.escape(message)):
        SamplingParams.build(2, **settings)


@pytest.mark.parametrize(
    "settings",
    [
        dict(top_p=1.5),
        dict(top_p=0.0),
        dict(typical_p=-0.1),
        dict(top_k=-1),
        dict(top_k=2.5),
        dict(top_k=2**31),
        dict(temperature=-1.0),
        dict(temperature=float("nan")),
        dict(temperature=1e39),
        dict(min_p=2.0),
        dict(repetition_penalty=0.0),
        dict(top_k=True),
        dict(temperature="hot"),
    ],
)
def test_a_sampling_is_checked_as_it_is_made_with_the_batch_settings_message(settings):
    """A Sampling out of range never reaches the device: it is refused with the words a batch's
    settings are refused with (those of one value for every row)."""
    with pytest.raises(SamplingError) as batch:
        SamplingParams.build(2, **settings)
    with pytest.raises(SamplingError) as one:
        Sampling(**settings)
    assert str(one.value) == str(batch.value).replace(", or a list of one per prompt;", ",")


def test_sampling_params_of_samplings_are_the_rows_numpy_arrays():
    rows = [Sampling(temperature=0, top_k=5, min_p=0.1), Sampling(top_p=0.5, typical_p=0.9, repetition_penalty=1.3)]
    params = SamplingParams.of(rows)
    expected = {
        "temperature": np.array([0.0, 1.0], np.float32),
        "top_k": np.array([5, 0], np.int32),
        "top_p": np.array([1.0, 0.5], np.float32),
        "typical_p": np.array([1.0, 0.9], np.float32),
        "min_p": np.array([0.1, 0.0], np.float32),
        "repetition_penalty": np.array([1.0, 1.3], np.float32),
    }
    for name, want in expected.items():
        got = getattr(params, name)
        assert got.dtype == want.dtype and got.tolist() == want.tolist(), name
    # per-row keyword lists are the same rows
    built = SamplingParams.build(
        2,
        temperature=[0, 1.0],
        top_k=[5, 0],
        top_p=[1.0, 0.5],
        typical_p=[1, 0.9],
        min_p=[0.1, 0],
        repetition_penalty=[1, 1.3],
    )
    assert jax.tree.all(jax.tree.map(np.array_equal, built, params))
    assert (
        Sampling(temperature=0) == Sampling(temperature=0.0)
        and repr(Sampling(top_k=np.int64(3))).count("top_k=3,") == 1
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        rows[0].temperature = 1.0


def test_first_argmax_is_numpys_argmax():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((6, 300)).astype(np.float32)
    logits[1, [0, 7, 299]] = 9.0  # ties: the first index wins
    logits[2] = -np.inf  # everything removed: index 0, as argmax
    logits[3] = 4.0  # constant row
    logits[4, -1] = np.inf
    logits[5, 0] = 50.0  # token id 0
    assert np.asarray(first_argmax(jnp.asarray(logits))).tolist() == np.argmax(logits, axis=-1).tolist()


def test_top_logprobs_are_the_k_likeliest_valid_ids_normalised_over_the_whole_vocabulary():
    logits = jax.random.normal(jax.random.key(3), (2, 5, 40)) * 3
    ids, values = jax.jit(top_logprobs, static_argnums=(1, 2))(logits, 4, 30)
    reference = np.asarray(jax.nn.log_softmax(logits, axis=-1), np.float64)
    expected_ids = np.argsort(-reference[..., :30], axis=-1, kind="stable")[..., :4]
    np.testing.assert_array_equal(np.asarray(ids), expected_ids)
    np.testing.assert_allclose(values, np.take_along_axis(reference, expected_ids, -1), atol=1e-5)
    assert np.all(np.diff(np.asarray(values), axis=-1) <= 0)  # most likely first
    assert [top_bucket(k) for k in (0, 1, 2, 3, 5, 8, 9, 20)] == [0, 1, 2, 4, 8, 8, 16, 32]
