"""The warm-up's watch on the kernel's limit on memory maps: it refuses the program that could
cross the limit, with room to say so, and never one that could not."""

import pytest

from gptj_flax.sampling import memory_maps
from gptj_flax.sampling.memory_maps import MapBudget, MemoryMapLimit


def test_the_next_program_is_refused_once_twice_the_largest_step_would_cross_the_limit(monkeypatch):
    counts = iter([1000, 1500, 2000, 2590, 2600])
    monkeypatch.setattr(memory_maps, "maps_in_use", lambda: next(counts))
    budget = MapBudget(limit=3600)
    budget.check("warming")  # 1000: the first program, its step not yet known
    budget.check("warming")  # 1500 + 2 x 500 <= 3600
    budget.check("warming")  # 2000 + 2 x 500
    with pytest.raises(MemoryMapLimit, match=r"warming: with 3 programs compiled, .* holds 2,590 memory maps"):
        budget.check("warming")  # 2590 + 2 x 590 > 3600


def test_the_limit_and_the_maps_in_use_are_read_from_proc():
    budget = MapBudget.of_this_process()
    with open("/proc/sys/vm/max_map_count") as f:
        assert budget.limit == int(f.read())
    with open("/proc/self/maps") as f:
        assert abs(budget.used - len(f.readlines())) < 50  # the read itself maps a little


def test_without_proc_nothing_is_checked(monkeypatch):
    monkeypatch.setattr(memory_maps, "LIMIT_FILE", "/nonexistent/max_map_count")
    budget = MapBudget.of_this_process()
    assert budget.limit is None
    for _ in range(3):
        budget.check("warming")
