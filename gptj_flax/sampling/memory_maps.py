"""The kernel's limit on a process's memory maps, which a warm-up of many CPU programs can reach.

XLA's CPU backend loads every compiled kernel as an object of its own, with a few memory maps
apiece, and Linux refuses a process more than ``vm.max_map_count`` of them (65530 unless raised;
recent Ubuntu, Fedora and Arch ship 1048576). Past the limit a compile fails deep inside LLVM with
"Cannot allocate memory" and hundreds of log lines that do not name the cause, so a warm-up that
compiles many programs checks, before each one, that the next cannot cross it.
"""

from __future__ import annotations

import dataclasses

from gptj_flax.sampling.samplers import SamplingError

LIMIT_FILE = "/proc/sys/vm/max_map_count"
MAPS_FILE = "/proc/self/maps"
RAISED_LIMIT = 1048576  # what the distributions that raised it chose


class MemoryMapLimit(SamplingError):
    """The programs still to compile would take more memory maps than the kernel allows."""


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):  # not Linux, or /proc not mounted: nothing to check
        return None


def maps_in_use(path: str = MAPS_FILE) -> int:
    """The memory maps this process holds now (a line of ``/proc/self/maps`` each)."""
    with open(path, "rb") as f:
        return sum(1 for _ in f)


@dataclasses.dataclass
class MapBudget:
    """Watches the maps a sequence of compiles takes; :meth:`check` before each one.

    A compile may take as many maps as the largest one seen so far, and twice that is kept spare:
    the next program is refused, with the fix, while there is still room to say so.
    """

    limit: int | None  # None: no limit to watch (not Linux)
    used: int = 0
    largest_step: int = 0
    programs: int = 0

    @classmethod
    def of_this_process(cls) -> MapBudget:
        limit = _read_int(LIMIT_FILE)
        return cls(limit, maps_in_use() if limit is not None else 0)

    def check(self, what: str) -> None:
        """Raises :class:`MemoryMapLimit` if the next program could take the maps past the limit;
        ``what`` names the programs being compiled, for the message."""
        if self.limit is None:
            return
        now = maps_in_use()
        if self.programs:
            self.largest_step = max(self.largest_step, now - self.used)
        self.used, self.programs = now, self.programs + 1
        if now + 2 * self.largest_step > self.limit:
            raise MemoryMapLimit(
                f"{what}: with {self.programs - 1} programs compiled, this process holds {now:,} memory maps of the "
                f"{self.limit:,} the kernel allows (vm.max_map_count), and each program compiled on the CPU takes up "
                f"to {self.largest_step:,} more, so the next one could fail to load. Raise the limit "
                f"(sudo sysctl -w vm.max_map_count={RAISED_LIMIT}) or compile fewer programs: fewer decode slots "
                "or shorter ones (gptj-serve --max-batch, --max-len)"
            )
