"""The report every run of the suite ends with: time per test file, and the tests that break the 60 s rule.

pytest's own ``--durations=30`` (pyproject.toml) lists the slowest phases; this adds the sum per file
(setup, call and teardown, so a module's shared fixtures count where they are built) and names every
test over ``SLOW_SECONDS`` that is not marked ``slow``, which ``make test-fast`` would otherwise keep.

Beside the wall time it counts CPU time (this process's threads and the child processes a test waited
for): on a machine shared with other work, wall times swell with the load while CPU seconds barely
move, so compare those between runs. Under pytest-xdist each worker measures its own tests and the
controller, which receives every report, prints the sums.
"""

from __future__ import annotations

import collections
import resource
import time

import pytest

# A test longer than this on the 2-core CI machine is marked slow (CONTRIBUTING.md, "Tests").
SLOW_SECONDS = 60.0
CPU_KEY = "cpu_s"


def cpu_seconds() -> float:
    """User and system CPU time of this process and of its children that have been waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class CpuMeter:
    """Puts each phase's CPU seconds on its report, where xdist carries them to the controller."""

    def __init__(self) -> None:
        self.mark = cpu_seconds()

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.mark = cpu_seconds()
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        now = cpu_seconds()
        used, self.mark = now - self.mark, now
        report = yield
        report.user_properties = [*report.user_properties, (CPU_KEY, used)]
        return report


class SuiteReport:
    """Sums the reports per test and per file; prints them when the session ends."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.wall: dict[str, float] = collections.defaultdict(float)
        self.cpu: dict[str, float] = collections.defaultdict(float)
        self.slow_marked: set[str] = set()

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.wall[report.nodeid] += report.duration
        self.cpu[report.nodeid] += sum(value for key, value in report.user_properties if key == CPU_KEY)
        if report.when == "setup" and "slow" in report.keywords:
            self.slow_marked.add(report.nodeid)

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.wall:
            return
        files: dict[str, list[str]] = collections.defaultdict(list)
        for nodeid in self.wall:
            files[nodeid.split("::", 1)[0]].append(nodeid)

        def total(table, nodeids):
            return sum(table[n] for n in nodeids)

        write = terminalreporter.write_line
        terminalreporter.section("time per test file (setup + call + teardown)")
        write(f"{'wall s':>8} {'cpu s':>8} {'tests':>5}  file")
        for path, nodeids in sorted(files.items(), key=lambda item: -total(self.wall, item[1])):
            write(f"{total(self.wall, nodeids):8.1f} {total(self.cpu, nodeids):8.1f} {len(nodeids):5d}  {path}")
        write(
            f"{sum(self.wall.values()):8.1f} {sum(self.cpu.values()):8.1f} {len(self.wall):5d}  in all; "
            f"{time.monotonic() - self.started:.1f} s wall since the session started"
        )
        unmarked = sorted(
            (seconds, nodeid)
            for nodeid, seconds in self.wall.items()
            if seconds > SLOW_SECONDS and nodeid not in self.slow_marked
        )
        if unmarked:
            terminalreporter.section(f"over {SLOW_SECONDS:.0f} s and not marked slow", yellow=True)
            for seconds, nodeid in reversed(unmarked):
                write(f"{seconds:8.1f} s  {nodeid}")


def register(config: pytest.Config) -> None:
    """Every process meters its tests; the controller (or the only process) prints the report."""
    config.pluginmanager.register(CpuMeter(), "suite-cpu-meter")
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(SuiteReport(), "suite-report")
