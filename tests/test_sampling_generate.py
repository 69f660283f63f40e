"""KV-cache generation against independent references: full-forward recomputation and HuggingFace.

One tiny model (8 heads, so it shards 8 ways) serves every test; its greedy continuations are
computed once by recomputing the full forward pass at every step, with no cache.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from gptj_flax import partitioning
from gptj_flax.model import GPTJ, KVCache, unstack_layers
from gptj_flax.sampling import LanguageModel, SamplingError, SamplingParams
from gptj_flax.sampling.decoding import EOS, LENGTH, RUNNING, bucket
from tests.helpers import hf_model, params_matching, tiny_config

CFG = tiny_config(n_layers=2, d_model=64, n_heads=8, rotary_dim=4, vocab_size=128, max_len=64)
PROMPTS = [[5, 17, 3, 99, 42, 8, 61], [7, 7, 120], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
NEW = 12


@pytest.fixture(scope="module")
def hf():
    return hf_model(CFG, seed=11)


@pytest.fixture(scope="module")
def params(hf):
    return params_matching(hf, CFG)["params"]


@pytest.fixture(scope="module")
def lm(params):
    return LanguageModel(CFG, params)


@pytest.fixture(scope="module")
def recomputed(params):
    """Greedy continuations by argmax over a full forward pass of the whole sequence at every step."""
    # right-padded to one length (causal attention never looks right), so this compiles once
    forward = jax.jit(lambda tokens, last: GPTJ(CFG).apply({"params": params}, tokens)[0, last])
    out = []
    for prompt in PROMPTS:
        seq = list(prompt)
        for _ in range(NEW):
            padded = np.zeros((1, CFG.max_len), np.int32)
            padded[0, : len(seq)] = seq
            seq.append(int(jnp.argmax(forward(padded, len(seq) - 1))))
        out.append(seq[len(prompt) :])
    return out


def greedy(lm, prompts=PROMPTS, **kwargs):
    kwargs = {"temperature": 0, "ignore_eos": True, "return_tokens": True, **kwargs}
    return lm.generate(prompts, NEW, **kwargs)


def test_cached_prefill_and_steps_give_the_full_forward_logits(params):
    cfg = dataclasses.replace(CFG, scan_layers=False)
    params = unstack_layers(params)
    model = GPTJ(cfg)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, size=(2, 11)), jnp.int32)
    full = model.apply({"params": params}, tokens)
    apply = jax.jit(lambda t, pos, cache: model.apply({"params": params}, t, pos, None, cache, method=GPTJ.decode))
    logits, cache = apply(tokens[:, :4], jnp.broadcast_to(jnp.arange(4), (2, 4)), KVCache.empty(cfg, 2, 16))
    steps = [logits]
    for t in range(4, 11):
        logits, cache = apply(tokens[:, t : t + 1], jnp.full((2, 1), t), cache)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=0, atol=1e-5)
    assert int(cache.index) == 11
    keys, values = (2, 8, 8, 16), (2, 8, 16, 8)  # [batch, heads, head_dim, slots], [batch, heads, slots, head_dim]
    assert [(k.shape, v.shape) for k, v in zip(cache.k, cache.v)] == [(keys, values)] * CFG.n_layers


def test_cached_decoding_of_scanned_layers_is_refused(params):
    """Scanned parameters decode through the unrolled layers (the Decoder converts them once)."""
    tokens = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="cached decoding runs the unrolled layers.*unstack_layers"):
        GPTJ(CFG).apply({"params": params}, tokens, None, None, KVCache.empty(CFG, 1, 8), method=GPTJ.decode)


def test_one_result_per_entry_point(params):
    tokens = jnp.asarray([[3, 1, 4, 1, 5]], jnp.int32)
    model = GPTJ(CFG)
    logits = model.apply({"params": params}, tokens)
    hidden = model.apply({"params": params}, tokens, method=GPTJ.hidden_states)
    assert logits.shape == (1, 5, CFG.vocab_size) and hidden.shape == (1, 5, CFG.d_model)
    head = params["lm_head"]
    np.testing.assert_allclose(hidden @ head["kernel"] + head["bias"], logits, rtol=0, atol=1e-5)


def test_greedy_with_the_cache_equals_recomputing_the_full_forward(lm, recomputed):
    # the three prompts have different lengths, so the batch is left-padded
    assert [c.tokens for c in greedy(lm)] == recomputed


def test_greedy_equals_huggingface_generate(hf, lm, recomputed):
    hf.generation_config.eos_token_id = None
    for prompt, ours in zip(PROMPTS, recomputed):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                pad_token_id=0,
            )
        assert out[0, len(prompt) :].tolist() == ours


def test_greedy_with_repetition_penalty_equals_huggingface(hf, lm):
    hf.generation_config.eos_token_id = None
    ours = greedy(lm, repetition_penalty=1.5)
    for prompt, completion in zip(PROMPTS, ours):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                repetition_penalty=1.5,
                pad_token_id=0,
            )
        assert out[0, len(prompt) :].tolist() == completion.tokens


def test_score_and_generation_logprobs_equal_huggingface_log_softmax(hf, lm, recomputed):
    sequences = [p + c for p, c in zip(PROMPTS, recomputed)]
    scored = lm.score(sequences)
    generated = greedy(lm, return_logprobs=True)
    for seq, s, g, prompt in zip(sequences, scored, generated, PROMPTS):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0, :-1].double(), -1)
        ref = ref.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0].numpy()
        assert s.tokens == seq and s.logprobs.shape == (len(seq) - 1,)
        np.testing.assert_allclose(s.logprobs, ref, rtol=0, atol=1e-4)
        np.testing.assert_allclose(g.logprobs, ref[len(prompt) - 1 :], rtol=0, atol=1e-4)


def test_eos_ends_each_row_on_its_own(lm, recomputed):
    # Row 0 stops at the first occurrence of its 4th greedy token, row 2 at its 2nd; row 1 ignores EOS.
    eos = [recomputed[0][3], -1, recomputed[2][1]]
    first = [recomputed[0].index(eos[0]), NEW - 1, recomputed[2].index(eos[2])]
    run = lm.decoder.start(
        PROMPTS,
        max_new_tokens=np.full(3, NEW),
        sampling=SamplingParams.build(3, temperature=0.0),
        seeds=np.zeros(3, np.uint32),
        eos_id=np.array(eos),
    )
    progress = run.advance(NEW)
    assert progress.finish.tolist() == [EOS, LENGTH, EOS]
    assert progress.num_generated.tolist() == [n + 1 for n in first]
    for row in range(3):
        assert progress.tokens[row, : first[row] + 1].tolist() == recomputed[row][: first[row] + 1]
        assert not progress.tokens[row, first[row] + 1 :].any()  # nothing recorded after the end


def test_max_new_tokens_per_row_and_early_exit(lm, recomputed):
    out = lm.generate(PROMPTS, [3, NEW, 1], temperature=0, ignore_eos=True, return_tokens=True)
    assert [c.tokens for c in out] == [recomputed[0][:3], recomputed[1], recomputed[2][:1]]
    assert [c.finish_reason for c in out] == ["length"] * 3
    # once every row is done the loop stops: the step count is the longest row's length
    run = lm.decoder.start(
        PROMPTS,
        max_new_tokens=np.array([2, 3, 2]),
        sampling=SamplingParams.build(3, temperature=0.0),
        seeds=np.zeros(3, np.uint32),
        eos_id=np.full(3, -1),
    )
    run.advance(1000)
    assert int(run._state.step) == 3 and not np.any(run.progress.finish == RUNNING)


def test_sampling_is_reproducible_and_independent_of_batch_neighbours(lm):
    settings = dict(temperature=0.9, top_k=50, top_p=0.95, seed=[3, 4, 5], ignore_eos=True, return_tokens=True)
    batch = lm.generate(PROMPTS, NEW, **settings)
    again = lm.generate(PROMPTS, NEW, **settings)
    alone = lm.generate(PROMPTS[1], NEW, **{**settings, "seed": 4})
    assert [c.tokens for c in batch] == [c.tokens for c in again]
    assert batch[1].tokens == alone.tokens
    other_seed = lm.generate(PROMPTS[1], NEW, **{**settings, "seed": 99})
    assert other_seed.tokens != alone.tokens


def test_per_example_settings_in_one_batch(lm, recomputed):
    # top_k=1 and a tiny top_p leave only the argmax, whatever the temperature
    out = lm.generate(
        PROMPTS,
        NEW,
        temperature=[0.0, 1.5, 1.0],
        top_k=[0, 1, 0],
        top_p=[1.0, 1.0, 1e-6],
        seed=[1, 2, 3],
        ignore_eos=True,
        return_tokens=True,
    )
    assert [c.tokens for c in out] == recomputed


@pytest.mark.parametrize("shape", [(1, 1, 8), (2, 1, 4)], ids=["model8", "data2_model4"])
def test_sharded_generation_equals_single_device(params, lm, shape):
    mesh = partitioning.make_mesh(shape)
    sharded = LanguageModel(CFG, params, mesh=mesh)
    settings = dict(
        temperature=[0.0, 0.8, 1.0],
        top_p=[1.0, 0.9, 1.0],
        seed=[1, 2, 3],
        ignore_eos=True,
        return_tokens=True,
        return_logprobs=True,
    )
    ours, single = sharded.generate(PROMPTS, NEW, **settings), lm.generate(PROMPTS, NEW, **settings)
    for a, b in zip(ours, single):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-4)
    run = sharded.decoder.start(
        PROMPTS,
        max_new_tokens=np.full(3, 2),
        sampling=SamplingParams.build(3),
        seeds=np.zeros(3, np.uint32),
        eos_id=np.full(3, -1),
    )
    for cached in (run._state.cache.k[0], run._state.cache.v[0]):  # one layer's keys and values
        assert cached.sharding.spec[:2] == (("data", "fsdp"), "model")


def test_no_recompilation_within_a_bucket(lm):
    lm.generate([[1, 2, 3]], 5, temperature=0)  # bucket: prompt 16, new 16, batch 1
    compiled = lm.decoder.compilations()
    for prompt_len, new, temperature, top_p in [(9, 16, 0.0, 1.0), (16, 1, 0.7, 0.9), (2, 11, 1.0, 0.5)]:
        lm.generate([list(range(1, prompt_len + 1))], new, temperature=temperature, top_p=top_p, seed=prompt_len)
    assert lm.decoder.compilations() == compiled
    lm.generate([[1, 2, 3]], 17, temperature=0)  # the next new-token bucket: prefill and decode compile again
    assert lm.decoder.compilations() == compiled + 2
    assert [bucket(n) for n in (1, 16, 17, 100)] == [16, 16, 32, 128]


@pytest.mark.parametrize("batch", [1, 2, 16])
def test_the_decode_loop_updates_the_cache_in_place(params, batch):
    """The compiled decode loop never copies a layer's cache: each step only writes its new slot.

    Copies cost as much as reading the whole cache again at every step; at batch 1 XLA once made
    several per layer (see ``model._decode_attention``).
    """
    cfg = dataclasses.replace(CFG, scan_layers=False)
    decoder = LanguageModel(cfg, unstack_layers(params)).decoder
    run = decoder.start(
        [[1, 2, 3]] * batch,
        max_new_tokens=np.full(batch, 4),
        sampling=SamplingParams.build(batch, temperature=0.0),
        seeds=np.zeros(batch, np.uint32),
        eos_id=np.full(batch, -1, np.int32),
    )
    with partitioning.sharding_scope(decoder.mesh, decoder.rules):
        hlo = (
            decoder._decode.lower(decoder.params, run._state, np.int32(4), np.zeros(batch, bool), False)
            .compile()
            .as_text()
        )
    cache_shapes = {f"f32[{','.join(map(str, a.shape))}]" for a in (*run._state.cache.k, *run._state.cache.v)}
    copies = [
        line
        for line in hlo.splitlines()
        if re.search(r"= f32\[[0-9,]+\]\S* copy\(", line)
        and line.split("=")[1].split()[0].split("{")[0] in cache_shapes
    ]
    assert len(cache_shapes) == 2 and not copies, "\n".join(copies[:4])


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda lm: lm.generate([], 4), "no prompts given"),
        (lambda lm: lm.generate([[1, 2], []], 4), "prompt 1 has no tokens"),
        (lambda lm: lm.generate([1] * 60, 8), "prompt 0 has 60 tokens; with max_new_tokens=8 that exceeds"),
        (lambda lm: lm.generate([1, 2], -3), "max_new_tokens must be an integer >= 1"),
        (lambda lm: lm.generate([1, 2], 0), "max_new_tokens must be an integer >= 1"),
        (lambda lm: lm.generate([1, 2], 4, top_p=1.2), "top_p must be in (0, 1]"),
        (lambda lm: lm.generate([[1, 2], [3]], 4, temperature=[1.0]), "temperature: got 1 values for 2 prompts"),
        (lambda lm: lm.generate([1, 500], 4), "token id 500 outside [0, 128)"),
        (lambda lm: lm.generate("text", 4), "this model has no tokenizer"),
        (lambda lm: lm.generate([1, 2], 4, stop="x"), "stop strings need a tokenizer"),
        (lambda lm: lm.generate([1, 2], 4, seed=-1), "seed must be an integer in [0, 2**32)"),
        (lambda lm: lm.generate([1, 2], 4, seed=2**32), "seed must be an integer in [0, 2**32)"),
        (
            lambda lm: lm.generate([1, 2], 4, temperature=1e39),
            "temperature must be >= 0 (0 is greedy) and within float32",
        ),
        (lambda lm: lm.generate([1, 2], 4, top_k=2**31), "top_k must be an integer >= 0 (0 is off) and fit in int32"),
        (lambda lm: lm.generate([1, 2], 2**31), "max_new_tokens must be an integer >= 1 and fit in int32"),
        (lambda lm: lm.generate([1, 2], 4, ignore_eos="yes"), "ignore_eos must be true or false"),
        (lambda lm: lm.generate(3.5, 4), "prompts must be a string, a list of token ids"),
        (lambda lm: lm.score([[1]]), "sequence 0 has 1 token(s); scoring needs at least 2"),
    ],
)
def test_bad_requests_raise_clear_errors(lm, call, message):
    with pytest.raises(SamplingError, match=re.escape(message)):
        call(lm)


def test_seeds_use_the_whole_uint32_range(lm):
    """Seeds up to 2**32 - 1 are accepted, reproducible and distinct from their value mod 2**31."""

    def draw(seed):
        return lm.generate([[5, 6, 7]], 8, temperature=1.0, seed=seed, ignore_eos=True, return_tokens=True)[0].tokens

    top = 2**32 - 1
    assert draw(top) == draw(top)
    assert draw(2**31 + 7) == draw([2**31 + 7])
    assert len({tuple(draw(s)) for s in (7, 2**31 + 7, top)}) == 3
