"""open_weights / place_weights: one trace of the parameter tree per load, the layer layouts derived
from it, and the weights placed once, as the checkpoint stores them."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import traverse_util

import gptj_flax
from gptj_flax import convert, model, partitioning
from gptj_flax.convert import layout
from gptj_flax.sampling import loading
from tests.helpers import hf_model, tiny_config
from tests.test_sampling_api import CFG, make_checkpoint


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A HuggingFace directory and an Orbax run (its layers scanned, as training saves them)."""
    root = tmp_path_factory.mktemp("sources")
    make_checkpoint(str(root / "run"))
    hf_model(dataclasses.replace(CFG, max_len=64)).save_pretrained(root / "hf")
    return {"hf": root / "hf", "orbax": root / "run"}


@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("kind", ["hf", "orbax"])
def test_a_load_traces_the_parameter_tree_once(sources, kind, quantize, monkeypatch):
    traces, inits, stacks = [], [], []
    trace, init, stack = model.abstract_params, model.GPTJ.init, layout._stack
    monkeypatch.setattr(model, "abstract_params", lambda config: traces.append(config) or trace(config))
    monkeypatch.setattr(model.GPTJ, "init", lambda self, *a, **k: inits.append(1) or init(self, *a, **k))
    monkeypatch.setattr(layout, "_stack", lambda *a: stacks.append(1) or stack(*a))  # stacking layers on the host

    lm = gptj_flax.load(sources[kind], quantize=quantize)

    assert (len(traces), len(inits)) == (1, 1)  # before: 5 (hf), 6 (hf int8), 4 (orbax), 6 (orbax int8)
    assert not traces[0].scan_layers and traces[0].quantize == quantize  # the unrolled model, as it runs
    assert not stacks
    assert lm.generate([1, 2, 3], max_new_tokens=4, temperature=0, return_tokens=True).tokens


@pytest.mark.parametrize("kind", ["hf", "orbax"])
def test_the_decoder_holds_the_arrays_placed_as_they_are(sources, kind, monkeypatch):
    placed, place = [], loading.place_weights
    monkeypatch.setattr(loading, "place_weights", lambda *a: placed.append(place(*a)) or placed[-1])
    lm = gptj_flax.load(sources[kind], mesh=(1, 2, 4))
    mine, held = jax.tree.leaves(placed[0].params), jax.tree.leaves(lm.decoder.params)
    assert len(mine) == len(held) and all(a is b for a, b in zip(mine, held))  # nothing unstacked or placed again


def _described(tree) -> dict:
    flat = traverse_util.flatten_dict(tree.abstract)
    return {path: (type(leaf), leaf.names, leaf.value.shape, leaf.value.dtype) for path, leaf in flat.items()}


@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])
def test_the_other_layer_layout_is_what_tracing_it_gives(quantize, scan_layers):
    config = tiny_config(n_layers=3, quantize=quantize, scan_layers=scan_layers)
    other = layout.ParamTree.of(config).in_layout(not scan_layers)
    assert other.config == dataclasses.replace(config, scan_layers=not scan_layers)
    assert _described(other) == _described(layout.ParamTree.of(other.config))


def test_a_scanned_checkpoint_is_restored_as_stored_then_unrolled_on_its_mesh(sources):
    mesh = partitioning.make_mesh((1, 2, 4))
    unrolled = dataclasses.replace(CFG, scan_layers=False)
    with convert.open_weights(sources["orbax"], step=0) as source:
        params, shardings = convert.place_weights(source, unrolled, mesh)
    _, stored, _ = convert.load_params(sources["orbax"], mesh, step=0)  # the scanned tree, restored as saved
    want = jax.tree.map(np.asarray, model.unstack_layers(stored))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, params), want)
    assert shardings == convert.param_targets(unrolled, mesh)[1]
    assert jax.tree.leaves(jax.tree.map(lambda x, s: x.sharding == s, params, shardings)) == [True] * len(
        jax.tree.leaves(params)
    )


def test_what_a_source_cannot_give_is_refused_with_the_way_out(sources, tmp_path):
    with pytest.raises(convert.ConversionError, match=r"step=3: .* holds one set of weights; step= is for Orbax"):
        convert.open_weights(sources["hf"], step=3)
    with pytest.raises(convert.ConversionError, match=r"records no model config; convert it with `gptj-convert from"):
        gptj_flax.load(f"legacy:{tmp_path}")
    # a HuggingFace directory needs no prefix, for training's --init-from as for load
    assert convert.parse_init_spec(str(sources["hf"])) == ("hf", str(sources["hf"]))
