"""One TrainSetup per run: a ``train()`` call (fresh, resumed, fine-tuned, LoRA) and the AOT fit check
trace the abstract training state once and build each batch sharding once; the AOT check compiles
the state and batch that training holds."""

import collections
import functools

import jax
import jax.numpy as jnp
import pytest

from gptj_flax import convert, partitioning
from gptj_flax.config import from_dict
from gptj_flax.training import TrainSetup, aot, steps, train
from tests.training_helpers import MODEL, make_config

LORA = {"rank": 4, "alpha": 8, "targets": ["*"]}
# Two steps, saved after each, no validation sets: the smallest run that can stop and resume.
SHORT = dict(total_steps=2, warmup_steps=1, anneal_steps=1, ckpt_every=1, val_set={})
ONCE_PER_RUN = {"abstract_trained": 1, "abstract_state": 1, "batch_sharding": 2}


@pytest.fixture(scope="module")
def corpus(stdlib_corpus):
    return stdlib_corpus(max_bytes=100_000)


@pytest.fixture(scope="module")
def base(corpus, tmp_path_factory):
    """A one-step checkpoint slimmed to bfloat16: a base to fine-tune and to put LoRA adapters on."""
    root = tmp_path_factory.mktemp("base")
    train(make_config(corpus, root / "run", **{**SHORT, "total_steps": 1}), progress=False)
    return str(convert.slim(root / "run", root / "bf16"))


def _counting(counts: collections.Counter, name: str, original):
    @functools.wraps(original)
    def counted(*args, **kwargs):
        counts[name] += 1
        return original(*args, **kwargs)

    return counted


@pytest.fixture
def builds(monkeypatch):
    """How many times each setup piece was built since the last ``clear()``: the trained tree's and
    the training state's abstract traces, the batch shardings, and parameter restore targets."""
    counts: collections.Counter = collections.Counter()
    for module, name in [
        (steps, "abstract_trained"),
        (steps, "abstract_state"),
        (steps, "batch_sharding"),
        (convert, "param_targets"),
    ]:
        monkeypatch.setattr(module, name, _counting(counts, name, getattr(module, name)))
    return counts


def built(counts) -> dict[str, int]:
    """The counts so far, cleared for the next call."""
    seen = {name: n for name, n in counts.items() if n and name in ONCE_PER_RUN}
    counts.clear()
    return seen


def test_a_run_and_its_resume_each_build_the_training_state_once(corpus, tmp_path, builds):
    config = make_config(corpus, tmp_path / "run", **SHORT)
    first = train(config, stop_after=1, progress=False)
    assert first.step == 1 and built(builds) == ONCE_PER_RUN
    second = train(config, progress=False)  # resumes at step 1
    assert second.step == 2 and min(second.losses) == 2
    assert built(builds) == ONCE_PER_RUN


def test_a_fine_tune_builds_the_training_state_once(corpus, base, tmp_path, builds):
    result = train(make_config(corpus, tmp_path / "run", **SHORT), init_from=base, progress=False)
    assert result.step == 2 and built(builds) == ONCE_PER_RUN


def test_a_lora_run_builds_the_training_state_and_its_bases_targets_once(corpus, base, tmp_path, builds):
    config = make_config(corpus, tmp_path / "run", lora=LORA, **SHORT)
    first = train(config, init_from=base, stop_after=1, progress=False)
    assert first.step == 1 and first.base_bytes
    assert builds["param_targets"] <= 1  # the base's, built by loading it; its steps take its shardings
    assert built(builds) == ONCE_PER_RUN
    second = train(config, progress=False)  # resumes on the recorded base
    assert second.step == 2 and builds["param_targets"] <= 1
    assert built(builds) == ONCE_PER_RUN


def _bytes_on_device(tree, device) -> int:
    return sum(
        shard.data.nbytes for x in jax.tree.leaves(tree) for shard in x.addressable_shards if shard.device == device
    )


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_the_aot_check_compiles_the_state_and_batch_training_holds(monkeypatch, builds, lora):
    """The 8 CPU devices stand in for a TPU slice (no libtpu here): the compiled step's arguments
    are, byte for byte, one device's share of the state ``train()`` creates, the batch, and the base."""
    train_section = {"batch_size": 8, "grad_accum_steps": 2, **({"lora": lora} if lora else {})}
    config = from_dict({"model": MODEL, "mesh": {"data": 2, "fsdp": 2, "model": 2}, "train": train_section})
    monkeypatch.setattr(aot, "topology_devices", lambda topology: jax.devices())
    report = aot.compile_for_topology(config, "cpu:2x2x2")
    assert built(builds) == {"abstract_trained": 1, "abstract_state": 1, "batch_sharding": 2}
    assert report.fits and (report.lora is None) == (lora is None)

    mesh = partitioning.make_mesh(config.mesh)
    setup = TrainSetup.build(config, mesh)
    device = mesh.devices.flat[0]
    state = steps.create_state(setup.model, setup.tx, mesh, jax.random.key(0))  # the standalone path
    rows = (2, 8)  # grad_accum_steps x batch_size
    tokens = jnp.zeros((*rows, MODEL["max_len"] + 1), jnp.int32, device=setup.train_sharding)
    mask = jnp.zeros((*rows, MODEL["max_len"]), jnp.float32, device=setup.train_sharding)
    batch = 2 * _bytes_on_device(tokens, device) + _bytes_on_device(mask, device)  # tokens, segment ids, mask
    held = _bytes_on_device(state, device)
    if lora:
        base_targets = setup.base_targets()
        base = jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype, device=t.sharding), base_targets)
        held += _bytes_on_device(base, device)
    assert report.argument_bytes == held + batch
    assert report.alias_bytes == _bytes_on_device(state, device)  # the state is donated, as in training
