"""The decode slots' warm-up with the persistent compilation cache on: the programs that need no other
program's output are compiled together on a thread pool, and each call then finds its program in the
cache; without the cache, one by one as before. The same programs either way."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import pytest
from jax import monitoring
from jax.experimental.compilation_cache import compilation_cache

from gptj_flax import partitioning
from gptj_flax.model import GPTJ
from gptj_flax.sampling import LanguageModel
from tests.helpers import tiny_config

CFG = tiny_config(n_layers=1, d_model=32, n_heads=2, rotary_dim=8, vocab_size=64, max_len=64, scan_layers=False)
CACHE_SETTINGS = {
    "jax_enable_compilation_cache": True,
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": -1,
}
HITS = "/jax/compilation_cache/cache_hits"
MISSES = "/jax/compilation_cache/cache_misses"


@pytest.fixture
def lm():
    """A model of its own per test: none of its programs is in JAX's in-memory caches yet."""
    return LanguageModel(CFG, GPTJ(CFG).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])


@pytest.fixture
def cache(tmp_path):
    """An empty persistent compilation cache (None: the cache off) in force for the test."""
    names = (*CACHE_SETTINGS, "jax_compilation_cache_dir")
    saved = {name: getattr(jax.config, name) for name in names}

    def use(on: bool) -> None:
        for name, value in CACHE_SETTINGS.items():
            jax.config.update(name, value)
        jax.config.update("jax_enable_compilation_cache", on)
        jax.config.update("jax_compilation_cache_dir", str(tmp_path) if on else None)
        compilation_cache.reset_cache()

    yield use
    for name, value in saved.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


@pytest.fixture
def events():
    counts: collections.Counter[str] = collections.Counter()

    def count(event: str, *args, **kwargs) -> None:
        counts[event] += 1

    monitoring.register_event_listener(count)
    yield counts
    monitoring.unregister_event_listener(count)


@pytest.mark.parametrize("beside", [False, True], ids=["prefill-between", "prefill-beside"])
def test_programs_compiled_together_are_those_each_call_finds_and_the_same_as_one_by_one(lm, cache, events, beside):
    spare = partitioning.spare_mesh(lm.mesh) if beside else None
    cache(False)
    alone = lm.slots(slots=4, length=64, chunk=16, prefill_mesh=spare)
    assert alone.warm_up(workers=2) and alone.compiled_together == (0, 1)
    one_by_one = alone.compilations()
    assert events[HITS] == events[MISSES] == 0

    jax.clear_caches()
    cache(True)
    slots = lm.slots(slots=4, length=64, chunk=16, prefill_mesh=spare)
    before = slots.compilations()  # the empty state's program, compiled as the slots are made
    events.clear()
    assert slots.warm_up(workers=2)
    together, threads = slots.compiled_together
    assert threads == 2 and together >= 8  # prefill batches of 1, 2, 4 rows and the decode programs at least
    # every program compiled once: a call either finds the one compiled together (in memory or in the
    # persistent cache) or compiles one of those left; none lowers to a module compiled together in vain
    assert events[MISSES] == slots.compilations() - before and events[HITS] <= together
    assert slots.compilations() == one_by_one


def test_a_stop_during_the_compiles_together_stops_the_warm_up(lm, cache):
    cache(True)
    slots = lm.slots(slots=4, length=64, chunk=16)
    asked = []
    assert not slots.warm_up(stop=lambda: asked.append(1) or len(asked) > 3, workers=2)
    assert len(asked) == 4
