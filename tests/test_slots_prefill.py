"""Prefill on spare devices (``--prefill beside``): prompts prefilled there and placed into the
decode slots come out token for token as those admitted between steps on the slots' own device;
the spare mesh is found, or its absence explained."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gptj_flax import partitioning
from gptj_flax.model import GPTJ
from gptj_flax.sampling import LanguageModel
from gptj_flax.sampling.samplers import SamplingParams
from gptj_flax.sampling.slots import Request
from gptj_flax.serving.service import prefill_mesh
from gptj_flax.serving.settings import ServingError
from tests.helpers import tiny_config

CFG = tiny_config(n_layers=2, d_model=64, n_heads=4, rotary_dim=8, vocab_size=96, max_len=64, scan_layers=False)


@pytest.fixture(scope="module")
def lm():
    return LanguageModel(CFG, GPTJ(CFG).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])


def requests() -> list[Request]:
    rng = np.random.default_rng(0)
    settings = [(5, 0.0, False), (9, 0.8, True), (3, 1.2, False), (40, 0.0, True)]  # the last one is chunked
    return [
        Request(
            [int(t) for t in rng.integers(1, CFG.vocab_size, n)],
            10,
            -1,
            seed,
            SamplingParams.build(1, temperature=temperature, top_p=0.9),
            want_top=top,
        )
        for seed, (n, temperature, top) in enumerate(settings)
    ]


def test_prompts_prefilled_beside_decode_as_those_admitted_between_steps(lm):
    between = lm.slots(slots=8, length=64, chunk=16, top_logprobs=3)
    spare = partitioning.spare_mesh(lm.mesh)
    beside = lm.slots(slots=8, length=64, chunk=16, top_logprobs=3, prefill_mesh=spare)
    short, long = requests()[:3], requests()[3]
    places = [0, 5, 2]

    first_between = [between.admit(short, places)]
    prefilled = beside.dispatch_prefill(short)
    assert prefilled.cache.k[0].devices() == set(spare.devices.flat)
    beside.place(prefilled, places)
    first_beside = [prefilled.pending.result()]

    prefill = between.start_prefill(long)
    while not prefill.done:
        between.prefill_chunk(prefill)
    first_between.append(between.insert(prefill, 7))
    prefill = beside.start_prefill(long)
    while not prefill.done:
        beside.prefill_chunk(prefill)
    assert prefill.cache.k[0].devices() == set(spare.devices.flat)
    prefilled = beside.dispatch_first(prefill)
    beside.place(prefilled, [7])
    first_beside.append(prefilled.pending.result())

    def same(a, b):
        # the same ids; log-probs to rounding (prefill and insert are one program between steps, two beside)
        for name in ("tokens", "top_ids", "finish", "num_generated"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
        for name in ("logprobs", "top_logprobs"):
            np.testing.assert_allclose(getattr(a, name), getattr(b, name), rtol=1e-5, atol=1e-6, err_msg=name)

    for a, b in zip(first_between, first_beside, strict=True):
        same(a, b)
    for _ in range(9):
        a, b = between.decode([], 1), beside.decode([], 1)
        same(a, b)
    assert np.asarray(b.finish)[[0, 2, 5, 7]].tolist() == [2] * 4  # LENGTH: every row ran its 10 tokens


def test_a_row_placed_nowhere_changes_no_slot(lm):
    beside = lm.slots(slots=8, length=64, chunk=16, top_logprobs=3, prefill_mesh=partitioning.spare_mesh(lm.mesh))
    before = jax.tree.map(np.asarray, beside.state)
    beside.place(beside.dispatch_prefill(requests()[:2]), [None, None])
    after = jax.tree.map(np.asarray, beside.state)
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(x, y)


def test_every_server_on_one_model_prefills_with_one_copy_of_it(lm):
    # one copy of the parameters on the prefill devices, and one set of programs, however many servers
    spare = partitioning.spare_mesh(lm.mesh)
    copy = lm.decoder.on(spare)
    assert copy is not lm.decoder and copy.mesh == spare
    assert lm.decoder.on(partitioning.spare_mesh(lm.mesh)) is copy
    assert lm.decoder.on(lm.mesh) is lm.decoder
    first = lm.slots(slots=8, length=64, chunk=16, prefill_mesh=spare)
    first.warm_up()
    compiled = first.compilations()
    second = lm.slots(slots=8, length=64, chunk=16, prefill_mesh=spare)
    second.warm_up()
    assert second.compilations() == compiled


def test_the_prefill_devices_must_be_others_than_the_slots(lm):
    with pytest.raises(ValueError, match="other than the decode slots"):
        lm.slots(slots=8, length=64, chunk=16, prefill_mesh=lm.mesh)


def test_the_spare_mesh_has_the_shape_of_the_mesh_on_the_next_devices():
    devices = jax.devices()
    mesh = partitioning.make_mesh((1, 1, 2), devices[:2])
    spare = partitioning.spare_mesh(mesh)
    assert dict(spare.shape) == dict(mesh.shape)
    assert list(spare.devices.flat) == devices[2:4]
    assert partitioning.spare_mesh(partitioning.make_mesh((len(devices), 1, 1))) is None


def test_beside_without_spare_devices_says_what_to_start_with():
    everything = partitioning.make_mesh((len(jax.devices()), 1, 1))
    with pytest.raises(ServingError, match=f"device_count={2 * len(jax.devices())}"):
        prefill_mesh(everything, "beside")
    assert prefill_mesh(everything, "between") is None
